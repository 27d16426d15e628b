"""The optional `model` keys of Qwen3-Next / Qwen3.5 (`attention_gate`, `layer_types`, `linear_attention`): checked
by type, range and consistency, and the dense tensors they put in the canonical directory."""

from __future__ import annotations

import pytest

from colibri_format import spec as S
from colibri_format.errors import InvalidMetadata
from colibri_format.synthetic import synthetic_model

LIN = {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 8, "value_head_dim": 12, "conv_kernel": 4}
KINDS = ["linear_attention", "linear_attention", "full_attention"]


def model(**changes) -> dict:
    return {**synthetic_model(experts=8, layers=3), **changes}


def test_valid_hybrid_keys_pass():
    S.check_model(model(attention_gate=True, layer_types=KINDS, linear_attention=LIN))
    S.check_model(model(layer_types=["full_attention"] * 3))            # no linear layer: no linear_attention


@pytest.mark.parametrize("changes, field", [
    ({"attention_gate": 1}, "model.attention_gate"),
    ({"layer_types": KINDS[:2], "linear_attention": LIN}, "model.layer_types"),                 # one per layer
    ({"layer_types": ["mamba", *KINDS[1:]], "linear_attention": LIN}, "model.layer_types"),
    ({"layer_types": "linear_attention", "linear_attention": LIN}, "model.layer_types"),
    ({"layer_types": KINDS}, "model.linear_attention"),                                         # dims missing
    ({"linear_attention": LIN}, "model.linear_attention"),                                      # no linear layer
    ({"layer_types": KINDS, "linear_attention": {**LIN, "extra": 1}}, "model.linear_attention"),
    ({"layer_types": KINDS, "linear_attention": {**LIN, "num_value_heads": 3}},
     "model.linear_attention.num_value_heads"),                                                 # 3 % 2
    ({"layer_types": KINDS, "linear_attention": {**LIN, "conv_kernel": 0}}, "model.linear_attention.conv_kernel"),
    ({"layer_types": KINDS, "linear_attention": {**LIN, "key_head_dim": True}},
     "model.linear_attention.key_head_dim"),
])
def test_bad_hybrid_keys_are_refused_in_one_line_naming_the_field(changes, field):
    with pytest.raises(InvalidMetadata) as info:
        S.check_model(model(**changes))
    assert info.value.field == field and "\n" not in str(info.value)


def test_linear_layers_and_the_attention_gate_in_the_directory():
    m = model(attention_gate=True, layer_types=KINDS, linear_attention=LIN)
    names = dict(S.canonical_dense_tensors(m))
    channels = 2 * 2 * 8 + 4 * 12
    assert names["layers.0.linear.qkv_proj"] == (channels, 32) and names["layers.0.linear.conv"] == (channels, 4)
    assert names["layers.1.linear.z_proj"] == (48, 32) and names["layers.1.linear.o_proj"] == (32, 48)
    assert names["layers.1.linear.A_log"] == names["layers.1.linear.b_proj"][:1] == (4,)
    assert names["layers.0.linear.norm"] == (12,)
    assert "layers.0.attn.q_proj" not in names and "layers.2.linear.qkv_proj" not in names
    assert names["layers.2.attn.gate_proj"] == names["layers.2.attn.q_proj"]
