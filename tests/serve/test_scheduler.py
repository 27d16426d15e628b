"""The serving loop without HTTP: requests that share the running batch (joining and leaving it between decode
steps, in either decode mode) get exactly what each gets alone; a cancelled request frees its slot before the next
step; the queue is bounded; stop tokens, stop strings and lengths end a request with the right reason."""

from __future__ import annotations

import threading
import time

import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.serve.scheduler import Delta, Done, Failed, Job, QueueFull, SamplingParams, Scheduler

PROMPTS = ["def fibonacci(n):\n    ", "import os\n", "class Stack:\n    def", "# compute the mean\n",
           "for i in range(", "x = [", "while True:\n", "return"]


class Sink:
    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if not isinstance(event, Delta):
            self.done.set()

    def result(self, timeout: float = 60.0):
        assert self.done.wait(timeout), "the request did not finish"
        return self.events[-1]

    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Delta) for t in e.token_ids]


@pytest.fixture(scope="module")
def tokenizer(demo_file):
    with Engine(demo_file) as eng:
        yield eng.tokenizer


@pytest.fixture(scope="module")
def alone(demo_file, tokenizer):
    """Greedy and seeded-sampling outputs of each prompt generated alone by Engine.generate."""
    with Engine(demo_file, EngineConfig(max_seq_len=512)) as eng:
        greedy = [eng.generate(tokenizer.encode(p), max_new_tokens=10 + 3 * i, stop_ids=[]).output_ids
                  for i, p in enumerate(PROMPTS)]
        sampled = [eng.generate(tokenizer.encode(p), max_new_tokens=12, temperature=0.8, top_k=50, seed=i,
                                stop_ids=[]).output_ids for i, p in enumerate(PROMPTS[:4])]
    return greedy, sampled


def submit(sched, prompt_ids, **params) -> tuple[Job, Sink]:
    sink = Sink()
    job = Job(list(prompt_ids), SamplingParams(**params), sink)
    sched.submit(job)
    return job, sink


@pytest.mark.parametrize("decode", ["packed", "runner"])
def test_a_shared_batch_gives_each_request_its_output_alone(demo_file, tokenizer, alone, decode):
    greedy, sampled = alone
    config = EngineConfig(max_batch_size=4, max_seq_len=512)     # 12 requests, 4 slots: they join as others leave
    with Scheduler(demo_file, config, decode=decode, max_queue=16) as sched:
        assert sched.decode_mode == decode
        jobs = [submit(sched, tokenizer.encode(p), max_tokens=len(g)) for p, g in zip(PROMPTS, greedy)]
        jobs += [submit(sched, tokenizer.encode(p), max_tokens=12, temperature=0.8, top_k=50, seed=i)
                 for i, p in enumerate(PROMPTS[:4])]
        results = [sink.result() for _, sink in jobs]
        m = sched.metrics.snapshot()
    assert [sink.token_ids() for _, sink in jobs] == greedy + sampled
    for (job, sink), done, expected in zip(jobs, results, greedy + sampled):
        assert isinstance(done, Done) and done.finish_reason == "length"
        assert (done.prompt_tokens, done.completion_tokens) == (len(job.prompt_ids), len(expected))
        assert done.text == tokenizer.decode(expected)
        assert "".join(e.text for e in sink.events if isinstance(e, Delta)) + done.tail == done.text
    assert m["decode_rows"] / m["decode_steps"] > 2           # the steps really ran several requests at once
    assert m["prefill_passes"] < len(jobs)                    # and admitted several in one pass
    assert m["outcomes"]["finished"] == len(jobs)


def test_cancel_frees_the_slot_before_the_next_step(demo_file, tokenizer):
    with Scheduler(demo_file, EngineConfig(max_batch_size=1, max_seq_len=1024), max_queue=4) as sched:
        long_job, long_sink = submit(sched, tokenizer.encode("import os\n"), max_tokens=1000)
        waiting, waiting_sink = submit(sched, tokenizer.encode("x = ["), max_tokens=3)
        while not long_sink.events:
            time.sleep(0.005)
        assert sched.running == 1 and len(sched.waiting) == 1
        sched.cancel(long_job)
        assert waiting_sink.result(10).finish_reason == "length"     # it got the only slot
        assert len(long_sink.token_ids()) < 200 and not long_sink.done.is_set()
        assert sched.metrics.snapshot()["outcomes"]["cancelled"] == 1
        queued, queued_sink = submit(sched, tokenizer.encode("x"), max_tokens=1000)
        behind, behind_sink = submit(sched, tokenizer.encode("y"), max_tokens=3)
        sched.cancel(behind)                                          # a waiting request leaves the queue
        assert behind not in sched.waiting
        sched.cancel(queued)
        deadline = time.monotonic() + 10
        while sched.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.running == 0 and not sched.waiting


def test_the_queue_is_bounded(demo_file, tokenizer):
    with Scheduler(demo_file, EngineConfig(max_batch_size=1, max_seq_len=1024), max_queue=1) as sched:
        first, sink = submit(sched, tokenizer.encode("a"), max_tokens=1000)
        while not sink.events:
            time.sleep(0.005)
        second, _ = submit(sched, tokenizer.encode("b"), max_tokens=2)          # waits
        with pytest.raises(QueueFull):
            submit(sched, tokenizer.encode("c"), max_tokens=2)
        assert sched.metrics.snapshot()["outcomes"]["rejected_queue_full"] == 1
        sched.cancel(first)
        sched.cancel(second)
    assert not sched.alive


def test_stops(demo_file, tokenizer, alone):
    greedy = alone[0][0]
    text = tokenizer.decode(greedy)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    with Scheduler(demo_file, EngineConfig(max_batch_size=2, max_seq_len=512)) as sched:
        _, by_string = submit(sched, tokenizer.encode(PROMPTS[0]), max_tokens=len(greedy), stop=(stop,))
        _, by_token = submit(sched, tokenizer.encode(PROMPTS[0]), max_tokens=len(greedy), stop_ids=(greedy[3],))
        s, t = by_string.result(), by_token.result()
    assert (s.finish_reason, s.text) == ("stop", text[:text.index(stop)])
    assert "".join(e.text for e in by_string.events if isinstance(e, Delta)) + s.tail == s.text
    assert (t.finish_reason, by_token.token_ids()) == ("stop", greedy[:greedy.index(greedy[3]) + 1])


def test_shutdown_fails_what_is_left(demo_file, tokenizer):
    sched = Scheduler(demo_file, EngineConfig(max_batch_size=1, max_seq_len=1024)).start()
    _, running = submit(sched, tokenizer.encode("a"), max_tokens=1000)
    _, queued = submit(sched, tokenizer.encode("b"), max_tokens=5)
    sched.close()
    assert isinstance(running.result(5), Failed) and isinstance(queued.result(5), Failed)
    assert running.events[-1].status == 503
