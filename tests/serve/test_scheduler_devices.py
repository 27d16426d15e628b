"""The serving loop's batch buckets on every backend (device="cuda" on a GPU, skipped with a visible reason
elsewhere), over a tiny Mixtral file with head_dim 64 (the CUDA attention kernel, so steps can be graphs): each step
runs the smallest bucket holding the running requests, each bucket's step is a captured graph exactly when the
engine can capture a step of that many rows (after its first, eager, step), and every request's greedy tokens are
those of the float64 NumPy engine alone."""

from __future__ import annotations

import pytest

from colibri_format.runtime import EngineConfig
from colibri_format.serve.scheduler import Done, Scheduler
from tests.runtime.test_engine_scenarios import WIDE, _gpu, make_file, reference
from tests.serve.test_scheduler_buckets import StepLog, bucket, submit


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    if request.param == "cuda" and not _gpu():
        pytest.skip("no CUDA GPU / CuPy available")
    return request.param


@pytest.fixture(scope="module")
def wide_file(tmp_path_factory):
    return make_file(tmp_path_factory, "mixtral", num_hidden_layers=3, **WIDE)


def test_buckets_graphs_and_tokens(wide_file, device):
    prompts = [[1 + (7 * i + j) % 30 for j in range(3 + i % 5)] for i in range(11)]
    lengths = [24, 3, 17, 9, 30, 5, 12, 2, 20, 7, 14]           # 11 running (bucket 16), ending out of slot order
    with reference(wide_file) as ref:
        alone = [ref.generate(p, max_new_tokens=n, stop_ids=[]).output_ids for p, n in zip(prompts, lengths)]
    log = StepLog()
    config = EngineConfig(device=device, max_batch_size=16, max_seq_len=64)
    with Scheduler(wide_file, config, decode="auto" if device == "cuda" else "runner", metrics=log) as sched:
        assert sched.decode_mode == "runner"
        with sched.cv:
            jobs = [submit(sched, p, max_tokens=n) for p, n in zip(prompts, lengths)]
        for _, sink in jobs:
            assert isinstance(sink.result(120), Done)
        graphs = sched.decode_graphs()
        blockers = {b: sched._engine.graph_blocker(b) for b in sched.buckets}
        m = log.snapshot()
    assert [sink.token_ids() for _, sink in jobs] == alone
    running = [rows for rows, _, _ in log.steps]
    assert running[0] == 11 and running[-1] == 1
    assert [batch for _, batch, _ in log.steps] == [bucket(rows, 16) for rows in running]
    used = set(m["decode_batches"])
    assert used == {1, 2, 4, 8, 16}
    for b in sched.buckets:                       # captured exactly where the engine can capture that many rows
        assert graphs[b] == ("captured" if blockers[b] is None else blockers[b]), (b, graphs[b])
    for b in used:                                # a captured bucket replays every step after its first
        graph_steps = sum(1 for _, batch, graph in log.steps if batch == b and graph)
        assert graph_steps == (m["decode_batches"][b] - 1 if graphs[b] == "captured" else 0), b
    if device == "cuda":
        assert graphs[1] == graphs[8] == graphs[16] == "captured" and m["decode_graph_steps"] > len(log.steps) // 2
    else:
        assert m["decode_graph_steps"] == 0
    assert m["slot_moves"] >= 3
