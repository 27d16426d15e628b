"""Every CUDA kernel against the NumPy backend's op (`numpy_backend`, in float64), on fresh random inputs (GPU only).

Kernels that are stages inside one decoder op (dispatch, gate/up, down, combine, KV append) are checked against
their contracts in kernel_expectations.py, which are built from the same `numpy_backend` functions.

Outputs are poisoned with NaN before each launch and must come back finite (every element written). Errors are
relative: ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.synthetic_experts import host_experts, upload

F32_TOL = 2e-5    # fp32 accumulation vs float64
BF16_TOL = 1e-2   # one bf16 rounding of the output


def rel(out, expected) -> float:
    out = np.asarray(out, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert np.isfinite(out).all(), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


def nan_like(cp, shape, dtype=np.float32):
    return cp.full(shape, np.nan, dtype=dtype)


def to_device_dtype(cp, a: np.ndarray, code: str):
    if code == "f32":
        return cp.asarray(a.astype(np.float32))
    if code == "f16":
        return cp.asarray(a.astype(np.float16))
    return cp.asarray(float32_to_bf16_bits(a.astype(np.float32)))


def f64(a) -> np.ndarray:
    """A kernel input or output (float32, float16 or bf16 bits) as float64: the NumPy oracle's inputs."""
    return nb.widen(a, np.float64)


# ---- router -------------------------------------------------------------------------------------------------------
ROUTER_CASES = [  # T, E, k, H
    (32, 128, 8, 2048), (1, 8, 2, 4096), (5, 64, 8, 256), (3, 300, 6, 128), (9, 512, 32, 64), (4, 1, 1, 16),
    (2, 256, 8, 128), (6, 20, 4, 2048), (200, 128, 8, 2048)]
ROUTER_MODES = [
    dict(scoring="softmax", order="softmax_topk", normalize=True, scale=1.0, bias=False),
    dict(scoring="softmax", order="softmax_topk", normalize=False, scale=1.0, bias=False),
    dict(scoring="sigmoid", order="softmax_topk", normalize=True, scale=2.5, bias=True),
    dict(scoring="softmax", order="topk_softmax", normalize=False, scale=1.0, bias=False),
]


@pytest.mark.parametrize("case", ROUTER_CASES)
@pytest.mark.parametrize("mode", ROUTER_MODES, ids=lambda m: f"{m['scoring']}-{m['order']}-n{int(m['normalize'])}")
@pytest.mark.parametrize("wdt", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("by_gemm", [False, True], ids=["fused", "gemm"])
def test_router(cp, rng, case, mode, wdt, by_gemm):
    """Both routes of ops.router: the fused kernel, and cuBLAS's fp32 logits then the selection launch."""
    T, E, k, H = case
    x = rng.standard_normal((T, H)).astype(np.float32)
    w_host = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)
    w = to_device_dtype(cp, w_host, wdt)
    bias = rng.standard_normal(E).astype(np.float32) * 0.1 if mode["bias"] else None
    ws = ops.RouterWorkspace(T, E)
    for _ in range(2):  # twice: the ticket counters must be back at zero after a launch
        ids, weights = ops.router(cp.asarray(x), w, k, bias=None if bias is None else cp.asarray(bias),
                                  scoring=mode["scoring"], order=mode["order"], normalize=mode["normalize"],
                                  scale=mode["scale"], workspace=ws, by_gemm=by_gemm,
                                  out_ids=cp.full((T, k), -7, cp.int32), out_weights=nan_like(cp, (T, k)))
        assert int(ws.tickets.sum()) == 0
    logits_gpu = ws.logits[:T].get()
    assert rel(logits_gpu, nb.linear(f64(x), w.get())) < F32_TOL   # the router's logits x @ w.T
    # selection is checked exactly on the kernel's own logits (float64 logits could reorder near-ties)
    exp_ids, exp_w = _route_from_logits(logits_gpu.astype(np.float64), k, bias, mode)
    np.testing.assert_array_equal(ids.get(), exp_ids)
    assert rel(weights.get(), exp_w) < F32_TOL


