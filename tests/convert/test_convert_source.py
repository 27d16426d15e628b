"""SourceCheckpoint: single/sharded safetensors, bf16/fp16, the pickle fallback, and hostile folders."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from colibri_format.convert import describe
from colibri_format.convert import source as source_mod
from colibri_format.convert.source import open_checkpoint
from colibri_format.dtypes import to_float32
from colibri_format.errors import InvalidInput, UnsupportedModel

FUSED_GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
MINIMAL_CONFIG = json.dumps({"model_type": "mixtral"})


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_tensor_reads_back_exactly(tiny_checkpoint: Any, tiny_reference: Any, sharded: bool,
                                         dtype: str) -> None:
    ref = tiny_reference("mixtral", dtype=dtype)
    with open_checkpoint(tiny_checkpoint("mixtral", fused=True, sharded=sharded, dtype=dtype)) as src:
        assert src.tensor_names() == sorted(ref)
        assert (len(src.files) > 1) == sharded and (src.index_xxh3 is not None) == sharded
        for name, expected in ref.items():
            assert src.shape(name) == expected.shape
            assert src.dtype(name) == dtype
            got = src.read(name)
            assert got.dtype == np.float32 and np.array_equal(got, expected), name


@pytest.mark.parametrize("dtype, storage", [("bfloat16", np.uint16), ("float16", np.float16),
                                            ("float32", np.float32)])
def test_native_view_keeps_the_stored_bits(tiny_checkpoint: Any, tiny_reference: Any, dtype: str,
                                           storage: Any) -> None:
    ref = tiny_reference("olmoe", dtype=dtype)["model.embed_tokens.weight"]
    with open_checkpoint(tiny_checkpoint("olmoe", dtype=dtype)) as src:
        native = src.native_view("model.embed_tokens.weight")
        assert native.dtype == storage
        widened = (native.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else native
        assert np.array_equal(widened.astype(np.float32), ref)


def test_one_expert_of_a_fused_tensor_is_read_without_the_rest(tiny_checkpoint: Any, tiny_reference: Any) -> None:
    ref = tiny_reference("mixtral", dtype="bfloat16")
    with open_checkpoint(tiny_checkpoint("mixtral", fused=True, dtype="bfloat16")) as src:
        for e in range(4):
            got = to_float32(src.native_view(FUSED_GATE_UP)[e])
            assert got.shape == (32, 32) and np.array_equal(got, ref[FUSED_GATE_UP][e])
            assert got.flags.owndata and got.flags.writeable  # a copy, not a view into the mapping
        with pytest.raises(InvalidInput):
            src.read("no.such.tensor")


def test_provenance_lists_files_and_hashes(tiny_checkpoint: Any) -> None:
    folder = tiny_checkpoint("qwen3_moe", sharded=True)
    with open_checkpoint(folder) as src:
        prov = describe.provenance(src)
    assert prov["source_format"] == "safetensors" and prov["tool"] == "colibri-format"
    assert prov["config_xxh3"] == xxhash.xxh3_64_hexdigest((folder / "config.json").read_bytes())
    index = folder / "model.safetensors.index.json"
    assert prov["index_xxh3"] == xxhash.xxh3_64_hexdigest(index.read_bytes())
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert [f["name"] for f in prov["source_files"]] == names
    for entry in prov["source_files"]:
        assert entry["size"] == (folder / entry["name"]).stat().st_size


# --- hostile shard names ---------------------------------------------------------------------------

def rewrite_index(folder: Path, shard: str) -> None:
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("shard", ["../model.safetensors", "/etc/passwd", "a/../../b.safetensors", "sub/x",
                                   "..", ".hidden", "", "a\\b", 7])
def test_shard_path_traversal_is_rejected(tiny_checkpoint: Any, tmp_path: Path, shard: Any) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=True), tmp_path / "ckpt")
    rewrite_index(folder, shard)
    with pytest.raises(InvalidInput, match="plain file name"):
        open_checkpoint(folder)


def test_shard_symlink_escaping_the_folder_is_rejected(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=True), tmp_path / "ckpt")
    victim = sorted(folder.glob("model-*.safetensors"))[0]
    outside = tmp_path / "outside.safetensors"
    victim.rename(outside)
    os.symlink(outside, victim)
    with pytest.raises(InvalidInput, match="outside"):
        open_checkpoint(folder)


def test_hub_cache_snapshot_symlinks_are_followed(tiny_checkpoint: Any, tmp_path: Path) -> None:
    src_folder = tiny_checkpoint("mixtral")
    snapshot = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in src_folder.iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        os.symlink(f"../../blobs/sha-{f.name}", snapshot / f.name)
    with open_checkpoint(snapshot) as src:
        assert src.has("lm_head.weight")


def test_index_naming_a_tensor_its_shard_lacks_is_rejected(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=True), tmp_path / "ckpt")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = next(iter(data["weight_map"].values()))
    index.write_text(json.dumps(data))
    with pytest.raises(InvalidInput, match="ghost"):
        open_checkpoint(folder)


@pytest.mark.parametrize("index_text", ["[]", '{"weight_map": []}', '{"weight_map": {}}',
                                        '{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'])
def test_malformed_index_is_rejected(tiny_checkpoint: Any, tmp_path: Path, index_text: str) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=True), tmp_path / "ckpt")
    (folder / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(InvalidInput):
        open_checkpoint(folder)


# --- hostile safetensors headers -------------------------------------------------------------------

def write_safetensors(folder: Path, header: dict[str, Any], data: bytes, *, declared: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw) if declared is None else declared) + raw + data
    (folder / "model.safetensors").write_bytes(blob)
    return folder


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, data, needle", [
    ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12), "overlaps"),
    ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, bytes(20), "gap"),
    ({"a": entry("F32", [2], 0, 8)}, bytes(16), "cover"),
    ({"a": entry("F32", [3], 0, 8)}, bytes(8), "needs"),
    ({"a": entry("Q4", [2], 0, 8)}, bytes(8), "dtype"),
    ({"a": entry("F32", [-2], 0, 8)}, bytes(8), "shape"),
    ({"a": entry("F32", [2], 8, 0)}, bytes(8), "data_offsets"),
    ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), "data_offsets"),
    ({"a": entry("F32", [1 << 40, 1 << 40], 0, 8)}, bytes(8), "needs"),
])
def test_bad_safetensors_headers_are_rejected(tmp_path: Path, header: dict[str, Any], data: bytes,
                                              needle: str) -> None:
    (tmp_path / "config.json").write_text(MINIMAL_CONFIG)
    with pytest.raises(InvalidInput, match=needle):
        open_checkpoint(write_safetensors(tmp_path, header, data))


def test_header_length_beyond_the_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(MINIMAL_CONFIG)
    with pytest.raises(InvalidInput, match="header length"):
        open_checkpoint(write_safetensors(tmp_path, {}, b"", declared=1 << 40))
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(InvalidInput, match="too short"):
        open_checkpoint(tmp_path)


def test_fp8_tensor_is_listed_but_reading_it_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(MINIMAL_CONFIG)
    header = {"__metadata__": {"format": "pt"}, "w": entry("F8_E4M3", [4], 0, 4), "x": entry("BF16", [2], 4, 8)}
    with open_checkpoint(write_safetensors(tmp_path, header, bytes(4) + b"\x80\x3f\x00\xc0")) as src:
        assert src.dtype("w") == "f8_e4m3"
        with pytest.raises(UnsupportedModel, match="F8_E4M3"):
            src.read("w")
        assert src.read("x").tolist() == [1.0, -2.0]


# --- pickle fallback -------------------------------------------------------------------------------

def make_bin_checkpoint(tiny_checkpoint: Any, tmp_path: Path, ref: dict[str, Any]) -> Path:
    import torch

    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(tiny_checkpoint("mixtral", fused=True) / "config.json", folder)
    torch.save({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in ref.items()}, folder / "pytorch_model.bin")
    return folder


def test_pickle_needs_opt_in_and_then_reads(tiny_checkpoint: Any, tiny_reference: Any, tmp_path: Path) -> None:
    ref = tiny_reference("mixtral", dtype="bfloat16")
    folder = make_bin_checkpoint(tiny_checkpoint, tmp_path, ref)
    with pytest.raises(UnsupportedModel, match="allow_pickle"):
        open_checkpoint(folder)
    with open_checkpoint(folder, allow_pickle=True) as src:
        assert src.source_format == "pytorch_bin"
        assert src.dtype(FUSED_GATE_UP) == "bfloat16"
        assert np.array_equal(src.read(FUSED_GATE_UP), ref[FUSED_GATE_UP])
        assert np.array_equal(to_float32(src.native_view(FUSED_GATE_UP)[2]), ref[FUSED_GATE_UP][2])
        native = src.native_view(FUSED_GATE_UP)
        assert native.dtype == np.uint16
        assert np.array_equal((native.astype(np.uint32) << 16).view(np.float32), ref[FUSED_GATE_UP])


def test_hostile_pickle_is_refused_even_when_allowed(tmp_path: Path) -> None:
    import pickle

    (tmp_path / "config.json").write_text(MINIMAL_CONFIG)

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Boom()}))
    with pytest.raises(InvalidInput, match="weights-only"):
        open_checkpoint(tmp_path, allow_pickle=True)
    assert not (tmp_path / "pwned").exists()


def test_safetensors_win_over_bin_and_empty_folder_fails(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral"), tmp_path / "ckpt")
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    with open_checkpoint(folder) as src:
        assert src.source_format == "safetensors"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(MINIMAL_CONFIG)
    with pytest.raises(InvalidInput, match="no model.safetensors"):
        open_checkpoint(empty)
    with pytest.raises(InvalidInput, match="not a directory"):
        open_checkpoint(tmp_path / "missing")


def test_index_size_cap(tiny_checkpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=True), tmp_path / "ckpt")
    monkeypatch.setattr(source_mod, "INDEX_MAX_BYTES", 16)
    with pytest.raises(InvalidInput, match="cap"):
        open_checkpoint(folder)


def test_fingerprint_tracks_config_and_file_sizes(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral", sharded=True), tmp_path / "ckpt")
    with open_checkpoint(folder) as src:
        before = describe.input_fingerprint(src, {})
    with open_checkpoint(folder) as src:
        assert describe.input_fingerprint(src, {}) == before
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    with open_checkpoint(folder) as src:
        assert describe.input_fingerprint(src, {}) != before


def test_native_view_is_a_read_only_zero_copy_view(tiny_checkpoint: Any, tiny_reference: Any) -> None:
    ref = tiny_reference("mixtral", dtype="bfloat16")
    with open_checkpoint(tiny_checkpoint("mixtral", fused=True, dtype="bfloat16")) as src:
        view = src.native_view(FUSED_GATE_UP)
        assert view.dtype == np.uint16 and not view.flags.writeable and not view.flags.owndata
        assert np.array_equal((view[1].astype(np.uint32) << 16).view(np.float32), ref[FUSED_GATE_UP][1])


def test_shard_truncated_after_open_is_caught_before_mapping(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = copy_checkpoint(tiny_checkpoint("mixtral"), tmp_path / "ckpt")
    with open_checkpoint(folder) as src:
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-4])
        with pytest.raises(InvalidInput, match="changed size"):
            src.read("model.norm.weight")
