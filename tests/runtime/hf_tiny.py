"""Tiny seeded transformers MoE models and their canonical (colibri) form, for the fidelity tests.

`to_canonical` is a deliberately small test-side mapping from a transformers v5 state dict to the canonical
tensor names of docs/design.md; the real converter's adapters are colibri_format/convert/adapters.py.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers as tf

from tests.runtime.tiny_weights import TinyWeights

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


_GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 16}


def _configs():
    return {
        "mixtral": lambda: tf.MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=4, sliding_window=5,
                                            rope_parameters={"rope_type": "llama3", "rope_theta": 500.0,
                                                             "factor": 4.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16}),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**{**SMALL, "num_hidden_layers": 3}, intermediate_size=24,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=20,
                                               num_experts=5, mlp_only_layers=[1], norm_topk_prob=False),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SMALL, head_dim=12, moe_intermediate_size=16, num_experts=4,
                                               norm_topk_prob=True,
                                               rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0,
                                                                "factor": 4.0, "original_max_position_embeddings": 16}),
        "olmoe": lambda: tf.OlmoeConfig(**SMALL, intermediate_size=16, num_experts=4, clip_qkv=1.5,
                                        attention_bias=True, rope_parameters={"rope_type": "linear",
                                                                              "rope_theta": 10000.0, "factor": 2.0}),
        "granitemoe": lambda: tf.GraniteMoeConfig(**SMALL, intermediate_size=16, num_local_experts=4,
                                                  tie_word_embeddings=True, embedding_multiplier=3.0,
                                                  residual_multiplier=0.5, attention_multiplier=0.3,
                                                  logits_scaling=2.5),
        "granitemoeshared": lambda: tf.GraniteMoeSharedConfig(**SMALL, intermediate_size=16,
                                                              shared_intermediate_size=24, num_local_experts=4,
                                                              embedding_multiplier=2.0, residual_multiplier=0.7,
                                                              attention_multiplier=0.2, logits_scaling=1.5),
        # GLM-4.5: a leading dense layer, q/k/v bias, per-head q/k norm, partial RoPE 0.5, sigmoid routing with a
        # selection-only bias, renormalised and scaled, one ungated shared expert
        "glm4_moe": lambda: tf.Glm4MoeConfig(**{**SMALL, "num_hidden_layers": 3}, head_dim=16, intermediate_size=40,
                                             moe_intermediate_size=16, n_routed_experts=4, first_k_dense_replace=1,
                                             attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5),
        # grouped top-k (4 groups of 2, keep 2), no dense layer, no q/k norm, odd vocabulary, two shared experts'
        # width, top-k weights not renormalised, YaRN over the partial rotary dims
        "glm4_moe-groups": lambda: tf.Glm4MoeConfig(**{**SMALL, "vocab_size": 97, "num_experts_per_tok": 3},
                                                    head_dim=12, intermediate_size=40, moe_intermediate_size=16,
                                                    n_routed_experts=8, n_group=4, topk_group=2,
                                                    first_k_dense_replace=0, n_shared_experts=2,
                                                    norm_topk_prob=False, routed_scaling_factor=1.5,
                                                    rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0,
                                                                     "factor": 4.0, "partial_rotary_factor": 0.5,
                                                                     "original_max_position_embeddings": 16}),
        # MiniMax-M2: q/k RMSNorm over the whole projection, partial RoPE through rotary_dim, sigmoid + bias
        "minimax_m2": lambda: tf.MiniMaxM2Config(**SMALL, head_dim=16, intermediate_size=16, num_local_experts=6,
                                                 rotary_dim=8, rope_theta=5000.0),
        # gpt-oss: attention sinks, q/k/v/o biases, a window on the sliding layers of layer_types (layer 0 here),
        # YaRN without truncation, a biased router (top-k of logits + bias, softmax over k), experts with biases
        # and the clamped SwiGLU, stored in-features first with gate and up interleaved
        "gpt_oss": lambda: tf.GptOssConfig(**SMALL, head_dim=16, intermediate_size=48, num_local_experts=4,
                                           sliding_window=5, rope_parameters=_GPT_OSS_YARN),
        # three layers, two of them sliding; a low clamp limit (the activations reach it), odd vocabulary
        "gpt_oss-clamped": lambda: tf.GptOssConfig(**{**SMALL, "num_hidden_layers": 3, "vocab_size": 97},
                                                   head_dim=16, intermediate_size=16, num_local_experts=5,
                                                   sliding_window=3, swiglu_limit=0.5,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"],
                                                   rope_parameters=_GPT_OSS_YARN),
    }


ARCHS = list(_configs())


def _router_std(config) -> float:
    """Sigmoid scores kept off saturation (GLM, MiniMax); gpt-oss's biased logits spread wider (its bf16 file
    would otherwise flip a near-tie choice)."""
    return {"glm4_moe": 0.2, "minimax_m2": 0.2, "gpt_oss": 1.2}.get(config.model_type, 0.6)


def build_hf(arch: str, seed: int = 0, **overrides):
    """A seeded fp32 eager model whose every parameter is random (norms near 1, biases non-zero); `overrides`
    change fields of the architecture's config."""
    config = _configs()[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                experts_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif ".gate.weight" in name or "router" in name:
                # decisive routing: no near-ties between fp32 implementations (sigmoid scores kept off saturation)
                p.copy_(_router_std(config) * noise)
            else:
                p.copy_(0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):     # a buffer, zero at init: make it steer the choice
                b.copy_(torch.randn(b.shape, generator=gen))
    return model


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()   # [n, V]


# --- HF config -> metadata `model` -------------------------------------------------------------------------

def greedy_walk_within(hf, engine, prompt: list[int], steps: int, tol: float) -> None:
    """A prompt and `steps` greedy steps: transformers' `generate` (its logits and tokens) against the engine's
    prefill then one-token decode steps; every step's logits within `tol` (relative) and the same tokens."""
    n = len(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ref_tokens = out.sequences[0, n:].tolist()
    ref_logits = [t[0].double().numpy() for t in out.logits]
    runner = engine.decode_runner(1, n + steps)
    logits = engine.be.to_host(engine.prefill_into(runner, [np.array(prompt)]))[0]
    tokens = []
    for step in range(steps):
        assert rel_err(logits, ref_logits[step]) < tol, step
        tokens.append(int(logits.argmax()))
        if step < steps - 1:
            logits = engine.be.to_host(runner.step(np.array([tokens[-1]]), np.array([n + step])))[0]
    assert tokens == ref_tokens


def _rope(cfg) -> dict:
    params = dict(cfg.rope_parameters)
    out = {"type": params.pop("rope_type", "default"), "theta": params.pop("rope_theta")}
    if params.get("partial_rotary_factor") == 1.0:      # written only when RoPE rotates part of a head
        params.pop("partial_rotary_factor")
    return {**out, **params}


def _moe_layers(arch: str, cfg) -> list[int]:
    if arch == "glm4_moe":
        return list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return list(range(cfg.num_hidden_layers))
    return [i for i in range(cfg.num_hidden_layers)
            if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0]


def _router(arch: str, cfg) -> dict:
    if arch == "glm4_moe":
        return {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": cfg.norm_topk_prob, "bias": True,
                "scale": cfg.routed_scaling_factor, "n_group": cfg.n_group, "topk_group": cfg.topk_group}
    if arch == "minimax_m2":
        return {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True, "scale": 1.0}
    if arch == "gpt_oss":
        return {"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False, "bias": True, "scale": 1.0}
    if arch.startswith("granite"):
        return {"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False, "bias": False, "scale": 1.0}
    normalize = True if arch == "mixtral" else bool(cfg.norm_topk_prob)
    return {"scoring": "softmax", "order": "softmax_topk", "normalize_topk": normalize, "bias": False, "scale": 1.0}


def _shared(arch: str, cfg):
    if arch == "qwen2_moe":
        return {"intermediate_size": cfg.shared_expert_intermediate_size, "gate": "sigmoid"}
    if arch == "granitemoeshared":
        return {"intermediate_size": cfg.shared_intermediate_size, "gate": "none"}
    if arch == "glm4_moe":
        return {"intermediate_size": cfg.moe_intermediate_size * cfg.n_shared_experts, "gate": "none"}
    return None


def _multipliers(arch: str, cfg) -> dict:
    if not arch.startswith("granite"):
        return {"embedding": 1.0, "residual": 1.0, "attention": None, "logits": 1.0}
    return {"embedding": cfg.embedding_multiplier, "residual": cfg.residual_multiplier,
            "attention": cfg.attention_multiplier, "logits": cfg.logits_scaling}


def model_dict(arch: str, cfg) -> dict:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_bias = bool(getattr(cfg, "attention_bias", False))
    moe_layers = _moe_layers(arch, cfg)
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "rope": _rope(cfg),
        "qkv_bias": bool(getattr(cfg, "qkv_bias", False)) if arch == "qwen2_moe" else attn_bias,
        "o_bias": attn_bias and arch not in ("qwen2_moe", "glm4_moe"),
        "qk_norm": {"qwen3_moe": "per_head", "olmoe": "full", "minimax_m2": "full",
                    "glm4_moe": "per_head" if getattr(cfg, "use_qk_norm", False) else "none"}.get(arch, "none"),
        "clip_qkv": getattr(cfg, "clip_qkv", None),
        "sliding_window": getattr(cfg, "sliding_window", None) if arch == "mixtral" else None,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings), "hidden_act": cfg.hidden_act,
        "moe_layers": moe_layers,
        "dense_intermediate_size": cfg.intermediate_size if len(moe_layers) < cfg.num_hidden_layers else None,
        "num_experts": getattr(cfg, "num_local_experts", None) or cfg.num_experts,
        "top_k": cfg.num_experts_per_tok,
        "expert_intermediate_size": getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
        "router": _router(arch, cfg), "shared_expert": _shared(arch, cfg), "multipliers": _multipliers(arch, cfg),
        **(_gpt_oss_keys(cfg) if arch == "gpt_oss" else {}),
    }


def _gpt_oss_keys(cfg) -> dict:
    sliding = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
    out = {"sliding_window": cfg.sliding_window if sliding else None, "attention_sinks": True}
    if sliding and len(sliding) < cfg.num_hidden_layers:
        out["sliding_layers"] = sliding
    return {**out, "expert_bias": True,
            "expert_act": {"alpha": cfg.swiglu_alpha, "limit": cfg.swiglu_limit, "up_offset": 1.0}}


# --- HF state dict -> canonical tensors ----------------------------------------------------------------------

_ATTN = {"q_proj.weight": "q_proj", "k_proj.weight": "k_proj", "v_proj.weight": "v_proj", "o_proj.weight": "o_proj",
         "q_proj.bias": "q_bias", "k_proj.bias": "k_bias", "v_proj.bias": "v_bias", "o_proj.bias": "o_bias",
         "q_norm.weight": "q_norm", "k_norm.weight": "k_norm"}


def _gpt_oss_expert_tensor(p: str, rest: str, t: np.ndarray, i: int, dense: dict, experts: dict) -> None:
    # in-features first, gate and up interleaved -> nn.Linear rows, gate rows first
    gate_first = lambda n: np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])  # noqa: E731
    if rest == "mlp.experts.gate_up_proj_bias":
        dense[f"{p}.moe.expert_gate_up_bias"] = t[:, gate_first(t.shape[1])]
    elif rest == "mlp.experts.down_proj_bias":
        dense[f"{p}.moe.expert_down_bias"] = t
    else:
        part = 0 if rest.endswith("gate_up_proj") else 1
        for e in range(t.shape[0]):
            m = t[e].T
            experts.setdefault((i, e), [None, None])[part] = m[gate_first(m.shape[0])] if part == 0 else m


