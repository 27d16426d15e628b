"""The small-decode-step expert kernels (moe_small.cu: gate/up by pair from the router's ids, down with the combine
folded in) against `numpy_backend` in float64, their fill on read, their checks, and the engine with
`EngineConfig(small_moe=True)` against the float64 NumPy engine (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.synthetic_experts import host_experts, upload
from tests.runtime.cuda.test_gpu_kernels import F32_TOL, _moe, f64, nan_like, rel

PLANS = [(g, d) for g in range(len(limits.SMALL_GATE_UP_PLANS)) for d in range(len(limits.SMALL_DOWN_PLANS))]


def _case(cp, rng, T, E, k, H, I, group, shared=False):
    """Device experts and a step's inputs; shared: expert ids[0, 0] in every token (one expert read by several)."""
    layout, experts, blobs = host_experts(rng, E, H, I, group)
    buf, table = upload(blobs, E, layout)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    if shared:
        for t in range(1, T):
            if ids[0, 0] not in ids[t]:
                ids[t, rng.integers(k)] = ids[0, 0]
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    resid = rng.standard_normal((T, H)).astype(np.float32)
    return buf, table, experts, blobs, layout, x, ids, w, resid


CASES = [  # T, E, k, H, I, group
    (1, 8, 1, 256, 128, 0), (1, 8, 2, 256, 128, 32), (2, 8, 2, 512, 256, 0), (4, 8, 2, 256, 96, 16),
    (1, 64, 8, 256, 128, 0), (2, 64, 8, 256, 128, 64), (4, 64, 8, 128, 64, 0), (1, 128, 8, 256, 128, 0),
    (2, 128, 8, 256, 128, 16), (4, 128, 8, 256, 128, 32), (2, 4, 2, 4160, 2080, 0), (4, 8, 4, 4160, 2080, 32),
    (3, 32, 5, 64, 32, 0)]


@pytest.mark.parametrize("case,plans", [(case, plans) for case in CASES    # long rows (slow on the host): two pairs
                                         for plans in (PLANS if case[3] <= 1024 else [(0, 0), (1, 2)])])
def test_small_kernels_match_numpy(cp, rng, case, plans):
    T, E, k, H, I, group = case
    buf, table, experts, _, _, x, ids, w, resid = _case(cp, rng, T, E, k, H, I, group, shared=T > 1)
    act = ops.moe_small_gate_up(cp.asarray(x), cp.asarray(ids), table, plan=plans[0], out=nan_like(cp, (T * k, I)))
    exp_act = expect.pair_act(f64(x), ids, experts)
    assert rel(act.get(), exp_act) < F32_TOL
    y = ops.moe_small_down(act, cp.asarray(ids), cp.asarray(w), table, residual=cp.asarray(resid), alpha=0.75,
                           plan=plans[1], out=nan_like(cp, (T, H)))
    exp_y = expect.combine(expect.pair_down(f64(act.get()), ids, f64(w), experts), k, f64(resid), 0.75)
    assert rel(y.get(), exp_y) < F32_TOL
    no_residual = ops.moe_small_down(act, cp.asarray(ids), cp.asarray(w), table, plan=plans[1])
    assert rel(no_residual.get(), _moe(x, ids, w, experts)) < F32_TOL


@pytest.mark.parametrize("T", [1, 2, 4])
def test_small_experts_block_equals_numpy_moe_and_is_deterministic(cp, rng, T):
    buf, table, experts, _, _, x, ids, w, resid = _case(cp, rng, T, 64, 8, 512, 256, 0, shared=True)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    h = cp.asarray(resid)
    y = ops.moe_experts_small(*args, residual=h, alpha=1.5, out=h)              # out may be the residual
    assert y is h and rel(y.get(), _moe(x, ids, w, experts, residual=resid, alpha=1.5)) < F32_TOL
    again = ops.moe_experts_small(*args, residual=cp.asarray(resid), alpha=1.5)
    np.testing.assert_array_equal(again.get(), y.get())                          # fixed summation order
    today = ops.moe_experts(*args, residual=cp.asarray(resid), alpha=1.5)
    assert rel(y.get(), f64(today.get())) < F32_TOL


