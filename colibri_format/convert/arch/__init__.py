"""Registry of architecture adapters, one module per Hugging Face `model_type`.

Each module exports `MODEL_TYPE`, `normalize_config(raw) -> model dict`,
`dense_tensors(src, model) -> list[DenseTensor]` and
`expert_tensors(src, model, layer, expert) -> (gate [I,H], up [I,H], down [H,I])`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from colibri_format.convert.arch.common import DenseTensor
from colibri_format.convert.safe_paths import short_repr
from colibri_format.errors import UnsupportedModel

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared")

# Families users will try, with the feature that keeps them out of v1.
NOT_YET = {
    "gpt_oss": "MXFP4 experts, interleaved clamped SwiGLU and attention sinks",
    "deepseek_v2": "multi-head latent attention and grouped routing",
    "deepseek_v3": "multi-head latent attention, sigmoid+bias routing and FP8 block scales",
    "kimi_k2": "the DeepSeek-V3 architecture",
    "phimoe": "sparsemixer routing and LayerNorm",
    "llama4": "input-scaled routing and chunked attention",
    "llama4_text": "input-scaled routing and chunked attention",
    "glm4_moe": "sigmoid+bias grouped routing and partial RoPE",
    "granitemoehybrid": "Mamba layers",
    "qwen3_next": "linear-attention layers",
    "jamba": "Mamba layers",
    "dbrx": "its fused attention and expert layout",
}


@dataclass(frozen=True)
class Adapter:
    """The three entry points of one architecture module."""

    model_type: str
    normalize_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    dense_tensors: Callable[[Any, dict[str, Any]], list[DenseTensor]]
    expert_tensors: Callable[[Any, dict[str, Any], int, int], tuple[Any, Any, Any]]


def supported_model_types() -> tuple[str, ...]:
    return SUPPORTED_MODEL_TYPES


def get_adapter(model_type: str) -> Adapter:
    """The adapter for `model_type`, or UnsupportedModel naming it and listing what is supported."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = f" ({NOT_YET[model_type]} not implemented)" if model_type in NOT_YET else ""
        raise UnsupportedModel(f"model_type {short_repr(model_type)} is not supported{why}; supported: "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}", field="model_type", value=model_type)
    module = importlib.import_module(f"colibri_format.convert.arch.{model_type}")
    return Adapter(module.MODEL_TYPE, module.normalize_config, module.dense_tensors, module.expert_tensors)