def _route_from_logits(logits, k, bias, mode):
    """numpy_backend.router with the logits given (x = identity, w = logits^T): (ids, weights)."""
    T, E = logits.shape
    return nb.router(np.eye(T), logits.T.copy(), k, bias=bias, scoring=mode["scoring"], order=mode["order"],
                     normalize=mode["normalize"], scale=mode["scale"])


# ---- dispatch -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P,E", [(1, 8), (8, 128), (256, 128), (64, 8), (2000, 64), (5000, 512), (16384, 128)])
@pytest.mark.parametrize("tile_m", [64, 7])
@pytest.mark.parametrize("spread", [False, True])
def test_dispatch(cp, rng, monkeypatch, P, E, tile_m, spread):
    """One block (moe_dispatch), or spread over several (limits.DISPATCH_SPREAD_MIN_PAIRS: the three launches of
    moe_dispatch_ranks / _groups / _scatter): the stable grouping either way."""
    # every size on each path: 1 spreads any pass, 0 never does (the default threshold would spread the large ones)
    monkeypatch.setattr(limits, "DISPATCH_SPREAD_MIN_PAIRS", 1 if spread else 0)
    # skewed ids: a few experts get most pairs
    ids = np.minimum(rng.zipf(1.5, P) - 1, E - 1).astype(np.int32)
    rng.shuffle(ids)
    d = ops.dispatch(cp.asarray(ids), E, tile_m=tile_m)
    assert (d.spread is not None) == spread
    r = expect.dispatch_grouping(ids, E, tile_m)
    for name in ("counts", "offsets", "perm", "inv"):
        np.testing.assert_array_equal(getattr(d, name).get(), r[name], err_msg=name)
    meta = d.meta.get()
    nact, ntiles = len(r["active"]), len(r["tile_expert"])
    assert tuple(meta[:3]) == (nact, ntiles, 0)
    active = d.active.get()
    np.testing.assert_array_equal(active[:nact], r["active"])
    assert (active[nact:] == -1).all()
    np.testing.assert_array_equal(d.tile_expert.get()[:ntiles], r["tile_expert"])
    np.testing.assert_array_equal(d.tile_start.get()[:ntiles], r["tile_start"])
    assert (d.tile_expert.get()[ntiles:] == -1).all()


@pytest.mark.parametrize("spread", [False, True])
def test_dispatch_counts_invalid_ids(cp, monkeypatch, spread):
    if spread:
        monkeypatch.setattr(limits, "DISPATCH_SPREAD_MIN_PAIRS", 1)
    ids = np.array([0, 5, 9, -1, 2], np.int32)
    d = ops.dispatch(cp.asarray(ids), 6)
    assert int(d.meta.get()[2]) == 2
    assert d.inv.get()[2] == -1 and d.inv.get()[3] == -1


# ---- experts ------------------------------------------------------------------------------------------------------
def _moe_case(cp, rng, T, E, k, H, I, group, skew=False):
    layout, experts, blobs = host_experts(rng, E, H, I, group)
    buf, table = upload(blobs, E, layout)
    x = rng.standard_normal((T, H)).astype(np.float32)
    if skew:  # expert 0 in every token: many tokens per expert (several passes)
        ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, E), k - 1, replace=False)]) for _ in range(T)])
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    ids = ids.astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return buf, table, experts, x, ids, w


def _moe(x, ids, w, experts, residual=None, alpha=1.0):
    """numpy_backend.moe in float64: residual (zero when None) + alpha * the routed experts' weighted sum."""
    resid = np.zeros(x.shape) if residual is None else f64(residual).copy()
    return nb.moe(f64(x), ids, f64(w), experts, residual=resid, alpha=alpha)


MOE_CASES = [  # T, E, k, H, I, group, skew
    (1, 8, 2, 256, 128, 0, False), (2, 8, 2, 512, 256, 0, False), (3, 16, 4, 256, 96, 0, False),
    (5, 64, 8, 256, 128, 32, False), (32, 64, 8, 256, 128, 0, True), (32, 8, 2, 128, 64, 16, True),
    (17, 4, 4, 64, 32, 0, False), (2, 4, 2, 4160, 2080, 0, False)]


