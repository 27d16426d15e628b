"""Turning source rows into the bytes of one piece (a dense tensor or an expert blob), chunk by chunk.

The bytes go to a `PieceStream` of the writer, which writes them at the piece's planned offset and hashes
them on the way; nothing here touches the file. A piece is never whole in memory: each chunk of source
rows is converted (or quantized) and handed on before the next one is read. With a buffered stream the
converted chunk is written straight into the writer's buffer (`reserve` / `commit`): int8 rows by
`quantize_into`, bf16 -> float16 by `cast.bf16_to_f16`; the scales of a matrix gather in a per-thread
buffer and follow it.

On the way every chunk is also (1) hashed as the source stored it (`SourceHash`, kept in the resume journal)
and (2) checked for NaN, infinity and overflow of the stored dtype (convert/finite.py), on the converted
chunk for float storage and through the quantizer's group maxima for int8. A bad value is a NonFiniteWeight
naming the tensor and the element, unless `allow_non_finite` (float storage only: int8 cannot hold them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from colibri_format import spec as S
from colibri_format.convert import finite
from colibri_format.convert.cast import bf16_to_f16
from colibri_format.convert.layout import RowSpan
from colibri_format.convert.quantize import quantize_int4_into, quantize_into
from colibri_format.convert.rows import SourceHash, iter_span_chunks
from colibri_format.dtypes import NUMPY_STORAGE, to_float32, to_storage
from colibri_format.errors import InvalidInput, NonFiniteWeight, UnsupportedModel
from colibri_format.writer import PieceStream

DTYPE_NAME = {dtype: name for name, dtype in S.DTYPE_NAMES.items()}
ALLOW_HINT = "--allow-non-finite stores such values as they are"
INT8_HINT = "int8 experts cannot hold it (--quantize none --allow-non-finite would store it as it is)"
INT4_HINT = "int4 experts cannot hold it (--quant-bits 8, or --quantize none [--allow-non-finite], would store it)"


class Filled(NamedTuple):
    """What writing one piece gave: its checksum in the file, the digest of its source bytes, whether it
    holds a non-finite value (only possible with allow_non_finite), and (int8 experts) its error stats."""

    checksum: int
    source: int
    non_finite: bool
    stats: ErrorStats | None = None


def _stored_chunk(chunk: np.ndarray, target: S.DType) -> np.ndarray:
    if chunk.dtype == NUMPY_STORAGE[target]:
        return np.ascontiguousarray(chunk)  # same dtype: the stored bits, untouched
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is found (and named) by the check below
        return to_storage(to_float32(chunk), target)


class _Checked:
    """Converts chunks to a float storage dtype, refusing (or, allowed, noting) non-finite results."""

    def __init__(self, src: Any, target: S.DType, allow_non_finite: bool,
                 expert: tuple[int, int] | None = None) -> None:
        self.src, self.target, self.allow, self.expert = src, target, allow_non_finite, expert
        self.non_finite = False

    def __call__(self, span: RowSpan, row0: int, chunk: np.ndarray) -> np.ndarray:
        out = _stored_chunk(chunk, self.target)
        self._check(finite.all_finite(out), span, row0, chunk)
        return out

    def _check(self, ok: bool, span: RowSpan, row0: int, chunk: np.ndarray) -> None:
        if not ok:
            if not self.allow:
                raise finite.describe(self.src, span, row0, chunk, DTYPE_NAME[self.target], ALLOW_HINT,
                                      self.expert)
            self.non_finite = True

    def put(self, stream: PieceStream, span: RowSpan, row0: int, chunk: np.ndarray) -> None:
        """Convert a chunk and hand it to the stream; bf16 -> float16 is cast straight into its buffer."""
        if chunk.dtype != np.uint16 or self.target != S.DType.F16:
            stream.put(self(span, row0, chunk))
            return
        nbytes = chunk.size * 2
        room = stream.reserve(nbytes)
        out = room.view(np.uint16) if room is not None else np.empty(chunk.size, np.uint16)
        self._check(bf16_to_f16(chunk, out), span, row0, chunk)
        if room is not None:
            stream.commit(nbytes)
        else:
            stream.put(out)


# --- dense tensors --------------------------------------------------------------------------------
def fill_dense(stream: PieceStream, dtype: S.DType, src: Any, spans: tuple[RowSpan, ...], *,
               allow_non_finite: bool = False) -> Filled:
    """Stream one dense tensor in the file's dense dtype."""
    source = SourceHash()
    convert = _Checked(src, dtype, allow_non_finite)
    for span, row0, chunk in iter_span_chunks(src, spans):
        source.update("dense", chunk)
        convert.put(stream, span, row0, chunk)
    if stream.pos != stream.slot.size:
        raise InvalidInput(f"{stream.slot.key}: source gave {stream.pos} bytes for a {stream.slot.size}-byte tensor",
                           field=stream.slot.key)
    return Filled(stream.finish(), source.intdigest(), convert.non_finite)


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


