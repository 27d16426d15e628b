"""The fused decode-layer kernels (fused.cu, and router.cu's add_rmsnorm_route) against the NumPy backend's ops in
float64 or the unfused kernels (GPU only).

Fresh random inputs every run (seed printed); outputs poisoned with NaN before each launch; relative errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect

F32_TOL = 2e-5
BF16_TOL = 1e-2


def rel(out, expected) -> float:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert np.isfinite(out).all(), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


def on_device(cp, a: np.ndarray, code: str):
    if code == "f32":
        return cp.asarray(a.astype(np.float32))
    if code == "f16":
        return cp.asarray(a.astype(np.float16))
    return cp.asarray(float32_to_bf16_bits(a.astype(np.float32)))


def f64(a) -> np.ndarray:
    """A kernel input or output (float32, float16 or bf16 bits) as float64: the NumPy oracle's inputs."""
    return nb.widen(a, np.float64)


@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 4096), (8, 1000), (512, 2048), (2, 96)])
@pytest.mark.parametrize("alpha", [1.0, 0.22])
def test_add_rmsnorm(cp, rng, wdt, shape, alpha):
    h = rng.standard_normal(shape).astype(np.float32) * 2
    b = rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    hd, bd, wd = cp.asarray(h), cp.asarray(b), on_device(cp, w, wdt)
    out = cp.full(shape, np.nan, cp.float32)
    got = ops.add_rmsnorm(hd, bd, wd, 1e-5, alpha=alpha, out=out)
    assert got is out
    exp_h = f64(h)                                          # a new array: add_rmsnorm updates it in place
    exp_x = nb.add_rmsnorm(exp_h, f64(b), f64(wd.get()), 1e-5, alpha=alpha)
    assert rel(hd.get(), exp_h) < 1e-6
    assert rel(out.get(), exp_x) < F32_TOL
    # same result as the unfused pair
    h2, x2 = cp.asarray(h), cp.empty(shape, cp.float32)
    ops.residual_add(h2, bd, alpha=alpha, out=h2)
    ops.rmsnorm(h2, wd, 1e-5, out=x2)
    assert rel(out.get(), x2.get()) < 1e-6


# ---- add_rmsnorm_route: the add + norm fused into the router (router.cu) -------------------------------------------
NORM_ROUTE_CASES = [  # T, E, k, H
    (1, 128, 8, 2048),      # Qwen3-30B-A3B decode
    (8, 128, 8, 2048),
    (1, 64, 8, 2048),       # OLMoE
    (4, 8, 2, 4096),        # Mixtral: one block a token group
    (3, 160, 8, 5120),      # GLM-4.5 widths (E not a power of two)
    (32, 256, 8, 7168),     # DeepSeek-V3 widths at the largest graph batch
    (9, 512, 32, 64),       # the widest kernel, k = ROUTER_MAX_K
    (70, 128, 8, 1024),     # a prefill-sized pass (the backend runs the two ops there; the op takes any T)
    (2, 32, 4, 8200),       # a row add_rmsnorm does not hold in registers: h and x equal within rounding only
]
NORM_ROUTE_MODES = {
    "softmax-normalized": dict(scoring="softmax", order="softmax_topk", normalize=True),
    "sigmoid-bias-scaled": dict(scoring="sigmoid", order="softmax_topk", normalize=True, scale=2.5, bias=True),
    "topk_softmax-bias": dict(scoring="softmax", order="topk_softmax", bias=True),
    "sigmoid-grouped": dict(scoring="sigmoid", order="softmax_topk", normalize=True, bias=True, groups=True),
}
REGISTER_ROW_MAX = 4 * limits.NORM_VECS * limits.FUSED_THREADS   # add_rmsnorm's widest row held in registers


def _norm_route_inputs(cp, rng, T: int, E: int, H: int, mode: str, wdt: str):
    """h, b, norm_w, w on the device, and the router options of `mode` (on the device, on the host)."""
    h = cp.asarray((rng.standard_normal((T, H)) * 2).astype(np.float32))
    b = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    norm_w = on_device(cp, rng.uniform(0.5, 1.5, H), wdt)
    w = on_device(cp, rng.standard_normal((E, H)) / np.sqrt(H), wdt)
    host = dict(NORM_ROUTE_MODES[mode])
    if host.pop("bias", False):
        host["bias"] = (rng.standard_normal(E) * 0.5).astype(np.float32)
    if host.pop("groups", False):
        host["groups"] = (8, 3) if E >= 16 else (4, 2)
    dev = {**host, "bias": cp.asarray(host["bias"])} if "bias" in host else host
    return h, b, norm_w, w, dev, host


