"""cache-sim and pins read a trace file line by line: peak memory follows the compact access arrays (16 bytes an
access), not the parsed records (a whole-file read kept every record, ~14x the file's size with the old access
lists); results equal the in-memory path."""

from __future__ import annotations

import tracemalloc

import pytest

from colibri_format.runtime.cache.cachesim import pins_from_trace, run_cache_sim, synthetic_trace
from colibri_format.runtime.cache.trace import read_accesses, read_trace, write_trace


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "big.jsonl"
    write_trace(synthetic_trace(8, 64, 8, tokens=20_000, skew=1.0, locality=0.2, seed=1), path)
    return path


def test_streamed_results_equal_the_in_memory_ones(tmp_path):
    """A shorter trace than the memory test's (the simulations, not the reading, take the time; 3,000 tokens still
    fill and churn the 10% and 50% caches many times over)."""
    path = tmp_path / "trace.jsonl"
    write_trace(synthetic_trace(8, 64, 8, tokens=3_000, skew=1.0, locality=0.2, seed=1), path)
    whole = read_trace(path)
    for scope in ("global", "per_layer"):
        assert run_cache_sim(path, "10%,50%", "lru,lrfu", scope) == run_cache_sim(whole, "10%,50%", "lru,lrfu", scope)
        assert pins_from_trace(path, 5, scope) == pins_from_trace(whole, 5, scope)


def test_peak_memory_follows_the_accesses_not_the_records(trace_file):
    size = trace_file.stat().st_size
    tracemalloc.start()
    header, acc, tokens = read_accesses(trace_file, dedup=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tokens == 20_000 and len(acc) == tokens * len(header.moe_layers) * header.top_k
    arrays = acc.layer.nbytes + acc.expert.nbytes + acc.step.nbytes
    assert peak < 1.6 * arrays + (4 << 20), (peak, arrays, size)       # the arrays, their growth slack, a line