def fill_expert(stream: PieceStream, blob: S.BlobLayout, src: Any, matrices: dict[str, tuple[RowSpan, ...]], *,
                allow_non_finite: bool = False, scale_search: bool = False) -> Filled:
    """Stream one expert blob (gate_up, [scale], down, [scale]); `scale_search`: int4 scales of least squared
    error (quantize_int4_into's `search`)."""
    stats = ErrorStats()
    source = SourceHash()
    fmt = blob.expert_format
    quantized = fmt in S.QUANTIZED_FORMATS
    group = blob.group_size or None
    expert = stream.slot.key
    convert = None if quantized else _Checked(src, S.DType(int(fmt)), allow_non_finite, expert)
    for arr in blob.arrays:
        if arr.name.endswith("_scale"):
            continue  # written right after its matrix
        stream.pad_to(arr.offset)
        scale = None
        if convert is None:
            scale_arr = blob.array(arr.name + "_scale")
            matrix = _mxfp4_matrix if fmt == S.ExpertFormat.MXFP4 else _quantized_matrix
            scale = matrix(stream, src, fmt, arr, scale_arr, matrices[arr.name], group, stats, source, expert,
                           scale_search)
        else:
            for span, row0, chunk in iter_span_chunks(src, matrices[arr.name]):
                source.update(arr.name, chunk)
                convert.put(stream, span, row0, chunk)
        if stream.pos != arr.offset + arr.nbytes:
            raise InvalidInput(f"expert {stream.slot.key}: source gave the wrong size for {arr.name}", field=arr.name)
        if scale is not None:
            scale_arr = blob.array(arr.name + "_scale")
            if tuple(scale.shape) != tuple(scale_arr.shape):
                raise InvalidInput(f"{scale_arr.name} has shape {scale.shape}, expected {scale_arr.shape}",
                                   field=scale_arr.name, value=scale.shape)
            stream.pad_to(scale_arr.offset)
            stream.put(scale)
    non_finite = convert is not None and convert.non_finite
    return Filled(stream.finish(), source.intdigest(), non_finite, stats if quantized else None)


_scales = threading.local()