def _clear_rows(logits, k: int, bias=None, scoring="softmax", order="softmax_topk", groups=None, **_) -> np.ndarray:
    """Rows whose k + 1 best selection keys (numpy_backend.router's, from these logits) lie further apart than fp32
    rounding of the logits could move them: rows whose ids cannot depend on that rounding."""
    logits = np.asarray(logits, np.float64)
    if order == "topk_softmax":
        key = logits
    else:
        key = nb.softmax(logits) if scoring == "softmax" else 1.0 / (1.0 + np.exp(-logits))
    key = key if bias is None else key + bias
    if groups is not None and order != "topk_softmax":
        key = nb.group_mask(key, groups)
    top = -np.sort(-key, axis=-1)[:, :k + 1]
    with np.errstate(invalid="ignore"):
        gaps = np.nan_to_num(top[:, :-1] - top[:, 1:], nan=np.inf)     # -inf - -inf: masked keys, no tie
    return gaps.min(axis=-1) > 1e-5


@pytest.mark.parametrize("case", NORM_ROUTE_CASES, ids=lambda c: "T{}-E{}-k{}-H{}".format(*c))
@pytest.mark.parametrize("mode", NORM_ROUTE_MODES)
@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
def test_add_rmsnorm_route(cp, rng, case, mode, wdt):
    """ops.add_rmsnorm_route against ops.add_rmsnorm then ops.router: h and x the same bits (within rounding for
    rows add_rmsnorm does not hold in registers), logits and weights within fp32 rounding, the same ids (but for
    rows whose best keys tie within that rounding); the selection exactly the oracle's on the kernel's own logits;
    the tickets back at zero (twice on one workspace)."""
    T, E, k, H = case
    h0, b, norm_w, w, how, host_how = _norm_route_inputs(cp, rng, T, E, H, mode, wdt)
    ws = ops.RouterWorkspace(T, E)
    for _ in range(2):
        h, x = h0.copy(), cp.full((T, H), np.nan, cp.float32)
        got, ids, weights = ops.add_rmsnorm_route(h, b, norm_w, 1e-5, w, k, alpha=0.5, out=x, workspace=ws,
                                                  out_ids=cp.full((T, k), -7, cp.int32),
                                                  out_weights=cp.full((T, k), np.nan, cp.float32), **how)
        assert got is x and int(ws.tickets.sum()) == 0
    logits, ids, weights = ws.logits[:T].get(), ids.get(), weights.get()
    h_ref, ref_ws = h0.copy(), ops.RouterWorkspace(T, E)
    x_ref = ops.add_rmsnorm(h_ref, b, norm_w, 1e-5, alpha=0.5, out=cp.empty((T, H), cp.float32))
    ref_ids, ref_weights = (a.get() for a in ops.router(x_ref, w, k, workspace=ref_ws, **how))
    ref_logits = ref_ws.logits[:T].get()
    if H <= REGISTER_ROW_MAX:
        np.testing.assert_array_equal(h.get(), h_ref.get())
        np.testing.assert_array_equal(x.get(), x_ref.get())
    else:
        assert rel(h.get(), h_ref.get()) < 1e-6 and rel(x.get(), x_ref.get()) < 1e-6
    assert rel(logits, ref_logits) < F32_TOL
    clear = _clear_rows(ref_logits, k, **host_how)
    np.testing.assert_array_equal(ids[clear], ref_ids[clear])
    assert rel(weights[clear], ref_weights[clear]) < F32_TOL
    own_ids, own_weights = nb.router(np.eye(T), logits.T.astype(np.float64), k, **host_how)
    # the same experts and weights; experts whose scores tie exactly (bf16 weights make that happen) in either order
    order, own_order = np.argsort(ids, axis=1, kind="stable"), np.argsort(own_ids, axis=1, kind="stable")
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), np.take_along_axis(own_ids, own_order, 1))
    assert rel(np.take_along_axis(weights, order, 1), np.take_along_axis(own_weights, own_order, 1)) < F32_TOL


