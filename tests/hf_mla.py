"""Tiny seeded DeepSeek-V3-family models (multi-head latent attention, the sigmoid router with grouped top-k, leading
dense layers, shared experts; V3.2 / GLM-5 with their DSA indexer; GLM-4.7-Flash) for the converter and engine tests;
transformers' modeling_deepseek_v3 / _deepseek_v32 / _glm_moe_dsa / _glm4_moe_lite are the oracle."""

from __future__ import annotations

import torch
import transformers as tf

from tests.hf_hybrid import convert_file, save  # noqa: F401 -- one way to save and convert a tiny model

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8,
              num_experts_per_tok=3, moe_intermediate_size=16, intermediate_size=40, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
INDEX = dict(index_topk=64, index_head_dim=16, index_n_heads=2)     # the indexer keeps every token up to 64

CONFIGS = {
    # DeepSeek-V3 as published, shrunk: q LoRA, interleaved rope pairs, 4 groups of 2 experts (keep 2), one leading
    # dense layer, one shared expert, YaRN with mscale = mscale_all_dim (cos/sin unscaled, softmax times mscale^2)
    "deepseek_v3": (tf.DeepseekV3Config, dict(
        q_lora_rank=16, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 16})),
    # no q LoRA (a plain q_proj), rope halves (rope_interleave false), two dense layers, 2 groups (keep 1), two
    # shared experts' width, weights not renormalised, YaRN with mscale != mscale_all_dim, an odd vocabulary
    "deepseek_v3-plain": (tf.DeepseekV3Config, dict(
        num_hidden_layers=4, vocab_size=97, q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1,
        first_k_dense_replace=2, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 8})),
    # DeepSeek-V3.2: the indexer (skipped by the converter), always interleaved rope, grouped top-k
    "deepseek_v32": (tf.DeepseekV32Config, dict(q_lora_rank=16, n_group=2, topk_group=1, first_k_dense_replace=1,
                                                **INDEX)),
    # GLM-5: the indexer, dense / sparse layers from mlp_layer_types, one group, rms_norm_eps 1e-5
    "glm_moe_dsa": (tf.GlmMoeDsaConfig, dict(q_lora_rank=16, mlp_layer_types=["dense", "sparse", "sparse"],
                                             rope_parameters={"rope_type": "default", "rope_theta": 2000.0},
                                             **INDEX)),
    # GLM-4.7-Flash: no indexer, no q LoRA, rope halves, mlp_layer_types left to its default (one dense layer),
    # 2 groups keeping 1
    "glm4_moe_lite": (tf.Glm4MoeLiteConfig, dict(q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1)),
}


def config(name: str, **overrides):
    cls, changes = CONFIGS[name]
    return cls(**{**COMMON, **changes, **overrides})


def build(name: str, seed: int = 0, **overrides):
    """A seeded fp32 eager model whose every parameter is random: norms near 1, routers decisive (sigmoid scores off
    saturation, the correction bias steering the choice). `overrides`: config fields changed (e.g. widths)."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config(name, **overrides), attn_implementation="eager",
                                                experts_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in pname else 0.2 * noise)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen))
    return model
