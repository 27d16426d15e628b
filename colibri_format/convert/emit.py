"""Streaming one planned piece (a dense tensor or an expert blob) into the `.part` file, chunk by chunk.

`SlotStream` writes strictly forward from the piece's planned offset with positional writes and hashes the
same bytes on the way, so the checksum equals the one-shot XXH3 of the finished piece without the piece
ever being in memory. Gaps (array padding inside a blob) are written as zeros explicitly: a resumed run
may be overwriting bytes of an interrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from colibri_format import spec as S
from colibri_format.convert import crashpoint
from colibri_format.convert.quantize import quantize_int8
from colibri_format.convert.rows import RowSpan, iter_chunks, to_float32
from colibri_format.dtypes import to_storage
from colibri_format.errors import InvalidInput, WriteError
from colibri_format.fsutil import pwrite_all
from colibri_format.spec.checksum import dense_seed, expert_seed

_ZEROS = bytes(S.BLOB_ALIGNMENT)
_STORED_AS = {"float32": S.DType.F32, "float16": S.DType.F16, "bfloat16": S.DType.BF16}


class SlotStream:
    """Forward-only writer of `size` bytes at `offset` of `fd`, hashing them with `seed`."""

    def __init__(self, fd: int, offset: int, size: int, seed: int) -> None:
        self.fd, self.base, self.size = fd, offset, size
        self.pos = 0
        self._hash = xxhash.xxh3_64(seed=seed)

    def put(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self.pos + len(view) > self.size:
            raise WriteError("piece overflows its planned slot", field="offset", value=self.base + self.pos)
        crashpoint.hit("data-write")
        pwrite_all(self.fd, view, self.base + self.pos)
        self._hash.update(view)
        self.pos += len(view)

    def pad_to(self, pos: int) -> None:
        while self.pos < pos:
            self.put(_ZEROS[:min(len(_ZEROS), pos - self.pos)])

    def finish(self) -> int:
        self.pad_to(self.size)
        return self._hash.intdigest()


# --- dense tensors --------------------------------------------------------------------------------
def write_dense(fd: int, t: S.PlannedTensor, src: Any, spans: tuple[RowSpan, ...]) -> int:
    """Stream one dense tensor in the file's dense dtype; returns its checksum."""
    stream = SlotStream(fd, t.offset, t.size, dense_seed(t.name, t.offset))
    for chunk, dtype in iter_chunks(src, spans):
        if _STORED_AS.get(dtype) == t.dtype:
            stream.put(np.ascontiguousarray(chunk))  # same dtype: the stored bits, untouched
        else:
            stream.put(to_storage(to_float32(chunk, dtype), t.dtype))
    if stream.pos != t.size:
        raise InvalidInput(f"{t.name}: source gave {stream.pos} bytes for a {t.size}-byte tensor", field=t.name)
    return stream.finish()


# --- expert blobs ---------------------------------------------------------------------------------
@dataclass
class ErrorStats:
    """Relative quantization error of one expert: max, and the sum over `count` elements for the mean."""

    max_rel: float = 0.0
    sum_rel: float = 0.0
    count: int = 0

    def add(self, max_rel: float, mean_rel: float, n: int) -> None:
        self.max_rel = max(self.max_rel, max_rel)
        self.sum_rel += mean_rel * n
        self.count += n

    @property
    def mean_rel(self) -> float:
        return self.sum_rel / self.count if self.count else 0.0


def write_expert(fd: int, blob: S.BlobLayout, offset: int, key: tuple[int, int], src: Any,
                 matrices: dict[str, tuple[RowSpan, ...]]) -> tuple[int, ErrorStats]:
    """Stream one expert blob (gate_up, [scale], down, [scale]); returns (checksum, error stats)."""
    stream = SlotStream(fd, offset, blob.size, expert_seed(key[0], key[1], offset))
    stats = ErrorStats()
    quantized = blob.expert_format in S.QUANTIZED_FORMATS
    group = blob.group_size or None
    for arr in blob.arrays:
        if arr.name.endswith("_scale"):
            continue  # written right after its matrix
        stream.pad_to(arr.offset)
        scale = None
        if quantized:
            scale = _quantized_matrix(stream, src, matrices[arr.name], group, stats)
        else:
            for chunk, dtype in iter_chunks(src, matrices[arr.name]):
                stream.put(_stored_chunk(chunk, dtype, arr.dtype))
        if stream.pos != arr.offset + arr.nbytes:
            raise InvalidInput(f"expert {key}: source gave the wrong size for {arr.name}", field=arr.name)
        if scale is not None:
            scale_arr = blob.array(arr.name + "_scale")
            _check_shape(scale, scale_arr.shape, scale_arr.name)
            stream.pad_to(scale_arr.offset)
            stream.put(scale)
    return stream.finish(), stats


def _stored_chunk(chunk: np.ndarray, dtype: str, target: S.DType) -> np.ndarray:
    if _STORED_AS.get(dtype) == target:
        return np.ascontiguousarray(chunk)
    return to_storage(to_float32(chunk, dtype), target)


def _quantized_matrix(stream: SlotStream, src: Any, spans: tuple[RowSpan, ...], group: int | None,
                      stats: ErrorStats) -> np.ndarray:
    """Quantize and write a matrix row chunk by row chunk; returns its float32 scales (small)."""
    scales = []
    buf = None
    for chunk, dtype in iter_chunks(src, spans):
        if buf is None or buf.size < chunk.size:
            buf = np.empty(chunk.size, np.float32)
        w = to_float32(chunk, dtype, buf[:chunk.size].reshape(chunk.shape))
        q = quantize_int8(w, group)
        stream.put(q.q)
        scales.append(q.scale)
        stats.add(q.max_rel_err, q.mean_rel_err, w.size)
    return np.ascontiguousarray(np.concatenate(scales), dtype=np.float32)


def _check_shape(array: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    if tuple(array.shape) != tuple(shape):
        raise InvalidInput(f"{name} has shape {array.shape}, expected {shape}", field=name, value=array.shape)
