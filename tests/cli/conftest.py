"""Files the CLI tests share: small synthetic `.colibri` files (no checkpoint, no converter)."""

import json
from pathlib import Path

import pytest

from colibri_format import synthetic
from colibri_format.synthetic import synthetic_model, write_synthetic

DEMO = Path(__file__).resolve().parents[2] / "models" / "colibri-demo-moe"


@pytest.fixture()
def small_file(tmp_path):
    """Two MoE layers of 4 experts after one dense layer."""
    return str(write_synthetic(tmp_path / "s.colibri", synthetic_model(dense_layers=(1,), layers=3, shared=32)))


@pytest.fixture()
def model_file(tmp_path):
    """Three MoE layers of 8 experts, top-2 (enough routing for traces and caches)."""
    return str(write_synthetic(tmp_path / "m.colibri", synthetic_model(layers=3, experts=8, top_k=2)))


def demo_tokenizer() -> dict:
    """The bundled demo model's tokenizer entry: byte-level BPE (4096 ids), its chat template, eos id 2."""
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    config["chat_template"] = (DEMO / "chat_template.jinja").read_text()
    return {"tokenizer_json": (DEMO / "tokenizer.json").read_text(), "tokenizer_config": config,
            "generation_config": json.loads((DEMO / "generation_config.json").read_text())}


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    """A synthetic model (random weights, vocab 4096) embedding the demo model's tokenizer and chat template."""
    path = tmp_path_factory.mktemp("chat") / "chat.colibri"
    plain = synthetic.synthetic_metadata
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synthetic, "synthetic_metadata", lambda *a, **k: {**plain(*a, **k), "tokenizer": demo_tokenizer()})
        write_synthetic(path, synthetic_model(vocab=4096, layers=2, experts=4, top_k=2))
    return str(path)
