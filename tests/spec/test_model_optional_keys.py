"""The optional `model` keys of GLM-4.5, MiniMax-M2 and gpt-oss: checked by type and range, and the dense tensors
they add to the canonical directory."""

from __future__ import annotations

import pytest

from colibri_format import spec as S
from colibri_format.errors import InvalidMetadata
from colibri_format.synthetic import synthetic_model

SIGMOID = {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True, "scale": 2.5}


def model(**changes) -> dict:
    return {**synthetic_model(experts=8, layers=3), **changes}


def test_valid_optional_keys_pass():
    S.check_model(model(router={**SIGMOID, "n_group": 4, "topk_group": 2}, attention_sinks=True,
                        sliding_window=128, sliding_layers=[0, 2], expert_bias=True,
                        expert_act={"alpha": 1.702, "limit": 7.0, "up_offset": 1.0},
                        rope={"type": "yarn", "theta": 1.5e5, "factor": 32.0, "truncate": False,
                              "partial_rotary_factor": 0.5}))


@pytest.mark.parametrize("changes, field", [
    ({"router": {**SIGMOID, "n_group": 3, "topk_group": 1}}, "model.router.n_group"),       # 8 % 3
    ({"router": {**SIGMOID, "n_group": 8, "topk_group": 1}}, "model.router.n_group"),       # groups of 1
    ({"router": {**SIGMOID, "n_group": 4, "topk_group": 5}}, "model.router.topk_group"),
    ({"router": {**SIGMOID, "n_group": 4}}, "model.router.topk_group"),
    ({"router": {**SIGMOID, "n_group": 4, "topk_group": 0}}, "model.router.topk_group"),
    ({"attention_sinks": 1}, "model.attention_sinks"),
    ({"sliding_layers": [0, 1]}, "model.sliding_layers"),                                   # no sliding_window
    ({"sliding_window": 8, "sliding_layers": [1, 0]}, "model.sliding_layers"),
    ({"sliding_window": 8, "sliding_layers": [3]}, "model.sliding_layers"),
    ({"expert_bias": "yes"}, "model.expert_bias"),
    ({"expert_act": {"alpha": 0.0, "limit": 7.0, "up_offset": 1.0}}, "model.expert_act.alpha"),
    ({"expert_act": {"alpha": 1.0, "limit": -1.0, "up_offset": 1.0}}, "model.expert_act.limit"),
    ({"expert_act": {"alpha": 1.0, "limit": None}}, "model.expert_act.up_offset"),
    ({"rope": {"type": "default", "theta": 1e4, "partial_rotary_factor": 1.5}}, "model.rope.partial_rotary_factor"),
])
def test_bad_optional_keys_name_the_field(changes, field):
    with pytest.raises(InvalidMetadata) as info:
        S.check_model(model(**changes))
    assert info.value.field == field


def test_sinks_and_expert_biases_join_the_directory_in_order():
    m = model(attention_sinks=True, expert_bias=True, router={**SIGMOID})
    names = dict(S.canonical_dense_tensors(m))
    assert names["layers.0.attn.sinks"] == (4,)
    assert names["layers.1.moe.expert_gate_up_bias"] == (8, 96) and names["layers.1.moe.expert_down_bias"] == (8, 32)
    order = [n for n, _ in S.canonical_dense_tensors(m) if n.startswith("layers.1.")]
    assert order.index("layers.1.attn.sinks") < order.index("layers.1.post_attn_norm")
    assert order.index("layers.1.moe.router_bias") < order.index("layers.1.moe.expert_gate_up_bias")
