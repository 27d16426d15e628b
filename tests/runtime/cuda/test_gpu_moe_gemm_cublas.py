"""The grouped expert GEMM on cuBLAS (moe_gemm_cublas.cu around cublasGemmEx, `ops.moe_experts_cublas`) against
`numpy_backend`'s expert math in float64 (kernel_expectations.py), GPU only.

The element-wise kernels are checked exactly (the gather and the widening are bit copies and exact conversions) or
to float32 rounding (the epilogues); the whole block on test_gpu_moe_gemm_fast.py's ragged routings (experts with
1, 63, 64, 65, 300 and no rows), outputs poisoned with NaN first; then the engine's choice of it.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import to_float32
from colibri_format.runtime import EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.synthetic_experts import blob_array, host_experts, upload
from tests.runtime.cuda.test_gpu_moe_gemm_fast import CASES, TOL, _case, f64, nan_array, prefill_error, rel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("split", [True, False])
def test_gather_rows(cp, rng, split):
    T, k, H, E = 37, 3, 96, 5
    x = rng.standard_normal((T, H)).astype(np.float32) * 10
    ids = rng.integers(0, E - 1, (T, k)).astype(np.int32)
    ids[ids >= 2] += 1                                         # expert 2 gets no rows
    d = ops.dispatch(cp.asarray(ids), E)
    perm, offsets = d.perm.get(), d.offsets.get()
    out = ops.gather_bf16(cp.asarray(x), d.perm, k, offsets=d.offsets if split else None,
                          out=cp.full(((2 if split else 1) * T * k, H), 0xFFFF, cp.uint16))
    rows = x[perm // k]
    want = expect.stacked_split_bf16(rows, offsets) if split else expect.split_bf16(rows)[0]
    assert np.array_equal(out.get(), want)


@pytest.mark.parametrize("matrix,name", [("gate_up", "gate_up"), ("down", "down")])
def test_widening_is_exact(cp, rng, matrix, name):
    layout, _, blobs = host_experts(rng, 3, 160, 48)
    buf, table = upload(blobs, 3, layout)
    for e in range(3):
        w = ops.widen_expert_bf16(table, e, matrix, out=cp.full(layout.array(name).shape, 0xFFFF, cp.uint16))
        assert np.array_equal(to_float32(w.get()), blob_array(blobs, layout, e, name, np.int8).astype(np.float32))


@pytest.mark.parametrize("split", [True, False])
def test_gate_up_epilogue_scales_and_gates(cp, rng, split):
    H, I, n, e = 64, 80, 21, 1
    layout, _, blobs = host_experts(rng, 2, H, I)
    buf, table = upload(blobs, 2, layout)
    gu = rng.standard_normal(((2 if split else 1) * n, 2 * I)).astype(np.float32) * 300
    act = ops.gate_up_epilogue(cp.asarray(gu), table, e, split=split).get()
    s = f64(blob_array(blobs, layout, e, "gate_up_scale", np.float32).reshape(-1))
    want = nb.silu_mul(f64((gu[:n] + gu[n:]) if split else gu) * s)
    got = to_float32(act[:n]) + (to_float32(act[n:]) if split else 0)
    assert rel(got, want) < (1e-5 if split else 4e-3)


@pytest.mark.parametrize("split", [True, False])
def test_down_epilogue_scatters_to_pair_order(cp, rng, split):
    H, I, P, e, start, n = 96, 32, 50, 0, 7, 30
    layout, _, blobs = host_experts(rng, 1, H, I)
    buf, table = upload(blobs, 1, layout)
    perm = rng.permutation(P).astype(np.int32)
    w = rng.uniform(0.1, 1.0, P).astype(np.float32)
    yd = rng.standard_normal(((2 if split else 1) * n, H)).astype(np.float32)
    ypair = ops.down_epilogue(cp.asarray(yd), table, e, cp.asarray(perm), start, cp.asarray(w),
                              nan_array(cp, (P, H)), split=split).get()
    rows = perm[start:start + n]
    products = (yd[:n] + yd[n:]) if split else yd
    sd = f64(blob_array(blobs, layout, e, "down_scale", np.float32).reshape(-1))
    assert rel(ypair[rows], f64(w[rows])[:, None] * f64(products) * sd) < 1e-6
    assert np.isnan(np.delete(ypair, rows, axis=0)).all()          # no other pair's row is touched


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("activations", ["split", "bf16"])
def test_moe_experts_cublas_matches_float64(cp, rng, name, activations):
    buf, table, experts, x, ids, w = _case(cp, rng, name)
    (T, k), H = ids.shape, table.hidden_size
    resid = rng.standard_normal((T, H)).astype(np.float32)
    disp = ops.dispatch(cp.asarray(ids), table.num_experts)
    y = ops.moe_experts_cublas(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, disp, activations=activations,
                               residual=cp.asarray(resid), ypair=nan_array(cp, (T * k, H)))
    ref = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy())
    assert rel(y.get(), ref) < TOL[activations]


def test_split_is_more_accurate_than_bf16(cp, rng):
    buf, table, experts, x, ids, w = _case(cp, rng, "many-k-steps")
    disp = ops.dispatch(cp.asarray(ids), table.num_experts)
    ref = nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros(x.shape))
    errs = {a: rel(ops.moe_experts_cublas(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, disp,
                                          activations=a).get(), ref) for a in ("split", "bf16")}
    assert errs["split"] < 1e-4 < errs["bf16"] < 1e-2, errs


def test_moe_experts_takes_cublas_from_the_rule_or_on_request(cp, rng, monkeypatch):
    buf, table, experts, x, ids, w = _case(cp, rng, "ragged")     # 6 experts, 621 pairs: 103 a expert
    calls = []
    real = ops.moe_experts_cublas
    monkeypatch.setattr(ops, "moe_experts_cublas", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    ref = nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros(x.shape))
    assert rel(ops.moe_experts(*args, gemm=True, fast_gemm="split", cublas=True).get(), ref) < TOL["split"]
    assert calls == [1]
    ops.moe_experts(*args, gemm=True, fast_gemm="split", cublas=False)
    ops.moe_experts(*args, gemm=True, fast_gemm=None, cublas=True)          # no activations named: today's kernel
    assert calls == [1]
    work = 621 * table.hidden_size * table.intermediate_size // 6             # the mean work of an expert
    monkeypatch.setattr(ops, "CUBLAS_MIN_EXPERT_MACS", work)
    ops.moe_experts(*args, gemm=True, fast_gemm="bf16")
    monkeypatch.setattr(ops, "CUBLAS_MIN_EXPERT_MACS", work + 1)
    ops.moe_experts(*args, gemm=True, fast_gemm="bf16")
    assert calls == [1, 1]


def test_wrappers_reject_bad_inputs(cp, rng):
    buf, table, experts, x, ids, w = _case(cp, rng, "one-k-step")
    disp = ops.dispatch(cp.asarray(ids), table.num_experts)
    with pytest.raises(ValueError, match="activations"):
        ops.moe_experts_cublas(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, disp, activations="fp8")
    with pytest.raises(ValueError, match="expert"):
        ops.widen_expert_bf16(table, table.num_experts, "down")
    with pytest.raises(TypeError):
        ops.gemm_bf16(cp.zeros((4, 16), cp.float32), cp.zeros((8, 16), cp.uint16), cp.zeros((4, 8), cp.float32))
    with pytest.raises(ValueError, match="does not match"):
        ops.gemm_bf16(cp.zeros((4, 16), cp.uint16), cp.zeros((8, 32), cp.uint16), cp.zeros((4, 8), cp.float32))
    with pytest.raises(ValueError, match="gu"):
        ops.gate_up_epilogue(cp.zeros((4, table.intermediate_size), cp.float32), table, 0)
    with pytest.raises(ValueError, match="gu"):
        ops.gate_up_epilogue(cp.zeros((3, 2 * table.intermediate_size), cp.float32), table, 0, split=True)
    with pytest.raises(ValueError, match="rows from"):
        ops.down_epilogue(cp.zeros((5, table.hidden_size), cp.float32), table, 0, disp.perm, disp.num_pairs - 4,
                          cp.asarray(w), cp.zeros((disp.num_pairs, table.hidden_size), cp.float32), split=False)
    grouped_layout, _, grouped_blobs = host_experts(rng, 4, 64, 32, 16)
    gbuf, grouped = upload(grouped_blobs, 4, grouped_layout)
    with pytest.raises(ValueError, match="per-row"):
        ops.widen_expert_bf16(grouped, 0, "gate_up")
    assert not ops.uses_cublas_gemm(10 ** 6, grouped, None)


def test_refused_inside_a_graph_capture(cp, rng):
    buf, table, experts, x, ids, w = _case(cp, rng, "one-k-step")
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, ops.dispatch(cp.asarray(ids), table.num_experts))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="graph capture"):
                ops.moe_experts_cublas(*args)
        finally:
            stream.end_capture()


def test_dense_products_replay_in_a_graph(cp, rng):
    """cuBLAS products through cublas_direct are captured (CuPy's own wrappers refuse a capturing stream) and the
    replay writes what the eager call wrote."""
    a, _ = ops.split_bf16(cp.asarray(rng.standard_normal((40, 64)).astype(np.float32)))
    w, _ = ops.split_bf16(cp.asarray(rng.standard_normal((24, 64)).astype(np.float32)))
    out = cp.zeros((40, 24), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ops.gemm_bf16(a, w, out)                    # eager first: the stream's cuBLAS workspace is made
        want = out.get()
        out.fill(0)
        stream.begin_capture()
        try:
            ops.gemm_bf16(a, w, out)
        finally:
            graph = stream.end_capture()
        assert not out.get().any()                  # captured, not run
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(out.get(), want)
    assert np.allclose(want, to_float32(a.get()) @ to_float32(w.get()).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activations,tol", [("split", 2e-3), ("bf16", 3e-2)])
def test_engine_prefill_on_cublas(tmp_path, monkeypatch, activations, tol):
    calls = []
    real = ops.moe_experts_cublas
    monkeypatch.setattr(ops, "moe_experts_cublas", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = EngineConfig(device="cuda", max_seq_len=128, fast_expert_gemm=activations, cublas_expert_gemm=True)
    err = prefill_error(tmp_path, cfg)
    assert calls, "the engine did not run the cuBLAS path"
    assert err < tol


# ---- W8A8 ("int8" activations) ------------------------------------------------------------------------------
# a warp a row (768, 1040, 2048), a block a row read once (14336) or twice (300, 16388)
@pytest.mark.parametrize("cols", [768, 1040, 2048, 14336, 300, 16388])
def test_quantize_rows_matches_numpy_bit_for_bit(cp, rng, cols):
    x = (rng.standard_normal((7, cols)) * rng.uniform(0.01, 100, (7, 1))).astype(np.float32)
    x[3] = 0
    q, s = ops.quantize_rows_int8(cp.asarray(x))
    want_q, want_s = nb.quantize_int8_groups(x, x.shape[1])
    assert np.array_equal(q.get(), want_q) and np.array_equal(s.get(), want_s.reshape(-1))


def test_int8_product_is_exact(cp, rng):
    a = rng.integers(-127, 128, (9, 160), dtype=np.int8)
    w = rng.integers(-127, 128, (96, 160), dtype=np.int8)
    out = ops.gemm_int8(cp.asarray(a), cp.asarray(w), cp.full((9, 96), -1, cp.int32))
    assert np.array_equal(out.get(), a.astype(np.int64) @ w.T.astype(np.int64))
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.gemm_int8(cp.zeros((2, 40), cp.int8), cp.zeros((8, 40), cp.int8), cp.zeros((2, 8), cp.int32))


@pytest.mark.parametrize("matrix", ["gate_up", "down"])
def test_expert_int8_products_are_exact_and_read_blobs_in_place(cp, rng, matrix):
    layout, _, blobs = host_experts(rng, 3, 160, 48)
    buf, table = upload(blobs, 3, layout)
    addresses = table.blob_ptrs.get()
    K = 160 if matrix == "gate_up" else 48
    N = 96 if matrix == "gate_up" else 160
    a = rng.integers(-127, 128, (11, K), dtype=np.int8)
    routed = [(2, 0, 4), (0, 4, 6), (1, 10, 1)]          # sorted rows of experts 2, 0 and 1, as a dispatch gives
    out = cp.full((11, N), -1, cp.int32)
    ops.gemm_int8_experts(cp.asarray(a), out, table, addresses, matrix, routed)
    for e, s, n in routed:
        want = a[s:s + n].astype(np.int64) @ blob_array(blobs, layout, e, matrix, np.int8).T.astype(np.int64)
        assert np.array_equal(out[s:s + n].get(), want)
    with pytest.raises(ValueError, match="do not fit"):
        ops.gemm_int8_experts(cp.asarray(a), out, table, addresses, matrix, [(0, 8, 4)])
    with pytest.raises(ValueError, match="do not fit"):
        ops.gemm_int8_experts(cp.asarray(a), out, table, addresses, matrix, [(3, 0, 1)])


@pytest.mark.parametrize("name", sorted(CASES))
def test_w8a8_block_matches_float64_of_rounded_inputs(cp, rng, name):
    buf, table, experts, x, ids, w = _case(cp, rng, name)
    (T, k), H = ids.shape, table.hidden_size
    resid = rng.standard_normal((T, H)).astype(np.float32)
    disp = ops.dispatch(cp.asarray(ids), table.num_experts)
    y = ops.moe_experts_cublas(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, disp, activations="int8",
                               residual=cp.asarray(resid), ypair=nan_array(cp, (T * k, H))).get()
    assert rel(y - resid, expect.w8a8_block(x, ids, w, experts, np.zeros((T, H)))) < 1e-3
    float_ref = nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros((T, H)))
    assert rel(y - resid, float_ref) > 1e-4          # the inputs really are rounded to int8


def test_engine_prefill_on_w8a8(tmp_path, monkeypatch):
    calls = []
    real = ops._experts_int8
    monkeypatch.setattr(ops, "_experts_int8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    err = prefill_error(tmp_path, EngineConfig(device="cuda", max_seq_len=128, fast_expert_gemm="int8",
                                               cublas_expert_gemm=True))
    assert calls, "the engine did not run the W8A8 route"
    assert err < 5e-2


@pytest.mark.parametrize("threshold,takes_w8a8", [(0, True), (10 ** 15, False)])
def test_engine_defaults_take_w8a8_past_the_threshold(tmp_path, monkeypatch, threshold, takes_w8a8):
    """EngineConfig's fast_expert_gemm 'auto': W8A8 on cuBLAS where an expert's mean work reaches both limits (the
    tiny model is far below the real ones, so they are moved), the pipelined split kernel below them."""
    calls = []
    real = ops._experts_int8
    monkeypatch.setattr(ops, "_experts_int8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(ops, "CUBLAS_INT8_MIN_EXPERT_MACS", threshold)
    monkeypatch.setattr(ops, "W8A8_MIN_EXPERT_MACS", threshold)    # 'auto' rounds to W8A8 from here
    err = prefill_error(tmp_path, EngineConfig(device="cuda", max_seq_len=128))
    assert bool(calls) == takes_w8a8
    assert err < (5e-2 if takes_w8a8 else 2e-3)
