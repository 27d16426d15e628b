"""Mixtral (`mixtral`): the baseline; every layer MoE, softmax over all experts, top-k, renormalised."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_format.convert.arch import common
from colibri_format.convert.arch.common import FusedLinear, HFNames, PerExpert
from colibri_format.convert.hf_config import Fields, common_model, finish_model, sliding_window

MODEL_TYPE = "mixtral"
NAMES = HFNames(
    # legacy checkpoints keep the MoE under block_sparse_moe; v5 fused ones under mlp
    routers=("{p}.block_sparse_moe.gate.weight", "{p}.mlp.gate.weight"),
    experts=(PerExpert("{p}.block_sparse_moe.experts.{e}.w1.weight", "{p}.block_sparse_moe.experts.{e}.w3.weight",
                       "{p}.block_sparse_moe.experts.{e}.w2.weight"),
             FusedLinear("{p}.mlp.experts.gate_up_proj", "{p}.mlp.experts.down_proj")),
)


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    f = Fields(raw)
    model = common_model(f, default_theta=1e6, default_eps=1e-5, default_max_pos=131072,
                         expert_intermediate_key="intermediate_size")
    model["sliding_window"] = sliding_window(f)
    return finish_model(model)


def dense_tensors(src: Any, model: dict[str, Any]) -> list[common.DenseTensor]:
    return common.dense_tensors(src, model, NAMES)


def expert_tensors(src: Any, model: dict[str, Any], layer: int, expert: int) -> tuple[Any, Any, Any]:
    return common.expert_tensors(src, model, NAMES, layer, expert)
