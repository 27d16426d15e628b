"""Hypothesis: hostile configs and safetensors bytes only ever raise the ColibriFormatError family."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from colibri_format.convert.adapters import normalize_config
from colibri_format.convert.source import open_checkpoint
from colibri_format.dtypes import to_float32
from colibri_format.errors import ColibriFormatError
from colibri_format.spec import check_model
from tests.convert.hand_configs import MIXTRAL, QWEN2, QWEN3

KEYS = sorted({*MIXTRAL, *QWEN2, "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
               "use_sliding_window", "layer_types", "mlp_only_layers", "decoder_sparse_step", "clip_qkv",
               "tie_word_embeddings", "quantization_config", "embedding_multiplier", "logits_scaling",
               "shared_intermediate_size", "num_experts", "n_routed_experts", "rms_norm_eps", "hidden_act"})
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 22), st.floats(allow_nan=False),
                    st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(
                                                           ["rope_type", "type", "factor", "rope_theta",
                                                            "quant_method", "short_factor"]), inner, max_size=3)),
                      max_leaves=8)
MODEL_TYPES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "gpt_oss"]
NO_SHRINK = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=300, **NO_SHRINK)
@given(st.sampled_from([MIXTRAL, QWEN2, QWEN3]), st.sampled_from(MODEL_TYPES),
       st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_any_config_is_normalized_or_rejected_cleanly(base: dict[str, Any], model_type: str,
                                                      changes: dict[str, Any]) -> None:
    raw = {**base, "model_type": model_type, **changes}
    try:
        _, model = normalize_config(raw)
    except ColibriFormatError:
        return
    check_model(model)  # whatever passes must also pass the format's own schema
    json.dumps(model, allow_nan=False)


def small_safetensors(folder: Path) -> bytes:
    (folder / "config.json").write_text(json.dumps(MIXTRAL))
    path = folder / "model.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float16)}, str(path))
    return path.read_bytes()


@settings(max_examples=200, **NO_SHRINK)
@given(data=st.data())
def test_mutated_safetensors_bytes_never_escape_the_error_family(tmp_path_factory: Any, data: Any) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    blob = bytearray(small_safetensors(folder))
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, header_end - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    (folder / "model.safetensors").write_bytes(bytes(blob))
    try:
        with open_checkpoint(folder) as src:
            for name in src.tensor_names():
                src.read(name)
    except ColibriFormatError:
        pass


def test_safetensors_written_by_the_library_read_back(tmp_path: Path) -> None:
    small_safetensors(tmp_path)
    with open_checkpoint(tmp_path) as src:
        assert src.read("a").tolist() == [[0, 1, 2], [3, 4, 5]]
        assert src.dtype("b") == "float16" and src.read("b").tolist() == [1, 1, 1, 1]


def test_reading_one_expert_allocates_only_that_expert(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    big = np.random.default_rng(0).standard_normal((16, 256, 256), dtype=np.float32)  # 4 MiB, 256 KiB each
    save_file({"experts": big}, str(tmp_path / "model.safetensors"))
    del big
    with open_checkpoint(tmp_path) as src:
        to_float32(src.native_view("experts")[0])  # warm up the mapping
        tracemalloc.start()
        try:
            one = to_float32(src.native_view("experts")[7])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert one.shape == (256, 256)
    assert peak < 2 * one.nbytes, f"peak {peak} bytes for a {one.nbytes}-byte slice"


@pytest.mark.parametrize("blob", [b"", b"\x00" * 7, struct.pack("<Q", 2) + b"{}", struct.pack("<Q", 2) + b"[]"])
def test_degenerate_safetensors_files(tmp_path: Path, blob: bytes) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    (tmp_path / "model.safetensors").write_bytes(blob)
    try:
        with open_checkpoint(tmp_path) as src:
            assert src.tensor_names() == []
    except ColibriFormatError:
        pass
