"""compressed-tensors "pack-quantized" int4 checkpoints (Kimi-K2-Thinking / K2.5): the converter dequantizes their
experts while reading, or, for int4_group experts of the source's group size, copies the 4-bit values and scales.

Checkpoints are crafted at test time from tiny transformers-built DeepSeek-V3 models (tests/hf_mla.py), their routed
experts packed by tests/convert/quantized_checkpoints.py::to_pack_quantized with Kimi's quantization_config, next to
a float32 twin holding the values the packed ones stand for.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import colibri_format
from colibri_format.convert.derived import PackedInt
from colibri_format.convert.pipeline import convert
from colibri_format.errors import InvalidInput, NonFiniteWeight, UnsupportedModel
from colibri_format.runtime import Engine, EngineConfig
from tests.convert.quantized_checkpoints import int4_groups, load_reference, pack_int4, to_pack_quantized
from tests.hf_mla import build, save
from tests.runtime.hf_tiny import hf_logits, prompts, rel_err

TOL = 1e-4
WIDTHS = dict(moe_intermediate_size=32)          # H = I = 32: int4 groups of 32 divide both


class _Src:
    """Just what PackedInt reads."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.t = tensors

    def int_view(self, name):
        return self.t[name]

    def native_view(self, name):
        return self.t[name]

    def has(self, name):
        return name in self.t


def test_the_packing_is_compressed_tensors():
    """pack_to_int32's layout, from its source: offset-8 fields, the first column in the lowest bits; q = -8 .. -1
    are the fields 0 .. 7, so the word is 0x76543210 (and the helper that crafts the checkpoints agrees)."""
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]])
    words = pack_int4(q)
    assert words.numpy().view(np.uint32).tolist() == [[0x76543210, 0xFEDCBA98]]
    scale = np.array([[0.5]], np.float32)
    t = PackedInt(_Src({"w_packed": words.numpy(), "w_scale": scale}), "w", 4, 16)
    np.testing.assert_array_equal(t.rows(None, 0, 1), q.numpy() * 0.5)
    pairs, s16 = t.int4_rows(None, 0, 1, 16)
    # int4_group: two's complement, element 2k in the low nibble of byte k
    nib = q.numpy()[0] & 0xF
    np.testing.assert_array_equal(pairs[0], (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8))
    assert s16.dtype == np.float16 and s16.tolist() == [[0.5]]
    assert t.int4_rows(None, 0, 1, 32) is None                     # another group size: requantized


@pytest.mark.parametrize("c", [16, 37, 64])
def test_unpacking_random_matrices_and_padded_rows(c):
    gen = torch.Generator().manual_seed(c)
    w = torch.randn(5, c, generator=gen)
    q, scale, deq = int4_groups(w, 16)
    shape = np.array([5, c], np.int64)
    t = PackedInt(_Src({"w_packed": pack_int4(q).numpy(), "w_scale": scale.view(torch.int16).numpy().view(np.uint16),
                        "w_shape": shape}), "w", 4, 16)
    assert t.shape == (5, c)
    np.testing.assert_array_equal(np.concatenate([t.rows(None, 0, 2), t.rows(None, 2, 5)]), deq.numpy())


def test_8_bit_packing():
    """pack-quantized int8: four offset-128 bytes a word, the first column in the lowest byte (pack_to_int32's
    docstring: [1, 2] -> 33409)."""
    words = np.array([[33409 + (128 << 16) + (128 << 24)]], np.uint32).view(np.int32)     # [1, 2, 0, 0]
    t = PackedInt(_Src({"w_packed": words, "w_scale": np.array([[2.0]], np.float32),
                        "w_shape": np.array([1, 3], np.int32)}), "w", 8, None)
    np.testing.assert_array_equal(t.rows(None, 0, 1), [[2.0, 4.0, 0.0]])
    assert t.int4_rows(None, 0, 1, 32) is None


def _pair(tmp_path, group=32, model_type=None, **widths):
    hf = build("deepseek_v3", **{**WIDTHS, **widths})
    return hf, *to_pack_quantized(save(hf, tmp_path / "hf"), tmp_path, group, model_type)


