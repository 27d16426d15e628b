"""int4_group experts on int8 activations (moe_gemv4_dp4a.cu, `EngineConfig.int8_activations`) on the CUDA engine
(GPU only; the kernels' logic runs on the CPU in test_moe_gemv4_dp4a_emulated.py).

Kernel level: the activation quantizer is its NumPy twin bit for bit; the dp4a GEMVs (every tokens-per-pass variant,
weight groups 32/64/128, fill on read) against `numpy_backend`'s float64 products on the kernel's own int8 inputs
(q * s, exact in float64), so to fp32 accumulation error; `moe_experts_4bit(int8_activations=True)` (decode GEMVs and
the prefill GEMM on rounded inputs) against `numpy_backend.moe` with `round_int8_groups` in float64.

Rounding to int8 is discontinuous: a value within float32 rounding of a tie rounds one step apart in fp32 and in
float64 (one step is max|v| / 127 of its group), so wherever the oracle rounds its own float64 values the check
allows it: per output row at the kernel level (`assert_rounded_like_the_oracle`: a 70-token prefill flipped a few
activations in about a third of runs, which one overall bound of 1e-3 failed), a wider bound for the engine's logits
(A8_ENGINE_TOL: the float32 NumPy engine with the switch is itself up to ~2.4e-3 from the float64 one on such files),
and each such comparison also checks that the result is nearer the rounded oracle than the unrounded one (what shows
that the rounding happened, and where).
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.test_gpu_4bit import (CASES, F32_TOL, LONG, PROMPTS, _file, _rel_logits, f64, packed_blobs,
                                              rel, routes, upload)

A8_ROW_TOL = 1e-4      # a token's output row, fp32-rounded inputs against float64-rounded ones, relative norm
A8_FLIP_TOL = 2e-2     # a row where an activation near a rounding boundary went the other way (~7e-3 seen)
A8_ENGINE_TOL = 8e-3   # CUDA engine logits against the float64 NumPy engine, both with int8 activations
ENGINE_TOL = 2e-3      # float activations (test_gpu_4bit.py)
INT4 = {"int4-g32": 32, "int4-g64": 64, "int4-g128": 128}


def assert_rounded_like_the_oracle(y, want, plain) -> None:
    """y (a kernel's [T, H] output on inputs it rounded to int8) against `want` (float64, rounded the same way) and
    `plain` (float64, unrounded). An fp32 activation within its rounding error of a boundary rounds the other way, in
    up to a fifth of the rows at T = 70 (each such row up to ~7e-3 off), so the check is per row: most rows within
    A8_ROW_TOL, none beyond A8_FLIP_TOL, the whole nearer the rounded oracle than the unrounded one. What this allows
    a single row, the dp4a GEMV test above checks exactly on the kernels' own int8 inputs."""
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    assert y.shape == want.shape and np.isfinite(y).all(), "unwritten or non-finite output"
    row_rel = np.linalg.norm(y - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    flipped = int((row_rel > A8_ROW_TOL).sum())
    assert flipped <= max(1, len(y) // 2), f"{flipped} of {len(y)} rows off by more than {A8_ROW_TOL}"
    assert row_rel.max() < A8_FLIP_TOL, f"a row off by {row_rel.max():.3g}"
    assert np.linalg.norm(y - want) < np.linalg.norm(y - plain)


def dequantized(q_staged, s) -> np.ndarray:
    """The float64 inputs the dp4a products see: q (column order) * s of its group."""
    q = ops.unstage_a8(q_staged).astype(np.float64)
    rows, cols = q.shape
    return (q.reshape(rows, cols // 32, 32) * f64(s)[:, :, None]).reshape(rows, cols)


@pytest.mark.parametrize("shape", [(1, 32), (3, 256), (37, 4224), (5, 14336)])
def test_quantize_is_the_twin_bit_for_bit(cp, rng, shape):
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3, (shape[0], 1))).astype(np.float32)
    x[0, :32] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5])      # s = 1: halves are ties (to even)
    if shape[1] >= 64:
        x[-1, 32:64] = 0.0                                                # a zero group
    q, s = ops.quantize_activations_a8(cp.asarray(x))
    want_q, want_s = ops.quantize_activations_a8_reference(x)
    np.testing.assert_array_equal(q.get(), want_q)
    np.testing.assert_array_equal(s.get().view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(ops.round_activations_a8(cp.asarray(x)).get(), nb.round_int8_groups(x))
    inplace = cp.asarray(x)
    ops.round_activations_a8(inplace, out=inplace)
    np.testing.assert_array_equal(inplace.get(), nb.round_int8_groups(x))


@pytest.mark.parametrize("T,H,E,k", [(1, 4096, 8, 2), (3, 2048, 128, 8), (37, 4224, 64, 6), (1, 32, 4, 1)])
def test_dispatch_rounds_x_as_the_quantizer(cp, rng, T, H, E, k):
    """moe_dispatch_a8: the dispatch of moe_dispatch and x's int8 rounding of moe4a8_quantize, bit for bit."""
    x = (rng.standard_normal((T, H)) * rng.uniform(1e-3, 1e3, (T, 1))).astype(np.float32)
    x[0, :32] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5])      # ties to even
    ids = cp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    xq = cp.full((T, H), 99, cp.int8)
    xs = cp.full((T, H // 32), cp.nan, cp.float32)
    got = ops.dispatch(ids, E, quantize=(cp.asarray(x), xq, xs))
    plain = ops.dispatch(ids, E)
    for field in ("counts", "offsets", "perm", "inv", "active", "meta", "tile_expert", "tile_start"):
        np.testing.assert_array_equal(getattr(got, field).get(), getattr(plain, field).get(), err_msg=field)
    want_q, want_s = ops.quantize_activations_a8_reference(x)
    np.testing.assert_array_equal(xq.get(), want_q)
    np.testing.assert_array_equal(xs.get().view(np.uint32), want_s.view(np.uint32))
    with pytest.raises(ValueError, match="shape"):
        ops.dispatch(ids, E, quantize=(cp.asarray(x), cp.zeros((T + 1, H), cp.int8), xs))


@pytest.mark.parametrize("name", sorted(INT4))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokc", [None, 1, 2, 4, 8])
def test_dp4a_gemvs_match_float64_on_their_inputs(cp, rng, name, case, tokc):
    T, E, k, H, I, skew = case
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, INT4[name], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, skew)
    x = rng.standard_normal((T, H)).astype(np.float32)
    d = ops.dispatch(cp.asarray(ids), E)
    xq, xs = ops.quantize_activations_a8(cp.asarray(x))
    act = ops.moe_gate_up_4bit_a8(xq, xs, table, d, k, tokens_per_pass_=tokc,
                                  out=cp.full((T * k, I), np.nan, cp.float32))
    act_pairs = act.get()[d.inv.get()]                        # sorted order -> pair order
    assert rel(act_pairs, expect.pair_act(dequantized(xq.get(), xs.get()), ids, experts)) < F32_TOL
    aq, as_ = ops.quantize_activations_a8(act)
    ypair = ops.moe_down_4bit_a8(aq, as_, table, d, cp.asarray(w), tokens_per_pass_=tokc,
                                 out=cp.full((T * k, H), np.nan, cp.float32))
    a_pairs = dequantized(aq.get(), as_.get())[d.inv.get()]
    assert rel(ypair.get(), expect.pair_down(a_pairs, ids, f64(w), experts)) < F32_TOL


@pytest.mark.parametrize("T", [1, 5])
def test_dp4a_gemvs_fill_admitted_slots_as_they_read(cp, rng, T):
    E, k, H, I = 8, 2, 256, 384
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, 32, E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    slots = cp.zeros(E * layout.size, cp.uint8)
    fills = np.array([slots.data.ptr + e * layout.size if e % 2 == 0 else 0 for e in range(E)], np.uint64)
    filled = ops.PackedExpertTable.from_layout(table.blob_ptrs, layout, fill_ptrs=cp.asarray(fills))
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(ids), cp.asarray(w), filled, gemm=False,
                             int8_activations=True)
    want = nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros((T, H)), round_input=nb.round_int8_groups)
    assert_rounded_like_the_oracle(y.get(), want, nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros((T, H))))
    got = slots.get()
    for e in range(E):
        for a in layout.arrays:
            lo = e * layout.size + a.offset
            region = got[lo:lo + a.nbytes]
            if e % 2 == 0 and e in ids:
                np.testing.assert_array_equal(region, blobs[lo:lo + a.nbytes], err_msg=f"expert {e} {a.name}")
            else:
                assert not region.any(), f"expert {e} {a.name} written without a routed slot"