def test_add_rmsnorm_route_rejects_what_it_cannot_run(cp):
    h, b, w = cp.zeros((2, 64), cp.float32), cp.zeros((2, 64), cp.float32), cp.zeros((8, 64), cp.float32)
    norm_w = cp.ones(64, cp.float32)
    with pytest.raises(TypeError):      # the norm weight in another dtype than the router's
        ops.add_rmsnorm_route(h, b, norm_w.astype(cp.float16), 1e-5, w, 2)
    with pytest.raises(ValueError):     # out is h
        ops.add_rmsnorm_route(h, b, norm_w, 1e-5, w, 2, out=h)
    rows = cp.zeros(2 * 64 + 1, cp.float32)[1:].reshape(2, 64)
    with pytest.raises(ValueError):     # rows off a 16-byte boundary
        ops.add_rmsnorm_route(rows, b, norm_w, 1e-5, w, 2)


@pytest.mark.parametrize("T,norm_dtype", [(1, "f32"), (limits.NORM_ROUTE_MAX_ROWS, "f32"),
                                          (limits.NORM_ROUTE_MAX_ROWS + 1, "f32"), (3, "bf16")])
def test_backend_add_rmsnorm_route_is_add_rmsnorm_then_the_router(cp, rng, T, norm_dtype):
    """CupyBackend.add_rmsnorm_route (the fused launch; the two ops above NORM_ROUTE_MAX_ROWS rows and for a norm
    weight in another dtype than the router's) writes the two ops' h and x and selects their ids."""
    from colibri_format.runtime.cuda.backend import CupyBackend
    from colibri_format.runtime.forward import Workspace

    be = CupyBackend(cp.cuda.Device().id)
    E, k, H = 64, 6, 512
    h0, b, _, w, how, host_how = _norm_route_inputs(cp, rng, T, E, H, "sigmoid-bias-scaled", "f32")
    norm_w = on_device(cp, rng.uniform(0.5, 1.5, H), norm_dtype)
    h, x = h0.copy(), cp.full((T, H), np.nan, cp.float32)
    outs = dict(out_ids=cp.full((T, k), -7, cp.int32), out_weights=cp.full((T, k), np.nan, cp.float32))
    got, ids, weights = be.add_rmsnorm_route(h, b, norm_w, 1e-5, w, k, alpha=0.5, out=x, ws=Workspace(be), **outs,
                                             **how)
    assert got is x and ids is outs["out_ids"] and weights is outs["out_weights"]
    h_ref = h0.copy()
    x_ref = ops.add_rmsnorm(h_ref, b, norm_w, 1e-5, alpha=0.5)
    ref_ws = ops.RouterWorkspace(T, E)
    ref_ids, ref_weights = (a.get() for a in ops.router(x_ref, w, k, workspace=ref_ws, **how))
    np.testing.assert_array_equal(h.get(), h_ref.get())
    np.testing.assert_array_equal(x.get(), x_ref.get())
    clear = _clear_rows(ref_ws.logits[:T].get(), k, **host_how)
    np.testing.assert_array_equal(ids.get()[clear], ref_ids[clear])
    assert rel(weights.get()[clear], ref_weights[clear]) < F32_TOL


QKV_CASES = [  # N, heads, kv_heads, hd, rot, norm, clip
    (1, 16, 16, 128, 128, "full", None),        # OLMoE
    (1, 32, 4, 128, 128, "per_head", None),     # Qwen3
    (1, 32, 8, 128, 128, "none", None),         # Mixtral
    (4, 8, 2, 64, 32, "per_head", None),        # partial rotary, several rows
    (3, 4, 4, 256, 256, "full", 1.5),           # clip after the full norm
    (5, 6, 2, 64, 64, "per_head", 0.7),         # clip before the per-head norm
    (2, 4, 1, 128, 0, "none", None),            # no rotary
    (512, 16, 4, 128, 128, "per_head", None),   # prefill rows
]