def _layer_tensor(i: int, rest: str, t: np.ndarray, dense: dict, experts: dict, arch: str = "") -> None:
    p = f"layers.{i}"
    rest = rest.replace("block_sparse_moe.", "mlp.")
    if arch == "gpt_oss" and rest.startswith("mlp.experts."):
        _gpt_oss_expert_tensor(p, rest, t, i, dense, experts)
    elif rest == "self_attn.sinks":
        dense[f"{p}.attn.sinks"] = t
    elif rest == "mlp.router.bias":
        dense[f"{p}.moe.router_bias"] = t
    elif rest.startswith("self_attn."):
        dense[f"{p}.attn.{_ATTN[rest[len('self_attn.'):]]}"] = t
    elif rest == "input_layernorm.weight":
        dense[f"{p}.input_norm"] = t
    elif rest == "post_attention_layernorm.weight":
        dense[f"{p}.post_attn_norm"] = t
    elif rest in ("mlp.gate.weight", "mlp.router.weight"):
        dense[f"{p}.moe.router"] = t
    elif rest in ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"):
        dense[f"{p}.moe.router_bias"] = t
    elif rest.startswith("mlp.shared_experts."):
        dense[f"{p}.moe.shared.{rest.split('.')[2]}"] = t
    elif rest.startswith("mlp.experts."):
        part = 0 if rest.endswith("gate_up_proj") else 1
        for e in range(t.shape[0]):
            experts.setdefault((i, e), [None, None])[part] = t[e]
    elif rest.startswith("mlp.shared_expert."):
        dense[f"{p}.moe.shared.{rest.split('.')[2]}"] = t
    elif rest == "mlp.shared_expert_gate.weight":
        dense[f"{p}.moe.shared_gate"] = t
    elif rest == "shared_mlp.input_linear.weight":
        half = t.shape[0] // 2
        dense[f"{p}.moe.shared.gate_proj"], dense[f"{p}.moe.shared.up_proj"] = t[:half], t[half:]
    elif rest == "shared_mlp.output_linear.weight":
        dense[f"{p}.moe.shared.down_proj"] = t
    elif rest.startswith("mlp.") and rest.endswith("_proj.weight"):
        dense[f"{p}.mlp.{rest.split('.')[1]}"] = t
    else:
        raise KeyError(rest)


