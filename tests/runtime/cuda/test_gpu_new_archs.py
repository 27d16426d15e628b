"""GLM-4.5, MiniMax-M2 and gpt-oss on the CUDA engine (GPU only).

Tiny transformers models (head_dim 64 so the CUDA attention kernel runs; partial RoPE, q/k norms, q/k/v biases,
sigmoid routing with a selection-only bias, grouped top-k, scaled weights, a leading dense layer, a shared expert,
a sliding window on some layers) are converted with int8 experts; the CUDA engine must give the NumPy engine's
greedy tokens and logits close to the float64 reference, eager and in graphs, from bf16 and from FP8 sources.
Attention sinks, per-layer windows and a router bias on the logits (gpt-oss) run on NumPy-built models with plain
experts; gpt-oss's expert biases and clamped SwiGLU are tested in test_gpu_gpt_oss.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.convert.pipeline import convert
from colibri_format.runtime import Engine, EngineConfig
from tests.convert.quantized_checkpoints import to_fp8
from tests.runtime.hf_tiny import build_hf

WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2], [40, 41, 42]]
TOL = 2e-3          # relative logit error of the CUDA engine against the float64 NumPy engine
RUN = {  # test id -> (config key, overrides[, dense dtype: bfloat16 by default])
    "glm4_moe": ("glm4_moe", dict(WIDE), "float32"),                      # partial RoPE 0.5, per-head q/k norm
    "glm4_moe-bf16": ("glm4_moe", dict(WIDE)),                            # its leading dense MLP layer in bf16
    "minimax_m2": ("minimax_m2", dict(WIDE, rotary_dim=16)),              # full q/k norm, rotary 16 of 64
    "glm4_moe-one-group": ("glm4_moe-groups", dict(WIDE, n_group=1, topk_group=1, num_experts_per_tok=2)),
    "glm4_moe-groups": ("glm4_moe-groups", dict(WIDE)),                   # 4 groups of 2, keep 2, top-3
}
def _file(tmp_path, key: str, overrides: dict, dtype: str = "bfloat16", fp8: bool = False):
    hf = build_hf(key, **overrides)
    hf.save_pretrained(tmp_path / "hf")
    src = to_fp8(tmp_path / "hf", tmp_path, (128, 128))[0] if fp8 else tmp_path / "hf"
    path = tmp_path / "model.colibri"
    convert(src, path, dtype=dtype, quantize="expert", workers=1, verify=False)
    return path


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _same_as_numpy(path, graphs: bool = True) -> None:
    cfg = EngineConfig(device="cuda", max_seq_len=64, use_graphs=graphs)
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64")) as ref, Engine(path) as cpu:
        for got, exp in zip(gpu.logits(PROMPTS), ref.logits(PROMPTS)):
            assert _rel(got, exp) < TOL
        for prompt in PROMPTS:
            tokens = gpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
            assert tokens == cpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
        assert gpu.generate_batch(PROMPTS, 6) == cpu.generate_batch(PROMPTS, 6)


@pytest.mark.parametrize("name", sorted(RUN))
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_gives_the_numpy_engines_tokens(tmp_path, name, graphs):
    key, overrides, *dtype = RUN[name]
    _same_as_numpy(_file(tmp_path, key, overrides, *dtype), graphs)


@pytest.mark.parametrize("name", ["glm4_moe", "minimax_m2"])
def test_fp8_sources_run_on_cuda(tmp_path, name):
    key, overrides = RUN[name][:2]
    _same_as_numpy(_file(tmp_path, key, overrides, dtype="float32", fp8=True))


@pytest.mark.parametrize("graphs", [True, False])
def test_windowed_layers_run_on_cuda(tmp_path, graphs):
    # gpt-oss's per-layer windows (sliding_layers): a window of 3 on layer 0 only, prompts longer than it
    from tests.runtime.numpy_tiny import random_weights
    from tests.runtime.tiny_weights import write_colibri

    weights = random_weights(seed=3, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                             sliding_window=3, sliding_layers=[0])
    _same_as_numpy(write_colibri(weights, tmp_path / "windowed.colibri", experts="int8_row"), graphs)


@pytest.mark.parametrize("graphs", [True, False])
def test_sinks_and_a_logit_router_bias_run_on_cuda(tmp_path, graphs):
    # gpt-oss's attention side and router (sinks, q/k/v/o biases, top-k of logits + bias,
    # softmax over the k) on a model whose experts the kernels run (plain SwiGLU, no expert biases)
    from tests.runtime.numpy_tiny import random_weights
    from tests.runtime.tiny_weights import write_colibri

    router = {"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False, "bias": True, "scale": 1.0}
    weights = random_weights(seed=5, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             attention_sinks=True, qkv_bias=True, o_bias=True, router=router)
    rng = np.random.default_rng(5)
    m = weights.model
    for i in range(m["num_layers"]):
        p = f"layers.{i}"
        weights.dense[f"{p}.attn.sinks"] = rng.uniform(-1.0, 3.0, m["num_attention_heads"]).astype(np.float32)
        weights.dense[f"{p}.moe.router_bias"] = rng.standard_normal(m["num_experts"]).astype(np.float32)
        for name, n in (("q_bias", 4 * 64), ("k_bias", 2 * 64), ("v_bias", 2 * 64), ("o_bias", 128)):
            weights.dense[f"{p}.attn.{name}"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    path = write_colibri(weights, tmp_path / "sinks.colibri", experts="int8_row")
    _same_as_numpy(path, graphs)
