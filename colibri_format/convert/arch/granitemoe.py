"""Granite MoE (`granitemoe`): fused 3-D experts on disk, top-k then softmax, four scalar multipliers.

`attention_multiplier` replaces 1/sqrt(head_dim) outright (default 1.0, not null);
logits are divided by `logits_scaling`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_format.convert.arch import common
from colibri_format.convert.arch.common import FusedLinear, HFNames
from colibri_format.convert.hf_config import Fields, common_model, finish_model

MODEL_TYPE = "granitemoe"
NAMES = HFNames(
    routers=("{p}.block_sparse_moe.router.layer.weight", "{p}.block_sparse_moe.router.weight"),
    # both spellings are nn.Linear-oriented [E, 2I, H] with the gate rows first
    experts=(FusedLinear("{p}.block_sparse_moe.input_linear.weight", "{p}.block_sparse_moe.output_linear.weight"),
             FusedLinear("{p}.block_sparse_moe.experts.gate_up_proj", "{p}.block_sparse_moe.experts.down_proj")),
)


def granite_model(f: Fields) -> dict[str, Any]:
    """The Granite fields shared with `granitemoeshared` (not yet finished)."""
    model = common_model(f, default_theta=1e4, default_eps=1e-6, default_max_pos=2048,
                         expert_intermediate_key="intermediate_size")
    bias = f.flag("attention_bias", False)
    model.update(qkv_bias=bias, o_bias=bias)
    # softmax over the k selected logits already sums to one: no extra renormalisation
    model["router"].update(order="topk_softmax", normalize_topk=False)
    model["multipliers"] = {
        key: f.number(hf_key, 1.0, lo=0.0, lo_open=True)
        for key, hf_key in (("embedding", "embedding_multiplier"), ("residual", "residual_multiplier"),
                            ("attention", "attention_multiplier"), ("logits", "logits_scaling"))
    }
    return model


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    return finish_model(granite_model(Fields(raw)))


def dense_tensors(src: Any, model: dict[str, Any]) -> list[common.DenseTensor]:
    return common.dense_tensors(src, model, NAMES)


def expert_tensors(src: Any, model: dict[str, Any], layer: int, expert: int) -> tuple[Any, Any, Any]:
    return common.expert_tensors(src, model, NAMES, layer, expert)
