"""A strict, zero-copy safetensors reader built on np.memmap.

We parse the header ourselves rather than use `safetensors.safe_open`: NumPy
has no bfloat16, and going through torch would pull it into every conversion.
The data section is memory-mapped read-only, so reading one expert out of a
fused `[E, 2I, H]` tensor touches only that expert's pages; nothing ever
loads a whole shard. bf16 is viewed as uint16 (see colibri_format/dtypes.py).

The header is checked the way the reference implementation checks it: a size
cap, known dtypes, byte lengths equal to the shape product, and tensor ranges
that tile the data section exactly (sorted, no gaps, no overlap, ending at EOF).

The converter reads its row chunks with positional reads instead (`file_offset`, `read_at`): a copy from the
page cache into a buffer it reuses costs less than faulting the mapped pages in and releasing them again, and
leaves nothing of the checkpoint in its resident memory.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri_format.convert.hf_config import parse_json_object
from colibri_format.convert.safe_paths import short_repr
from colibri_format.dtypes import STORAGE
from colibri_format.errors import InvalidInput, UnsupportedModel

HEADER_MAX_BYTES = 100 << 20
MAX_NDIM = 8
MAX_EXTENT = 1 << 62  # a dimension or offset above this cannot describe bytes of a real file

# safetensors dtype tag -> the name of a float dtype we convert (colibri_format.dtypes.STORAGE)
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
# integer tags -> their numpy dtype (safetensors stores little-endian), for `int_view`
INT_DTYPES = {"I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "U16": np.dtype("<u2"),
              "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8")}
# Legal in the format but not a weight we can convert (FP8 block scales, int weights, ...).
OTHER_DTYPES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
                "I64": 8, "U64": 8, "BOOL": 1, "F8_E8M0": 1, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; `begin`/`end` are relative to the data section."""

    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int


def _itemsize(tag: str) -> int:
    if tag in FLOAT_DTYPES:
        return STORAGE[FLOAT_DTYPES[tag]].itemsize
    return OTHER_DTYPES[tag]


def _entry(name: str, spec: Any, where: str) -> TensorEntry:
    if not isinstance(spec, dict):
        raise InvalidInput(f"{where}: header entry {short_repr(name)} is not an object", field=name)
    tag, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(tag, str) or (tag not in FLOAT_DTYPES and tag not in OTHER_DTYPES):
        raise InvalidInput(f"{where}: tensor {short_repr(name)} has unknown dtype {short_repr(tag)}", field=name,
                           value=tag)
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_EXTENT for d in shape)):
        raise InvalidInput(f"{where}: tensor {short_repr(name)} has a bad shape {short_repr(shape)}", field=name,
                           value=shape)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or any(isinstance(o, bool) or not isinstance(o, int) or not 0 <= o <= MAX_EXTENT for o in offsets)
            or offsets[0] > offsets[1]):
        raise InvalidInput(f"{where}: tensor {short_repr(name)} has bad data_offsets {short_repr(offsets)}", field=name,
                           value=offsets)
    count = 1
    for d in shape:  # Python ints: no silent wrap-around; capped, so a message never prints a huge number
        count = min(count * d, MAX_EXTENT + 1)
    if count * _itemsize(tag) != offsets[1] - offsets[0]:
        raise InvalidInput(f"{where}: tensor {short_repr(name)} spans {offsets[1] - offsets[0]} bytes but "
                           f"{tag}{shape} needs {count * _itemsize(tag)}", field=name)
    return TensorEntry(name, tag, tuple(shape), offsets[0], offsets[1])


def _check_tiling(entries: list[TensorEntry], data_size: int, where: str) -> None:
    cursor = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != cursor:
            kind = "overlaps the previous tensor" if e.begin < cursor else "leaves a gap"
            raise InvalidInput(f"{where}: tensor {short_repr(e.name)} {kind} (offset {e.begin}, expected {cursor})",
                               field=e.name, offset=e.begin)
        cursor = e.end
    if cursor != data_size:
        raise InvalidInput(f"{where}: tensors cover {cursor} bytes but the data section has {data_size}",
                           offset=cursor)