@pytest.mark.parametrize("name", sorted(INT4))
@pytest.mark.parametrize("gemm", [False, True])
@pytest.mark.parametrize("T", [1, 6, 70])
def test_moe_experts_4bit_with_int8_activations(cp, rng, name, gemm, T):
    E, k, H, I = 16, 4, 256, 128
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, INT4[name], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    resid = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, residual=cp.asarray(resid),
                             alpha=0.5, gemm=gemm, int8_activations=True).get()
    want = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy(), alpha=0.5,
                  round_input=nb.round_int8_groups)
    plain = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy(), alpha=0.5)
    assert_rounded_like_the_oracle(y, want, plain)


@pytest.mark.parametrize("name", sorted(INT4))
def test_one_token_passes_run_by_pair_alike_to_the_bit(cp, rng, name):
    """On int8 activations too, a one-token pass runs by pair (x rounded by moe4a8_quantize, no dispatch): the same
    bits as the dispatch path (moe_dispatch_a8 rounds x there), with a residual; an id outside [0, E) adds nothing."""
    E, k, H, I = 16, 4, 256, 128
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, INT4[name], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, 1, E, k, False)
    x = rng.standard_normal((1, H)).astype(np.float32)
    resid = rng.standard_normal((1, H)).astype(np.float32)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    kw = {"residual": cp.asarray(resid), "alpha": 0.5, "gemm": False, "int8_activations": True}
    by_pair = ops.moe_experts_4bit(*args, **kw).get()
    np.testing.assert_array_equal(by_pair, ops.moe_experts_4bit(*args, pairs=False, **kw).get())
    want = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy(), alpha=0.5,
                  round_input=nb.round_int8_groups)
    plain = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy(), alpha=0.5)
    assert_rounded_like_the_oracle(by_pair, want, plain)
    bad = ids.copy()
    bad[0, 2] = -1
    kept_w = w.copy()
    kept_w[0, 2] = 0.0
    got = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(bad), cp.asarray(w), table, gemm=False,
                               int8_activations=True).get()
    want = nb.moe(f64(x), np.where(bad >= 0, bad, ids[0, 0]), f64(kept_w), experts, residual=np.zeros((1, H)),
                  round_input=nb.round_int8_groups)
    assert rel(got, want) < A8_FLIP_TOL
    xq, xs = ops.quantize_activations_a8(cp.asarray(x))
    with pytest.raises(ValueError, match="shape"):
        ops.moe_gate_up_4bit_a8_pairs(xq, xs, cp.asarray(np.concatenate([ids, ids])), table)


