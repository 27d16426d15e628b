"""The top_k and expert-count limits of the format are the named constants of spec/constants.py, in every place
that checks or documents them (metadata checks here; header checks in test_bad_inputs.py)."""

from __future__ import annotations

import pytest

from colibri_format import errors as E
from colibri_format import spec as S
from colibri_format.synthetic import synthetic_model


def test_top_k_up_to_min_of_experts_and_max_top_k():
    S.check_model(synthetic_model(experts=S.MAX_TOP_K, top_k=S.MAX_TOP_K))
    S.check_model(synthetic_model(experts=S.MAX_EXPERTS, top_k=S.MAX_TOP_K))
    S.check_model(synthetic_model(experts=3, top_k=3))


@pytest.mark.parametrize("experts,top_k", [(S.MAX_EXPERTS, S.MAX_TOP_K + 1), (3, 4), (8, 0)])
def test_top_k_over_the_limit(experts, top_k):
    with pytest.raises(E.InvalidMetadata) as info:
        S.check_model(synthetic_model(experts=experts, top_k=top_k))
    assert info.value.field == "model.top_k" and info.value.value == top_k
    assert f"{min(experts, S.MAX_TOP_K)}]" in str(info.value)


@pytest.mark.parametrize("experts", [0, S.MAX_EXPERTS + 1])
def test_expert_count_over_the_limit(experts):
    with pytest.raises(E.InvalidMetadata) as info:
        S.check_model(synthetic_model(experts=experts, top_k=1))
    assert info.value.field == "model.num_experts" and f"{S.MAX_EXPERTS}]" in str(info.value)


def test_header_field_docs_state_the_constants():
    docs = {f.name: f.doc for f in S.HEADER_FIELDS}
    assert f"1..{S.MAX_EXPERTS}" in docs["num_experts"]
    assert f"min(num_experts, {S.MAX_TOP_K})" in docs["top_k"]
    assert f"1..{S.MAX_LAYERS}" in docs["num_layers"]