def declared_header_bytes(path: Path) -> int:
    """The header length a safetensors file declares in its first 8 bytes, at most the bytes the file has after
    them (0 for a file too short to say): what opening it would read. Nothing else is read."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
    return 0 if len(head) < 8 else min(struct.unpack("<Q", head)[0], size - 8)


class SafetensorsFile:
    """One `.safetensors` file: parsed header, lazily memory-mapped data."""

    def __init__(self, path: Path, display_name: str) -> None:
        self.path = path
        self.name = display_name
        with open(path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            if self.size < 8:
                raise InvalidInput(f"{display_name}: {self.size} bytes is too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > min(HEADER_MAX_BYTES, self.size - 8):
                raise InvalidInput(f"{display_name}: header length {header_len} exceeds the file or the cap",
                                   value=header_len, offset=0)
            header = parse_json_object(fh.read(header_len), what=f"{display_name} header")
        self.data_start = 8 + header_len
        header.pop("__metadata__", None)
        self.entries = {name: _entry(name, spec, display_name) for name, spec in header.items()}
        _check_tiling(list(self.entries.values()), self.size - self.data_start, display_name)
        self._map: np.memmap | None = None
        self._fd = -1
        self._open_lock = threading.Lock()

    def _data(self) -> np.ndarray:
        if self._map is None:
            if self.size == self.data_start:  # mmap cannot map zero bytes
                return np.zeros(0, np.uint8)
            with self._open_lock:
                if self._map is None:
                    if os.stat(self.path).st_size != self.size:  # a shrunk file would SIGBUS on access
                        raise InvalidInput(f"{self.name}: file changed size since it was opened", field=self.name)
                    self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start)
        return self._map

    def file_offset(self, view: np.ndarray) -> int | None:
        """Where in the file the bytes of `view` start, when `view` is a C-contiguous view of this file's map (what
        `native_view` hands out, or a slice of it); None for anything else."""
        data = self._map
        if data is None or not isinstance(view, np.ndarray) or not view.flags.c_contiguous:
            return None
        base = view
        while base is not None and base is not data and base is not data.base:
            base = getattr(base, "base", None)
        if base is None:
            return None
        start = view.ctypes.data - data.ctypes.data
        if start < 0 or start + view.nbytes > data.nbytes:
            return None
        return self.data_start + start

    def read_at(self, offset: int, out: np.ndarray) -> None:
        """Fill `out` (a C-contiguous buffer) with the file's bytes from `offset`, by positional reads."""
        buf = memoryview(out).cast("B")
        done = 0
        while done < len(buf):
            try:
                n = os.preadv(self._fd, [buf[done:]], offset + done)
            except OSError as exc:
                raise InvalidInput(f"{self.name}: read failed at offset {offset + done}: "
                                   f"{os.strerror(exc.errno or errno.EIO)}", field=self.name) from None
            if n <= 0:
                raise InvalidInput(f"{self.name}: file changed size since it was opened", field=self.name,
                                   offset=offset + done)
            done += n

    def native_view(self, name: str) -> np.ndarray:
        """Zero-copy read-only view in the storage dtype (bf16 as uint16)."""
        e = self.entries[name]
        if e.dtype not in FLOAT_DTYPES:
            raise UnsupportedModel(f"{self.name}: tensor {short_repr(name)} has dtype {e.dtype}; only F32/F16/BF16/F64 "
                                   "weights can be converted", field=name, value=e.dtype)
        return self._data()[e.begin:e.end].view(STORAGE[FLOAT_DTYPES[e.dtype]]).reshape(e.shape)

    def raw_view(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of a one-byte tensor (FP8 weights, FP4 blocks, E8M0 scales) as uint8."""
        e = self.entries[name]
        if _itemsize(e.dtype) != 1:
            raise UnsupportedModel(f"{self.name}: tensor {short_repr(name)} has dtype {e.dtype}, not a one-byte type",
                                   field=name, value=e.dtype)
        return self._data()[e.begin:e.end].reshape(e.shape)

    def int_view(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of an integer tensor (I8 .. I64, U8 .. U64) in its little-endian dtype (the
        int32 words of compressed-tensors' packed weights, their int64 `weight_shape`)."""
        e = self.entries[name]
        if e.dtype not in INT_DTYPES:
            raise UnsupportedModel(f"{self.name}: tensor {short_repr(name)} has dtype {e.dtype}, not an integer type",
                                   field=name, value=e.dtype)
        return self._data()[e.begin:e.end].view(INT_DTYPES[e.dtype]).reshape(e.shape)

    def element_offset(self, name: str, flat_index: int) -> int:
        """Byte offset in the file of element `flat_index` (row-major) of tensor `name`."""
        e = self.entries[name]
        return self.data_start + e.begin + flat_index * _itemsize(e.dtype)

    # The same small interface as TorchBinFile, so SourceCheckpoint does not care which it holds.
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> str:
        tag = self.entries[name].dtype
        return FLOAT_DTYPES.get(tag, tag.lower())

    def close(self) -> None:
        self._map = None  # the mapping closes when the last view is gone
        with self._open_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