@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("tokc,variant", [(None, None), (1, "t1"), (1, "w2"), (1, "w4"), (2, None), (4, None),
                                          (8, None)])
def test_moe_gemv(cp, rng, case, tokc, variant):
    T, E, k, H, I, group, skew = case
    buf, table, experts, x, ids, w = _moe_case(cp, rng, T, E, k, H, I, group, skew)
    d = ops.dispatch(cp.asarray(ids), E)
    act = ops.moe_gate_up(cp.asarray(x), table, d, k, tokens_per_pass_=tokc, variant=variant,
                          out=nan_like(cp, (T * k, I)))
    exp_act = expect.pair_act(f64(x), ids, experts)
    act_pairs = act.get()[d.inv.get()]  # sorted order -> pair order
    assert rel(act_pairs, exp_act) < F32_TOL
    ypair = ops.moe_down(act, table, d, cp.asarray(w), tokens_per_pass_=tokc, variant=variant,
                         out=nan_like(cp, (T * k, H)))
    exp_y = expect.pair_down(f64(act_pairs), ids, f64(w), experts)
    assert rel(ypair.get(), exp_y) < F32_TOL
    resid = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_combine(ypair, k, residual=cp.asarray(resid), alpha=0.75, out=nan_like(cp, (T, H)))
    assert rel(y.get(), expect.combine(f64(ypair.get()), k, f64(resid), 0.75)) < 1e-6
    full = _moe(x, ids, w, experts)
    assert rel(ops.moe_combine(ypair, k).get(), full) < F32_TOL


@pytest.mark.parametrize("case", [(1, 8, 2, 256, 128, 0, False), (70, 8, 2, 256, 192, 0, False),
                                  (300, 16, 4, 128, 64, 32, False), (130, 64, 8, 256, 128, 0, True),
                                  (40, 4, 2, 96, 80, 0, False)])
@pytest.mark.parametrize("tc", [False, True])
def test_moe_gemm(cp, rng, case, tc):
    T, E, k, H, I, group, skew = case
    if tc and group:
        pytest.skip("the tensor-core GEMM takes per-row scales only")
    tol = 1e-4 if tc else F32_TOL  # tensor cores: activations split into two bf16 terms (~16 bits)
    buf, table, experts, x, ids, w = _moe_case(cp, rng, T, E, k, H, I, group, skew)
    d = ops.dispatch(cp.asarray(ids), E, tile_m=ops.GEMM_BM)
    act = ops.moe_gemm_gate_up(cp.asarray(x), table, d, k, tensor_cores=tc, out=nan_like(cp, (T * k, I)))
    exp_act = expect.pair_act(f64(x), ids, experts)
    act_pairs = act.get()[d.inv.get()]
    assert rel(act_pairs, exp_act) < tol
    ypair = ops.moe_gemm_down(act, table, d, cp.asarray(w), tensor_cores=tc, out=nan_like(cp, (T * k, H)))
    assert rel(ypair.get(), expect.pair_down(f64(act_pairs), ids, f64(w), experts)) < tol


@pytest.mark.parametrize("gemm", [False, True])
def test_moe_experts_end_to_end(cp, rng, gemm):  # gemm: the tensor-core path (per-row scales)
    T, E, k, H, I = 6, 16, 4, 256, 128
    buf, table, experts, x, ids, w = _moe_case(cp, rng, T, E, k, H, I, 0)
    resid = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, residual=cp.asarray(resid),
                        alpha=1.0, gemm=gemm)
    assert rel(y.get(), _moe(x, ids, w, experts, residual=resid)) < (1e-4 if gemm else F32_TOL)


