"""OLMoE (`olmoe`): full-width q/k RMSNorm (before the head split) and optional `clip_qkv`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_format.convert.arch import common
from colibri_format.convert.arch.common import HFNames
from colibri_format.convert.arch.qwen2_moe import QWEN_EXPERTS
from colibri_format.convert.hf_config import Fields, common_model, finish_model

MODEL_TYPE = "olmoe"
NAMES = HFNames(routers=("{p}.mlp.gate.weight",), experts=QWEN_EXPERTS)


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    f = Fields(raw)
    model = common_model(f, default_theta=1e4, default_eps=1e-5, default_max_pos=4096,
                         expert_intermediate_key="intermediate_size")
    bias = f.flag("attention_bias", False)
    clip = f.number("clip_qkv", None, lo=0.0, lo_open=True)
    # OLMoE never uses a sliding window, whatever config.json says.
    model.update(qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=clip)
    model["router"]["normalize_topk"] = f.flag("norm_topk_prob", False)
    return finish_model(model)


def dense_tensors(src: Any, model: dict[str, Any]) -> list[common.DenseTensor]:
    return common.dense_tensors(src, model, NAMES)


def expert_tensors(src: Any, model: dict[str, Any], layer: int, expert: int) -> tuple[Any, Any, Any]:
    return common.expert_tensors(src, model, NAMES, layer, expert)
