"""Tiny seeded Qwen3-Next models (Gated DeltaNet + gated attention layers, the qwen2_moe MoE block) for the
converter and engine tests; transformers' modeling_qwen3_next is the oracle (its torch fallback of the gated
delta rule: chunked for a prompt, recurrent for each decode step)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20,
              intermediate_size=24, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    # the published pattern: three Gated DeltaNet layers, then gated full attention (full_attention_interval 4);
    # each key head serves two value heads; partial RoPE 0.25
    "qwen3_next": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=12),
    # a mixed pattern starting with full attention, a dense MLP layer, as many value heads as key heads, conv
    # kernel 3, top-k weights not renormalised, partial RoPE 0.5, an odd vocabulary
    "qwen3_next-mixed": dict(num_hidden_layers=5, vocab_size=97, linear_num_key_heads=2, linear_num_value_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                             layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                          "linear_attention"],
                             mlp_only_layers=[2], norm_topk_prob=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                              "partial_rotary_factor": 0.5}),
    # Qwen3.5: the split projections, the text model alone, with interleaved MRoPE (1-D for text)
    "qwen3_5_moe_text": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=12,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                              "mrope_interleaved": True}),
    # the vision-language checkpoint: text weights under model.language_model.*, a vision tower to skip
    "qwen3_5_moe": dict(num_hidden_layers=4, linear_num_key_heads=1, linear_num_value_heads=2,
                        linear_key_head_dim=8, linear_value_head_dim=8,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
}
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


def _model(name: str, overrides: dict):
    text = {**COMMON, **CONFIGS[name], **overrides}
    if name == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeForCausalLM._from_config(tf.Qwen3_5MoeTextConfig(**text), attn_implementation="eager")
    if name == "qwen3_5_moe":
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=VISION)
        return tf.Qwen3_5MoeForConditionalGeneration._from_config(config, attn_implementation="eager")
    return tf.AutoModelForCausalLM.from_config(tf.Qwen3NextConfig(**text), attn_implementation="eager")


def build(name: str, seed: int = 0, **overrides):
    """A seeded fp32 eager Qwen3-Next / Qwen3.5 whose every parameter is random: zero-centred norms near 0
    (x * (1 + w)), the gated norm near 1, dt_bias near 1, A_log as initialised, routers decisive. `overrides`: text
    config keys over CONFIGS[name] (the CUDA tests' wider heads)."""
    torch.manual_seed(seed)
    model = _model(name, overrides).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if pname.endswith("A_log"):
                continue
            if pname.endswith(("linear_attn.norm.weight", "dt_bias")):
                p.copy_(1.0 + 0.2 * noise)
            elif pname.endswith(".gate.weight"):
                p.copy_(0.6 * noise)
            else:
                p.copy_(0.2 * noise)
    return model


def save(model, out_dir: Path, fused: bool = False) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, save_original_format=not fused)
    return out_dir


def convert_file(model, out_dir: Path, fused: bool = False, **options) -> Path:
    """`model` saved in `out_dir`/hf and converted by the real pipeline to `out_dir`/model.colibri (float32, no
    quantization unless `options` say otherwise)."""
    from colibri_format.convert.pipeline import convert

    src, dest = save(model, out_dir / "hf", fused), out_dir / "model.colibri"
    convert(src, dest, workers=1, **{"dtype": "float32", "quantize": "none", **options})
    return dest
