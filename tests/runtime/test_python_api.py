"""The public Python API refuses wrong types and use after close with the ColibriFormatError family (never a
TypeError, struct.error or a silently coerced argument)."""

from __future__ import annotations

import numpy as np
import pytest

import colibri_format
from colibri_format.errors import ColibriFormatError, InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from tests.runtime.numpy_tiny import tiny_file


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_file(tmp_path_factory.mktemp("api") / "m.colibri")


@pytest.mark.parametrize("layer,expert", [(0.0, 1), (True, 0), (0, False), ("0", 1), (None, 0), (0, 1.5), ([0], 1)])
def test_expert_arguments_are_type_checked(path, layer, expert):
    with colibri_format.open(path) as f:
        for call in (f.expert, f.expert_blob, f.expert_f32, f.blob_offset, f.verify_expert):
            with pytest.raises(InvalidInput, match="must be an integer"):
                call(layer, expert)


def test_numpy_integers_are_integers(path):
    with colibri_format.open(path) as f:
        assert f.blob_offset(np.int64(1), np.int32(2)) == f.blob_offset(1, 2)


@pytest.mark.parametrize("name", [0, None, b"embed_tokens", ["embed_tokens"]])
def test_dense_names_are_strings(path, name):
    with colibri_format.open(path) as f:
        with pytest.raises(InvalidInput, match="string"):
            f.dense(name)


def test_use_after_close_is_a_clear_error(path):
    f = colibri_format.open(path)
    f.close()
    for call in (lambda: f.expert(0, 1), lambda: f.dense("embed_tokens"), lambda: f.expert_blob(0, 1),
                 lambda: f.verify_dense("final_norm"), lambda: f.verify_expert(0, 0), lambda: f.expert_f32(0, 0)):
        with pytest.raises(InvalidInput, match="closed"):
            call()


@pytest.mark.parametrize("pinned", [((7, 0),), ((0, 99),), ((0, -1),), ((True, 0),), ((0,),), ("ab",)])
def test_pinned_experts_must_name_experts_of_the_file(path, pinned):
    with pytest.raises(ColibriFormatError, match="pinned expert"):
        Engine(path, EngineConfig(max_cached_experts=4, cache_policy="static", pinned_experts=pinned))


def test_valid_pins_open(path):
    with Engine(path, EngineConfig(max_cached_experts=4, cache_policy="static", pinned_experts=((0, 1), (1, 2)))) \
            as eng:
        assert eng.infer([[1, 2]])