def _scale_buffer(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """A per-thread buffer for one matrix's scales (float32, float16 or E8M0 bytes), reused from piece to piece."""
    nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
    buf = getattr(_scales, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scales.buf = np.empty(max(nbytes, 4), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def _quantized_matrix(stream: PieceStream, src: Any, fmt: S.ExpertFormat, arr: S.BlobArray, scale_arr: S.BlobArray,
                      spans: tuple[RowSpan, ...], group: int | None, stats: ErrorStats, source: SourceHash,
                      expert: Any, scale_search: bool = False) -> np.ndarray:
    """Quantize and write a matrix row chunk by row chunk (int8, or int4_group: two values a byte), the rows straight
    into the stream's buffer; returns its scales (a view of a per-thread buffer, valid until the next matrix)."""
    n_out, row_bytes = arr.shape
    int4 = fmt == S.ExpertFormat.INT4_GROUP
    n_in = row_bytes * 2 if int4 else row_bytes
    storage = NUMPY_STORAGE[arr.dtype]
    scales = _scale_buffer(scale_arr.shape, NUMPY_STORAGE[scale_arr.dtype])
    row = 0
    for span, row0, chunk in iter_span_chunks(src, spans):
        source.update(arr.name, chunk)
        if chunk.ndim != 2 or chunk.shape[1] != n_in or row + chunk.shape[0] > n_out:
            raise InvalidInput(f"expert {expert}: source gave the wrong size for {arr.name}", field=arr.name)
        rows = chunk.shape[0]
        nbytes = rows * row_bytes
        room = stream.reserve(nbytes)
        q = room.view(storage).reshape(rows, row_bytes) if room is not None else np.empty((rows, row_bytes), storage)
        exact = _exact_int4(src, span, row0, rows, group) if int4 else _exact_int8(src, span, row0, rows, group)
        try:
            if exact is not None:
                if not np.isfinite(exact[1]).all():     # an E8M0 scale byte 0xFF: NaN, and int8 holds none
                    raise NonFiniteWeight("non-finite source scale")
                q[...], scales[row:row + rows] = exact
                max_rel = mean_rel = 0.0
            elif int4:
                max_rel, mean_rel = quantize_int4_into(chunk, group, q, scales[row:row + rows], search=scale_search)
            else:
                max_rel, mean_rel = quantize_into(chunk, group, q, scales[row:row + rows])
        except NonFiniteWeight:       # NaN, inf, or (int4) a group beyond what a float16 scale holds
            raise finite.describe(src, span, row0, chunk, "int4_group" if int4 else "float32",
                                  INT4_HINT if int4 else INT8_HINT, expert) from None
        if room is not None:
            stream.commit(nbytes)
        else:
            stream.put(q)
        stats.add(max_rel, mean_rel, chunk.size)
        row += rows
    return scales[:row]


def _mxfp4_matrix(stream: PieceStream, src: Any, fmt: S.ExpertFormat, arr: S.BlobArray, scale_arr: S.BlobArray,
                  spans: tuple[RowSpan, ...], group: int | None, stats: ErrorStats, source: SourceHash,
                  expert: Any, scale_search: bool = False) -> np.ndarray:
    """Copy an MXFP4 checkpoint matrix's blocks and E8M0 scales as they are stored (rows in the canonical order),
    chunk by chunk; returns its scales. The source hash is taken over the values the rows stand for, as for every
    other piece (what a resume re-reads)."""
    n_out, row_bytes = arr.shape
    scales = _scale_buffer(scale_arr.shape, np.uint8)
    row = 0
    for span, row0, chunk in iter_span_chunks(src, spans):
        source.update(arr.name, chunk)
        rows = chunk.shape[0]
        exact = src.exact_mxfp4(span.hf_name, span.index, row0, row0 + rows) if hasattr(src, "exact_mxfp4") else None
        if exact is None:                          # plan_job refuses such sources before the first piece
            raise UnsupportedModel(f"{span.hf_name!r} is not an MXFP4 tensor; mxfp4 experts are copied from an MXFP4 "
                                   "checkpoint", field=span.hf_name)
        blocks, e8 = exact
        if blocks.shape != (rows, row_bytes) or row + rows > n_out or e8.shape != (rows, scale_arr.shape[1]):
            raise InvalidInput(f"expert {expert}: source gave the wrong size for {arr.name}", field=arr.name)
        nan = np.argwhere(e8 == 0xFF)
        if nan.size:
            r, g = (int(i) for i in nan[0])
            raise NonFiniteWeight(f"{span.hf_name}: the E8M0 scale of row {row0 + r}, block {g} is 0xFF (NaN), which "
                                  "an mxfp4 .colibri file may not hold", field=span.hf_name, value=0xFF)
        stream.put(blocks)
        scales[row:row + rows] = e8
        stats.add(0.0, 0.0, chunk.size)
        row += rows
    return scales[:row]


def _exact_int8(src: Any, span: RowSpan, row0: int, rows: int, group: int | None) -> Any:
    """(int8 rows, scales) when the source stores these rows as int8 groups already (MXFP4 at group 32,
    convert/derived.py): copied as they are, with no second rounding; else None."""
    exact = getattr(src, "exact_int8", None)
    return None if exact is None else exact(span.hf_name, span.index, row0, row0 + rows, group)


def _exact_int4(src: Any, span: RowSpan, row0: int, rows: int, group: int | None) -> Any:
    """(int4_group rows: uint8 two values a byte, float16 scales) when the source stores these rows as 4-bit groups of
    this size already (compressed-tensors pack-quantized, convert/derived.py): copied as they are, with no second
    rounding; else None (the rows are quantized)."""
    exact = getattr(src, "exact_int4", None)
    return None if exact is None else exact(span.hf_name, span.index, row0, row0 + rows, group)
