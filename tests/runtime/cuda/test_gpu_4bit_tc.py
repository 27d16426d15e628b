"""The tensor-core int4_group decode GEMVs (moe_gemv4_tc.cu) on the GPU: against `numpy_backend` in float64 and
against moe_gemv4.cu's SIMT kernels on the same blobs (every tokens-per-pass variant, groups 32/64/128), their fill
on read, the checks of their wrappers, and the CUDA engine with the crossover (limits.TC4_MIN_*) lowered to every
pass: the NumPy engine's greedy tokens on a tiny int4 Mixtral, eager and in graphs.
CPU twin: test_moe_gemv4_tc_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.test_gpu_4bit import (
    CASES, ENGINE_TOL, LONG, PROMPTS, _int4_file, _rel_logits, f64, packed_blobs, rel, routes, upload)

TC_TOL = 5e-5   # bf16 hi + lo activations, fp32 accumulation (the emulated kernels measure ~4e-6)
GROUPS = (32, 64, 128)


def _gemvs(cp, x, table, ids, w, k: int, tokc, tensor_cores: bool):
    """(act in pair order, ypair) of gate_up + down on the tensor-core or the SIMT kernels."""
    gate_up, down = ((ops.moe_gate_up_4bit_tc, ops.moe_down_4bit_tc) if tensor_cores
                     else (ops.moe_gate_up_4bit, ops.moe_down_4bit))
    T, E = ids.shape[0], table.num_experts
    d = ops.dispatch(cp.asarray(ids), E)
    act = gate_up(cp.asarray(x), table, d, k, tokens_per_pass_=tokc,
                  out=cp.full((T * k, table.intermediate_size), np.nan, cp.float32))
    ypair = down(act, table, d, cp.asarray(w), tokens_per_pass_=tokc,
                 out=cp.full((T * k, table.hidden_size), np.nan, cp.float32))
    return act.get()[d.inv.get()], ypair.get()


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokc", [None, 1, 2, 4, 8])
def test_gemv_4bit_tc_matches_numpy_and_the_simt_kernels(cp, rng, group, case, tokc):
    T, E, k, H, I, skew = case
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, group, E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, skew)
    x = rng.standard_normal((T, H)).astype(np.float32)
    act, ypair = _gemvs(cp, x, table, ids, w, k, tokc, tensor_cores=True)
    assert rel(act, expect.pair_act(f64(x), ids, experts)) < TC_TOL
    assert rel(ypair, expect.pair_down(f64(act), ids, f64(w), experts)) < TC_TOL
    simt_act, simt_ypair = _gemvs(cp, x, table, ids, w, k, tokc, tensor_cores=False)
    assert rel(act, simt_act) < TC_TOL
    assert rel(ypair, expect.pair_down(f64(simt_act), ids, f64(w), experts)) < TC_TOL
    assert rel(ypair, simt_ypair) < TC_TOL


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("T", [1, 6])
def test_moe_experts_4bit_on_the_tensor_cores(cp, rng, group, T):
    E, k, H, I = 16, 4, 256, 128
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, group, E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    resid = rng.standard_normal((T, H)).astype(np.float32)
    staged = (cp.empty((T, 2, H // 2), cp.uint32), cp.empty((T * k, 2, I // 2), cp.uint32))
    y = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, residual=cp.asarray(resid),
                             alpha=0.5, gemm=False, tensor_cores=True, staged=staged)
    want = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy(), alpha=0.5)
    assert rel(y.get(), want) < TC_TOL


@pytest.mark.parametrize("T", [1, 5])
def test_gemv_4bit_tc_fills_admitted_slots_as_it_reads(cp, rng, T):
    E, k, H, I = 8, 2, 256, 384
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, 32, E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    slots = cp.zeros(E * layout.size, cp.uint8)
    fills = np.array([slots.data.ptr + e * layout.size if e % 2 == 0 else 0 for e in range(E)], np.uint64)
    filled = ops.PackedExpertTable.from_layout(table.blob_ptrs, layout, fill_ptrs=cp.asarray(fills))
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(ids), cp.asarray(w), filled, gemm=False, tensor_cores=True)
    assert rel(y.get(), nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros((T, H)))) < TC_TOL
    got = slots.get()
    for e in range(E):
        for a in layout.arrays:
            lo = e * layout.size + a.offset
            region = got[lo:lo + a.nbytes]
            if e % 2 == 0 and e in ids:
                np.testing.assert_array_equal(region, blobs[lo:lo + a.nbytes], err_msg=f"expert {e} {a.name}")
            else:
                assert not region.any(), f"expert {e} {a.name} written without a routed slot"


def test_tc_wrappers_reject_bad_inputs(cp, rng):
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, 32, 4, 128, 64)
    buf, table = upload(cp, blobs, 4, layout)
    ids, w = routes(rng, 2, 4, 2, False)
    d = ops.dispatch(cp.asarray(ids), 4)
    x = cp.zeros((2, 128), cp.float32)
    with pytest.raises(TypeError):
        ops.moe_gate_up_4bit_tc(cp.zeros((2, 128), cp.float64), table, d, 2)
    with pytest.raises(ValueError, match="tokens per pass"):
        ops.moe_gate_up_4bit_tc(x, table, d, 2, tokens_per_pass_=3)
    with pytest.raises(ValueError, match="shape"):
        ops.moe_gate_up_4bit_tc(x, table, d, 2, staged=cp.empty((2, 2, 32), cp.uint32))
    mx_layout, _, mx_blobs = packed_blobs(rng, S.ExpertFormat.MXFP4, 32, 4, 128, 64)
    mx_buf, mx_table = upload(cp, mx_blobs, 4, mx_layout)
    with pytest.raises(ValueError, match="tensor-core"):
        ops.moe_gate_up_4bit_tc(x, mx_table, d, 2)
    assert not ops.uses_tc4(True, mx_table, 2) and ops.uses_tc4(True, table, 2) and not ops.uses_tc4(False, table, 8)
    assert not ops.uses_tc4(None, table, 8)       # small experts: under the crossover, the SIMT kernels run


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_with_tensor_core_gemvs_gives_the_numpy_engines_tokens(tmp_path, monkeypatch, group, graphs):
    monkeypatch.setattr(limits, "TC4_MIN_TOKENS", 1)
    monkeypatch.setattr(limits, "TC4_MIN_INTERMEDIATE", 1)
    path = _int4_file(tmp_path, group)
    flt = dict(int8_activations=False)   # the float-activation kernels (int8 activations skip the tensor cores)
    cfg = EngineConfig(device="cuda", max_seq_len=128, use_graphs=graphs, **flt)
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64", **flt)) as ref, \
            Engine(path, EngineConfig(**flt)) as cpu:
        for got, exp in zip(gpu.logits(PROMPTS + [LONG]), ref.logits(PROMPTS + [LONG])):
            assert _rel_logits(got, exp) < ENGINE_TOL
        for prompt in PROMPTS:
            tokens = gpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
            assert tokens == cpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
        assert gpu.generate_batch(PROMPTS, 6) == cpu.generate_batch(PROMPTS, 6)