@pytest.mark.parametrize("group", [0, 32])
def test_one_token_passes_run_by_pair_alike_to_the_bit(cp, rng, group):
    """A one-token GEMV pass runs by pair, without a dispatch (ops.pairs_path): the same bits as the dispatch path,
    with and without a residual; a pass naming an id outside [0, E) adds nothing for it."""
    E, k, H, I = 16, 4, 256, 128
    buf, table, experts, x, ids, w = _moe_case(cp, rng, 1, E, k, H, I, group)
    assert ops.pairs_path(1) and not ops.pairs_path(2)
    resid = rng.standard_normal((1, H)).astype(np.float32)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    for residual in (None, resid):
        kw = {} if residual is None else {"residual": cp.asarray(residual), "alpha": 1.5}
        by_pair = ops.moe_experts(*args, **kw).get()
        np.testing.assert_array_equal(by_pair, ops.moe_experts(*args, pairs=False, **kw).get())
        assert rel(by_pair, _moe(x, ids, w, experts, residual=residual, alpha=kw.get("alpha", 1.0))) < F32_TOL
    bad = ids.copy()
    bad[0, 1] = E + 3
    kept = ids.copy()
    kept[0, 1] = ids[0, 0]
    kept_w = w.copy()
    kept_w[0, 1] = 0.0
    got = ops.moe_experts(cp.asarray(x), cp.asarray(bad), cp.asarray(w), table).get()
    assert rel(got, _moe(x, kept, kept_w, experts)) < F32_TOL
    with pytest.raises(ValueError, match="weights"):
        ops.moe_down_pairs(cp.zeros((k, I), cp.float32), cp.asarray(ids), cp.zeros((1, k + 1), cp.float32), table)


def test_moe_wrappers_reject_bad_inputs(cp, rng):
    buf, table, experts, x, ids, w = _moe_case(cp, rng, 2, 8, 2, 64, 32, 0)
    d = ops.dispatch(cp.asarray(ids), 8)
    with pytest.raises(TypeError):
        ops.moe_gate_up(cp.asarray(x.astype(np.float64)), table, d, 2)
    with pytest.raises(ValueError):
        ops.moe_gate_up(cp.ones((2, 128), cp.float32)[:, ::2], table, d, 2)  # not C-contiguous
    with pytest.raises(TypeError):
        ops.moe_gate_up(x, table, d, 2)  # host array


# ---- dense layers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("xdt,odt", [("f32", "f32"), ("f32", "bf16"), ("bf16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(3, 2048), (1, 4096), (40, 128), (5, 100)])
def test_rmsnorm(cp, rng, xdt, odt, wdt, shape):
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    xd, wd = to_device_dtype(cp, x, xdt), to_device_dtype(cp, w, wdt)
    out_dtype = np.float32 if odt == "f32" else np.uint16
    out = ops.rmsnorm(xd, wd, 1e-5, out_dtype=out_dtype, w_offset=0.25)
    got = f64(out.get())
    exp = nb.rmsnorm(f64(xd.get()), f64(wd.get()) + 0.25, 1e-5)   # w_offset: the weight is w + 0.25
    assert rel(got, exp) < (F32_TOL if odt == "f32" else BF16_TOL)


@pytest.mark.parametrize("cdt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("copies", [1, 3])   # 15 rows run attention_decode, 45 (> ATT_DECODE_MAX_ROWS) attention_split
def test_attention(cp, rng, cdt, hd, window, copies):
    S, cap, nkv, nh = 3, 40, 2, 8 if hd != 64 else 32  # group of 16 with hd 64: two query-head chunks
    dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[cdt]
    kc = cp.asarray(to_device_dtype(cp, rng.standard_normal((S, cap, nkv, hd)).astype(np.float32), cdt))
    vc = cp.asarray(to_device_dtype(cp, rng.standard_normal((S, cap, nkv, hd)).astype(np.float32), cdt))
    assert kc.dtype == dtype
    # decode: one query per sequence; plus causal-prefill rows of sequence 1 at positions 0..11
    q_seq = np.tile(np.array([0, 1, 2] + [1] * 12, np.int32), copies)
    q_len = np.tile(np.array([4, 12, 1] + list(range(1, 13)), np.int32), copies)
    assert (len(q_seq) <= ops.ATT_DECODE_MAX_ROWS) == (copies == 1)
    q = rng.standard_normal((len(q_seq), nh, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, scale, window=window)
    for variant in (dict(), dict(nsplit=1), dict(nsplit=3), dict(nsplit=40)):
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), scale, window=window,
                            out=nan_like(cp, q.shape), **variant)
        assert rel(out.get(), exp) < F32_TOL, variant


