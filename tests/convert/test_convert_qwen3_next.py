"""Qwen3-Next and Qwen3.5 through the converter: the fused Gated DeltaNet projections split as transformers splits
them, the zero-centred norms stored as 1 + w, q_proj split into q and gate, both expert layouts, Qwen3.5's
vision-language checkpoint (text weights only), and one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import colibri_format
from colibri_format.convert.adapters import normalize_config
from colibri_format.convert.pipeline import convert
from colibri_format.errors import InvalidInput, UnsupportedModel
from tests.hf_hybrid import CONFIGS, build, convert_file, save


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    hf = build("qwen3_next")
    return hf, convert_file(hf, tmp_path_factory.mktemp("q3n"))


def test_the_file_splits_the_projections_as_transformers_does(converted):
    hf, path = converted
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(7))
    with colibri_format.open(path, verify="always") as f, torch.no_grad():
        assert f.model["layer_types"] == hf.config.layer_types and f.model["attention_gate"] is True
        lin = hf.model.layers[0].linear_attn
        q, k, v, z, b, a = lin.fix_query_key_value_ordering(lin.in_proj_qkvz(x)[None], lin.in_proj_ba(x)[None])
        want = {"qkv_proj": torch.cat([t.reshape(5, -1) for t in (q[0], k[0], v[0])], -1), "z_proj": z[0].reshape(5, -1),
                "b_proj": b[0], "a_proj": a[0]}
        for name, ref in want.items():
            np.testing.assert_allclose(x.numpy() @ f.dense_f32(f"layers.0.linear.{name}").T, ref.numpy(), rtol=1e-5,
                                       atol=1e-6)
        np.testing.assert_array_equal(f.dense_f32("layers.0.linear.conv"), lin.conv1d.weight[:, 0].numpy())
        np.testing.assert_array_equal(f.dense_f32("layers.0.linear.norm"), lin.norm.weight.numpy())    # not shifted
        for name, ref in (("layers.0.input_norm", hf.model.layers[0].input_layernorm),
                          ("layers.3.attn.q_norm", hf.model.layers[3].self_attn.q_norm), ("final_norm", hf.model.norm)):
            np.testing.assert_array_equal(f.dense_f32(name), (1.0 + ref.weight.float()).numpy())   # exact in fp32
        attn = hf.model.layers[3].self_attn
        qg = attn.q_proj(x).view(5, 4, 32)
        np.testing.assert_allclose(x.numpy() @ f.dense_f32("layers.3.attn.q_proj").T, qg[..., :16].reshape(5, -1),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(x.numpy() @ f.dense_f32("layers.3.attn.gate_proj").T,
                                   qg[..., 16:].reshape(5, -1), rtol=1e-5, atol=1e-6)


def test_the_fused_expert_layout_gives_the_same_file_contents(converted, tmp_path):
    hf, path = converted
    with colibri_format.open(path) as a, colibri_format.open(convert_file(hf, tmp_path, fused=True)) as b:
        assert a.model == b.model and a.dense_names() == b.dense_names()
        for name in a.dense_names():
            np.testing.assert_array_equal(a.dense_f32(name), b.dense_f32(name))
        for layer in a.model["moe_layers"]:
            for e in range(a.model["num_experts"]):
                for x, y in zip(a.expert_f32(layer, e), b.expert_f32(layer, e)):
                    np.testing.assert_array_equal(x, y)


def config(**changes) -> dict:
    cfg = build("qwen3_next").config.to_dict()
    cfg.pop("layer_types")
    return json.loads(json.dumps({**cfg, **changes}))


def test_the_layer_pattern_comes_from_layer_types_or_the_interval():
    _, model = normalize_config(config(full_attention_interval=2))
    assert model["layer_types"] == ["linear_attention", "full_attention"] * 2
    _, model = normalize_config(config(layer_types=["full_attention"] * 4))
    assert "linear_attention" not in model and model["attention_gate"] is True
    _, model = normalize_config(config(**{k: v for k, v in CONFIGS["qwen3_next-mixed"].items() if k != "vocab_size"}))
    assert model["dense_intermediate_size"] == 24 and model["moe_layers"] == [0, 1, 3, 4]
    assert model["rope"]["partial_rotary_factor"] == 0.5 and model["router"]["normalize_topk"] is False


@pytest.mark.parametrize("changes, error, field", [
    ({"layer_types": ["mamba"] * 4}, UnsupportedModel, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, UnsupportedModel, "layer_types"),
    ({"attention_bias": True}, UnsupportedModel, "attention_bias"),
    ({"linear_num_value_heads": 3}, InvalidInput, "model.linear_attention.num_value_heads"),
    ({"linear_conv_kernel_dim": 0}, InvalidInput, "linear_conv_kernel_dim"),
])
def test_unsupported_or_inconsistent_configs_are_refused_in_one_line(changes, error, field):
    with pytest.raises(error) as info:
        normalize_config(config(**changes))
    assert info.value.field == field and "\n" not in str(info.value)


def test_qwen3_5_vision_language_checkpoint_converts_its_text_model(tmp_path):
    # text weights under model.language_model.*, the vision tower skipped (named in the provenance), an mtp.* head
    # skipped too, the split projections taken as stored
    from safetensors.torch import load_file, save_file

    hf = build("qwen3_5_moe")
    src = save(hf, tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(32, 64)}, src / "model.safetensors", metadata={"format": "pt"})
    convert(src, tmp_path / "m.colibri", dtype="float32", quantize="none", workers=1)
    text = hf.model.language_model
    with colibri_format.open(tmp_path / "m.colibri", verify="always") as f:
        assert f.metadata["architecture"] == "qwen3_5_moe" and f.model["linear_attention"]["num_key_heads"] == 1
        skipped = f.metadata["provenance"]["skipped_tensors"]
        assert any("model.visual." in json.dumps(s) for s in skipped) and "mtp.fc.weight" in json.dumps(skipped)
        lin = text.layers[0].linear_attn
        for name, ref in (("qkv_proj", lin.in_proj_qkv), ("z_proj", lin.in_proj_z), ("b_proj", lin.in_proj_b),
                          ("a_proj", lin.in_proj_a), ("o_proj", lin.out_proj)):
            np.testing.assert_array_equal(f.dense_f32(f"layers.0.linear.{name}"), ref.weight.detach().numpy())
        np.testing.assert_array_equal(f.dense_f32("final_norm"), (1.0 + text.norm.weight.float()).detach().numpy())
