"""FP8 block-scaled and MXFP4 checkpoints: the converter dequantizes them while reading.

The decoding tables are checked against torch / transformers; checkpoints crafted from tiny models in the
real on-disk layouts (tests/convert/quantized_checkpoints.py) convert to float32 files whose logits and greedy
tokens match transformers' fp32 eager forward of the dequantized model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from colibri_format.convert.derived import E4M3, Mxfp4
from colibri_format.convert.pipeline import convert
from colibri_format.errors import InvalidInput, UnsupportedModel
from colibri_format.runtime import Engine
from tests.convert.quantized_checkpoints import load_reference, mxfp4_blocks, to_fp8, to_mxfp4
from tests.runtime.hf_tiny import build_hf, hf_logits, prompts, rel_err

TOL = 1e-4


def test_e4m3_table_is_torchs():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(np.isnan(E4M3), np.isnan(ref))
    np.testing.assert_array_equal(E4M3[~np.isnan(ref)], ref[~np.isnan(ref)])


@pytest.mark.parametrize("shape, block, index", [((300, 1000), (128, 128), None), ((2, 130, 257), (128, 64), 1),
                                                 ((7, 9), (4, 2), None)])
def test_fp8_rows_compiled_are_numpys_bit_for_bit(shape, block, index):
    """Fp8Blocks.rows through _native.c's loop (where built) against its NumPy form: every byte (NaN ones too),
    ragged blocks at both edges, row ranges starting inside a block."""
    import unittest.mock

    from colibri_format.convert import native
    from colibri_format.convert.derived import Fp8Blocks

    rng = np.random.default_rng(sum(shape))
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    *lead, r, c = shape
    scale = rng.uniform(0.5, 2.0, (*lead, -(-r // block[0]), -(-c // block[1]))).astype(np.float32)

    class Src:
        def raw_view(self, name):
            return q

        def native_view(self, name):
            return scale

    fp8 = Fp8Blocks(Src(), "w", "s", block)
    for start, stop in ((0, r), (1, r - 1), (block[0] - 1, min(r, 2 * block[0] + 1)), (r - 1, r)):
        got = fp8.rows(index, start, stop)
        with unittest.mock.patch.object(native, "library", lambda: None):
            want = fp8.rows(index, start, stop)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.isnan(got).any() == np.isnan(want).any()


def test_mxfp4_decoding_is_transformers():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ref = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2).numpy()   # [3, 10, 128]

    class Src:
        def raw_view(self, name):
            return (blocks if name == "b" else scales).numpy()

    got = Mxfp4(Src(), "b", "s")
    assert got.shape == (3, 10, 128)
    for e in range(3):
        np.testing.assert_array_equal(np.concatenate([got.rows(e, 0, 7), got.rows(e, 7, 10)]), ref[e])


def test_mxfp4_crafting_round_trips():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales, deq = mxfp4_blocks(w)

    class Src:
        def raw_view(self, name):
            return (blocks if name == "b" else scales).numpy()

    np.testing.assert_array_equal(Mxfp4(Src(), "b", "s").rows(None, 0, 4), deq.numpy())


def _greedy(hf, prompt, n):
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(hf_logits(hf, ids)[-1].argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("arch, block", [("glm4_moe", (24, 20)), ("minimax_m2", (128, 128)),
                                          ("glm4_moe-groups", (8, 16))])
def test_fp8_checkpoint_converts_to_the_dequantized_model(tmp_path, arch, block):
    hf = build_hf(arch)
    hf.save_pretrained(tmp_path / "hf")
    fp8, dequantized = to_fp8(tmp_path / "hf", tmp_path, block)
    ref = load_reference(dequantized)
    convert(fp8, tmp_path / "f32.colibri", dtype="float32", quantize="none", workers=2)
    batch = prompts(96, [11, 4], seed=5)
    with Engine(tmp_path / "f32.colibri") as engine:
        for ids, logits in zip(batch, engine.logits(batch)):
            assert rel_err(logits, hf_logits(ref, ids)) < TOL
        assert engine.generate(batch[0], max_new_tokens=8, stop_ids=[]).output_ids == _greedy(ref, batch[0], 8)
    # the FP8 values really differ from the original weights: the test would not see a missing dequantization
    assert rel_err(hf_logits(ref, batch[0]), hf_logits(hf, batch[0])) > 10 * TOL


def test_fp8_scale_of_the_wrong_shape_is_named(tmp_path):
    build_hf("minimax_m2").save_pretrained(tmp_path / "hf")
    fp8, _ = to_fp8(tmp_path / "hf", tmp_path, (16, 16))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [8, 16]       # the scales were made for 16 x 16
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInput, match=r"weight_scale_inv.*expected"):
        convert(fp8, tmp_path / "x.colibri", dtype="float32", quantize="none", workers=1)


def test_fp8_in_another_format_is_refused(tmp_path):
    build_hf("minimax_m2").save_pretrained(tmp_path / "hf")
    fp8, _ = to_fp8(tmp_path / "hf", tmp_path, (16, 16))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="e5m2"):
        convert(fp8, tmp_path / "x.colibri", dtype="float32", quantize="none", workers=1)


@pytest.mark.parametrize("options, tol", [(dict(dtype="float32", quantize="none"), TOL),
                                          (dict(dtype="float32", quantize="expert", group_size=32), TOL),
                                          (dict(dtype="float32", quantize="mxfp4"), TOL)])
def test_mxfp4_gpt_oss_converts_to_the_dequantized_model(tmp_path, options, tol):
    hf = build_hf("gpt_oss", intermediate_size=64)        # in-features multiples of 32 (H 32, I 64)
    hf.save_pretrained(tmp_path / "hf")
    mxfp4, dequantized = to_mxfp4(tmp_path / "hf", tmp_path)
    ref = load_reference(dequantized)
    convert(mxfp4, tmp_path / "out.colibri", workers=2, **options)
    batch = prompts(96, [11, 4], seed=5)
    with Engine(tmp_path / "out.colibri") as engine:
        for ids, logits in zip(batch, engine.logits(batch)):
            assert rel_err(logits, hf_logits(ref, ids)) < tol
        assert engine.generate(batch[0], max_new_tokens=8, stop_ids=[]).output_ids == _greedy(ref, batch[0], 8)
    assert rel_err(hf_logits(ref, batch[0]), hf_logits(hf, batch[0])) > 10 * TOL


def test_mxfp4_experts_become_int8_groups_of_32_exactly(tmp_path):
    import colibri_format

    hf = build_hf("gpt_oss", intermediate_size=64)
    hf.save_pretrained(tmp_path / "hf")
    mxfp4, dequantized = to_mxfp4(tmp_path / "hf", tmp_path)
    convert(mxfp4, tmp_path / "g32.colibri", dtype="float32", quantize="expert", group_size=32, workers=1)
    convert(dequantized, tmp_path / "f32.colibri", dtype="float32", quantize="none", workers=1)
    with colibri_format.open(tmp_path / "g32.colibri") as q, colibri_format.open(tmp_path / "f32.colibri") as f:
        assert q.metadata["quantization"]["error"]["max_rel"] == 0.0
        for layer in q.model["moe_layers"]:
            for e in range(q.model["num_experts"]):
                for a, b in zip(q.expert_f32(layer, e), f.expert_f32(layer, e)):
                    np.testing.assert_array_equal(a, b)


def _gpt_oss_mxfp4(tmp_path):
    hf = build_hf("gpt_oss", intermediate_size=64)
    hf.save_pretrained(tmp_path / "hf")
    return to_mxfp4(tmp_path / "hf", tmp_path)


def test_mxfp4_experts_are_copied_bit_for_bit(tmp_path):
    """--quantize mxfp4: each blob holds the checkpoint's blocks and E8M0 scales themselves (gate_up rows
    de-interleaved, gate rows first); the engine then computes exactly what the int8 g32 file (the same values,
    held as int8) computes."""
    import colibri_format
    from safetensors.numpy import load_file

    from colibri_format.convert.derived import _deinterleave

    mxfp4, _ = _gpt_oss_mxfp4(tmp_path)
    summary = convert(mxfp4, tmp_path / "mx.colibri", dtype="float32", quantize="mxfp4", workers=2)
    convert(mxfp4, tmp_path / "g32.colibri", dtype="float32", quantize="expert", group_size=32, workers=1)
    assert summary.expert_format == "mxfp4" and summary.quant_error_max == 0.0
    raw = load_file(str(mxfp4 / "model.safetensors"))
    with colibri_format.open(tmp_path / "mx.colibri", verify="always") as f:
        assert (f.header.version_minor, f.header.group_size) == (1, 32)
        assert f.metadata["quantization"]["bits"] == 4
        for layer in f.model["moe_layers"]:
            p = f"model.layers.{layer}.mlp.experts."
            order = _deinterleave(raw[p + "gate_up_proj_blocks"].shape[1])
            for e in range(f.model["num_experts"]):
                v = f.expert(layer, e)
                blocks, scales = raw[p + "gate_up_proj_blocks"][e][order], raw[p + "gate_up_proj_scales"][e][order]
                np.testing.assert_array_equal(v.gate_up, blocks.reshape(blocks.shape[0], -1))
                np.testing.assert_array_equal(v.gate_up_scale, scales)
                np.testing.assert_array_equal(v.down, raw[p + "down_proj_blocks"][e].reshape(v.down.shape))
                np.testing.assert_array_equal(v.down_scale, raw[p + "down_proj_scales"][e])
    batch = prompts(96, [9, 5], seed=2)
    with Engine(tmp_path / "mx.colibri") as mx, Engine(tmp_path / "g32.colibri") as g32:
        for a, b in zip(mx.logits(batch), g32.logits(batch)):
            np.testing.assert_array_equal(a, b)


def test_mxfp4_output_needs_an_mxfp4_checkpoint(tmp_path):
    hf = build_hf("gpt_oss", intermediate_size=64)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(UnsupportedModel, match="--quant-bits 4") as info:
        convert(tmp_path / "hf", tmp_path / "x.colibri", quantize="mxfp4")
    assert "experts" in info.value.field
    assert not (tmp_path / "x.colibri").exists() and not list(tmp_path.glob(".x.colibri*"))


def _mxfp4_with_a_nan_scale(tmp_path):
    """The gpt-oss MXFP4 checkpoint with one E8M0 scale set to 0xFF (NaN): expert 2, row 5, block 1 of layer 1's
    down_proj."""
    from safetensors.numpy import load_file, save_file

    mxfp4, _ = _gpt_oss_mxfp4(tmp_path)
    tensors = load_file(str(mxfp4 / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 1] = 0xFF
    save_file(tensors, str(mxfp4 / "model.safetensors"), metadata={"format": "pt"})
    return mxfp4


def test_mxfp4_nan_scale_is_refused_by_name(tmp_path):
    from colibri_format.errors import NonFiniteWeight

    mxfp4 = _mxfp4_with_a_nan_scale(tmp_path)
    with pytest.raises(NonFiniteWeight, match="0xFF") as info:
        convert(mxfp4, tmp_path / "x.colibri", quantize="mxfp4", workers=1)
    assert info.value.field == "model.layers.1.mlp.experts.down_proj" and "row 5, block 1" in str(info.value)


def test_mxfp4_nan_scale_is_refused_when_converting_to_int8_groups(tmp_path):
    """The exact MXFP4 -> int8 g32 path (no second rounding) refuses a 0xFF scale as the rounding path does."""
    from colibri_format.errors import NonFiniteWeight

    mxfp4 = _mxfp4_with_a_nan_scale(tmp_path)
    with pytest.raises(NonFiniteWeight) as info:
        convert(mxfp4, tmp_path / "x.colibri", quantize="expert", group_size=32, workers=1)
    assert info.value.field == "model.layers.1.mlp.experts.down_proj" and "expert 2 of layer 1" in str(info.value)
    assert not (tmp_path / "x.colibri").exists()
