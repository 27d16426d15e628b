"""Row-chunked reads of canonical tensors, so no whole tensor or whole expert is ever held in memory.

A canonical matrix is a list of `RowSpan`s: rows of a Hugging Face tensor (or of one expert of a fused 3-D
tensor), concatenated. The blob's `gate_up [2I, H]` is `w1` then `w3` for per-expert checkpoints and rows
`[0, 2I)` of `gate_up_proj[e]` for fused ones. The spans come from the adapter's own name table
(`NAMES` in each `convert/arch/<type>.py`) and are checked against the shapes the adapter expects, so both
paths read exactly what `adapter.expert_tensors` returns (tests/convert/test_pipeline.py compares them).

Reads go through the safetensors memory map (only the chunk's pages are touched); sources without a
zero-copy view (pickled `.bin`) fall back to one whole-tensor read.
"""

from __future__ import annotations

import importlib
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_format.convert.arch import common
from colibri_format.errors import InvalidInput, UnsupportedModel

CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32 per step (cache-friendly); fixed, so statistics never vary


@dataclass(frozen=True)
class RowSpan:
    """Rows [start, stop) of `hf_name` (of `hf_name[index]` when `index` is set: one expert of a fused tensor)."""

    hf_name: str
    index: int | None
    start: int
    stop: int


@dataclass(frozen=True)
class ExpertSpans:
    gate_up: tuple[RowSpan, ...]
    down: tuple[RowSpan, ...]


def dense_spans(src: Any, t: common.DenseTensor) -> tuple[RowSpan, ...]:
    shape = tuple(src.shape(t.hf_name))
    if t.transform is not None:
        return (RowSpan(t.hf_name, None, t.transform.start, t.transform.stop),)
    return (RowSpan(t.hf_name, None, 0, shape[0] if shape else 1),)


def names_table(model_type: str) -> common.HFNames:
    module = importlib.import_module(f"colibri_format.convert.arch.{model_type}")
    names = getattr(module, "NAMES", None)
    if not isinstance(names, common.HFNames):
        raise UnsupportedModel(f"adapter {model_type!r} has no HFNames table for streaming", field="model_type")
    return names


def expert_spans(src: Any, model: dict[str, Any], names: common.HFNames, layer: int, expert: int) -> ExpertSpans:
    """Where the rows of one expert's gate_up and down live, shapes checked like the adapter checks them."""
    e_count, i_size, h = model["num_experts"], model["expert_intermediate_size"], model["hidden_size"]
    p = common.layer_prefix(layer)
    layout = common.expert_layout(src, names, p)  # the adapter's own layout probe
    if isinstance(layout, common.FusedLinear):
        gate_up, down = layout.gate_up.format(p=p), layout.down.format(p=p)
        common.check_shape(src, gate_up, (e_count, 2 * i_size, h))
        common.check_shape(src, down, (e_count, h, i_size))
        return ExpertSpans((RowSpan(gate_up, expert, 0, 2 * i_size),), (RowSpan(down, expert, 0, h),))
    gate, up, down = (f.format(p=p, e=expert) for f in (layout.gate, layout.up, layout.down))
    for name, shape in ((gate, (i_size, h)), (up, (i_size, h)), (down, (h, i_size))):
        common.check_shape(src, name, shape)
    return ExpertSpans((RowSpan(gate, None, 0, i_size), RowSpan(up, None, 0, i_size)), (RowSpan(down, None, 0, h),))


# --- reading ---------------------------------------------------------------------------------------
def native_view(src: Any, name: str) -> np.ndarray:
    """The tensor in its stored dtype (bf16 as uint16): a zero-copy map for safetensors, else a copy."""
    return src.native_view(name)


def to_float32(chunk: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """float32 copy of a stored chunk; bf16 bits widen by a 16-bit shift."""
    if out is None:
        out = np.empty(chunk.shape, np.float32)
    if dtype == "bfloat16":
        # widen into the output, then shift in place: about 2x faster than one mixed-type left_shift
        bits = out.view(np.uint32)
        bits[...] = chunk
        np.left_shift(bits, 16, out=bits)
    elif dtype in ("float32", "float16", "float64"):
        np.copyto(out, chunk, casting="unsafe" if dtype == "float64" else "same_kind")
    else:
        raise UnsupportedModel(f"tensor dtype {dtype!r} cannot be converted", value=dtype)
    return out


def iter_chunks(src: Any, spans: tuple[RowSpan, ...]) -> Iterator[tuple[np.ndarray, str]]:
    """(stored rows, dtype name) in order, each at most CHUNK_ELEMENTS values (at least one row).

    A chunk is only valid until the next one is asked for: its mapped pages are released then.
    """
    for span in spans:
        view = native_view(src, span.hf_name)
        dtype = src.dtype(span.hf_name)
        if span.index is not None:
            view = view[span.index]
        if view.ndim == 0 or view.ndim > 2:
            raise InvalidInput(f"{span.hf_name!r} has rank {view.ndim} where a vector or matrix is needed",
                               field=span.hf_name)
        if view.ndim == 1:
            yield view, dtype
            continue
        step = max(1, CHUNK_ELEMENTS // max(1, view.shape[1]))
        for start in range(span.start, span.stop, step):
            chunk = view[start:min(start + step, span.stop)]
            yield chunk, dtype
            release_pages(chunk)


def _backing_map(array: np.ndarray) -> mmap.mmap | None:
    base: Any = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    return base


def release_pages(array: np.ndarray) -> None:
    """Drop the pages under a view of a read-only file mapping from this process's RSS.

    Without this, every page of the checkpoint read through the safetensors map stays counted in our RSS
    until the map closes (a 9 GB checkpoint showed a 9 GB peak RSS). The page cache keeps the data, and
    a later touch (another worker reading a neighbouring tensor on a shared page) faults it back in
    unchanged. Arrays not backed by a file map (copies) are left alone: on anonymous memory MADV_DONTNEED
    would zero them.
    """
    mm = _backing_map(array)
    if mm is None or not hasattr(mm, "madvise") or array.nbytes == 0:
        return
    try:
        map_start = np.frombuffer(mm, np.uint8, count=1).ctypes.data
    except (ValueError, BufferError):  # closed or empty map
        return
    begin = array.ctypes.data - map_start
    start = begin // mmap.PAGESIZE * mmap.PAGESIZE
    stop = min(len(mm), -(-(begin + array.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
    if 0 <= start < stop:
        mm.madvise(mmap.MADV_DONTNEED, start, stop - start)


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def span_bytes(src: Any, spans: tuple[RowSpan, ...]) -> int:
    """Source bytes the spans cover (for throughput figures)."""
    total = 0
    for span in spans:
        shape = tuple(src.shape(span.hf_name))[(1 if span.index is not None else 0):]
        row = 1
        for d in shape[1:]:
            row *= d
        rows = (span.stop - span.start) if shape else 1
        total += rows * row * ITEMSIZE.get(src.dtype(span.hf_name), 4)
    return total