@pytest.mark.parametrize("rows", [3, 36])     # attention_decode, attention_split
def test_attention_long_context(cp, rng, rows):
    """Many key tiles per warp and per split (the short test above never fills a tile)."""
    S, cap, nkv, nh, hd = 2, 1000, 2, 8, 128
    kc = cp.asarray(float32_to_bf16_bits(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)))
    vc = cp.asarray(float32_to_bf16_bits(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)))
    q_seq = np.array([0, 1, 1] * 12, np.int32)[:rows]
    q_len = np.array([1000, 777, 129] * 12, np.int32)[:rows]
    q = (rng.standard_normal((rows, nh, hd)) * 2).astype(np.float32)
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, 0.1)
    for variant in (dict(), dict(nsplit=1), dict(nsplit=7)):
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.1,
                            out=nan_like(cp, q.shape), **variant)
        assert rel(out.get(), exp) < F32_TOL, variant


def test_attention_decode_merges_in_its_last_block_and_leaves_tickets_zero(cp, rng):
    """The decode kernel's split merge: repeated launches on one workspace (as graph replays do) stay exact."""
    S, cap, nkv, nh, hd, ns = 2, 300, 4, 32, 128, 7
    kc = cp.asarray(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32))
    vc = cp.asarray(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32))
    q_seq, q_len = np.array([0, 1], np.int32), np.array([300, 3], np.int32)
    q = rng.standard_normal((2, nh, hd)).astype(np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32)
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, 0.1, sinks=f64(sinks))
    ws = ops.AttentionWorkspace(2, nh, hd, ns)
    for _ in range(3):
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.1, sinks=cp.asarray(sinks),
                            out=nan_like(cp, q.shape), nsplit=ns, workspace=ws)
        assert rel(out.get(), exp) < F32_TOL
        assert int(ws.tickets.sum()) == 0


@pytest.mark.parametrize("window", [0, 40])
def test_attention_decode_work_follows_the_length_not_the_splits(cp, rng, window):
    """A workspace and split count planned for a long cache (as a captured graph is), replayed at lengths from 1 to
    the capacity: splits get >= ATT_DECODE_MIN_KEYS keys each and the merge reads only the splits that hold keys,
    so short rows leave most splits empty; every length stays exact and the tickets end at zero."""
    S, cap, nkv, nh, hd = 2, 1100, 4, 32, 128
    ns = ops.limits.ATT_MAX_SPLITS
    kc = cp.asarray(float32_to_bf16_bits(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)))
    vc = cp.asarray(float32_to_bf16_bits(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)))
    sinks = rng.standard_normal(nh).astype(np.float32)
    ws = ops.AttentionWorkspace(2, nh, hd, ns)
    k_h, v_h = f64(kc.get()), f64(vc.get())
    for lens in ([1, 15], [16, 17], [33, 100], [1023, 1024], [1100, 2]):
        q_seq, q_len = np.array([0, 1], np.int32), np.array(lens, np.int32)
        q = rng.standard_normal((2, nh, hd)).astype(np.float32)
        exp = nb.attention(f64(q), k_h, v_h, q_seq, q_len, 0.1, window=window, sinks=f64(sinks))
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.1, window=window,
                            sinks=cp.asarray(sinks), out=nan_like(cp, q.shape), nsplit=ns, workspace=ws)
        assert rel(out.get(), exp) < F32_TOL, lens
        assert int(ws.tickets.sum()) == 0


