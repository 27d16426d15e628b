"""Qwen3-MoE (`qwen3_moe`): per-head q/k RMSNorm, explicit head_dim, `norm_topk_prob` renormalisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_format.convert.arch import common
from colibri_format.convert.arch.common import HFNames
from colibri_format.convert.arch.qwen2_moe import QWEN_EXPERTS
from colibri_format.convert.hf_config import Fields, common_model, finish_model, moe_layer_indices, sliding_window

MODEL_TYPE = "qwen3_moe"
NAMES = HFNames(routers=("{p}.mlp.gate.weight",), experts=QWEN_EXPERTS)


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    f = Fields(raw)
    model = common_model(f, default_theta=1e4, default_eps=1e-6, default_max_pos=32768,
                         expert_intermediate_key="moe_intermediate_size")
    bias = f.flag("attention_bias", False)  # one flag for q, k, v and o
    model.update(qkv_bias=bias, o_bias=bias, qk_norm="per_head", sliding_window=sliding_window(f))
    model["moe_layers"] = moe_layer_indices(f, model["num_layers"])
    model["dense_intermediate_size"] = f.integer("intermediate_size", None)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", False)
    return finish_model(model)


def dense_tensors(src: Any, model: dict[str, Any]) -> list[common.DenseTensor]:
    return common.dense_tensors(src, model, NAMES)


def expert_tensors(src: Any, model: dict[str, Any], layer: int, expert: int) -> tuple[Any, Any, Any]:
    return common.expert_tensors(src, model, NAMES, layer, expert)
