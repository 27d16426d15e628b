"""The supported architectures: one declarative record each, in one registry.

A record says where the architecture keeps its tensors (`names`, read by convert/layout.py only) and how
its config.json maps onto the design-doc `model` dict: `hf_config.common_model` with the architecture's
`defaults`, then `fields` sets what the architecture changes, then `hf_config.finish_model` checks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from colibri_format.convert.hf_config import (MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, ConfigDefaults, Fields,
                                              common_model, finish_model, model_type_of, moe_layer_indices,
                                              sliding_window)
from colibri_format.convert.derived import (Derive, gpt_oss_experts, mla_tensors, prepare_source, qwen3_next_tensors,
                                           text_config)
from colibri_format.convert.layout import FusedLinear, HFNames, PerExpert, Skip
from colibri_format.convert.safe_paths import short_repr
from colibri_format.errors import InvalidInput, UnsupportedModel

Model = dict[str, Any]


@dataclass(frozen=True)
class Adapter:
    """One architecture: its Hugging Face tensor names and its config.json fields."""

    model_type: str
    names: HFNames
    defaults: ConfigDefaults
    fields: Callable[[Fields, Model], None]  # sets the model fields this architecture changes
    derive: Derive | None = None  # tensors computed from the checkpoint's (convert/derived.py)
    text_only: bool = False  # a vision-language config: its `text_config` describes the model (Qwen3.5)

    def source(self, src: Any) -> Any:
        """The checkpoint as the names table reads it: quantized weights dequantized, re-layouts applied."""
        return prepare_source(src, self.derive)

    def normalize_config(self, raw: Mapping[str, Any]) -> Model:
        """The design-doc `model` dict for a config.json of this architecture."""
        f = Fields(text_config(raw) if self.text_only else raw)
        model = common_model(f, self.defaults)
        self.fields(f, model)
        return finish_model(model)


# --- per-architecture config fields ---------------------------------------------------------------

def _mixtral(f: Fields, model: Model) -> None:
    model["sliding_window"] = sliding_window(f)


def _qwen2_moe(f: Fields, model: Model) -> None:
    # Qwen2-MoE windows only some layers (odd ones below max_window_layers); the file has one window.
    layer_types = f.raw.get("layer_types")
    if f.flag("use_sliding_window", False) or (
            isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types)):
        raise UnsupportedModel("qwen2_moe with per-layer sliding windows is not supported",
                               field="use_sliding_window", value=True)
    model["qkv_bias"] = f.flag("qkv_bias", True)  # v5 field; v4 always had q/k/v bias
    model["moe_layers"] = moe_layer_indices(f, model["num_layers"])
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    # top-k weights are not renormalised unless asked (false in published models)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", False)
    model["shared_expert"] = {"intermediate_size": f.integer("shared_expert_intermediate_size"), "gate": "sigmoid"}


def _qwen3_moe(f: Fields, model: Model) -> None:
    bias = f.flag("attention_bias", False)  # one flag for q, k, v and o
    model.update(qkv_bias=bias, o_bias=bias, qk_norm="per_head", sliding_window=sliding_window(f))
    model["moe_layers"] = moe_layer_indices(f, model["num_layers"])
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", False)


def _olmoe(f: Fields, model: Model) -> None:
    bias = f.flag("attention_bias", False)
    clip = f.number("clip_qkv", None, lo=0.0, lo_open=True)
    # q/k RMSNorm over the full width (before the head split); never a sliding window, whatever the config says
    model.update(qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=clip)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", False)


def _granitemoe(f: Fields, model: Model) -> None:
    bias = f.flag("attention_bias", False)
    model.update(qkv_bias=bias, o_bias=bias)
    # softmax over the k selected logits already sums to one: no extra renormalisation
    model["router"].update(order="topk_softmax", normalize_topk=False)
    # attention_multiplier replaces 1/sqrt(head_dim) outright (default 1.0, not null); logits are divided
    # by logits_scaling
    model["multipliers"] = {
        key: f.number(hf_key, 1.0, lo=0.0, lo_open=True)
        for key, hf_key in (("embedding", "embedding_multiplier"), ("residual", "residual_multiplier"),
                            ("attention", "attention_multiplier"), ("logits", "logits_scaling"))
    }


def _granitemoeshared(f: Fields, model: Model) -> None:
    _granitemoe(f, model)
    # y = moe(x) + shared_mlp(x), no shared gate; size 0 means there is none
    size = f.integer("shared_intermediate_size", 0, lo=0)
    model["shared_expert"] = {"intermediate_size": size, "gate": "none"} if size else None


def _sigmoid_router(f: Fields, model: Model, *, normalize: bool, scale: float) -> None:
    """DeepSeek-V3-style routing: sigmoid scores, the correction bias steering the selection only."""
    scoring = f.text("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModel(f"{model_type_of(f.raw)} with scoring_func {short_repr(scoring)} is not supported "
                               "(only 'sigmoid')", field="scoring_func", value=scoring)
    model["router"] = {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": normalize, "bias": True,
                       "scale": scale}


def _glm4_moe(f: Fields, model: Model) -> None:
    n = model["num_layers"]
    model.update(qkv_bias=f.flag("attention_bias", False),  # q/k/v only; o_proj never has a bias
                 qk_norm="per_head" if f.flag("use_qk_norm", False) else "none")
    first_moe = f.integer("first_k_dense_replace", 1, lo=0, hi=MAX_LAYERS)
    if first_moe >= n:
        raise UnsupportedModel(f"first_k_dense_replace {first_moe} leaves no MoE layer in {n} layers",
                               field="first_k_dense_replace", value=first_moe)
    model["moe_layers"] = list(range(first_moe, n))
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    _sigmoid_router(f, model, normalize=f.flag("norm_topk_prob", True),
                    scale=f.number("routed_scaling_factor", 1.0, lo=0.0, lo_open=True))
    # grouped top-k (n_group = topk_group = 1 in the published GLM-4.5/4.6/4.7: plain top-k)
    model["router"]["n_group"] = f.integer("n_group", 1, hi=MAX_EXPERTS)
    model["router"]["topk_group"] = f.integer("topk_group", 1, hi=MAX_EXPERTS)
    shared = f.integer("n_shared_experts", 1, lo=0, hi=MAX_EXPERTS)  # ungated, n x the routed width
    model["shared_expert"] = ({"intermediate_size": shared * model["expert_intermediate_size"], "gate": "none"}
                              if shared else None)


def _minimax_m2(f: Fields, model: Model) -> None:
    # q/k RMSNorm over the whole projection (before the head split); no biases, no window, no shared expert
    if f.flag("use_qk_norm", True) is False:
        raise UnsupportedModel("minimax_m2 without q/k norm (use_qk_norm false) is not supported",
                               field="use_qk_norm", value=False)
    norm_type = f.text("qk_norm_type", "per_layer")
    if norm_type != "per_layer":
        raise UnsupportedModel(f"minimax_m2 qk_norm_type {short_repr(norm_type)} is not supported (only "
                               "'per_layer': one norm over all heads)", field="qk_norm_type", value=norm_type)
    if f.integer("shared_intermediate_size", 0, lo=0):
        raise UnsupportedModel("minimax_m2 with a shared expert (shared_intermediate_size) is not supported",
                               field="shared_intermediate_size")
    model["qk_norm"] = "full"
    _sigmoid_router(f, model, normalize=True, scale=1.0)  # top-k weights always renormalised, never scaled


def _gpt_oss(f: Fields, model: Model) -> None:
    bias = f.flag("attention_bias", True)
    model.update(qkv_bias=bias, o_bias=bias, attention_sinks=True)
    if not f.has("rope_parameters") and not f.has("rope_scaling"):  # transformers' default for gpt-oss
        model["rope"] = {"type": "yarn", "theta": model["rope"]["theta"], "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096.0}
    window = f.integer("sliding_window", None, lo=0, hi=1 << 30) or None
    # layer_types: sliding on the even layers by default (transformers' GptOssConfig)
    kinds = f.raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                         for i in range(model["num_layers"])]
    if (not isinstance(kinds, list) or len(kinds) != model["num_layers"]
            or any(k not in ("sliding_attention", "full_attention") for k in kinds)):
        raise UnsupportedModel(f"gpt_oss layer_types {short_repr(kinds)} is not supported (one of "
                               "'sliding_attention' / 'full_attention' per layer)", field="layer_types")
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    if window and sliding:
        model["sliding_window"] = window
        if len(sliding) < model["num_layers"]:
            model["sliding_layers"] = sliding
    # the router is a biased linear layer: top-k of logits + bias, softmax over the k
    model["router"] = {"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False, "bias": True,
                       "scale": 1.0}
    model["expert_bias"] = True
    model["expert_act"] = {"alpha": f.number("swiglu_alpha", 1.702, lo=0.0, lo_open=True),
                           "limit": f.number("swiglu_limit", 7.0, lo=0.0, lo_open=True), "up_offset": 1.0}


def _qwen3_next(f: Fields, model: Model) -> None:
    """Qwen3-Next: Gated DeltaNet layers between gated full-attention ones (`layer_types`, else every
    `full_attention_interval`-th layer is full attention), per-head q/k norm, the qwen2_moe MoE block."""
    n = model["num_layers"]
    if f.flag("attention_bias", False):
        raise UnsupportedModel("qwen3_next with attention_bias is not supported", field="attention_bias", value=True)
    interval = f.integer("full_attention_interval", 4, hi=MAX_LAYERS)
    kinds = f.raw.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                         for i in range(n)]
    if (not isinstance(kinds, list) or len(kinds) != n
            or any(k not in ("linear_attention", "full_attention") for k in kinds)):
        raise UnsupportedModel(f"{model_type_of(f.raw)} layer_types {short_repr(kinds)} is not supported (one of "
                               "'linear_attention' / 'full_attention' per layer)", field="layer_types")
    model.update(qk_norm="per_head", attention_gate=True, layer_types=list(kinds))
    if "linear_attention" in kinds:
        model["linear_attention"] = {
            "num_key_heads": f.integer("linear_num_key_heads", 16, hi=4096),
            "num_value_heads": f.integer("linear_num_value_heads", 32, hi=4096),
            "key_head_dim": f.integer("linear_key_head_dim", 128, hi=4096),
            "value_head_dim": f.integer("linear_value_head_dim", 128, hi=4096),
            "conv_kernel": f.integer("linear_conv_kernel_dim", 4, hi=64)}
    model["moe_layers"] = moe_layer_indices(f, n)
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", True)
    model["shared_expert"] = {"intermediate_size": f.integer("shared_expert_intermediate_size"), "gate": "sigmoid"}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla(f: Fields, model: Model) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3): the `mla` dims, head_dim = nope + rope (the q.k width of a
    head), RoPE over the rope part only, and the softmax scale head_dim^-1/2 times mscale(factor, mscale_all_dim)^2
    under a scaled RoPE (transformers' yarn_apply_mscale). The interleaved rope pairs are de-interleaved in the
    weights (convert/derived.py::mla_tensors), so the file's RoPE is rotate-half."""
    if f.flag("attention_bias", False):
        raise UnsupportedModel(f"{model_type_of(f.raw)} with attention_bias is not supported", field="attention_bias",
                               value=True)
    nope, rope = f.integer("qk_nope_head_dim", hi=4096), f.integer("qk_rope_head_dim", hi=4096)
    model["mla"] = {"q_lora_rank": f.integer("q_lora_rank", None, hi=MAX_DIM), "kv_lora_rank": f.integer(
        "kv_lora_rank", hi=MAX_DIM), "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "v_head_dim": f.integer("v_head_dim", hi=4096), "latent_norm_eps": 1e-6}   # q_a / kv_a norms: eps 1e-6
    model.update(head_dim=nope + rope, num_key_value_heads=model["num_attention_heads"])
    scale = (nope + rope) ** -0.5
    r = model["rope"]
    if r["type"] != "default" and r.get("mscale_all_dim"):
        if r.get("factor") is None:
            raise InvalidInput(f"config.json: rope mscale_all_dim needs a factor ({r['type']})", field="factor")
        scale *= _yarn_mscale(r["factor"], r["mscale_all_dim"]) ** 2
    model["multipliers"]["attention"] = scale


def _deepseek_v3(f: Fields, model: Model, groups: tuple[int, int] = (8, 4), layer_types: bool = False,
                 first_dense: int = 3) -> None:
    """DeepSeek-V3 / R1 / V3.1 and Kimi-K2: MLA, the first `first_k_dense_replace` layers dense (or, with
    `layer_types`, those `mlp_layer_types` calls dense where the config lists them: V3.2, GLM-5), the rest MoE with the
    sigmoid router (selection-only correction bias, grouped top-k, renormalised, times routed_scaling_factor) and
    `n_shared_experts` ungated shared experts."""
    _mla(f, model)
    n = model["num_layers"]
    method = f.text("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise UnsupportedModel(f"{model_type_of(f.raw)} topk_method {short_repr(method)} is not supported (only "
                               "'noaux_tc': sigmoid scores plus the correction bias)", field="topk_method", value=method)
    if f.integer("moe_layer_freq", 1, hi=MAX_LAYERS) != 1:
        raise UnsupportedModel("moe_layer_freq other than 1 is not supported", field="moe_layer_freq",
                               value=f.raw.get("moe_layer_freq"))
    kinds = f.raw.get("mlp_layer_types") if layer_types else None
    if kinds is not None:
        if (not isinstance(kinds, list) or len(kinds) != n or any(k not in ("dense", "sparse") for k in kinds)):
            raise UnsupportedModel(f"{model_type_of(f.raw)} mlp_layer_types {short_repr(kinds)} is not supported "
                                   "(one of 'dense' / 'sparse' per layer)", field="mlp_layer_types")
        moe = [i for i, k in enumerate(kinds) if k == "sparse"]
    else:
        moe = list(range(min(f.integer("first_k_dense_replace", first_dense, lo=0, hi=MAX_LAYERS), n), n))
    if not moe:
        raise UnsupportedModel(f"{model_type_of(f.raw)} with no MoE layer (first_k_dense_replace / mlp_layer_types) "
                               "is not supported", field="first_k_dense_replace", value=n)
    model["moe_layers"] = moe
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    _sigmoid_router(f, model, normalize=f.flag("norm_topk_prob", True),
                    scale=f.number("routed_scaling_factor", 2.5, lo=0.0, lo_open=True))
    model["router"]["n_group"] = f.integer("n_group", groups[0], hi=MAX_EXPERTS)
    model["router"]["topk_group"] = f.integer("topk_group", groups[1], hi=MAX_EXPERTS)
    shared = f.integer("n_shared_experts", 1, lo=0, hi=MAX_EXPERTS)
    model["shared_expert"] = ({"intermediate_size": shared * model["expert_intermediate_size"], "gate": "none"}
                              if shared else None)


def _deepseek_v32(f: Fields, model: Model, groups: tuple[int, int] = (8, 4)) -> None:
    """DeepSeek-V3.2 and GLM-5: DeepSeek-V3 plus the DSA lightning indexer, which keeps each query's index_topk
    best-scored tokens: every token while a context holds at most index_topk, where attention is dense MLA. The
    file holds no indexer (its tensors are skipped) and says `index_topk`: engines refuse longer contexts."""
    _deepseek_v3(f, model, groups, layer_types=True)
    model["index_topk"] = f.integer("index_topk", 2048, hi=MAX_POSITIONS)


# --- the records ----------------------------------------------------------------------------------

_QWEN_EXPERTS = (PerExpert("{p}.mlp.experts.{e}.gate_proj.weight", "{p}.mlp.experts.{e}.up_proj.weight",
                           "{p}.mlp.experts.{e}.down_proj.weight"),
                 FusedLinear("{p}.mlp.experts.gate_up_proj", "{p}.mlp.experts.down_proj"))
# legacy block_sparse_moe experts (w1 gate, w3 up, w2 down), or transformers v5's fused ones under mlp
_BLOCK_SPARSE_EXPERTS = (PerExpert("{p}.block_sparse_moe.experts.{e}.w1.weight",
                                   "{p}.block_sparse_moe.experts.{e}.w3.weight",
                                   "{p}.block_sparse_moe.experts.{e}.w2.weight"),
                         FusedLinear("{p}.mlp.experts.gate_up_proj", "{p}.mlp.experts.down_proj"))

MIXTRAL = Adapter(
    model_type="mixtral",
    names=HFNames(
        # legacy checkpoints keep the MoE under block_sparse_moe; v5 fused ones under mlp
        routers=("{p}.block_sparse_moe.gate.weight", "{p}.mlp.gate.weight"),
        experts=_BLOCK_SPARSE_EXPERTS),
    defaults=ConfigDefaults(rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=131072,
                            expert_width_key="intermediate_size"),
    fields=_mixtral,
)
QWEN2_MOE = Adapter(
    model_type="qwen2_moe",
    names=HFNames(
        routers=("{p}.mlp.gate.weight",),
        experts=_QWEN_EXPERTS,
        shared=("{p}.mlp.shared_expert.gate_proj.weight", "{p}.mlp.shared_expert.up_proj.weight",
                "{p}.mlp.shared_expert.down_proj.weight"),
        shared_gate="{p}.mlp.shared_expert_gate.weight"),
    defaults=ConfigDefaults(rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=32768,
                            expert_width_key="moe_intermediate_size"),
    fields=_qwen2_moe,
)
QWEN3_MOE = Adapter(
    model_type="qwen3_moe",
    names=HFNames(routers=("{p}.mlp.gate.weight",), experts=_QWEN_EXPERTS),
    defaults=QWEN2_MOE.defaults,
    fields=_qwen3_moe,
)
OLMOE = Adapter(
    model_type="olmoe",
    names=QWEN3_MOE.names,
    defaults=ConfigDefaults(rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=4096,
                            expert_width_key="intermediate_size"),
    fields=_olmoe,
)
GRANITEMOE = Adapter(
    model_type="granitemoe",
    names=HFNames(
        routers=("{p}.block_sparse_moe.router.layer.weight", "{p}.block_sparse_moe.router.weight"),
        # both spellings are nn.Linear-oriented [E, 2I, H] with the gate rows first
        experts=(FusedLinear("{p}.block_sparse_moe.input_linear.weight",
                             "{p}.block_sparse_moe.output_linear.weight"),
                 FusedLinear("{p}.block_sparse_moe.experts.gate_up_proj", "{p}.block_sparse_moe.experts.down_proj"))),
    defaults=ConfigDefaults(rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=2048,
                            expert_width_key="intermediate_size"),
    fields=_granitemoe,
)
GRANITEMOESHARED = Adapter(
    model_type="granitemoeshared",
    names=replace(GRANITEMOE.names, shared_fused=("{p}.shared_mlp.input_linear.weight",
                                                  "{p}.shared_mlp.output_linear.weight")),
    defaults=GRANITEMOE.defaults,
    fields=_granitemoeshared,
)

GLM4_MOE = Adapter(
    model_type="glm4_moe",
    names=HFNames(
        routers=("{p}.mlp.gate.weight",),
        router_bias=("{p}.mlp.gate.e_score_correction_bias",),
        experts=_QWEN_EXPERTS,
        shared=("{p}.mlp.shared_experts.gate_proj.weight", "{p}.mlp.shared_experts.up_proj.weight",
                "{p}.mlp.shared_experts.down_proj.weight")),
    defaults=ConfigDefaults(rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=131072,
                            expert_width_key="moe_intermediate_size", partial_rotary_factor=0.5),
    fields=_glm4_moe,
)
MINIMAX_M2 = Adapter(
    model_type="minimax_m2",
    names=HFNames(
        # released checkpoints keep the MoE under block_sparse_moe (w1 gate, w3 up, w2 down); v5 fused under mlp
        routers=("{p}.block_sparse_moe.gate.weight", "{p}.mlp.gate.weight"),
        router_bias=("{p}.block_sparse_moe.e_score_correction_bias", "{p}.mlp.e_score_correction_bias"),
        experts=_BLOCK_SPARSE_EXPERTS),
    defaults=ConfigDefaults(rope_theta=5e6, rms_norm_eps=1e-6, max_position_embeddings=196608,
                            expert_width_key="intermediate_size"),
    fields=_minimax_m2,
)

GPT_OSS = Adapter(
    model_type="gpt_oss",
    names=HFNames(
        routers=("{p}.mlp.router.weight",),
        router_bias=("{p}.mlp.router.bias",),
        # nn.Linear rows, gate first: re-laid out from the checkpoint's in-features-first interleaved tensors
        # (or dequantized from MXFP4) by convert/derived.py::gpt_oss_experts
        experts=(FusedLinear("{p}.mlp.experts.gate_up_proj", "{p}.mlp.experts.down_proj"),),
        expert_bias=("{p}.mlp.experts.gate_up_proj_bias", "{p}.mlp.experts.down_proj_bias")),
    defaults=ConfigDefaults(rope_theta=150000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                            expert_width_key="intermediate_size"),
    fields=_gpt_oss,
    derive=gpt_oss_experts,
)

# zero-centred norms stored as 1 + w, q_proj split into q and gate, fused in_proj_qkvz / in_proj_ba split
# (convert/derived.py::qwen3_next_tensors); the MoE block is qwen2_moe's
QWEN3_NEXT = Adapter(
    model_type="qwen3_next",
    names=replace(QWEN2_MOE.names, skip=(Skip(r"mtp\..*", "multi-token-prediction head (mtp.*; not used for "
                                                         "generation)"),)),
    defaults=ConfigDefaults(rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=32768,
                            expert_width_key="moe_intermediate_size", partial_rotary_factor=0.25),
    fields=_qwen3_next,
    derive=qwen3_next_tensors,
)

# Qwen3.5 / 3.6 MoE: Qwen3-Next's layers with the linear-attention projections stored split (in_proj_qkv, _z, _b,
# _a); the text model alone (qwen3_5_moe_text), or inside the vision-language checkpoint (qwen3_5_moe: text_config,
# weights under model.language_model.*, the vision tower skipped). Text-only MRoPE is 1-D RoPE: the three position
# components of a text token are equal.
QWEN3_5_MOE_TEXT = replace(QWEN3_NEXT, model_type="qwen3_5_moe_text")
QWEN3_5_MOE = replace(QWEN3_NEXT, model_type="qwen3_5_moe", text_only=True)

# DeepSeek-V3 / R1 / V3.1: MLA (kv_b_proj split into k_b_proj and v_b_proj, interleaved rope rows de-interleaved:
# convert/derived.py::mla_tensors), the GLM-4.5 MoE block (shared_experts, selection-only correction bias), grouped
# top-k; the multi-token-prediction layer past num_hidden_layers skipped (layout.skip_rules). Kimi-K2 checkpoints
# declare the same graph under model_type kimi_k2.
DEEPSEEK_V3 = Adapter(
    model_type="deepseek_v3",
    names=GLM4_MOE.names,
    defaults=ConfigDefaults(rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=4096,
                            expert_width_key="moe_intermediate_size", mla=True),
    fields=_deepseek_v3,
    derive=mla_tensors,
)
KIMI_K2 = replace(DEEPSEEK_V3, model_type="kimi_k2")
INDEXER = Skip(r"model\.layers\.\d+\.self_attn\.indexer\..*",
               "DSA lightning indexer (it keeps every token up to index_topk, where attention is dense: the file "
               "records index_topk and engines refuse longer contexts)")
DEEPSEEK_V32 = replace(DEEPSEEK_V3, model_type="deepseek_v32", names=replace(GLM4_MOE.names, skip=(INDEXER,)),
                       fields=_deepseek_v32)
GLM_MOE_DSA = replace(DEEPSEEK_V32, model_type="glm_moe_dsa",
                      defaults=replace(DEEPSEEK_V3.defaults, rms_norm_eps=1e-5, max_position_embeddings=202752),
                      fields=lambda f, model: _deepseek_v32(f, model, groups=(1, 1)))

# GLM-4.7-Flash: DeepSeek-V3's graph without an indexer, dense / sparse layers from mlp_layer_types (one dense layer by
# default), rope_interleave from the config
GLM4_MOE_LITE = replace(DEEPSEEK_V3, model_type="glm4_moe_lite", defaults=GLM_MOE_DSA.defaults,
                        fields=lambda f, model: _deepseek_v3(f, model, groups=(1, 1), layer_types=True, first_dense=1))

ADAPTERS = {a.model_type: a for a in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, GRANITEMOE, GRANITEMOESHARED, GLM4_MOE,
                                      MINIMAX_M2, GPT_OSS, QWEN3_NEXT, QWEN3_5_MOE_TEXT, QWEN3_5_MOE, DEEPSEEK_V3,
                                      KIMI_K2, DEEPSEEK_V32, GLM_MOE_DSA, GLM4_MOE_LITE)}
SUPPORTED_MODEL_TYPES = tuple(ADAPTERS)

# Families users will try, with the feature that keeps them out of v1.
NOT_YET = {
    "deepseek_v2": "multi-head latent attention",
    "phimoe": "sparsemixer routing and LayerNorm",
    "llama4": "input-scaled routing and chunked attention",
    "llama4_text": "input-scaled routing and chunked attention",
    "granitemoehybrid": "Mamba layers",
    "jamba": "Mamba layers",
    "dbrx": "its fused attention and expert layout",
}


def get_adapter(model_type: str) -> Adapter:
    """The record for `model_type`, or UnsupportedModel naming it and listing what is supported."""
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        why = f" ({NOT_YET[model_type]} not implemented)" if model_type in NOT_YET else ""
        raise UnsupportedModel(f"model_type {short_repr(model_type)} is not supported{why}; supported: "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}", field="model_type", value=model_type)
    return adapter


def normalize_config(raw: Mapping[str, Any]) -> tuple[str, Model]:
    """(architecture, model dict) for any supported config.json; dispatches on `model_type`."""
    adapter = get_adapter(model_type_of(raw))
    return adapter.model_type, adapter.normalize_config(raw)