def test_attention_refuses_more_splits_than_the_merge_holds(cp, rng):
    kc = cp.zeros((1, 8, 1, 64), cp.float32)
    q = cp.zeros((1, 1, 64), cp.float32)
    rows = cp.zeros(1, cp.int32), cp.ones(1, cp.int32)
    with pytest.raises(ValueError, match="nsplit"):
        ops.attention(q, kc, kc, *rows, 0.1, nsplit=ops.limits.ATT_MAX_SPLITS + 1)


def test_attention_decode_refuses_an_output_off_a_16_byte_boundary(cp, rng):
    """Its merge stores 4 values at once: an `out` view starting one float into its buffer is a ValueError, not a
    misaligned-address fault that would poison the CUDA context."""
    kc = cp.zeros((1, 8, 1, 64), cp.float32)
    q = cp.zeros((1, 1, 64), cp.float32)
    rows = cp.zeros(1, cp.int32), cp.ones(1, cp.int32)
    shifted = cp.zeros(65, cp.float32)[1:].reshape(q.shape)
    with pytest.raises(ValueError, match="16-byte"):
        ops.attention(q, kc, kc, *rows, 0.1, out=shifted, nsplit=2)


@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
def test_embedding(cp, rng, wdt):
    V, H = 100, 64
    table = to_device_dtype(cp, rng.standard_normal((V, H)).astype(np.float32), wdt)
    ids = rng.integers(0, V, 9).astype(np.int32)
    out = ops.embedding(cp.asarray(ids), table, mult=1.5, out=nan_like(cp, (9, H)))
    assert rel(out.get(), nb.embedding(ids, table.get(), mult=1.5, dtype=np.float64)) < 1e-7
    bad = ops.embedding(cp.asarray(np.array([V], np.int32)), table)
    assert np.isnan(bad.get()).all()


def test_residual_add_and_silu_mul(cp, rng):
    a = rng.standard_normal((5, 300)).astype(np.float32)
    b = rng.standard_normal((5, 300)).astype(np.float32)
    ad = cp.asarray(a)
    ops.residual_add(ad, cp.asarray(b), alpha=0.5, out=ad)  # in place
    assert rel(ad.get(), nb.residual_add(f64(a), f64(b), alpha=0.5)) < 1e-7
    gu = rng.standard_normal((4, 2 * 96)).astype(np.float32)
    assert rel(ops.silu_mul(cp.asarray(gu)).get(), nb.silu_mul(f64(gu))) < 1e-6


@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("T,N,K", [(1, 4096, 2048), (1, 5, 1032), (2, 9, 520), (3, 33, 4104), (4, 64, 4096),
                                   (5, 130, 256), (8, 7, 64)])   # every token plan, ragged K
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 2, 8])      # None: the split ops.dense_gemv picks
def test_dense_gemv(cp, rng, wdt, T, N, K, with_bias, splits):
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = to_device_dtype(cp, (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), wdt)
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    y = ops.dense_gemv(cp.asarray(x), w, bias=None if bias is None else cp.asarray(bias), out=nan_like(cp, (T, N)),
                       splits=splits)
    assert rel(y.get(), nb.linear(f64(x), w.get(), bias=bias)) < F32_TOL
    with pytest.raises(ValueError, match="T <= 8"):          # more rows go to cuBLAS (runtime/cuda/dense.py)
        ops.dense_gemv(cp.asarray(np.zeros((9, K), np.float32)), w)
    with pytest.raises(ValueError, match="splits must divide"):
        ops.dense_gemv(cp.asarray(x), w, splits=3)


