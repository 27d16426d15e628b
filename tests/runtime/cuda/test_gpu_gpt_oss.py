"""gpt-oss's experts on the CUDA engine (GPU only): per-expert biases and the clamped SwiGLU (model.expert_bias,
model.expert_act), run by the `*_extras` variants of the expert kernels (moe_gemv.cu at decode, moe_gemm.cu for
prefill).

Kernel level: every GEMV and grouped-GEMM variant with extras against the NumPy twin (`numpy_backend.expert_ffn` /
`moe`, float64), for each combination of the extras (both biases and a clamp the activations reach, no clamp, biases
without the clamped SwiGLU, the clamped SwiGLU without biases). Model level: tiny transformers-built gpt-oss models
(head_dim 64 so the CUDA attention kernel runs; sinks, sliding layers, the biased router) converted with int8
experts (per-row and grouped scales): the CUDA engine gives the NumPy engine's greedy tokens, and logits close to the
float64 NumPy engine's, eager and in CUDA graphs, at decode (GEMV) and over a prompt long enough for the GEMM path.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.convert.pipeline import convert
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.synthetic_experts import host_experts, upload
from tests.runtime.hf_tiny import build_hf

F32_TOL = 2e-5      # fp32 accumulation vs float64 (the plain kernels' bound in test_gpu_kernels.py)
TC_TOL = 1e-4       # tensor cores: activations split into two bf16 terms
MODEL_TOL = 2e-3    # relative logit error of the CUDA engine against the float64 NumPy engine
GPT_OSS = {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}
EXTRAS = {  # id -> (act, gate_up bias, down bias); the gate/up products here have std ~1.7
    "gpt-oss-clamped": (dict(GPT_OSS, limit=0.8), True, True),     # most activations clamped
    "gpt-oss": (GPT_OSS, True, True),
    "no-clamp": (dict(GPT_OSS, limit=None), False, True),
    "biases-only": (None, True, True),                             # silu(gate + b) * (up + b)
    "act-only": (GPT_OSS, False, False),
}


def rel(out, expected) -> float:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert out.shape == expected.shape and np.isfinite(out).all(), "wrong shape or an unwritten element"
    return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


def _case(cp, rng, T, E, k, H, I, group, extras_id):
    """Experts, inputs and extras on both sides: (table, experts, x, ids, w, host extras dict, ops.ExpertExtras)."""
    layout, experts, blobs = host_experts(rng, E, H, I, group)
    buf, table = upload(blobs, E, layout)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    act, gu, dn = EXTRAS[extras_id]
    host = {"act": act,
            "gate_up_bias": rng.normal(0.0, 0.5, (E, 2 * I)).astype(np.float32) if gu else None,
            "down_bias": rng.normal(0.0, 0.5, (E, H)).astype(np.float32) if dn else None}
    dev = ops.ExpertExtras.from_model(act, *(None if host[n] is None else cp.asarray(host[n])
                                             for n in ("gate_up_bias", "down_bias")))
    return (buf, table), experts, x, ids, w, host, dev


def _check_stages(cp, gate_up, down, case, tol):
    """gate_up(x, d) -> act (sorted order) and down(act, d) -> ypair against the NumPy twin's stages."""
    (_, table), experts, x, ids, w, host, _ = case
    d = ops.dispatch(cp.asarray(ids), table.num_experts, tile_m=ops.GEMM_BM)
    act = gate_up(cp.asarray(x), d)
    act_pairs = act.get()[d.inv.get()]
    gu, dn = (None if host[n] is None else nb.widen(host[n]) for n in ("gate_up_bias", "down_bias"))
    assert rel(act_pairs, expect.pair_act(nb.widen(x), ids, experts, act=host["act"], gate_up_bias=gu)) < tol
    ypair = down(act, d)
    exp = expect.pair_down(nb.widen(act_pairs), ids, nb.widen(w), experts, down_bias=dn)
    assert rel(ypair.get(), exp) < tol
    full = nb.moe(nb.widen(x), ids, nb.widen(w), experts, residual=np.zeros(x.shape), act=host["act"],
                  gate_up_bias=host["gate_up_bias"], down_bias=host["down_bias"])
    assert rel(ops.moe_combine(ypair, ids.shape[1]).get(), full) < tol


GEMV_CASES = [  # T, E, k, H, I, group
    (1, 8, 2, 256, 128, 0), (3, 16, 4, 256, 96, 0), (5, 32, 4, 256, 128, 32), (8, 4, 4, 128, 64, 0),
    (2, 4, 2, 4160, 2080, 0)]


@pytest.mark.parametrize("extras_id", sorted(EXTRAS))
@pytest.mark.parametrize("case", GEMV_CASES)
@pytest.mark.parametrize("tokc,variant", [(None, None), (1, "t1"), (1, "w2"), (1, "w4"), (2, None), (4, None),
                                          (8, None)])
def test_gemv_extras_match_the_numpy_twin(cp, rng, extras_id, case, tokc, variant):
    T, E, k, H, I, group = case
    c = _case(cp, rng, T, E, k, H, I, group, extras_id)
    (_, table), *_, dev = c
    _check_stages(
        cp,
        lambda x, d: ops.moe_gate_up(x, table, d, k, tokens_per_pass_=tokc, variant=variant, extras=dev,
                                     out=cp.full((T * k, I), np.nan, cp.float32)),
        lambda a, d: ops.moe_down(a, table, d, cp.asarray(c[4]), tokens_per_pass_=tokc, variant=variant,
                                  extras=dev, out=cp.full((T * k, H), np.nan, cp.float32)),
        c, F32_TOL)


