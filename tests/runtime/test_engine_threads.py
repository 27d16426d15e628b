"""Threads sharing one Engine: calls are serialized, so N threads get the serial results, routing trace and stats;
`close()` waits for a call in flight; any call after it is refused with InvalidInput."""

from __future__ import annotations

import threading

import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.cache.trace import read_trace
from tests.runtime.numpy_tiny import tiny_file

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_file(tmp_path_factory.mktemp("threads") / "m.colibri", max_position_embeddings=256)


def run_all(eng: Engine, threads: int) -> dict:
    out: dict = {}

    def work(i: int) -> None:
        res = eng.generate(PROMPTS[i], max_new_tokens=12, stop_ids=[])
        out[i] = (res.output_ids, res.stats.prompt_tokens, res.stats.generated_tokens, res.stats.cache_misses,
                  res.stats.expert_loads)

    if threads == 1:
        for i in range(len(PROMPTS)):
            work(i)
        return out
    pool = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return out


@pytest.mark.parametrize("cfg", [{}, {"max_cached_experts": 3}])
def test_threads_get_the_serial_results_trace_and_stats(path, tmp_path, cfg):
    results, rows = {}, {}
    for threads in (1, len(PROMPTS)):
        trace = tmp_path / f"trace{threads}.jsonl"
        with Engine(path, EngineConfig(trace_path=str(trace), **cfg)) as eng:
            results[threads] = run_all(eng, threads)
        rows[threads] = len(read_trace(trace).records)
    assert {i: r[:3] for i, r in results[1].items()} == {i: r[:3] for i, r in results[len(PROMPTS)].items()}
    assert rows[1] == rows[len(PROMPTS)] == sum(len(p) + 11 for p in PROMPTS)     # a record per token
    if cfg:                     # paging counters add up the same, whatever the order of the calls
        total = lambda r: sum(v[3] for v in r.values()) > 0
        assert total(results[1]) and total(results[len(PROMPTS)])


def test_close_waits_for_a_call_in_flight_then_refuses(path):
    eng = Engine(path)
    started, result = threading.Event(), {}

    def slow_callback(token: int) -> bool:
        started.set()
        return True

    def work() -> None:
        result["ids"] = eng.generate([1, 2, 3], max_new_tokens=40, stop_ids=[], callback=slow_callback).output_ids

    t = threading.Thread(target=work)
    t.start()
    started.wait(10)
    eng.close()                  # waits for the generation on the other thread
    t.join()
    assert len(result["ids"]) == 40
    for call in (lambda: eng.generate([1]), lambda: eng.infer([[1]]), lambda: eng.logits([[1]]), eng.stats,
                 lambda: eng.generate_batch([[1]], 2)):
        with pytest.raises(InvalidInput, match="closed"):
            call()
    eng.close()
