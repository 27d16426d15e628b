"""The expert pool's sizing and its table logic between passes, on the NumPy backend (the same code drives the
CUDA backend: tests/runtime/cuda/test_gpu_paging.py and the cuda half of test_engine_scenarios.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.expert_pool import capacity_from_budget, parse_memory
from tests.runtime.test_engine_scenarios import WIDE, make_file


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_file(tmp_path_factory, "mixtral", **WIDE)


@pytest.mark.parametrize("text,size", [("20GiB", 20 << 30), ("512MB", 512 * 10**6), ("1.5G", 3 << 29),
                                       (4096, 4096), (" 8 gib ", 8 << 30), ("100", 100)])
def test_parse_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("bad", ["", "GiB", "-1GiB", "12 parsecs", "0", 0, -5, True, "1e400GiB", "9" * 40,
                                 "2048TiB"])
def test_parse_memory_refuses_with_one_line(bad):
    with pytest.raises(InvalidInput, match="gpu_memory") as info:
        parse_memory(bad)
    assert "\n" not in str(info.value)


def test_capacity_from_budget():
    blob = 1 << 20
    assert capacity_from_budget(100 * blob, 10 * blob, 20 * blob, blob, "global", 4, 8) == 32     # all fit: 32
    assert capacity_from_budget(50 * blob, 10 * blob, 20 * blob, blob, "global", 4, 8) == 20
    assert capacity_from_budget(50 * blob, 10 * blob, 20 * blob, blob, "per_layer", 4, 8) == 5
    with pytest.raises(InvalidInput, match="at least 0.03 GiB is needed"):
        capacity_from_budget(30 * blob, 10 * blob, 20 * blob, blob, "global", 4, 8)


def test_gpu_memory_sizes_the_cache(path):
    with Engine(path, EngineConfig()) as probe:
        blob, dense = probe.experts.blob_size, probe.dense.nbytes
        a = probe.args
        kv = 2 * a.num_layers * 2048 * a.n_kv_heads * a.head_dim * 4
    from colibri_format.runtime.expert_pool import MEMORY_RESERVE

    budget = dense + kv + MEMORY_RESERVE + 5 * blob + blob // 2
    with Engine(path, EngineConfig(gpu_memory=budget)) as eng, Engine(path) as ref:
        assert eng.experts.capacity == 5 and not eng.experts.resident and eng.stats()["capacity"] == 5
        assert eng.generate([1, 2, 3], max_new_tokens=6, stop_ids=[]).output_ids == \
            ref.generate([1, 2, 3], max_new_tokens=6, stop_ids=[]).output_ids
    with Engine(path, EngineConfig(gpu_memory="1TiB")) as eng:
        assert eng.experts.resident
    with pytest.raises(InvalidInput, match="not both"):
        EngineConfig(gpu_memory="1GiB", max_cached_experts=3)


def _slot_bytes(pool, key) -> bytes:
    addr = int(pool.mirror[key])
    return ctypes.string_at(addr, pool.blob_size)


def _blob_bytes(eng, pool, key) -> bytes:
    li, e = key
    return bytes(eng.reader.expert_blob(pool.layers[li], e))


def test_admitted_experts_are_filled_on_read_and_published_after_that_pass(path):
    """Pass k routes an expert; the cache admits it when it accounts for pass k (after pass k+1 is queued) and
    arms its fill slot; the next pass that routes it copies it into the slot as it reads it; the entry points
    at the slot from the table write after the pass that accounted for that one on. No copy is queued."""
    with Engine(path) as probe:
        total = len(probe.experts.layers) * probe.experts.E
    with Engine(path, EngineConfig(max_cached_experts=total - 1)) as eng:
        pool = eng.experts
        runner = eng.decode_runner(1, 32)
        eng.prefill_into(runner, [np.array([1, 2, 3])])
        runner.step(np.array([4]), np.array([3]))                  # accounts the prefill: admits, arms
        armed = set(pool._armed)
        assert armed and pool.counters.loads == 0 and not pool.resident_mask().any()
        assert {(int(li), int(e)) for li, e in zip(*np.nonzero(pool.fill_mirror))} == armed
        for pos in range(4, 12):
            runner.step(np.array([pos + 1]), np.array([pos]))
        pool.flush()
        published = [(int(li), int(e)) for li, e in zip(*np.nonzero(pool.resident_mask()))]
        assert published and pool.counters.fills == pool.counters.loads == len(published)
        assert pool.counters.bytes_paged == 0                      # filled on read: nothing crossed twice
        for key in published:                                      # each slot holds its expert, byte for byte
            assert _slot_bytes(pool, key) == _blob_bytes(eng, pool, key) and pool.fill_mirror[key] == 0


def test_a_pass_that_cannot_fill_copies_the_armed_experts_it_routes(path, monkeypatch):
    """A grouped-GEMM pass (prefill on CUDA) fills nothing: an armed expert it routes is copied instead."""
    with Engine(path) as probe:
        total = len(probe.experts.layers) * probe.experts.E
        monkeypatch.setattr(type(probe.be), "fills_on_read", lambda self, rows, k, E: False)
    with Engine(path, EngineConfig(max_cached_experts=total - 1)) as eng:
        pool = eng.experts
        for _ in range(6):                      # the same prompt: armed, routed again, copied, published
            eng.infer([[1, 2, 3, 4, 5]])
        pool.flush()
        published = [(int(li), int(e)) for li, e in zip(*np.nonzero(pool.resident_mask()))]
        assert published and pool.counters.fills == 0 and pool.counters.loads == len(published)
        assert pool.counters.bytes_paged == len(published) * pool.blob_size
        for key in published:
            assert _slot_bytes(pool, key) == _blob_bytes(eng, pool, key)


def test_an_evicted_entry_points_back_at_the_host_at_once(path):
    with Engine(path, EngineConfig(max_cached_experts=2, cache_policy="lru")) as eng:
        pool = eng.experts
        eng.generate([1, 2, 3, 4, 5], max_new_tokens=12, stop_ids=[])
        pool.flush()
        assert eng.cache.stats().evictions > 0
        held = {(li, e) for li, layer in enumerate(pool.layers) for e in range(pool.E) if eng.cache.contains(layer, e)}
        published = {(int(li), int(e)) for li, e in zip(*np.nonzero(pool.resident_mask()))}
        assert published <= held and len(published) <= 2 and set(pool._pending) <= held
        assert np.all(pool.mirror[~pool.resident_mask()] == pool.host[~pool.resident_mask()])
