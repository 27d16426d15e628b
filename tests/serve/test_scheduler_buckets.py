"""The serving loop's decode step follows the running count: running requests stay in the lowest slots (a finished
or cancelled request's slot is taken by the highest running one, its KV rows and recurrent state moved), and a
runner-mode step runs the smallest bucket (1, 2, 4, ... rows) that holds them. Whatever runs beside a request and
whatever moves it makes, its greedy tokens are those of Engine.generate alone."""

from __future__ import annotations

import random
import time

import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.serve.metrics import Metrics
from colibri_format.serve.scheduler import Done, Scheduler, batch_buckets
from tests.hf_hybrid import build, convert_file
from tests.runtime.hf_tiny import prompts
from tests.serve.test_scheduler import PROMPTS, submit


class StepLog(Metrics):
    """Metrics that also keep every decode step's (running requests, rows run, graph replayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, int, bool]] = []

    def decode_step(self, rows: int, seconds: float, *, batch: int | None = None, graph: bool = False) -> None:
        self.steps.append((rows, rows if batch is None else batch, graph))
        super().decode_step(rows, seconds, batch=batch, graph=graph)


def bucket(rows: int, max_batch_size: int) -> int:
    return next(b for b in batch_buckets(max_batch_size) if b >= rows)


@pytest.fixture(scope="module")
def tokenizer(demo_file):
    with Engine(demo_file) as eng:
        yield eng.tokenizer


@pytest.fixture(scope="module")
def reference(demo_file, tokenizer):
    """Each prompt's greedy tokens alone (60 of them: a shorter request's are their prefix)."""
    with Engine(demo_file, EngineConfig(max_seq_len=512)) as eng:
        return [eng.generate(tokenizer.encode(p), max_new_tokens=60, stop_ids=[]).output_ids for p in PROMPTS]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("decode", ["runner", "packed"])
def test_the_step_follows_the_running_count_and_moves_keep_the_tokens(demo_file, tokenizer, reference, decode):
    lengths = [30, 4, 22, 9, 15, 3]                  # they finish out of slot order: holes open below running ones
    log = StepLog()
    with Scheduler(demo_file, EngineConfig(max_batch_size=8, max_seq_len=512), decode=decode, metrics=log) as sched:
        with sched.cv:                               # all six wait before the loop's next turn: one admission
            jobs = [submit(sched, tokenizer.encode(p), max_tokens=n) for p, n in zip(PROMPTS, lengths)]
        for _, sink in jobs:
            assert isinstance(sink.result(), Done)
        graphs = sched.decode_graphs()
        m = log.snapshot()
    assert [sink.token_ids() for _, sink in jobs] == [r[:n] for r, n in zip(reference, lengths)]
    running = [rows for rows, _, _ in log.steps]
    assert running[0] == 6 and running[-1] == 1 and running == sorted(running, reverse=True)
    if decode == "runner":
        assert [batch for _, batch, _ in log.steps] == [bucket(rows, 8) for rows in running]
        assert set(m["decode_batches"]) == {1, 2, 4, 8}
        assert all(not graph for _, _, graph in log.steps)          # the NumPy engine has no graphs
        assert set(graphs) == {1, 2, 4, 8} and all(why.endswith("has no graphs") for why in graphs.values())
    else:
        assert [batch for _, batch, _ in log.steps] == running
        assert graphs == {1: "unused", 2: "unused", 4: "unused", 8: "unused"}
    assert m["slot_moves"] >= 2                      # 4 tokens (slot 1) and 9 (slot 3) ended below running ones
    assert m["decode_eager_steps"] == len(log.steps) and m["decode_graph_steps"] == 0


def test_cancelling_in_the_middle_of_the_batch(demo_file, tokenizer, reference):
    lengths = [12, 1000, 16, 50]
    log = StepLog()
    with Scheduler(demo_file, EngineConfig(max_batch_size=4, max_seq_len=1024), decode="runner",
                   metrics=log) as sched:
        with sched.cv:
            jobs = [submit(sched, tokenizer.encode(p), max_tokens=n) for p, n in zip(PROMPTS, lengths)]
        (victim, victim_sink), (last, _) = jobs[1], jobs[3]
        deadline = time.monotonic() + 30
        while len(victim_sink.token_ids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        sched.cancel(victim)
        for i in (0, 2, 3):
            assert isinstance(jobs[i][1].result(), Done)
        m = log.snapshot()
    assert [jobs[i][1].token_ids() for i in (0, 2, 3)] == [reference[i][:lengths[i]] for i in (0, 2, 3)]
    assert m["prefill_passes"] == 1                                  # one admission: slots 0..3 in order
    assert victim.finished and not victim_sink.done.is_set() and m["outcomes"]["cancelled"] == 1
    assert victim_sink.token_ids() == reference[1][:len(victim_sink.token_ids())]
    assert m["slot_moves"] >= 1 and last.slot in (0, 1)            # the last request moved down, maybe twice
    running = [rows for rows, _, _ in log.steps]
    assert [batch for _, batch, _ in log.steps] == [bucket(rows, 4) for rows in running]
    assert running[-1] == 1 and log.steps[-1][1] == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_lengths_and_cancels(demo_file, tokenizer, reference, seed):
    rng = random.Random(seed)
    n = 10
    lengths = [rng.randint(1, 40) for _ in range(n)]
    cancel_at = {i: rng.randint(1, 5) for i in rng.sample(range(n), 2)}     # cancelled after a few tokens
    for i in cancel_at:
        lengths[i] = 1000
    order = [rng.randrange(len(PROMPTS)) for _ in range(n)]
    log = StepLog()
    with Scheduler(demo_file, EngineConfig(max_batch_size=4, max_seq_len=1200), decode="runner", max_queue=n,
                   metrics=log) as sched:
        jobs = []
        for i in range(n):
            jobs.append(submit(sched, tokenizer.encode(PROMPTS[order[i]]), max_tokens=lengths[i]))
            time.sleep(rng.random() * 0.02)
        deadline = time.monotonic() + 60
        pending = dict(cancel_at)
        while pending and time.monotonic() < deadline:
            for i in list(pending):
                if len(jobs[i][1].token_ids()) >= pending[i]:
                    sched.cancel(jobs[i][0])
                    del pending[i]
            time.sleep(0.001)
        for i, (_, sink) in enumerate(jobs):
            if i not in cancel_at:
                assert isinstance(sink.result(), Done)
        m = log.snapshot()
    for i, (_, sink) in enumerate(jobs):
        got = sink.token_ids()
        expected = reference[order[i]]
        if i in cancel_at:
            assert got == expected[:len(got)] and not sink.done.is_set()
        else:
            assert got == expected[:lengths[i]]
    assert [batch for _, batch, _ in log.steps] == [bucket(rows, 4) for rows, _, _ in log.steps]
    assert m["outcomes"]["finished"] == n - 2 and m["outcomes"]["cancelled"] == 2


@pytest.fixture(scope="module")
def hybrid_file(tmp_path_factory):
    return str(convert_file(build("qwen3_next"), tmp_path_factory.mktemp("q3n-buckets")))


@pytest.mark.parametrize("decode", ["runner", "packed"])
def test_moves_carry_the_recurrent_state(hybrid_file, decode):
    batch = prompts(96, [9, 3, 14, 5, 7], seed=2)
    lengths = [20, 3, 16, 6, 12]
    with Engine(hybrid_file) as engine:
        alone = [engine.generate(p, max_new_tokens=n, stop_ids=[]).output_ids for p, n in zip(batch, lengths)]
    log = StepLog()
    with Scheduler(hybrid_file, EngineConfig(max_batch_size=8, max_seq_len=64), decode=decode, metrics=log) as sched:
        with sched.cv:
            jobs = [submit(sched, p, max_tokens=n) for p, n in zip(batch, lengths)]
        for _, sink in jobs:
            assert isinstance(sink.result(), Done)
    assert [sink.token_ids() for _, sink in jobs] == alone
    assert log.snapshot()["slot_moves"] >= 2
    if decode == "runner":
        assert [batch for _, batch, _ in log.steps] == [bucket(rows, 8) for rows, _, _ in log.steps]
