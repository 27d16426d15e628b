"""Paging without a host sync, on the GPU: the route-count kernel against its NumPy twin, the expert kernels
reading blobs straight from pinned host memory (zero-copy, as they read a registered file mapping), and a
captured decode graph replayed while its expert table's entries flip between device slots and host addresses.
The engine-level paging scenarios (outputs, counters, corrupt blobs, registration failure) run on both
backends in tests/runtime/test_engine_scenarios.py."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda.synthetic_experts import host_experts, upload


@pytest.mark.parametrize("P,E", [(1, 8), (8, 128), (256, 128), (5000, 64)])
def test_count_routes_matches_numpy(cp, P, E):
    rng = np.random.default_rng(P)
    ids = rng.integers(-2, E + 2, P).astype(np.int32)           # a few ids out of range: ignored
    start = rng.integers(0, 2**32, E, dtype=np.uint64).astype(np.uint32)
    start[0] = 2**32 - 1                                       # wraps
    dev = cp.asarray(start)
    ops.count_routes(cp.asarray(ids), dev)
    np.testing.assert_array_equal(dev.get(), nb.count_routes(ids, start.copy()))


def test_count_routes_checks_its_inputs(cp):
    with pytest.raises(TypeError, match="totals"):
        ops.count_routes(cp.zeros(4, cp.int32), cp.zeros(8, cp.int32))
    with pytest.raises(TypeError, match="ids"):
        ops.count_routes(cp.zeros(4, cp.int64), cp.zeros(8, cp.uint32))


@pytest.mark.parametrize("T,gemm,tc", [(1, False, False), (3, False, False), (64, True, False), (64, True, True)])
def test_expert_kernels_read_blobs_from_pinned_host_memory(cp, T, gemm, tc):
    """Half the experts on the device, half in pinned host memory: the same result as all on the device."""
    rng = np.random.default_rng(T)
    E, k, H, I = 8, 2, 256, 128
    layout, experts, blobs = host_experts(rng, E, H, I)
    buf, device_table = upload(blobs, E, layout)
    pinned = cp.cuda.alloc_pinned_memory(blobs.nbytes)
    host = np.frombuffer(pinned, np.uint8, blobs.nbytes)
    host[:] = blobs
    ptrs = [int(host.ctypes.data) + e * layout.size if e % 2 else buf.data.ptr + e * layout.size for e in range(E)]
    mixed = ops.ExpertTable.from_layout(cp.asarray(np.array(ptrs, np.uint64)), layout)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    ids = cp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
    w = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    want = ops.moe_experts(x, ids, w, device_table, gemm=gemm, tensor_cores=tc).get()
    got = ops.moe_experts(x, ids, w, mixed, gemm=gemm, tensor_cores=tc).get()
    np.testing.assert_array_equal(got, want)


def test_graph_replays_while_table_entries_flip(tmp_path_factory):
    """A paged engine whose pool holds every expert but one: between replays of its captured decode step, random
    entries are pointed at the host mapping and back at their (filled) slots. Every step's logits equal a
    resident engine's on the same tokens: a replay reads whatever the table says, never a stale address."""
    from tests.runtime.test_engine_scenarios import WIDE, make_file

    path = make_file(tmp_path_factory, "mixtral", **WIDE)
    rng = np.random.default_rng(0)
    with Engine(path, EngineConfig(device="cuda")) as resident:
        total = len(resident.experts.layers) * resident.experts.E
    # prefill passes of up to 32 rows on both (a resident engine's padded prefill graph runs other kernels)
    with Engine(path, EngineConfig(device="cuda", max_prefill_rows=32)) as resident, \
            Engine(path, EngineConfig(device="cuda", max_cached_experts=total - 1, max_prefill_rows=32)) as paged:
        prompt = [[3, 4, 5, 6]]
        r_run, p_run = resident.decode_runner(1, 40), paged.decode_runner(1, 40)
        r_tok = resident.argmax(resident.prefill_into(r_run, [np.array(prompt[0])]))
        p_tok = paged.argmax(paged.prefill_into(p_run, [np.array(prompt[0])]))
        for _ in range(8):                                     # warm: the cache admits and publishes
            p_tok = paged.argmax(p_run.step(np.array(p_tok), np.array([len(prompt[0])])))
        pool = paged.experts
        pool.flush()
        pool.cache = None               # freeze the cache: from here on only this test changes the table
        slots = pool.mirror.copy()      # entries now: mostly slots
        assert p_run.graph is not None and pool.resident_mask().sum() >= total // 2
        pos = len(prompt[0])
        for step in range(24):
            flip = rng.random(slots.shape) < 0.5
            pool.mirror[...] = np.where(flip, pool.host, slots)
            pool._upload()
            want = resident.be.to_host(r_run.step(np.array(r_tok), np.array([pos + step])))
            got = paged.be.to_host(p_run.step(np.array(r_tok), np.array([pos + step])))
            np.testing.assert_array_equal(got, want)          # same kernels, same bytes: bit for bit
            r_tok = [int(np.argmax(want[0]))]
        assert p_run.graph is not None and p_run.eager_steps == 1


@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize("T,variant", [(1, None), (1, "t1"), (1, "w2"), (3, None), (8, None)])
def test_gemv_kernels_fill_admitted_slots_as_they_read(cp, group, T, variant):
    """Experts with a fill slot, read from pinned host memory: after the gate_up and down GEMVs every array of
    each routed one is in its slot, byte for byte; unrouted experts' slots stay untouched; results unchanged."""
    rng = np.random.default_rng(T + group)
    E, k, H, I = 8, 2, 256, 128
    layout, experts, blobs = host_experts(rng, E, H, I, group)
    pinned = cp.cuda.alloc_pinned_memory(blobs.nbytes)
    host = np.frombuffer(pinned, np.uint8, blobs.nbytes)
    host[:] = blobs
    slots = cp.full(blobs.nbytes, 0xAB, cp.uint8)
    ptrs = cp.asarray(np.array([int(host.ctypes.data) + e * layout.size for e in range(E)], np.uint64))
    fills = cp.asarray(np.array([slots.data.ptr + e * layout.size if e % 3 else 0 for e in range(E)], np.uint64))
    plain = ops.ExpertTable.from_layout(ptrs, layout)
    filling = ops.ExpertTable.from_layout(ptrs, layout, fill_ptrs=fills)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    ids_h = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    ids, w = cp.asarray(ids_h), cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    d = ops.dispatch(ids, E)
    act = ops.moe_gate_up(x, filling, d, k, variant=variant)
    y = ops.moe_down(act, filling, d, w, variant=variant)
    np.testing.assert_array_equal(y.get(), ops.moe_down(ops.moe_gate_up(x, plain, d, k, variant=variant), plain, d,
                                                        w, variant=variant).get())
    got = slots.get().reshape(E, layout.size)
    for e in range(E):
        filled = e % 3 and e in ids_h
        for a in layout.arrays:
            span = slice(a.offset, a.offset + a.nbytes)
            want = blobs.reshape(E, layout.size)[e, span] if filled else np.full(a.nbytes, 0xAB, np.uint8)
            np.testing.assert_array_equal(got[e, span], want, err_msg=f"expert {e} array {a.name}")
