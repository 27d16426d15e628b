"""The optional `model` keys of the DeepSeek-V3 family (`mla`, `index_topk`): checked by type, range and consistency
with the other attention fields, and the dense tensors an MLA layer puts in the canonical directory."""

from __future__ import annotations

import pytest

from colibri_format import spec as S
from colibri_format.errors import InvalidMetadata
from colibri_format.synthetic import synthetic_model

MLA = {"q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 10,
       "latent_norm_eps": 1e-6}


def model(**changes) -> dict:
    return {**synthetic_model(experts=8, layers=3), "num_key_value_heads": 4, "head_dim": 14, "mla": MLA, **changes}


def test_valid_mla_keys_pass():
    S.check_model(model())
    S.check_model(model(mla={**MLA, "q_lora_rank": None}, index_topk=2048))


@pytest.mark.parametrize("changes, field", [
    ({"mla": {**MLA, "extra": 1}}, "model.mla"),
    ({"mla": [1, 2]}, "model.mla"),
    ({"mla": {**MLA, "q_lora_rank": 0}}, "model.mla.q_lora_rank"),
    ({"mla": {**MLA, "kv_lora_rank": None}}, "model.mla.kv_lora_rank"),
    ({"mla": {**MLA, "qk_rope_head_dim": 5}, "head_dim": 13}, "model.mla.qk_rope_head_dim"),     # odd
    ({"mla": {**MLA, "v_head_dim": True}}, "model.mla.v_head_dim"),
    ({"mla": {**MLA, "latent_norm_eps": 0}}, "model.mla.latent_norm_eps"),
    ({"head_dim": 8}, "model.head_dim"),                                   # not nope + rope
    ({"num_key_value_heads": 2}, "model.num_key_value_heads"),
    ({"qkv_bias": True}, "model.qkv_bias"),
    ({"qk_norm": "per_head"}, "model.qk_norm"),
    ({"sliding_window": 8}, "model.sliding_window"),
    ({"attention_sinks": True}, "model.attention_sinks"),
    ({"rope": {"type": "default", "theta": 1e4, "partial_rotary_factor": 0.5}}, "model.rope.partial_rotary_factor"),
    ({"index_topk": 0}, "model.index_topk"),
    ({"index_topk": 64, "mla": None}, "model.index_topk"),                # the indexer belongs to MLA models
])
def test_bad_mla_keys_are_refused_in_one_line_naming_the_field(changes, field):
    m = model(**changes)
    if m.get("mla") is None:
        m.pop("mla")
        m.update(num_key_value_heads=2, head_dim=8)
    with pytest.raises(InvalidMetadata) as info:
        S.check_model(m)
    assert info.value.field == field and "\n" not in str(info.value)


def test_mla_layers_in_the_directory():
    names = dict(S.canonical_dense_tensors(model()))
    assert names["layers.0.attn.q_a_proj"] == (16, 32) and names["layers.0.attn.q_a_norm"] == (16,)
    assert names["layers.0.attn.q_b_proj"] == (4 * 14, 16)
    assert names["layers.1.attn.kv_a_proj"] == (12 + 6, 32) and names["layers.1.attn.kv_a_norm"] == (12,)
    assert names["layers.2.attn.k_b_proj"] == (4 * 8, 12) and names["layers.2.attn.v_b_proj"] == (4 * 10, 12)
    assert names["layers.2.attn.o_proj"] == (32, 4 * 10)
    assert not any(n.endswith(("k_proj", "v_proj", "attn.q_proj")) for n in names)
    plain = dict(S.canonical_dense_tensors(model(mla={**MLA, "q_lora_rank": None})))
    assert plain["layers.0.attn.q_proj"] == (4 * 14, 32) and "layers.0.attn.q_a_proj" not in plain
