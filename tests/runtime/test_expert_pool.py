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
    with Engine(path, EngineConfig(gpu_memory=budget - kv // 2, kv_cache_dtype="bfloat16")) as eng:
        assert eng.experts.capacity == 5        # a bf16 KV cache takes half the budget's KV share
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
        assert published <= held and len(published) <= 2 and pool.pending_keys() <= held
        assert np.all(pool.mirror[~pool.resident_mask()] == pool.host[~pool.resident_mask()])


# --- expert_loading="copy" / "copy-async": copied at admission, published behind the copies' event ----------------
class AsyncCopies:
    """The pool's copy stream made asynchronous on the NumPy backend (whose compute stream runs at once): a copy is
    held back until something waits for it (the compute stream, the host, or an event query answered True), the
    latest a GPU could run it; or run at once ("early"), the earliest (its compute event is always complete here).
    At every table upload each published slot must hold its expert's bytes (no half-copied or stale slot is ever
    read); when a copy runs, no entry of the device tables may point at its slot (no pass that can still read a
    slot, or fill it, is overwritten). `answers`: what successive queries of one event say (then True)."""

    def __init__(self, eng, early: bool = False, answers=(False,)) -> None:
        self.eng, self.pool, self.be = eng, eng.experts, eng.be
        self.early, self.answers = early, tuple(answers)
        self.queue: list[tuple[int, int, int]] = []
        self.ran = self.uploads = self.published_checked = 0
        self.asked: dict[int, int] = {}
        self.real_copy = type(self.be).copy_htod.__get__(self.be)
        for name in ("copy_htod", "record", "wait", "sync_event", "event_done"):
            setattr(self.be, name, getattr(self, name))

    def copy_htod(self, dst: int, src: int, nbytes: int, stream) -> None:
        if stream is self.pool.copy_stream:
            self.queue.append((dst, src, nbytes))
            if self.early:
                self._run(len(self.queue))
            return
        self.real_copy(dst, src, nbytes, stream)
        if dst == self.be.ptr(self.pool._device_tables):
            self._check_published()

    def record(self, stream):
        return len(self.queue) if stream is self.pool.copy_stream else None

    def wait(self, stream, event) -> None:
        if stream is not self.pool.copy_stream and event is not None:
            self._run(event)                         # the compute stream waits for the copies

    def sync_event(self, event) -> None:
        if event is not None:
            self._run(event)

    def event_done(self, event) -> bool:
        if event is None or event <= self.ran:
            return True
        n = self.asked.get(event, 0)
        self.asked[event] = n + 1
        if n < len(self.answers) and not self.answers[n]:
            return False
        self._run(event)
        return True

    def _run(self, upto: int) -> None:
        tables = self.pool._device_tables
        while self.ran < upto:
            dst, src, nbytes = self.queue[self.ran]
            assert not np.any(tables == dst), "a copy overwrote a slot that a queued pass may still read or fill"
            self.real_copy(dst, src, nbytes, None)
            self.ran += 1

    def _check_published(self) -> None:
        pool = self.pool
        self.uploads += 1
        for li, e in zip(*np.nonzero(pool.mirror != pool.host)):
            key = (int(li), int(e))
            assert _slot_bytes(pool, key) == _blob_bytes(self.eng, pool, key), f"{key} published before its copy"
            self.published_checked += 1


def _total(path) -> int:
    with Engine(path) as probe:
        assert len({bytes(probe.reader.expert_blob(layer, e)) for layer in probe.experts.layers
                    for e in range(probe.experts.E)}) > 1          # distinct blobs: a stale slot would be seen
        return len(probe.experts.layers) * probe.experts.E


@pytest.mark.parametrize("mode", ["copy", "copy-async"])
def test_copy_modes_publish_admissions_two_passes_after_they_are_accounted(path, mode):
    """Pass 0 (prefill) routes experts; accounting it while pass 1 runs admits them and queues their copies (no fill
    slot is armed); the table write after pass 2 publishes them whether or not pass 1 or 2 routed them again."""
    total = _total(path)
    with Engine(path, EngineConfig(max_cached_experts=total - 1, expert_loading=mode)) as eng:
        pool = eng.experts
        assert eng.stats()["expert_loading"] == mode
        runner = eng.decode_runner(1, 32)
        eng.prefill_into(runner, [np.array([1, 2, 3])])
        runner.step(np.array([4]), np.array([3]))                  # accounts pass 0: admits, copies queued
        queued = pool.pending_keys()
        assert queued and not pool._armed and not pool.fill_mirror.any() and not pool.resident_mask().any()
        assert pool.counters.loads == len(queued) and pool.counters.bytes_paged == len(queued) * pool.blob_size
        runner.step(np.array([5]), np.array([4]))                  # accounts pass 1: publishes pass 0's copies
        published = {(int(li), int(e)) for li, e in zip(*np.nonzero(pool.resident_mask()))}
        assert queued <= published
        for key in published:
            assert _slot_bytes(pool, key) == _blob_bytes(eng, pool, key)
        assert pool.counters.fills == 0


def test_copy_async_leaves_unfinished_copies_for_a_later_table_write(path):
    total = _total(path)
    with Engine(path, EngineConfig(max_cached_experts=total - 1, expert_loading="copy-async")) as eng:
        pool = eng.experts
        fake = AsyncCopies(eng, answers=(False, False))              # each batch reported done at its third query
        runner = eng.decode_runner(1, 32)
        eng.prefill_into(runner, [np.array([1, 2, 3])])
        runner.step(np.array([4]), np.array([3]))
        queued = pool.pending_keys()
        assert queued and fake.ran == 0
        runner.step(np.array([5]), np.array([4]))                  # first query: not done, nothing published
        assert queued <= pool.pending_keys() and not pool.resident_mask().any() and fake.ran == 0
        runner.step(np.array([6]), np.array([5]))                  # second query: still not done
        assert not (queued & {(int(a), int(b)) for a, b in zip(*np.nonzero(pool.resident_mask()))})
        runner.step(np.array([7]), np.array([6]))                  # third: done, published
        published = {(int(li), int(e)) for li, e in zip(*np.nonzero(pool.resident_mask()))}
        assert queued <= published and fake.published_checked >= len(queued)


@pytest.mark.parametrize("mode,early,answers", [("fill", False, ()), ("copy", False, ()), ("copy", True, ()),
                                                ("copy-async", False, (False,)), ("copy-async", True, (False, False))])
@pytest.mark.parametrize("capacity,policy", [(2, "lru"), (None, "lrfu")])
def test_copy_modes_under_churn_keep_tables_valid_counters_right_and_tokens_equal(path, mode, early, answers,
                                                                                  capacity, policy):
    """Small caches (evictions while copies are queued or unpublished), copies run as late or as early as a GPU may:
    every upload points only at slots holding their experts, no copy lands in a slot a table still names, evicted
    experts' copies are never published, the counters add up, and the greedy tokens equal the resident engine's."""
    total = _total(path)
    cap = capacity or total // 2
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    with Engine(path) as ref:
        want = [ref.generate(p, max_new_tokens=10, stop_ids=[]).output_ids for p in prompts]
    cfg = EngineConfig(max_cached_experts=cap, cache_policy=policy, expert_loading=mode)
    with Engine(path, cfg) as eng:
        pool = eng.experts
        fake = AsyncCopies(eng, early=early, answers=answers)
        got = [eng.generate(p, max_new_tokens=10, stop_ids=[]).output_ids for p in prompts]
        assert got == want
        held = {(li, e) for li, layer in enumerate(pool.layers) for e in range(pool.E) if eng.cache.contains(layer, e)}
        assert pool.pending_keys() <= held
        assert {(int(li), int(e)) for li, e in zip(*np.nonzero(pool.resident_mask()))} <= held
        stats = eng.stats()                                          # flushes the last pass
        c = pool.counters
        assert fake.uploads > 0 and c.hits + c.misses > 0 and c.bytes_zero_copy == c.misses * pool.blob_size
        assert c.bytes_paged == len(fake.queue) * pool.blob_size     # every copy queued is counted once
        if mode == "fill":
            assert c.loads == c.fills + len(fake.queue)
        else:
            assert c.fills == 0 and c.loads == len(fake.queue) > 0 and not pool.fill_mirror.any()
            assert not pool._armed
        if capacity == 2:
            assert eng.cache.stats().evictions > 0
        assert stats["paging"]["hit_rate"] == pytest.approx(c.hits / (c.hits + c.misses))
    assert fake.ran == len(fake.queue)                               # close() waits for the copy stream


def test_accesses_do_not_depend_on_the_loading_mode(path):
    """The same routes are counted whatever the mode (hits + misses), and copies make hits sooner than fills."""
    total = _total(path)
    seen = {}
    for mode in ("fill", "copy", "copy-async"):
        with Engine(path, EngineConfig(max_cached_experts=total // 2, expert_loading=mode)) as eng:
            eng.generate([3, 1, 4, 1, 5], max_new_tokens=16, stop_ids=[])
            c = eng.experts.counters
            eng.experts.flush()
            seen[mode] = (c.hits + c.misses, c.hits)
    assert seen["fill"][0] == seen["copy"][0] == seen["copy-async"][0]
    assert seen["copy"][1] == seen["copy-async"][1] >= seen["fill"][1]


def test_expert_loading_is_checked():
    with pytest.raises(InvalidInput, match="expert_loading"):
        EngineConfig(expert_loading="dma")


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
@pytest.mark.parametrize("mode,lag", [("fill", "fill"), ("copy", "2"), ("copy-async", "2")])
def test_engine_hits_match_the_simulators_publication_lag(path, mode, lag, policy):
    """A synthetic trace forced onto the routers (experts in ascending order: the order the pool accounts them in)
    gives the hits the cache simulator predicts for the mode's lag (fill: the fill-on-read rule; copy: 2): exactly
    under lru; under lrfu the engine's cache runs a token later on its clock (a near-tie may flip)."""
    from colibri_format.runtime.cache.cachesim import run_cache_sim, synthetic_trace
    from colibri_format.runtime.cache.trace import Trace, TraceRecord

    with Engine(path) as probe:
        layers, E, k = probe.experts.layers, probe.experts.E, probe.args.top_k
    steps = 120
    raw = synthetic_trace(len(layers), E, k, steps, skew=1.0, locality=0.3, seed=4)
    choices = np.zeros((steps, len(layers), k), np.int32)
    records = []
    for rec in raw.records:
        experts = tuple((layer, tuple(sorted(chosen))) for layer, chosen in rec.experts)
        records.append(TraceRecord(rec.t, rec.seq, rec.pos, experts))
        for li, (_, chosen) in enumerate(experts):
            choices[rec.t, li] = chosen
    trace = Trace(raw.header, records)
    cap = len(layers) * E // 2
    spec, admission = ("lru", "always") if policy == "lru" else ("lrfu+hist:0.999:token", "frequency")
    sim = run_cache_sim(trace, str(cap), spec, "global", admission=admission, lag=lag)
    cfg = EngineConfig(max_cached_experts=cap, expert_loading=mode, cache_policy=policy, cache_admission=admission)
    with Engine(path, cfg) as eng:
        step = [0]
        eng.decoder.forced_routes = lambda layer, rows: choices[step[0], layers.index(layer)][None].repeat(rows, 0)
        runner = eng.decode_runner(1, steps + 2)
        eng.prefill_into(runner, [np.array([1])])
        for t in range(1, steps):
            step[0] = t
            runner.step(np.array([t % 50 + 1]), np.array([t]))
        eng.experts.flush()
        c = eng.experts.counters
    row = sim["rows"][0]
    assert c.hits + c.misses == row["accesses"]
    if policy == "lru":
        assert c.hits == row["hits"]
    else:
        assert abs(c.hits - row["hits"]) <= 0.01 * row["accesses"], (c.hits, row["hits"])
