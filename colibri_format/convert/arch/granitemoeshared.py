"""Granite MoE with a shared MLP (`granitemoeshared`): `y = moe(x) + shared_mlp(x)`, no shared gate.

The shared MLP is one fused `input_linear [2Is, H]` (gate rows first) and `output_linear [H, Is]`;
`shared_intermediate_size == 0` means there is none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from colibri_format.convert.arch import common, granitemoe
from colibri_format.convert.hf_config import Fields, finish_model

MODEL_TYPE = "granitemoeshared"
NAMES = replace(granitemoe.NAMES, shared_fused=("{p}.shared_mlp.input_linear.weight",
                                                "{p}.shared_mlp.output_linear.weight"))


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    f = Fields(raw)
    model = granitemoe.granite_model(f)
    size = f.integer("shared_intermediate_size", 0, lo=0)
    model["shared_expert"] = {"intermediate_size": size, "gate": "none"} if size else None
    return finish_model(model)


def dense_tensors(src: Any, model: dict[str, Any]) -> list[common.DenseTensor]:
    return common.dense_tensors(src, model, NAMES)


def expert_tensors(src: Any, model: dict[str, Any], layer: int, expert: int) -> tuple[Any, Any, Any]:
    return common.expert_tensors(src, model, NAMES, layer, expert)