@pytest.mark.parametrize("case", QKV_CASES)
@pytest.mark.parametrize("cdt", ["f32", "bf16"])
@pytest.mark.parametrize("wdt", ["f32", "bf16"])
def test_qkv_rope_kv(cp, rng, case, cdt, wdt):
    N, nh, nkv, hd, rot, norm, clip = case
    S, cap, npos = 3, max(64, N + 2), max(N, 8)
    qkv = (rng.standard_normal((N, (nh + 2 * nkv) * hd)) * 2).astype(np.float32)
    kc = on_device(cp, rng.standard_normal((S, cap, nkv, hd)).astype(np.float32), cdt)
    vc = on_device(cp, rng.standard_normal((S, cap, nkv, hd)).astype(np.float32), cdt)
    seq = rng.integers(0, S, N).astype(np.int32)
    pos = rng.permutation(cap)[:N].astype(np.int32)        # distinct slots: no two rows write the same place
    rpos = rng.integers(0, npos, N).astype(np.int32)
    half = rot // 2
    ang = np.arange(npos)[:, None] * (1e4 ** (-np.arange(half) / max(half, 1)))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    norms = {}
    if norm != "none":
        sizes = (nh * hd, nkv * hd) if norm == "full" else (hd, hd)
        norms = dict(q_norm=on_device(cp, rng.uniform(0.5, 1.5, sizes[0]).astype(np.float32), wdt),
                     k_norm=on_device(cp, rng.uniform(0.5, 1.5, sizes[1]).astype(np.float32), wdt))
    exp_k, exp_v = f64(kc.get()), f64(vc.get())             # new arrays: qkv_rope_kv writes the caches
    exp_q = nb.qkv_rope_kv(f64(qkv), nh, nkv, exp_k, exp_v, seq, pos, rpos, cos, sin, norm=norm, eps=1e-6,
                           clip=clip, **{k: f64(v.get()) for k, v in norms.items()})
    q_out = cp.full((N, nh, hd), np.nan, cp.float32)
    got = ops.qkv_rope_kv(cp.asarray(qkv), nh, nkv, kc, vc, cp.asarray(seq), cp.asarray(pos), cp.asarray(rpos),
                          cp.asarray(cos), cp.asarray(sin), norm=norm, eps=1e-6, clip=clip, q_out=q_out, **norms)
    assert got is q_out
    assert rel(q_out.get(), exp_q) < F32_TOL
    tol = F32_TOL if cdt == "f32" else BF16_TOL
    assert rel(f64(kc.get()), exp_k) < tol
    assert rel(f64(vc.get()), exp_v) < tol
    # the rows written, checked alone (the untouched rest of the cache dominates the norms above)
    assert rel(f64(kc.get())[seq, pos], exp_k[seq, pos]) < tol
    assert rel(f64(vc.get())[seq, pos], exp_v[seq, pos]) < tol


def test_qkv_rope_kv_rejects_bad_shapes(cp):
    kc = cp.zeros((1, 8, 2, 64), cp.float32)
    cos = cp.zeros((1, 32), cp.float32)
    idx = cp.zeros(1, cp.int32)
    with pytest.raises(ValueError):
        ops.qkv_rope_kv(cp.zeros((1, 5 * 64), cp.float32), 4, 2, kc, kc.copy(), idx, idx, idx, cos, cos)
    with pytest.raises(ValueError):
        ops.qkv_rope_kv(cp.zeros((1, 8 * 64), cp.float32), 4, 2, kc, kc.copy(), idx, idx, idx, cos, cos,
                        norm="bogus")


@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (512, 2048)])
def test_split_bf16(cp, rng, shape):
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(np.float32)
    hi, lo = ops.split_bf16(cp.asarray(x), hi=cp.full(shape, 0xFFFF, cp.uint16), lo=cp.full(shape, 0xFFFF, cp.uint16))
    exp_hi, exp_lo = expect.split_bf16(x)
    assert (hi.get() == exp_hi).all() and (lo.get() == exp_lo).all()
    assert rel(f64(hi.get()) + f64(lo.get()), x) < 1e-5


@pytest.mark.parametrize("shape", [(1, 7), (512, 2048)])
def test_round_bf16_is_the_splits_hi_alone(cp, rng, shape):
    """ops.round_bf16 (dense_gemm='bf16'): split_bf16's hi, bit for bit, and no lo written anywhere."""
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(np.float32)
    out = ops.round_bf16(cp.asarray(x), out=cp.full(shape, 0xFFFF, cp.uint16))
    assert (out.get() == expect.split_bf16(x)[0]).all()


@pytest.mark.parametrize("T,N,K", [(9, 64, 128), (512, 6144, 2048), (33, 1000, 96), (512, 2048, 4096)])
def test_gemm_bf16_split(cp, rng, T, N, K):
    """The prefill dense product for bf16 matrices (tensor cores, hi+lo activations) against float64."""
    from colibri_format.runtime.cuda.backend import CupyBackend

    be = CupyBackend(cp.cuda.Device().id)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = float32_to_bf16_bits((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32))
    out = cp.full((T, N), np.nan, cp.float32)
    be.gemm_bf16_split(cp.asarray(x), cp.asarray(w), out)
    cp.cuda.get_current_stream().synchronize()
    exp = nb.linear(f64(x), w)
    err = rel(out.get(), exp)
    print(f"T={T} N={N} K={K} rel={err:.2e}")
    assert err < 1e-4       # plain bf16 activations would give ~3e-3
