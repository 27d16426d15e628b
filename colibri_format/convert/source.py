"""`SourceCheckpoint`: one Hugging Face checkpoint folder, read tensor by tensor.

Layouts, in order of preference:
1. `model.safetensors.index.json` + shards (names from its `weight_map`),
2. a single `model.safetensors`,
3. only with `allow_pickle=True`: `pytorch_model.bin.index.json` + shards, or `pytorch_model.bin`.

A tensor is read as `native_view(name)`: its stored values (bf16 as uint16), a
zero-copy read-only view of the safetensors mapping, so slicing it reads only
those rows (pickled files hand over a copy). Reads touch no shared mutable state
beyond a lazily created read-only mapping, so several threads may read from one
SourceCheckpoint at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from colibri_format.convert.hf_config import HFConfig, load_config, parse_json_object
from colibri_format.convert.safe_paths import check_basename, read_capped, resolve_member, short_repr
from colibri_format.convert.safetensors_file import SafetensorsFile, declared_header_bytes
from colibri_format.dtypes import to_float32
from colibri_format.errors import InvalidInput, UnsupportedModel

INDEX_MAX_BYTES = 64 << 20
MAX_SHARDS = 16_384  # weight files one index may name (the largest public checkpoints have a few thousand)
# The safetensors headers of all shards together (each is also capped, at safetensors_file.HEADER_MAX_BYTES):
# parsed headers are held in memory for the whole conversion.
MAX_TOTAL_HEADER_BYTES = 256 << 20
ST_INDEX, ST_SINGLE = "model.safetensors.index.json", "model.safetensors"
PT_INDEX, PT_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


@dataclass(frozen=True)
class SourceFile:
    """A weight file of the checkpoint, for provenance and the resume journal."""

    name: str
    size: int


class _File(Protocol):
    """What SafetensorsFile and TorchBinFile both offer."""

    name: str
    size: int
    names: list[str]

    def __contains__(self, name: str) -> bool: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> str: ...
    def native_view(self, name: str) -> np.ndarray: ...
    def close(self) -> None: ...


def _weight_map(raw: dict[str, Any], what: str) -> dict[str, str]:
    wm = raw.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise InvalidInput(f"{what}: 'weight_map' must be a non-empty object", field="weight_map")
    shards = len(set(map(str, wm.values())))  # before any shard is looked at
    if shards > MAX_SHARDS:
        raise InvalidInput(f"{what} names {shards:,} weight files, over the limit of {MAX_SHARDS:,}",
                           field="weight_map", value=shards)
    for tensor, shard in wm.items():
        check_basename(shard, field=f"{what} weight_map[{short_repr(tensor)}]")
    return wm


class SourceCheckpoint:
    """Read-only access to a checkpoint's tensors by their Hugging Face names."""

    def __init__(self, root: Path, config: HFConfig, source_format: str, files: dict[str, _File],
                 weight_map: dict[str, str], index_xxh3: str | None) -> None:
        self.root = root
        self.config = config
        self.source_format = source_format
        self.index_xxh3 = index_xxh3
        self._files = files
        self._where = weight_map  # tensor name -> file name
        self._check_weight_map()

    def _check_weight_map(self) -> None:
        for tensor, fname in self._where.items():
            if tensor not in self._files[fname]:
                raise InvalidInput(f"index lists {short_repr(tensor)} in {fname!r}, which does not hold it",
                                   field=tensor)

    # --- listing -------------------------------------------------------------------------------
    @property
    def files(self) -> list[SourceFile]:
        return [SourceFile(name, f.size) for name, f in sorted(self._files.items())]

    @property
    def config_xxh3(self) -> str:
        return self.config.xxh3

    def tensor_names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> _File:
        try:
            return self._files[self._where[name]]
        except KeyError:
            raise InvalidInput(f"checkpoint has no tensor {name!r}", field=name) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> str:
        """'float32' | 'float16' | 'bfloat16' | 'float64' (or the raw tag of a non-float tensor)."""
        return self._file(name).dtype(name)

    # --- reading -------------------------------------------------------------------------------
    def native_view(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bf16 as uint16) without copying: a read-only view of the
        safetensors mapping (slice it to read only some rows). Pickled sources return a copy."""
        return self._file(name).native_view(name)

    def raw_view(self, name: str) -> np.ndarray:
        """A one-byte tensor's stored bytes as uint8 (FP8 / FP4 sources, dequantized by convert/derived.py)."""
        return self._safetensors_view(name, "raw_view")

    def int_view(self, name: str) -> np.ndarray:
        """An integer tensor in its stored dtype (compressed-tensors' packed int4 weights, convert/derived.py)."""
        return self._safetensors_view(name, "int_view")

    def _safetensors_view(self, name: str, view: str) -> np.ndarray:
        """`view` of a quantized tensor's file: only safetensors files have one (pickled ones are refused)."""
        f = self._file(name)
        if not hasattr(f, view):
            raise UnsupportedModel(f"tensor {name!r} is {f.dtype(name)} in a pickled file; quantized weights are "
                                   "read from safetensors only", field=name)
        return getattr(f, view)(name)

    def positional_reader(self, name: str, view: np.ndarray) -> tuple[Any, int] | None:
        """(file, byte offset) to read the bytes of `view` with `file.read_at`, when `view` is a view of the
        mapped file that holds tensor `name` (safetensors); None otherwise (pickled files, computed views)."""
        f = self._files.get(self._where.get(name, ""))
        offset = f.file_offset(view) if isinstance(f, SafetensorsFile) else None
        return None if offset is None else (f, offset)

    def element_offset(self, name: str, index: tuple[int, ...]) -> int | None:
        """Byte offset in its file of one element of tensor `name` (None for pickled sources)."""
        f = self._file(name)
        if not hasattr(f, "element_offset"):
            return None
        flat = 0
        for i, d in zip(index, f.shape(name)):
            flat = flat * d + i
        return f.element_offset(name, flat)

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a fresh float32 array."""
        return to_float32(self.native_view(name))

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_index(root: Path, index_name: str) -> tuple[dict[str, str], str]:
    path = resolve_member(root, index_name, field=index_name)
    data = read_capped(path, max_bytes=INDEX_MAX_BYTES, field=index_name)
    return _weight_map(parse_json_object(data, what=index_name), index_name), xxhash.xxh3_64_hexdigest(data)


def _open_files(root: Path, names: set[str], opener: Any) -> dict[str, _File]:
    return {n: opener(resolve_member(root, n, field=f"shard {n!r}"), n) for n in sorted(names)}


def _check_header_total(root: Path, names: set[str]) -> None:
    """The shards' safetensors headers together stay under MAX_TOTAL_HEADER_BYTES: summed from each file's
    8-byte length field before any header is read."""
    total = sum(declared_header_bytes(resolve_member(root, n, field=f"shard {n!r}")) for n in sorted(names))
    if total > MAX_TOTAL_HEADER_BYTES:
        raise InvalidInput(f"the safetensors headers of the {len(names):,} shards take {total:,} bytes together, "
                           f"over the limit of {MAX_TOTAL_HEADER_BYTES:,}", field="safetensors_headers", value=total)


def _open_safetensors(root: Path, config: HFConfig) -> SourceCheckpoint:
    index_xxh3 = None
    if (root / ST_INDEX).exists():
        weight_map, index_xxh3 = _read_index(root, ST_INDEX)
        _check_header_total(root, set(weight_map.values()))
        files = _open_files(root, set(weight_map.values()), SafetensorsFile)
    else:
        files = _open_files(root, {ST_SINGLE}, SafetensorsFile)
        weight_map = {t: ST_SINGLE for t in files[ST_SINGLE].names}
    return SourceCheckpoint(root, config, "safetensors", files, weight_map, index_xxh3)


def _open_torch_bin(root: Path, config: HFConfig) -> SourceCheckpoint:
    from colibri_format.convert.torch_bin import TorchBinFile

    index_xxh3 = None
    if (root / PT_INDEX).exists():
        weight_map, index_xxh3 = _read_index(root, PT_INDEX)
        files = _open_files(root, set(weight_map.values()), TorchBinFile)
    else:
        files = _open_files(root, {PT_SINGLE}, TorchBinFile)
        weight_map = {t: PT_SINGLE for t in files[PT_SINGLE].names}
    return SourceCheckpoint(root, config, "pytorch_bin", files, weight_map, index_xxh3)


def open_checkpoint(checkpoint_dir: str | Path, *, allow_pickle: bool = False) -> SourceCheckpoint:
    """Open a checkpoint folder; pickled `.bin` weights only when no safetensors exist and allowed."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise InvalidInput(f"{str(root)!r} is not a directory", field="checkpoint_dir")
    config = load_config(root)
    if (root / ST_INDEX).exists() or (root / ST_SINGLE).exists():
        return _open_safetensors(root, config)
    if (root / PT_INDEX).exists() or (root / PT_SINGLE).exists():
        if not allow_pickle:
            raise UnsupportedModel("only pickled pytorch_model*.bin weights found; pickles can run code, so "
                                   "this needs allow_pickle=True (or convert to safetensors)", field="allow_pickle")
        return _open_torch_bin(root, config)
    raise InvalidInput(f"no {ST_SINGLE}, {ST_INDEX} or {PT_SINGLE} in the checkpoint folder",
                       field="checkpoint_dir")