def test_ids_outside_the_layer_add_nothing(cp, rng):
    T, E, k, H, I = 2, 8, 2, 256, 128
    buf, table, experts, _, _, x, ids, w, resid = _case(cp, rng, T, E, k, H, I, 0)
    bad = ids.copy()
    bad[0, 1], bad[1, 0] = -1, E
    act = ops.moe_small_gate_up(cp.asarray(x), cp.asarray(bad), table, out=nan_like(cp, (T * k, I)))
    assert not act.get()[[1, 2]].any()
    y = ops.moe_small_down(act, cp.asarray(bad), cp.asarray(w), table, residual=cp.asarray(resid))
    w0 = w.copy()
    w0[0, 1] = w0[1, 0] = 0.0                   # the same as those slots weighing nothing
    assert rel(y.get(), _moe(x, ids, w0, experts, residual=resid)) < F32_TOL


@pytest.mark.parametrize("group", [0, 32])
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("plans", PLANS)
def test_small_kernels_fill_admitted_slots_as_they_read(cp, group, T, plans):
    """Experts read from pinned host memory with a fill slot for two in three: after the two launches every array of
    each routed one is in its slot byte for byte (an expert several tokens pick too), other slots stay untouched,
    and the result equals the run without fills."""
    rng = np.random.default_rng(100 * T + group)
    E, k, H, I = 8, 2, 256, 128
    _, _, experts, blobs, layout, x, ids_h, w, _ = _case(cp, rng, T, E, k, H, I, group, shared=True)
    pinned = cp.cuda.alloc_pinned_memory(blobs.nbytes)
    host = np.frombuffer(pinned, np.uint8, blobs.nbytes)
    host[:] = blobs
    slots = cp.full(blobs.nbytes, 0xAB, cp.uint8)
    ptrs = cp.asarray(np.array([int(host.ctypes.data) + e * layout.size for e in range(E)], np.uint64))
    fills = cp.asarray(np.array([slots.data.ptr + e * layout.size if e % 3 else 0 for e in range(E)], np.uint64))
    plain = ops.ExpertTable.from_layout(ptrs, layout)
    filling = ops.ExpertTable.from_layout(ptrs, layout, fill_ptrs=fills)
    x, ids, w = cp.asarray(x), cp.asarray(ids_h), cp.asarray(w)
    got = ops.moe_experts_small(x, ids, w, filling, plans=plans).get()
    np.testing.assert_array_equal(got, ops.moe_experts_small(x, ids, w, plain, plans=plans).get())
    assert rel(got, _moe(x.get(), ids_h, w.get(), experts)) < F32_TOL
    slot_bytes = slots.get().reshape(E, layout.size)
    for e in range(E):
        filled = e % 3 and e in ids_h
        for a in layout.arrays:
            span = slice(a.offset, a.offset + a.nbytes)
            want = blobs.reshape(E, layout.size)[e, span] if filled else np.full(a.nbytes, 0xAB, np.uint8)
            np.testing.assert_array_equal(slot_bytes[e, span], want, err_msg=f"expert {e} array {a.name}")


def test_small_wrappers_reject_bad_inputs(cp, rng):
    T, E, k, H, I = 2, 8, 2, 64, 32
    buf, table, _, _, _, x, ids, w, _ = _case(cp, rng, T, E, k, H, I, 0)
    x, ids, w = cp.asarray(x), cp.asarray(ids), cp.asarray(w)
    act = ops.moe_small_gate_up(x, ids, table)
    too_many = cp.zeros((limits.MOE_SMALL_MAX_TOKENS + 1, k), cp.int32)
    with pytest.raises(ValueError, match="tokens"):
        ops.moe_small_gate_up(cp.zeros((too_many.shape[0], H), cp.float32), too_many, table)
    with pytest.raises(TypeError):
        ops.moe_small_gate_up(x, ids.astype(cp.int64), table)
    with pytest.raises(ValueError):
        ops.moe_small_gate_up(cp.ones((T, 2 * H), cp.float32)[:, ::2], ids, table)       # not C-contiguous
    with pytest.raises(ValueError, match="plan"):
        ops.moe_small_gate_up(x, ids, table, plan=len(limits.SMALL_GATE_UP_PLANS))
    with pytest.raises(ValueError, match="weights"):
        ops.moe_small_down(act, ids, w.reshape(-1), table)
    with pytest.raises(ValueError, match="act"):
        ops.moe_small_down(act[:1], ids, w, table)
    with pytest.raises(ValueError, match="residual"):
        ops.moe_small_down(act, ids, w, table, residual=cp.zeros((T, H + 16), cp.float32))


