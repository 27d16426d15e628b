"""Files the CLI tests share: small synthetic `.colibri` files (no checkpoint, no converter)."""

import pytest

from colibri_format.synthetic import synthetic_model, write_synthetic


@pytest.fixture()
def small_file(tmp_path):
    """Two MoE layers of 4 experts after one dense layer."""
    return str(write_synthetic(tmp_path / "s.colibri", synthetic_model(dense_layers=(1,), layers=3, shared=32)))


@pytest.fixture()
def model_file(tmp_path):
    """Three MoE layers of 8 experts, top-2 (enough routing for traces and caches)."""
    return str(write_synthetic(tmp_path / "m.colibri", synthetic_model(layers=3, experts=8, top_k=2)))