def to_canonical(arch: str, model) -> TinyWeights:
    dense, experts = {}, {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float().numpy().copy()
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            _layer_tensor(int(i), rest, t, dense, experts, arch)
        elif name == "model.embed_tokens.weight":
            dense["embed_tokens"] = t
        elif name == "model.norm.weight":
            dense["final_norm"] = t
        elif name == "lm_head.weight" and not model.config.tie_word_embeddings:
            dense["lm_head"] = t
    experts = {k: (v[0], v[1]) for k, v in experts.items()}
    return TinyWeights(model_dict(arch, model.config), dense, experts, {"architecture": arch})


# --- the converter's path: save_pretrained -> convert.pipeline.convert (what `colibri convert` runs) ------------

def converted_file(model, out_dir, fused: bool = False, **options):
    """`model` saved as a checkpoint (legacy per-expert form, or the v5 fused form) in `out_dir`/hf and converted
    by the real pipeline to `out_dir`/model.colibri (float32, no quantization unless `options` say otherwise)."""
    from colibri_format.convert.pipeline import convert

    src, dest = out_dir / "hf", out_dir / "model.colibri"
    model.save_pretrained(src, save_original_format=not fused)
    convert(src, dest, workers=1, **{"dtype": "float32", "quantize": "none", **options})
    return dest
