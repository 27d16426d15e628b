"""The NumPy engine on int4_group and mxfp4 experts: it computes exactly what it computes on float32 experts
holding the dequantized weights (float32 engine), with float activations, and with `int8_activations` (int4_group)
what those compute on expert inputs rounded to int8 per group of 32; the float64 oracle reads the same weights (what
every CUDA kernel is tested against); paged (a small expert cache) and resident runs agree."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import colibri_format
from colibri_format import spec as S
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.synthetic import synthetic_model, write_synthetic
from colibri_format.writer import ColibriWriter

FORMATS = {"int4-g32": (S.ExpertFormat.INT4_GROUP, 32), "int4-g64": (S.ExpertFormat.INT4_GROUP, 64),
           "mxfp4": (S.ExpertFormat.MXFP4, 32)}
MODEL = dict(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, expert_inter=128)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def files(request, tmp_path_factory):
    """(a 4-bit file, a float32-expert file with the same dense tensors and the 4-bit file's dequantized experts)."""
    fmt, group = FORMATS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = synthetic_model(**MODEL)
    packed = write_synthetic(d / "q.colibri", model, expert_format=fmt, group_size=group, seed=3)
    with colibri_format.open(packed) as f, ColibriWriter(d / "f.colibri", model, dense_dtype=S.DType.F32,
                                                         expert_format=S.ExpertFormat.F32) as w:
        for t in w.plan.dense:
            w.write_dense(t.name, f.dense_f32(t.name))
        for layer, e in w.plan.blob_keys():
            gate_up, down = f.expert_f32(layer, e)
            w.write_expert(layer, e, {"gate_up": gate_up, "down": down})
        meta = dict(f.metadata, quantization={"experts": "float32", "dense_dtype": "float32", "bits": None,
                                              "group_size": None})
        w.finalize(meta)
    return packed, str(d / "f.colibri")


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_logits_equal_those_of_the_dequantized_float32_file(files, precision):
    packed, flat = files
    batch = [[1, 5, 9, 2, 33, 17], [4, 4, 60]]
    config = EngineConfig(precision=precision, int8_activations=False)
    with Engine(packed, config) as q, Engine(flat, config) as f:
        for a, b in zip(q.logits(batch), f.logits(batch)):
            np.testing.assert_array_equal(a, b)
        assert q.generate(batch[0], max_new_tokens=6, stop_ids=[]).output_ids == \
            f.generate(batch[0], max_new_tokens=6, stop_ids=[]).output_ids


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_int8_activations_are_the_float_products_of_rounded_inputs(files, precision, monkeypatch):
    """int4_group: the switch rounds both expert products' inputs (numpy_backend.round_int8_groups), which the
    float32-expert file computes when its expert_ffn rounds them; mxfp4 (not in limits.A8_FORMATS) is unchanged."""
    packed, flat = files
    batch = [[1, 5, 9, 2, 33, 17], [4, 4, 60]]
    with Engine(packed, EngineConfig(precision=precision)) as q:
        rounded = q.logits(batch)
        int4 = S.ExpertFormat(q.reader.blob_layout.expert_format) == S.ExpertFormat.INT4_GROUP
    with Engine(packed, EngineConfig(precision=precision, int8_activations=False)) as q:
        plain = q.logits(batch)
    for a, b in zip(rounded, plain):
        if int4:
            assert not np.array_equal(a, b)
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.05
        else:
            np.testing.assert_array_equal(a, b)
    if int4:
        monkeypatch.setattr(nb, "expert_ffn", functools.partial(nb.expert_ffn, round_input=nb.round_int8_groups))
        with Engine(flat, EngineConfig(precision=precision, int8_activations=False)) as f:
            for a, b in zip(rounded, f.logits(batch)):
                np.testing.assert_array_equal(a, b)


def test_rounded_float32_engine_is_near_the_rounded_float64_one(files):
    """The CUDA tests' oracle (float64, rounded) and the float32 engine round alike but near ties."""
    packed, _ = files
    batch = [[1, 5, 9, 2, 33, 17], [4, 4, 60]]
    with Engine(packed) as f32, Engine(packed, EngineConfig(precision="float64")) as f64, \
            Engine(packed, EngineConfig(precision="float64", int8_activations=False)) as plain:
        for a, b, c in zip(f32.logits(batch), f64.logits(batch), plain.logits(batch)):
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 8e-3
            if S.ExpertFormat(f32.reader.blob_layout.expert_format) == S.ExpertFormat.INT4_GROUP:
                assert np.linalg.norm(a - b) < np.linalg.norm(a - c)


def test_paged_experts_compute_the_same(files):
    packed, _ = files
    batch = [[3, 1, 4, 1, 5, 9, 2, 6]]
    with Engine(packed) as resident, Engine(packed, EngineConfig(max_cached_experts=2)) as paged:
        np.testing.assert_array_equal(resident.logits(batch)[0], paged.logits(batch)[0])


def test_float64_oracle_reads_the_same_weights(files):
    packed, _ = files
    with colibri_format.open(packed) as f:
        layout = f.blob_layout
        for layer in f.model["moe_layers"]:
            for e in range(f.model["num_experts"]):
                blob = np.frombuffer(f.expert_blob(layer, e), np.uint8).copy()
                addr = blob.ctypes.data
                w32 = nb.blob_arrays(addr, layout, np.float32)
                w64 = nb.blob_arrays(addr, layout, np.float64)
                for a32, a64, ref in zip(w32, w64, f.expert_f32(layer, e)):
                    assert a32.dtype == np.float32 and a64.dtype == np.float64
                    np.testing.assert_array_equal(a32, ref)
                    np.testing.assert_array_equal(a64, ref.astype(np.float64))   # exact in float32 already
