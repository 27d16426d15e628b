"""Grouped top-k, a router bias on the logits and attention sinks on the CUDA kernels, against the NumPy backend's
ops in float64 (GPU only; the patterns of test_gpu_kernels.py).

- `ops.router(..., groups=(n_group, topk_group))`: each group scores the sum of its two best selection keys, the
  topk_group best groups are kept (ties to the lower group index), the others are masked before the top-k
  (`numpy_backend.group_mask`);
- `ops.router(..., order="topk_softmax", bias=...)`: the top-k of logits + bias, softmax over the k (gpt-oss);
- `ops.attention(..., sinks=...)`: one learned logit per head joins each softmax's denominator (gpt-oss), on the
  single-split path and through attention_merge.

Selections are checked exactly on the kernel's own logits (float64 logits could reorder near-ties); weights and
outputs by relative error. With the new options off the kernels must give exactly what they gave before.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda.test_gpu_kernels import F32_TOL, f64, nan_like, rel, to_device_dtype


def _route(cp, x, w, k, ws, **how):
    """ops.router twice on the same workspace (the tickets must be back at zero), outputs poisoned first."""
    T = x.shape[0]
    for _ in range(2):
        ids, weights = ops.router(cp.asarray(x), w, k, workspace=ws, out_ids=cp.full((T, k), -7, cp.int32),
                                  out_weights=nan_like(cp, (T, k)), **how)
        assert int(ws.tickets.sum()) == 0
    return ids.get(), weights.get()


def _expected(logits, k, bias, **how):
    """numpy_backend.router on given logits (x = identity, w = logits^T), float64."""
    T = logits.shape[0]
    return nb.router(np.eye(T), logits.T.copy(), k, bias=bias, **how)


# ---- grouped top-k ------------------------------------------------------------------------------------------------
GROUP_CASES = [  # T, E, k, H, n_group, topk_group
    (1, 8, 2, 256, 4, 2),       # one block per token group (E <= ROUTER_EPB)
    (5, 8, 3, 128, 4, 2),       # the tiny GLM shape: 4 groups of 2, keep 2, top-3
    (7, 64, 6, 256, 8, 3),
    (32, 128, 8, 2048, 8, 4),   # DeepSeek-V3-like: 8 groups, keep 4
    (3, 160, 8, 512, 8, 3),     # GLM-4.5: 160 experts (E not a power of two)
    (9, 512, 32, 64, 64, 40),   # many groups (two per lane), k = ROUTER_MAX_K
    (4, 256, 8, 128, 128, 9),   # groups of two
    (6, 96, 4, 256, 3, 1),      # one group kept
]
GROUP_MODES = [
    dict(scoring="sigmoid", normalize=True, scale=2.5, bias=True),     # GLM-4.5 / DeepSeek-V3
    dict(scoring="sigmoid", normalize=False, scale=1.5, bias=True),
    dict(scoring="softmax", normalize=True, scale=1.0, bias=False),
]


@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("mode", GROUP_MODES, ids=lambda m: f"{m['scoring']}-n{int(m['normalize'])}-b{int(m['bias'])}")
@pytest.mark.parametrize("wdt", ["f32", "bf16"])
@pytest.mark.parametrize("by_gemm", [False, True], ids=["fused", "gemm"])
def test_grouped_router(cp, rng, case, mode, wdt, by_gemm):
    T, E, k, H, n_group, topk_group = case
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = to_device_dtype(cp, (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32), wdt)
    bias = rng.standard_normal(E).astype(np.float32) * 0.5 if mode["bias"] else None
    how = dict(scoring=mode["scoring"], order="softmax_topk", normalize=mode["normalize"], scale=mode["scale"])
    ws = ops.RouterWorkspace(T, E)
    ids, weights = _route(cp, x, w, k, ws, bias=None if bias is None else cp.asarray(bias),
                          groups=(n_group, topk_group), by_gemm=by_gemm, **how)
    logits = ws.logits[:T].get().astype(np.float64)
    assert rel(logits, nb.linear(f64(x), w.get())) < F32_TOL
    exp_ids, exp_w = _expected(logits, k, bias, groups=(n_group, topk_group), **how)
    np.testing.assert_array_equal(ids, exp_ids)
    assert rel(weights, exp_w) < F32_TOL
    # every selected expert lies in one of the kept groups: at most topk_group distinct groups a token
    assert max(len(set(row // (E // n_group))) for row in ids) <= topk_group


@pytest.mark.parametrize("n_group,topk_group", [(4, 1), (4, 2), (8, 3)])
def test_grouped_router_ties_go_to_the_lower_group_and_expert(cp, rng, n_group, topk_group):
    """Every group a copy of group 0 (identical rows give bit-identical logits): all group scores tie, so the
    lowest topk_group groups are kept, and within them equal keys go to the lower expert index."""
    T, E, H = 6, 64, 256
    k = 2 * topk_group
    x = rng.standard_normal((T, H)).astype(np.float32)
    w0 = (rng.standard_normal((E // n_group, H)) / np.sqrt(H)).astype(np.float32)
    w = cp.asarray(np.tile(w0, (n_group, 1)))
    how = dict(scoring="sigmoid", order="softmax_topk", normalize=True, scale=1.0)
    ws = ops.RouterWorkspace(T, E)
    ids, weights = _route(cp, x, w, k, ws, groups=(n_group, topk_group), **how)
    logits = ws.logits[:T].get().astype(np.float64)
    exp_ids, exp_w = _expected(logits, k, None, groups=(n_group, topk_group), **how)
    np.testing.assert_array_equal(ids, exp_ids)
    assert rel(weights, exp_w) < F32_TOL
    assert (ids < topk_group * (E // n_group)).all()


@pytest.mark.parametrize("groups", [None, (1, 1), (4, 4)])
def test_router_without_masked_groups_is_unchanged(cp, rng, groups):
    """groups None, one group, or every group kept: exactly the plain top-k (no shared memory, same kernel path)."""
    T, E, k, H = 5, 64, 6, 256
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = cp.asarray((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(E).astype(np.float32) * 0.1)
    how = dict(bias=bias, scoring="sigmoid", order="softmax_topk", normalize=True, scale=2.0)
    assert ops.router_shared_bytes(E, groups) == 0
    plain = _route(cp, x, w, k, ops.RouterWorkspace(T, E), **how)
    grouped = _route(cp, x, w, k, ops.RouterWorkspace(T, E), groups=groups, **how)
    np.testing.assert_array_equal(grouped[0], plain[0])
    np.testing.assert_array_equal(grouped[1], plain[1])


# ---- a router bias on the logits (topk_softmax) ----------------------------------------------------------------
BIAS_CASES = [(32, 128, 4, 2048), (1, 32, 4, 2880), (5, 4, 2, 256), (3, 300, 6, 128), (9, 512, 32, 64)]


@pytest.mark.parametrize("case", BIAS_CASES)
@pytest.mark.parametrize("wdt", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_topk_softmax_with_a_logit_bias(cp, rng, case, wdt, scale):
    T, E, k, H = case
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = to_device_dtype(cp, (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32), wdt)
    bias = rng.standard_normal(E).astype(np.float32)          # as large as the logits: it changes the choice
    how = dict(scoring="softmax", order="topk_softmax", normalize=False, scale=scale)
    ws = ops.RouterWorkspace(T, E)
    ids, weights = _route(cp, x, w, k, ws, bias=cp.asarray(bias), **how)
    logits = ws.logits[:T].get().astype(np.float64)
    exp_ids, exp_w = _expected(logits, k, bias, **how)
    np.testing.assert_array_equal(ids, exp_ids)
    assert rel(weights, exp_w) < F32_TOL
    # transformers' GptOssTopKRouter: topk(logits + bias), softmax over the k values
    biased = logits + bias
    top = -np.sort(-biased, axis=-1)[:, :k]
    np.testing.assert_allclose(weights, scale * nb.softmax(top), rtol=1e-5, atol=1e-6)


def test_router_wrapper_rejects_bad_groups(cp):
    x = cp.zeros((2, 64), cp.float32)
    w = cp.zeros((8, 64), cp.float32)
    for groups in [(3, 1), (4, 5), (4, 0), (16, 1)]:
        with pytest.raises(ValueError):
            ops.router(x, w, 2, groups=groups, scoring="sigmoid")
    with pytest.raises(ValueError):
        ops.router(x, w, 2, groups=(4, 2), order="topk_softmax")


# ---- attention sinks ----------------------------------------------------------------------------------------------
def _sinks(rng, nh: int) -> np.ndarray:
    s = rng.standard_normal(nh).astype(np.float32) * 2.0
    s[0], s[-1] = 8.0, -30.0          # one sink that dominates every row, one that never matters
    return s


@pytest.mark.parametrize("cdt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window", [0, 5])
def test_attention_with_sinks(cp, rng, cdt, hd, window):
    S, cap, nkv, nh = 3, 40, 2, 8 if hd != 64 else 32  # group of 16 with hd 64: two query-head chunks
    kc = to_device_dtype(cp, rng.standard_normal((S, cap, nkv, hd)).astype(np.float32), cdt)
    vc = to_device_dtype(cp, rng.standard_normal((S, cap, nkv, hd)).astype(np.float32), cdt)
    q_seq = np.array([0, 1, 2] + [1] * 12, np.int32)
    q_len = np.array([4, 12, 1] + list(range(1, 13)), np.int32)
    q = rng.standard_normal((len(q_seq), nh, hd)).astype(np.float32)
    sinks = _sinks(rng, nh)
    scale = 1.0 / np.sqrt(hd)
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, scale, window=window, sinks=f64(sinks))
    for variant in (dict(), dict(nsplit=1), dict(nsplit=3), dict(nsplit=40)):
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), scale, window=window,
                            sinks=cp.asarray(sinks), out=nan_like(cp, q.shape), **variant)
        assert rel(out.get(), exp) < F32_TOL, variant


def test_attention_sinks_long_context(cp, rng):
    """Many key tiles per warp and per split; sinks near the scores' own size."""
    from colibri_format.dtypes import float32_to_bf16_bits

    S, cap, nkv, nh, hd = 2, 1000, 2, 8, 64
    kc = cp.asarray(float32_to_bf16_bits(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)))
    vc = cp.asarray(float32_to_bf16_bits(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32)))
    q_seq = np.array([0, 1, 1], np.int32)
    q_len = np.array([1000, 777, 129], np.int32)
    q = (rng.standard_normal((3, nh, hd)) * 2).astype(np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32) * 3
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, 0.1, window=128, sinks=f64(sinks))
    for variant in (dict(), dict(nsplit=1), dict(nsplit=7)):
        out = ops.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.1, window=128,
                            sinks=cp.asarray(sinks), out=nan_like(cp, q.shape), **variant)
        assert rel(out.get(), exp) < F32_TOL, variant