@pytest.mark.parametrize("extras_id", sorted(EXTRAS))
@pytest.mark.parametrize("case", [(70, 8, 2, 256, 192, 0), (300, 16, 4, 128, 64, 32), (40, 4, 2, 96, 80, 0)])
@pytest.mark.parametrize("tc", [False, True])
def test_grouped_gemm_extras_match_the_numpy_twin(cp, rng, extras_id, case, tc):
    T, E, k, H, I, group = case
    if tc and group:
        pytest.skip("the tensor-core GEMM takes per-row scales only")
    c = _case(cp, rng, T, E, k, H, I, group, extras_id)
    (_, table), *_, dev = c
    _check_stages(
        cp,
        lambda x, d: ops.moe_gemm_gate_up(x, table, d, k, tensor_cores=tc, extras=dev,
                                          out=cp.full((T * k, I), np.nan, cp.float32)),
        lambda a, d: ops.moe_gemm_down(a, table, d, cp.asarray(c[4]), tensor_cores=tc, extras=dev,
                                       out=cp.full((T * k, H), np.nan, cp.float32)),
        c, TC_TOL if tc else F32_TOL)


@pytest.mark.parametrize("gemm", [False, True])
def test_moe_experts_with_extras_end_to_end(cp, rng, gemm):
    T, E, k, H, I = 6, 16, 4, 256, 128
    (buf, table), experts, x, ids, w, host, dev = _case(cp, rng, T, E, k, H, I, 0, "gpt-oss")
    resid = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, residual=cp.asarray(resid),
                        alpha=0.5, gemm=gemm, extras=dev)
    exp = nb.moe(nb.widen(x), ids, nb.widen(w), experts, residual=nb.widen(resid), alpha=0.5, **host)
    assert rel(y.get(), exp) < (TC_TOL if gemm else F32_TOL)


@pytest.mark.parametrize("group", [0, 32])
def test_one_token_passes_with_extras_run_by_pair_alike_to_the_bit(cp, rng, group):
    """A one-token pass of gpt-oss's experts runs by pair (ops.pairs_path), the same bits as the dispatch path."""
    E, k, H, I = 16, 4, 256, 128
    (buf, table), experts, x, ids, w, host, dev = _case(cp, rng, 1, E, k, H, I, group, "gpt-oss")
    resid = rng.standard_normal((1, H)).astype(np.float32)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    y = ops.moe_experts(*args, residual=cp.asarray(resid), alpha=0.5, extras=dev).get()
    np.testing.assert_array_equal(y, ops.moe_experts(*args, residual=cp.asarray(resid), alpha=0.5, extras=dev,
                                                     pairs=False).get())
    exp = nb.moe(nb.widen(x), ids, nb.widen(w), experts, residual=nb.widen(resid), alpha=0.5, **host)
    assert rel(y, exp) < F32_TOL


def test_extras_wrappers_check_the_bias_shapes(cp, rng):
    (buf, table), _, x, ids, w, host, _ = _case(cp, rng, 2, 8, 2, 64, 32, 0, "gpt-oss")
    d = ops.dispatch(cp.asarray(ids), 8)
    wrong = ops.ExpertExtras(gate_up_bias=cp.zeros((8, 32), cp.float32))       # [E, I], not [E, 2I]
    with pytest.raises(ValueError):
        ops.moe_gate_up(cp.asarray(x), table, d, 2, extras=wrong)
    with pytest.raises(TypeError):
        ops.moe_down(cp.zeros((4, 32), cp.float32), table, d, cp.asarray(w),
                     extras=ops.ExpertExtras(down_bias=cp.zeros((8, 64), cp.float64)))


def test_no_extras_is_none():
    assert ops.ExpertExtras.from_model(None) is None


# ---- the engine on tiny transformers-built gpt-oss models ---------------------------------------------------------
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
MODELS = {  # id -> (hf_tiny key, overrides, group size (None: per-row scales))
    "gpt_oss": ("gpt_oss", dict(WIDE, intermediate_size=64), None),            # sliding layer 0, limit 7
    "gpt_oss-clamped": ("gpt_oss-clamped", dict(WIDE), None),                  # limit 0.5, 3 layers, vocab 97
    "gpt_oss-g32": ("gpt_oss", dict(WIDE, intermediate_size=64), 32),          # int8 group-32 scales
}
DECODE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2], [40, 41, 42]]
LONG_PROMPT = [(7 * i + 3) % 90 + 3 for i in range(40)]     # 40 rows: T > 32 takes the grouped GEMM


def _file(tmp_path, key: str, overrides: dict, group: int | None):
    hf = build_hf(key, **overrides)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "model.colibri"
    convert(tmp_path / "hf", path, dtype="bfloat16", quantize="expert", group_size=group, workers=1, verify=False)
    return path


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_gives_the_numpy_engines_tokens(tmp_path, name, graphs):
    key, overrides, group = MODELS[name]
    path = _file(tmp_path, key, overrides, group)
    assert ops.gemm_path(len(LONG_PROMPT), 2, 5) and not ops.gemm_path(1, 2, 4)
    cfg = EngineConfig(device="cuda", max_seq_len=64, use_graphs=graphs)
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64")) as ref, Engine(path) as cpu:
        for prompts in (DECODE_PROMPTS, [LONG_PROMPT]):
            for got, exp in zip(gpu.logits(prompts), ref.logits(prompts)):
                assert rel(got, exp) < MODEL_TOL
        for prompt in (*DECODE_PROMPTS, LONG_PROMPT):
            tokens = gpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
            assert tokens == cpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
        assert gpu.generate_batch(DECODE_PROMPTS, 6) == cpu.generate_batch(DECODE_PROMPTS, 6)