def test_moe_experts_takes_the_small_path_only_when_asked_and_able(cp, rng, monkeypatch):
    calls = []
    real = ops.moe_experts_small
    monkeypatch.setattr(ops, "moe_experts_small", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    for T, small, extras in ((2, False, None), (2, True, ops.ExpertExtras()), (limits.MOE_SMALL_MAX_TOKENS + 1, True,
                                                                                None), (2, True, None)):
        buf, table, experts, _, _, x, ids, w, _ = _case(cp, rng, T, 8, 2, 256, 128, 0)
        y = ops.moe_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, small=small, extras=extras)
        assert rel(y.get(), _moe(x, ids, w, experts)) < F32_TOL
    assert calls == [(2, 2)]


# ---- the engine with small_moe --------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["mixtral", "granitemoe"])     # granitemoe: residual_multiplier 0.22 (alpha)
def model_file(request, tmp_path_factory):
    from tests.runtime.test_engine_scenarios import WIDE, make_file

    return make_file(tmp_path_factory, request.param, num_hidden_layers=3, **WIDE)


def _count_small_launches(monkeypatch) -> list:
    calls = []
    real = ops.moe_experts_small
    monkeypatch.setattr(ops, "moe_experts_small", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("use_graphs", [False, True])
@pytest.mark.parametrize("capacity", [None, 3])     # resident; paged (the kernels fill admitted slots)
def test_engine_with_small_moe_matches_the_float64_engine(model_file, use_graphs, capacity, monkeypatch):
    from tests.runtime.test_engine_scenarios import TOLERANCE

    calls = _count_small_launches(monkeypatch)
    cfg = dict(max_seq_len=64, max_cached_experts=capacity, cache_policy="lru")     # lru: every miss admitted
    with Engine(model_file, EngineConfig(device="cuda", small_moe=True, use_graphs=use_graphs, **cfg)) as eng, \
            Engine(model_file, EngineConfig(precision="float64", **cfg)) as ref:
        prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [4], [40, 41, 42]]
        for got, exp in zip(eng.logits(prompts[1:3]), ref.logits(prompts[1:3])):     # prefills of <= 4 rows
            assert rel(got, exp) < TOLERANCE["cuda"]
        for prompt in prompts[:2]:
            assert eng.generate(prompt, max_new_tokens=8, stop_ids=[]).output_ids == \
                ref.generate(prompt, max_new_tokens=8, stop_ids=[]).output_ids
        assert eng.generate_batch(prompts, 6) == ref.generate_batch(prompts, 6)      # decode steps of 4 rows
        assert calls and set(calls) <= set(range(1, limits.MOE_SMALL_MAX_TOKENS + 1))
        if use_graphs:
            assert eng.stats()["graphs"]["1x64"] == "captured"
        if capacity is not None:
            assert eng.experts.counters.fills > 0


def test_engine_small_moe_graph_replay_equals_eager_and_today_within_fp32(model_file):
    with Engine(model_file, EngineConfig(device="cuda", small_moe=True)) as g, \
            Engine(model_file, EngineConfig(device="cuda", small_moe=True, use_graphs=False)) as e, \
            Engine(model_file, EngineConfig(device="cuda")) as today:
        tokens, pos = np.array([1, 2, 3, 4]), np.array([20, 21, 22, 23])
        la = g.be.to_host(g.decode_runner(4, 64).step(tokens, pos)).copy()
        lb = e.be.to_host(e.decode_runner(4, 64).step(tokens, pos)).copy()
        lc = today.be.to_host(today.decode_runner(4, 64).step(tokens, pos))
        assert np.array_equal(la, lb)                   # same kernels, same order: bit-identical
        assert rel(la, np.asarray(lc, np.float64)) < 1e-4
