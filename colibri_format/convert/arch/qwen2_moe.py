"""Qwen1.5/Qwen2-MoE (`qwen2_moe`): q/k/v bias, a sigmoid-gated shared expert, optional dense layers.

Top-k weights are not renormalised unless `norm_topk_prob` (false in published models).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_format.convert.arch import common
from colibri_format.convert.arch.common import FusedLinear, HFNames, PerExpert
from colibri_format.convert.hf_config import Fields, common_model, finish_model, moe_layer_indices
from colibri_format.errors import UnsupportedModel

MODEL_TYPE = "qwen2_moe"
QWEN_EXPERTS = (PerExpert("{p}.mlp.experts.{e}.gate_proj.weight", "{p}.mlp.experts.{e}.up_proj.weight",
                          "{p}.mlp.experts.{e}.down_proj.weight"),
                FusedLinear("{p}.mlp.experts.gate_up_proj", "{p}.mlp.experts.down_proj"))
NAMES = HFNames(
    routers=("{p}.mlp.gate.weight",),
    experts=QWEN_EXPERTS,
    shared=("{p}.mlp.shared_expert.gate_proj.weight", "{p}.mlp.shared_expert.up_proj.weight",
            "{p}.mlp.shared_expert.down_proj.weight"),
    shared_gate="{p}.mlp.shared_expert_gate.weight",
)


def _reject_sliding_window(f: Fields) -> None:
    # Qwen2-MoE windows only some layers (odd ones below max_window_layers); the file has one window.
    layer_types = f.raw.get("layer_types")
    uses_window = f.flag("use_sliding_window", False) or (
        isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types))
    if uses_window:
        raise UnsupportedModel("qwen2_moe with per-layer sliding windows is not supported",
                               field="use_sliding_window", value=True)


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    f = Fields(raw)
    _reject_sliding_window(f)
    model = common_model(f, default_theta=1e4, default_eps=1e-6, default_max_pos=32768,
                         expert_intermediate_key="moe_intermediate_size")
    model["qkv_bias"] = f.flag("qkv_bias", True)  # v5 field; v4 always had q/k/v bias
    model["moe_layers"] = moe_layer_indices(f, model["num_layers"])
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", False)
    model["shared_expert"] = {"intermediate_size": f.integer("shared_expert_intermediate_size"), "gate": "sigmoid"}
    return finish_model(model)


def dense_tensors(src: Any, model: dict[str, Any]) -> list[common.DenseTensor]:
    return common.dense_tensors(src, model, NAMES)


def expert_tensors(src: Any, model: dict[str, Any], layer: int, expert: int) -> tuple[Any, Any, Any]:
    return common.expert_tensors(src, model, NAMES, layer, expert)
