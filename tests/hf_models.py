"""Tiny seeded Hugging Face MoE checkpoints for tests (shared by every test suite).

`make_tiny_checkpoint("qwen3_moe", tmp_path)` builds a random transformers
model for one supported architecture and `save_pretrained`s it. Options pick
the on-disk form: legacy per-expert names (default) or the transformers-v5
fused layout (`fused=True`, i.e. `save_original_format=False`), one file or
several shards, tied or untied embeddings, and the storage dtype.
`tiny_model(arch)` returns the in-memory model for comparing against.

Sizes are tiny (hidden 32, 2-3 layers, 4 experts, vocab 128) so a whole suite
runs in seconds on a 2-core CI box. transformers is imported lazily: only the
tests need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "glm4_moe", "minimax_m2",
         "gpt_oss")

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256)

# arch -> (config class, model class, config kwargs beyond _COMMON)
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, num_experts=4, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                       norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=16, num_experts=4, clip_qkv=8.0, eos_token_id=2, pad_token_id=1)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(intermediate_size=16, num_local_experts=4, embedding_multiplier=12.0,
                        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         dict(intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
                              embedding_multiplier=12.0, residual_multiplier=0.22,
                              attention_multiplier=0.0625, logits_scaling=6.0)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(num_hidden_layers=3, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                      n_routed_experts=4, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                      routed_scaling_factor=2.5)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(head_dim=16, intermediate_size=16, num_local_experts=4, rotary_dim=8, bos_token_id=1,
                        eos_token_id=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, intermediate_size=48, num_local_experts=4, sliding_window=8)),
}


def tiny_config_kwargs(arch: str, *, tie: bool = False, **overrides: Any) -> dict[str, Any]:
    """The transformers config kwargs used for `arch` (handy for hand-made variants)."""
    if arch not in _SPECS:
        raise KeyError(f"no tiny spec for {arch!r}; have {', '.join(ARCHS)}")
    return {**_COMMON, **_SPECS[arch][2], "tie_word_embeddings": tie, **overrides}


def tiny_model(arch: str, *, tie: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """A seeded random `<Arch>ForCausalLM` in float32, eval mode."""
    import torch
    import transformers

    config_cls, model_cls, _ = _SPECS[arch]
    config = getattr(transformers, config_cls)(**tiny_config_kwargs(arch, tie=tie, **overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    _randomize_vectors(model, seed)
    return model.eval()


def _randomize_vectors(model: Any, seed: int) -> None:
    # Norm weights start at exactly 1.0 and biases at 0.0; random values catch a vector read
    # from the wrong tensor.
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif param.ndim == 1 and name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a zero buffer at init
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def make_tiny_checkpoint(arch: str, out_dir: str | Path, *, fused: bool = False, sharded: bool = False,
                         tie: bool = False, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny `arch` checkpoint into `out_dir` and return that path.

    fused: transformers-v5 fused expert tensors instead of legacy per-expert names.
    sharded: several `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`.
    tie: tied input/output embeddings (no `lm_head.weight` on disk).
    dtype: "float32", "bfloat16" or "float16" storage.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(arch, tie=tie, seed=seed, **overrides)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, save_original_format=not fused, max_shard_size="20KB" if sharded else "1GB")
    return out


def reference_state(arch: str, *, tie: bool = False, seed: int = 0, dtype: str = "float32",
                    **overrides: Any) -> dict[str, Any]:
    """The model's own state_dict as float32 NumPy arrays (after rounding to `dtype`)."""
    import torch

    model = tiny_model(arch, tie=tie, seed=seed, **overrides)
    return {k: v.detach().to(getattr(torch, dtype)).float().numpy() for k, v in model.state_dict().items()}