def _same_files(a, b) -> None:
    with colibri_format.open(a, verify="always") as x, colibri_format.open(b, verify="always") as y:
        assert x.model == y.model and x.metadata["quantization"] == y.metadata["quantization"]
        assert x.dense_names() == y.dense_names()
        for name in x.dense_names():
            np.testing.assert_array_equal(x.dense_f32(name), y.dense_f32(name))
        for layer in x.model["moe_layers"]:
            for e in range(x.model["num_experts"]):
                u, v = x.expert(layer, e), y.expert(layer, e)
                for p, q in zip((u.gate_up, u.gate_up_scale, u.down, u.down_scale),
                                (v.gate_up, v.gate_up_scale, v.down, v.down_scale)):
                    if p is None:
                        assert q is None
                    else:
                        np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("group, options", [
    (32, dict(dtype="float32", quantize="none")),
    (32, dict(dtype="bfloat16", quantize="none")),
    (32, dict(dtype="float16", quantize="expert")),                         # int8 rows
    (16, dict(dtype="float32", quantize="expert", group_size=16)),          # int8 groups of the source's size
    (16, dict(dtype="float32", quantize="expert", quant_bits=4, group_size=32)),    # int4 of another group size
    (None, dict(dtype="float32", quantize="expert", quant_bits=4)),         # the "channel" strategy, requantized
])
def test_packed_checkpoint_converts_to_the_file_of_its_dequantized_twin(tmp_path, group, options):
    _, packed, dequantized = _pair(tmp_path, group)
    convert(packed, tmp_path / "p.colibri", workers=2, **options)
    convert(dequantized, tmp_path / "d.colibri", workers=1, **options)
    _same_files(tmp_path / "p.colibri", tmp_path / "d.colibri")
    with colibri_format.open(tmp_path / "p.colibri") as f:
        source = f.metadata["provenance"]["source_quantization"]
    assert source["quant_method"] == "compressed-tensors" and source["tensors"] == 2 * 8 * 3
    assert source["schemes"] == [{"bits": 4, "group_size": group}]
    assert "experts_requantized" not in source and source["read"].startswith("dequantized")


def test_the_float32_file_computes_what_transformers_computes_on_the_dequantized_weights(tmp_path):
    hf, packed, dequantized = _pair(tmp_path)
    convert(packed, tmp_path / "p.colibri", dtype="float32", quantize="none", workers=2)
    ref = load_reference(dequantized)
    batch = prompts(hf.config.vocab_size, [11, 4], seed=5)
    with Engine(tmp_path / "p.colibri", EngineConfig(max_seq_len=64)) as engine:
        for ids, logits in zip(batch, engine.logits(batch)):
            assert rel_err(logits, hf_logits(ref, ids)) < TOL
    assert rel_err(hf_logits(ref, batch[0]), hf_logits(hf, batch[0])) > 10 * TOL      # int4 really rounds