def test_a8_wrappers_reject_bad_inputs(cp, rng):
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, 32, 4, 128, 64)
    buf, table = upload(cp, blobs, 4, layout)
    ids, w = routes(rng, 2, 4, 2, False)
    d = ops.dispatch(cp.asarray(ids), 4)
    with pytest.raises(TypeError):
        ops.quantize_activations_a8(cp.zeros((2, 128), cp.float64))
    with pytest.raises(ValueError, match="groups of 32"):
        ops.quantize_activations_a8(cp.zeros((2, 48), cp.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.round_activations_a8(cp.zeros((128, 2), cp.float32).T)
    xq, xs = ops.quantize_activations_a8(cp.zeros((2, 128), cp.float32))
    with pytest.raises(ValueError, match="shape"):
        ops.moe_gate_up_4bit_a8(xq[:1], xs[:1], table, d, 2)
    with pytest.raises(TypeError):
        ops.moe_gate_up_4bit_a8(xq.view(cp.uint8), xs, table, d, 2)
    with pytest.raises(ValueError, match="tokens per pass"):
        ops.moe_gate_up_4bit_a8(xq, xs, table, d, 2, tokens_per_pass_=3)
    aq, as_ = ops.quantize_activations_a8(cp.zeros((4, 64), cp.float32))
    with pytest.raises(ValueError, match="weights"):
        ops.moe_down_4bit_a8(aq, as_, table, d, cp.zeros(3, cp.float32))
    mx_layout, _, mx_blobs = packed_blobs(rng, S.ExpertFormat.MXFP4, 32, 4, 128, 64)
    mx_buf, mx = upload(cp, mx_blobs, 4, mx_layout)
    with pytest.raises(ValueError, match="INT4_GROUP"):
        ops.moe_gate_up_4bit_a8(xq, xs, mx, d, 2)
    with pytest.raises(ValueError, match="int8 activations"):
        ops.moe_experts_4bit(cp.zeros((2, 128), cp.float32), cp.asarray(ids), cp.asarray(w), mx,
                             int8_activations=True)
    assert not ops.uses_a8(True, mx) and ops.uses_a8(True, table) and not ops.uses_a8(False, table)


# ---- engine ---------------------------------------------------------------------------------------------------------
def _check_greedy(gpu: Engine, ref: Engine, prompt: list[int], n: int) -> None:
    """The CUDA engine's greedy tokens, teacher-forced through the float64 oracle: each is within the logit error
    the bound allows of the oracle's best (an exact token match would fail on near ties)."""
    tokens = gpu.generate(prompt, max_new_tokens=n, stop_ids=[]).output_ids
    assert len(tokens) == n
    logits = ref.logits([prompt + tokens[:-1]])[0][len(prompt) - 1:]
    for row, tok in zip(logits, tokens):
        assert row[tok] >= row.max() - 2 * A8_ENGINE_TOL * np.linalg.norm(row)


@pytest.mark.parametrize("name", sorted(INT4))
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_with_int8_activations(tmp_path, name, graphs):
    path = _file(tmp_path, name)
    cfg = EngineConfig(device="cuda", max_seq_len=128, use_graphs=graphs)
    assert cfg.int8_activations     # the default
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64")) as ref, \
            Engine(path, EngineConfig(precision="float64", int8_activations=False)) as plain:
        batch = PROMPTS + [LONG]   # LONG: the prefill GEMM on rounded inputs
        outs = [e.logits(batch) for e in (gpu, ref, plain)]
        for a, b in zip(outs[0], outs[1]):
            assert _rel_logits(a, b) < A8_ENGINE_TOL
        got, exp, unrounded = (np.concatenate(o).astype(np.float64) for o in outs)
        assert np.linalg.norm(got - exp) < np.linalg.norm(got - unrounded)   # over the whole batch
        for prompt in PROMPTS:
            _check_greedy(gpu, ref, prompt, 10)
        out = gpu.generate_batch(PROMPTS, 6)
        assert len(out) == len(PROMPTS)


@pytest.mark.parametrize("graphs", [True, False])
def test_float_activations_switch_gives_the_float_path(tmp_path, graphs):
    """int8_activations=False: the float-activation kernels, within test_gpu_4bit.py's float bound of the float64
    engine without rounding."""
    path = _file(tmp_path, "int4-g32")
    cfg = EngineConfig(device="cuda", max_seq_len=128, use_graphs=graphs, int8_activations=False)
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64", int8_activations=False)) as ref:
        for got, exp in zip(gpu.logits(PROMPTS + [LONG]), ref.logits(PROMPTS + [LONG])):
            assert _rel_logits(got, exp) < ENGINE_TOL


def test_mxfp4_ignores_the_switch(tmp_path):
    """mxfp4 is not in limits.A8_FORMATS: with the switch on (the default) both engines keep float activations."""
    path = _file(tmp_path, "mxfp4")
    with Engine(path, EngineConfig(device="cuda", max_seq_len=128)) as gpu, \
            Engine(path, EngineConfig(precision="float64", int8_activations=False)) as ref:
        for got, exp in zip(gpu.logits(PROMPTS + [LONG]), ref.logits(PROMPTS + [LONG])):
            assert _rel_logits(got, exp) < ENGINE_TOL


@pytest.mark.parametrize("graphs", [True, False])
def test_paged_dp4a_experts_compute_what_resident_ones_do(tmp_path, graphs):
    """A cache of 3 of the 8 experts on the dp4a path: misses read blobs over PCIe, admissions fill on read."""
    path = _file(tmp_path, "int4-g64")
    # passes of at most 48 rows on both (LONG: 48 + 32, the first on the grouped GEMM): a padded prefill graph of
    # 64 rows on the resident engine would run the GEMM where the paged one runs a short prompt on the GEMVs
    base = dict(device="cuda", max_seq_len=128, use_graphs=graphs, max_prefill_rows=48)
    with Engine(path, EngineConfig(**base)) as resident, \
            Engine(path, EngineConfig(**base, max_cached_experts=3)) as paged:
        for _ in range(2):
            for a, b in zip(paged.logits(PROMPTS + [LONG]), resident.logits(PROMPTS + [LONG])):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            for prompt in PROMPTS:
                assert paged.generate(prompt, max_new_tokens=12, stop_ids=[]).output_ids == \
                    resident.generate(prompt, max_new_tokens=12, stop_ids=[]).output_ids
        assert paged.stats()["paging"]["misses"] > 0