@pytest.mark.parametrize("nsplit", [1, 3])
def test_attention_without_sinks_is_unchanged(cp, rng, nsplit):
    """sinks=None and sinks of -inf give the same bits (the sink terms vanish), and the float64 reference."""
    S, cap, nkv, nh, hd = 2, 50, 2, 4, 128
    kc = cp.asarray(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32))
    vc = cp.asarray(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32))
    q_seq, q_len = cp.asarray(np.array([0, 1], np.int32)), cp.asarray(np.array([50, 17], np.int32))
    q = cp.asarray(rng.standard_normal((2, nh, hd)).astype(np.float32))
    plain = ops.attention(q, kc, vc, q_seq, q_len, 0.2, nsplit=nsplit).get()
    none = ops.attention(q, kc, vc, q_seq, q_len, 0.2, sinks=None, nsplit=nsplit).get()
    neg = ops.attention(q, kc, vc, q_seq, q_len, 0.2, sinks=cp.full(nh, -np.inf, cp.float32), nsplit=nsplit).get()
    np.testing.assert_array_equal(none, plain)
    np.testing.assert_array_equal(neg, plain)
    exp = nb.attention(f64(q.get()), f64(kc.get()), f64(vc.get()), q_seq.get(), q_len.get(), 0.2)
    assert rel(plain, exp) < F32_TOL


