"""`colibri inspect` shows the routing and attention fields of GLM-4.5 and gpt-oss files (grouped top-k, the
correction bias, partial RoPE, sinks, per-layer windows, expert biases, the clamped SwiGLU)."""

import json

import pytest

from colibri_format.cli import main
from tests.runtime.hf_tiny import build_hf, converted_file


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return {key: str(converted_file(build_hf(key), tmp_path_factory.mktemp(key)))
            for key in ("glm4_moe-groups", "gpt_oss")}


def test_json_view_has_the_fields(files, capsys):
    assert main(["inspect", files["glm4_moe-groups"], "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["metadata"]["model"]
    assert model["router"] == {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": False, "bias": True,
                               "scale": 1.5, "n_group": 4, "topk_group": 2}
    assert model["rope"]["partial_rotary_factor"] == 0.5
    assert main(["inspect", files["gpt_oss"], "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    model = info["metadata"]["model"]
    assert model["attention_sinks"] is True and model["sliding_layers"] == [0] and model["expert_bias"] is True
    assert model["expert_act"] == {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}
    names = {t["name"] for t in info["dense_tensors"]}
    assert {"layers.1.attn.sinks", "layers.1.moe.router_bias", "layers.1.moe.expert_gate_up_bias"} <= names


def test_human_view_shows_them(files, capsys):
    assert main(["inspect", files["gpt_oss"]]) == 0
    text = capsys.readouterr().out
    for needle in ("attention_sinks", "sliding_layers", "expert_bias", "expert_act", "topk_softmax", "1.702"):
        assert needle in text
    assert main(["inspect", files["glm4_moe-groups"]]) == 0
    text = capsys.readouterr().out
    for needle in ("n_group", "topk_group", "sigmoid", "partial_rotary_factor"):
        assert needle in text