@pytest.mark.parametrize("T,N,K", [(1, 5120, 2048), (2, 2048, 4096), (8, 5120, 2048), (9, 37, 2080),
                                   (16, 130, 64), (32, 2048, 4096), (5, 151936 // 8, 2048)])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_dense_gemv_tc(cp, rng, T, N, K, splits):
    """The tensor-core dense product against its NumPy twin (x split into bf16 hi + lo, float64 sums) and against
    the exact product (~1e-5: the split's mantissa bits); shapes of Qwen3's decode (q/k/v, o_proj, an lm_head slice),
    ragged N, every tile count; columns of every scale."""
    x = (rng.standard_normal((T, K)) * np.geomspace(0.01, 100.0, K)).astype(np.float32)
    w = to_device_dtype(cp, (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), "bf16")
    bias = rng.standard_normal(N).astype(np.float32)
    y = ops.dense_gemv_tc(cp.asarray(x), w, bias=cp.asarray(bias), out=nan_like(cp, (T, N)), splits=splits)
    assert rel(y.get(), ops.dense_gemv_tc_reference(x, w.get(), bias)) < 5e-6   # the tensor cores' fp32 sums
    assert rel(y.get(), nb.linear(f64(x), w.get(), bias=bias)) < F32_TOL       # and the split's ~16 bits
    with pytest.raises(ValueError, match="K % 32 == 0"):
        ops.dense_gemv_tc(cp.asarray(np.zeros((T, 48), np.float32)), to_device_dtype(cp, np.zeros((N, 48),
                                                                                                   np.float32), "bf16"))
    with pytest.raises(ValueError, match="1 <= T <= 32"):
        ops.dense_gemv_tc(cp.asarray(np.zeros((33, K), np.float32)), w)


@pytest.mark.parametrize("T,N,K", [(2, 5120, 2048), (8, 2048, 4096), (13, 37, 2080), (32, 5120, 2048)])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_dense_gemv_tc_normed(cp, rng, T, N, K, splits):
    """The input rmsnorm folded into the tensor-core product, as test_dense_gemv_normed checks the SIMT one."""
    check_normed_gemv(cp, rng, ops.dense_gemv_tc_normed, "bf16", T, N, K, splits)


def check_normed_gemv(cp, rng, normed_gemv, wdt: str, T: int, N: int, K: int, splits) -> None:
    """A normed GEMV against rmsnorm then the product in float64, and its x_out against the normed rows; rows of
    different scales; x_out overlapping x is refused."""
    x = (rng.standard_normal((T, K)) * np.geomspace(0.05, 20.0, T)[:, None]).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, K).astype(np.float32)
    w = to_device_dtype(cp, (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32), wdt)
    bias = rng.standard_normal(N).astype(np.float32)
    xd, x_out = cp.asarray(x), nan_like(cp, (T, K))
    y = normed_gemv(xd, cp.asarray(gamma), 1e-6, w, x_out=x_out, bias=cp.asarray(bias), out=nan_like(cp, (T, N)),
                    splits=splits)
    normed = nb.rmsnorm(f64(x), f64(gamma), 1e-6)
    assert rel(x_out.get(), normed) < F32_TOL
    assert rel(y.get(), nb.linear(normed, f64(w.get()), bias=bias)) < F32_TOL
    with pytest.raises(ValueError, match="must not overlap"):
        normed_gemv(xd, cp.asarray(gamma), 1e-6, w, x_out=xd)


def test_dense_gemv_tc_replays_in_a_graph(cp, rng):
    """Captured and replayed, it gives the eager launch's bits (decode graphs capture it)."""
    x = cp.asarray(rng.standard_normal((8, 2048)).astype(np.float32))
    w = to_device_dtype(cp, rng.standard_normal((5120, 2048)).astype(np.float32), "bf16")
    eager, out = ops.dense_gemv_tc(x, w).get(), nan_like(cp, (8, 5120))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            ops.dense_gemv_tc(x, w, out=out)
        finally:
            graph = stream.end_capture()
        assert np.isnan(out.get()).all()            # captured, not run
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(out.get(), eager)


@pytest.mark.parametrize("wdt", ["f32", "bf16"])
@pytest.mark.parametrize("T,N,K", [(1, 5120, 2048), (1, 2048, 4096), (3, 33, 4104), (8, 64, 2048)])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_dense_gemv_normed(cp, rng, wdt, T, N, K, splits):
    """The input rmsnorm folded into the product (`check_normed_gemv`)."""
    check_normed_gemv(cp, rng, ops.dense_gemv_normed, wdt, T, N, K, splits)
