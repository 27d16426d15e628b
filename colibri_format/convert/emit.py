"""Turning source rows into the bytes of one piece (a dense tensor or an expert blob), chunk by chunk.

The bytes go to a `PieceStream` of the writer, which writes them at the piece's planned offset and hashes
them on the way; nothing here touches the file. A piece is never whole in memory: each chunk of source
rows is converted (or quantized) and handed on before the next one is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_format import spec as S
from colibri_format.convert.layout import RowSpan
from colibri_format.convert.quantize import quantize_int8
from colibri_format.convert.rows import iter_chunks
from colibri_format.dtypes import NUMPY_STORAGE, to_float32, to_storage
from colibri_format.errors import InvalidInput
from colibri_format.writer import PieceStream


def _stored_chunk(chunk: np.ndarray, target: S.DType) -> np.ndarray:
    if chunk.dtype == NUMPY_STORAGE[target]:
        return np.ascontiguousarray(chunk)  # same dtype: the stored bits, untouched
    return to_storage(to_float32(chunk), target)


# --- dense tensors --------------------------------------------------------------------------------
def fill_dense(stream: PieceStream, dtype: S.DType, src: Any, spans: tuple[RowSpan, ...]) -> int:
    """Stream one dense tensor in the file's dense dtype; returns its checksum."""
    for chunk in iter_chunks(src, spans):
        stream.put(_stored_chunk(chunk, dtype))
    if stream.pos != stream.slot.size:
        raise InvalidInput(f"{stream.slot.key}: source gave {stream.pos} bytes for a {stream.slot.size}-byte tensor",
                           field=stream.slot.key)
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


def fill_expert(stream: PieceStream, blob: S.BlobLayout, src: Any, matrices: dict[str, tuple[RowSpan, ...]]
                ) -> tuple[int, ErrorStats]:
    """Stream one expert blob (gate_up, [scale], down, [scale]); returns (checksum, error stats)."""
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
            for chunk in iter_chunks(src, matrices[arr.name]):
                stream.put(_stored_chunk(chunk, arr.dtype))
        if stream.pos != arr.offset + arr.nbytes:
            raise InvalidInput(f"expert {stream.slot.key}: source gave the wrong size for {arr.name}", field=arr.name)
        if scale is not None:
            scale_arr = blob.array(arr.name + "_scale")
            if tuple(scale.shape) != tuple(scale_arr.shape):
                raise InvalidInput(f"{scale_arr.name} has shape {scale.shape}, expected {scale_arr.shape}",
                                   field=scale_arr.name, value=scale.shape)
            stream.pad_to(scale_arr.offset)
            stream.put(scale)
    return stream.finish(), stats


def _quantized_matrix(stream: PieceStream, src: Any, spans: tuple[RowSpan, ...], group: int | None,
                      stats: ErrorStats) -> np.ndarray:
    """Quantize and write a matrix row chunk by row chunk; returns its float32 scales (small)."""
    scales = []
    buf = None
    for chunk in iter_chunks(src, spans):
        if buf is None or buf.size < chunk.size:
            buf = np.empty(chunk.size, np.float32)  # reused across chunks: fresh pages are costly
        w = to_float32(chunk, buf[:chunk.size].reshape(chunk.shape))
        q = quantize_int8(w, group)
        stream.put(q.q)
        scales.append(q.scale)
        stats.add(q.max_rel_err, q.mean_rel_err, w.size)
    return np.ascontiguousarray(np.concatenate(scales), dtype=np.float32)