def _source_int4(packed, layer: int, e: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """(int4_group bytes, float16 scales) that one packed matrix stands for, read with the crafting helper's layout."""
    raw = load_file(str(packed / "model.safetensors"))
    p = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
    words = raw[p + "weight_packed"].numpy().view(np.uint32)
    fields = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    q = fields.reshape(words.shape[0], -1).astype(np.int8) - 8
    nib = (q & 0xF).astype(np.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4), raw[p + "weight_scale"].float().numpy().astype(np.float16)


def test_int4_experts_of_the_sources_group_size_are_copied_bit_for_bit(tmp_path):
    """--quant-bits 4 --group-size 32 from Kimi's layout (model_type kimi_k2): every blob holds the source's 4-bit
    values and its bf16 scales as float16, so it dequantizes to exactly the twin's float values; no error."""
    _, packed, dequantized = _pair(tmp_path, 32, "kimi_k2")
    summary = convert(packed, tmp_path / "q4.colibri", dtype="float32", quantize="expert", quant_bits=4,
                      group_size=32, workers=2)
    convert(dequantized, tmp_path / "f32.colibri", dtype="float32", quantize="none", workers=1)
    assert summary.quant_error_max == 0.0 and summary.architecture == "kimi_k2"
    with colibri_format.open(tmp_path / "q4.colibri", verify="always") as q, \
            colibri_format.open(tmp_path / "f32.colibri") as f:
        assert q.metadata["quantization"]["experts"] == "int4_group" and q.header.group_size == 32
        source = q.metadata["provenance"]["source_quantization"]
        assert source["experts_requantized"] == 0 and source["read"].startswith("int4_group experts: the 4-bit")
        for layer in q.model["moe_layers"]:
            for e in range(q.model["num_experts"]):
                v = q.expert(layer, e)
                gate, gate_s = _source_int4(packed, layer, e, "gate_proj")
                up, up_s = _source_int4(packed, layer, e, "up_proj")
                down, down_s = _source_int4(packed, layer, e, "down_proj")
                np.testing.assert_array_equal(v.gate_up, np.concatenate([gate, up]))
                np.testing.assert_array_equal(v.gate_up_scale, np.concatenate([gate_s, up_s]))
                np.testing.assert_array_equal(v.down, down)
                np.testing.assert_array_equal(v.down_scale, down_s)
                for a, b in zip(q.expert_f32(layer, e), f.expert_f32(layer, e)):
                    np.testing.assert_array_equal(a, b)


def _tiny_scale(packed, name: str, row: int) -> None:
    """Give one group a bf16 scale float16 cannot hold (0.75 * 2^-24, below its smallest subnormal step)."""
    tensors = load_file(str(packed / "model.safetensors"))
    tensors[name][row, 0] = torch.tensor(0.75 * 2.0 ** -24, dtype=torch.bfloat16)
    save_file(tensors, str(packed / "model.safetensors"), metadata={"format": "pt"})


def test_a_scale_float16_cannot_hold_is_requantized_and_said_so_and_resume_keeps_it(tmp_path, monkeypatch):
    from colibri_format.convert import schedule

    real_runs = schedule.runs
    monkeypatch.setattr(schedule, "runs", lambda items, size: real_runs(items, size, run_pieces=1))
    _, packed, _ = _pair(tmp_path)
    _tiny_scale(packed, "model.layers.1.mlp.experts.1.down_proj.weight_scale", 3)
    options = dict(dtype="float32", quantize="expert", quant_bits=4, group_size=32)
    whole = convert(packed, tmp_path / "whole.colibri", workers=1, **options)
    assert whole.quant_error_max > 0.0

    def stop_after_some(done, total, *_):       # 46 dense tensors, then the experts of layer 1: (1, 1) is in
        if done >= 50:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(packed, tmp_path / "cut.colibri", workers=1, progress=stop_after_some, **options)
    resumed = convert(packed, tmp_path / "cut.colibri", workers=1, **options)
    assert 50 <= resumed.pieces_resumed < 62
    assert (tmp_path / "cut.colibri").read_bytes() == (tmp_path / "whole.colibri").read_bytes()
    with colibri_format.open(tmp_path / "cut.colibri") as f:
        assert f.metadata["provenance"]["source_quantization"]["experts_requantized"] == 1
        errors = {(r[0], r[1]): r[2] for r in f.metadata["quantization"]["error"]["per_expert"]}
    assert [k for k, v in errors.items() if v != 0.0] == [(1, 1)]


def _edit(packed, tensors=None, config=None) -> None:
    if tensors is not None:
        raw = load_file(str(packed / "model.safetensors"))
        tensors(raw)
        save_file(raw, str(packed / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        c = json.loads((packed / "config.json").read_text())
        config(c["quantization_config"])
        (packed / "config.json").write_text(json.dumps(c))


P = "model.layers.1.mlp.experts.3.up_proj."
GROUP = "quantization_config.config_groups.group_0"


def _drop_word(raw):
    raw[P + "weight_packed"] = raw[P + "weight_packed"][:, :-1].contiguous()


def _nan_scale(raw):
    raw[P + "weight_scale"][7, 0] = float("nan")


def _fp8_module(raw):            # a float-quantized (FP8) module beside the packed ones, as mixed configs have
    raw[P + "weight"] = torch.zeros(32, 32).to(torch.float8_e4m3fn)
    raw[P + "weight_scale"] = torch.ones(32, 1)
    del raw[P + "weight_packed"], raw[P + "weight_shape"]


def _zero_point(raw):
    raw[P + "weight_zero_point"] = torch.zeros(raw[P + "weight_scale"].shape, dtype=torch.int8)


@pytest.mark.parametrize("tensors, config, error, field, words", [
    (_drop_word, None, InvalidInput, P + "weight_packed", "does not hold"),
    (_nan_scale, None, NonFiniteWeight, P + "weight_scale", "row 7, group 0"),
    (None, lambda q: q.update(format="nvfp4-pack-quantized"), UnsupportedModel, GROUP + ".format", "nvfp4"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), UnsupportedModel,
     GROUP + ".weights.strategy", "'tensor'"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), UnsupportedModel,
     GROUP + ".weights.num_bits", "num_bits is 2"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), UnsupportedModel,
     GROUP + ".weights.symmetric", "zero points"),
    (_zero_point, None, UnsupportedModel, P + "weight_zero_point", "asymmetric"),
    (_fp8_module, None, UnsupportedModel, P + "weight_scale", "not pack-quantized"),
    (None, lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), UnsupportedModel,
     GROUP + ".weights.actorder", "activation-ordered"),
    (None, lambda q: q["ignore"].append(r"re:.*layers\.1\.mlp\.experts\.3\.up_proj$"), InvalidInput,
     P + "weight_packed", "ignores"),
    (None, lambda q: q["config_groups"]["group_0"].update(targets=[r"re:(?!.*layers\.1\.mlp\.experts\.3\.up_proj)"]),
     InvalidInput, P + "weight_packed", "no quantization_config group targets"),
    (None, lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), UnsupportedModel,
     GROUP + ".input_activations", "activations"),
])
def test_bad_packed_inputs_are_refused_in_one_line_naming_the_tensor(tmp_path, tensors, config, error, field, words):
    _, packed, _ = _pair(tmp_path)
    _edit(packed, tensors, config)
    for options in (dict(quantize="expert", quant_bits=4, group_size=32), dict(quantize="none")):
        with pytest.raises(error) as info:
            convert(packed, tmp_path / "x.colibri", dtype="float32", workers=1, **options)
        message = str(info.value)
        assert info.value.field == field and words in message and "\n" not in message
        assert "experts.3.up_proj" in message or "experts." in message
        assert not (tmp_path / "x.colibri").exists()