def test_attention_wrapper_rejects_bad_sinks(cp):
    q = cp.zeros((1, 4, 64), cp.float32)
    kc = cp.zeros((1, 8, 2, 64), cp.float32)
    seq, ln = cp.zeros(1, cp.int32), cp.ones(1, cp.int32)
    with pytest.raises(ValueError):
        ops.attention(q, kc, kc, seq, ln, 0.1, sinks=cp.zeros(2, cp.float32))       # not [heads]
    with pytest.raises(TypeError):
        ops.attention(q, kc, kc, seq, ln, 0.1, sinks=cp.zeros(4, cp.float64))
    with pytest.raises(TypeError):
        ops.attention(q, kc, kc, seq, ln, 0.1, sinks=np.zeros(4, np.float32))       # host array


# ---- the backend's methods (what the decoder calls) ----------------------------------------------------------
@pytest.fixture(scope="module")
def be():
    from colibri_format.runtime.cuda.backend import CupyBackend

    return CupyBackend()


def test_backend_router_passes_groups_and_a_logit_bias(be, rng):
    from colibri_format.runtime.forward import Workspace

    cp = be.xp
    T, E, k, H = 4, 16, 3, 128
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = cp.asarray((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32))
    bias = rng.standard_normal(E).astype(np.float32)
    ws = Workspace(be)
    for how in (dict(scoring="sigmoid", order="softmax_topk", normalize=True, scale=2.5, groups=(4, 2)),
                dict(scoring="softmax", order="topk_softmax", normalize=False, scale=1.0)):
        ids, weights = be.router(cp.asarray(x), w, k, bias=cp.asarray(bias), ws=ws,
                                 out_ids=cp.empty((T, k), cp.int32), out_weights=cp.empty((T, k), cp.float32), **how)
        logits = ws.extra[("router", T, E)].logits[:T].get().astype(np.float64)
        exp_ids, exp_w = _expected(logits, k, bias, **how)
        np.testing.assert_array_equal(ids.get(), exp_ids)
        assert rel(weights.get(), exp_w) < F32_TOL


@pytest.mark.parametrize("hd", [64, 48])      # 48: the array-operation fallback for head sizes without a kernel
@pytest.mark.parametrize("max_len", [16, 256])  # one split, several
def test_backend_attention_passes_sinks(be, rng, hd, max_len):
    from colibri_format.runtime.forward import Workspace

    cp = be.xp
    S, cap, nkv, nh = 2, 16, 1, 4
    kc = cp.asarray(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32))
    vc = cp.asarray(rng.standard_normal((S, cap, nkv, hd)).astype(np.float32))
    q_seq, q_len = np.array([0, 1, 1], np.int32), np.array([16, 3, 9], np.int32)
    q = rng.standard_normal((3, nh, hd)).astype(np.float32)
    sinks = _sinks(rng, nh)
    out = cp.full(q.shape, np.nan, cp.float32)
    be.attention(cp.asarray(q), kc, vc, cp.asarray(q_seq), cp.asarray(q_len), 0.125, window=0, out=out,
                 ws=Workspace(be), max_len=max_len, sinks=cp.asarray(sinks))
    exp = nb.attention(f64(q), f64(kc.get()), f64(vc.get()), q_seq, q_len, 0.125, sinks=f64(sinks))
    assert rel(out.get(), exp) < F32_TOL
