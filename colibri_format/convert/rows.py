"""Row-chunked reads of `RowSpan`s, so no whole tensor or whole expert is ever held in memory.

A canonical matrix is a list of spans (convert/layout.py says which): rows of a Hugging Face tensor, or
of one expert of a fused 3-D tensor, concatenated. A chunk of a safetensors tensor is read with one
positional read into a buffer the reading thread reuses (the source's `positional_reader`): nothing of the
checkpoint stays in the process's memory, and there are no page faults or TLB flushes per chunk. Other views
(pickled `.bin` files, tensors computed from others) are sliced as they are; a chunk of a view backed by a file
map has its pages released after use.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from colibri_format.convert.layout import RowSpan
from colibri_format.dtypes import STORAGE
from colibri_format.errors import InvalidInput

CHUNK_ELEMENTS = 1 << 20  # 4 MB of float32 per step (cache-friendly); fixed, so statistics never vary
FAULT_AROUND = max(mmap.PAGESIZE, 64 << 10)  # what one page fault maps of a file (Linux's fault_around_bytes)


def iter_chunks(src: Any, spans: tuple[RowSpan, ...]) -> Iterator[np.ndarray]:
    """The spans' rows in order, in their stored dtype (bf16 as uint16), each chunk at most CHUNK_ELEMENTS
    values (at least one row).

    A chunk is only valid until the next one is asked for: its mapped pages are released then.
    """
    for _, _, chunk in iter_span_chunks(src, spans):
        yield chunk


def iter_span_chunks(src: Any, spans: tuple[RowSpan, ...]) -> Iterator[tuple[RowSpan, int, np.ndarray]]:
    """`iter_chunks` with each chunk's span and the index of its first row in that tensor (for messages
    that name the element at fault)."""
    with _read_buffer() as buffer:
        for span in spans:
            view = src.native_view(span.hf_name)
            if span.index is not None:
                view = view[span.index]
            if view.ndim == 0 or view.ndim > 2:
                raise InvalidInput(f"{span.hf_name!r} has rank {view.ndim} where a vector or matrix is needed",
                                   field=span.hf_name)
            finder = getattr(src, "positional_reader", None)
            reader = finder(span.hf_name, view) if finder is not None else None
            if view.ndim == 1:
                yield span, 0, view if reader is None else buffer.read(reader, view.dtype, view.shape)
                continue
            step = max(1, CHUNK_ELEMENTS // max(1, view.shape[1]))
            for start in range(span.start, span.stop, step):
                stop = min(start + step, span.stop)
                if reader is None:
                    chunk = view[start:stop]
                    yield span, start, chunk
                    release_pages(chunk)
                else:
                    row_bytes = view.shape[1] * view.dtype.itemsize
                    yield span, start, buffer.read((reader[0], reader[1] + start * row_bytes), view.dtype,
                                                   (stop - start, view.shape[1]))


class _ReadBuffer:
    """A reusable byte buffer for positional reads; one per chunk iterator, taken from its thread's pool."""

    def __init__(self) -> None:
        self.data = np.empty(0, np.uint8)

    def read(self, reader: tuple[Any, int], dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        f, offset = reader
        n = dtype.itemsize
        for d in shape:
            n *= d
        if self.data.size < n:  # grown rarely (a chunk is at most CHUNK_ELEMENTS values or one row)
            self.data = np.empty(max(n, CHUNK_ELEMENTS * 2), np.uint8)
        out = self.data[:n]
        f.read_at(offset, out)
        return out.view(dtype).reshape(shape)


_pool = threading.local()


@contextlib.contextmanager
def _read_buffer() -> Iterator[_ReadBuffer]:
    """Borrow a read buffer from the calling thread's pool (kept for reuse: fresh pages are costly on some
    VMs); nested iterators on one thread each get their own."""
    free = getattr(_pool, "free", None)
    if free is None:
        free = _pool.free = []
    buffer = free.pop() if free else _ReadBuffer()
    try:
        yield buffer
    finally:
        free.append(buffer)


class SourceHash:
    """XXH3-64 of the stored source bytes a piece is made of, matrix by matrix, so the digest does not depend
    on the order the matrices are read in. The resume journal keeps it for each piece; a piece is reused only
    while its source still hashes the same (an edit that keeps size and mtime is caught)."""

    def __init__(self) -> None:
        self._parts: dict[str, xxhash.xxh3_64] = {}

    def update(self, matrix: str, chunk: np.ndarray) -> None:
        h = self._parts.get(matrix)
        if h is None:
            h = self._parts[matrix] = xxhash.xxh3_64()
        h.update(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1))

    def intdigest(self) -> int:
        joined = "".join(f"{name}:{self._parts[name].hexdigest()};" for name in sorted(self._parts))
        return xxhash.xxh3_64_intdigest(joined.encode("ascii"))


def source_digest(src: Any, rows: dict[str, tuple[RowSpan, ...]]) -> int:
    """The `SourceHash` of a piece's source rows as the checkpoint holds them now."""
    h = SourceHash()
    for matrix, spans in rows.items():
        for chunk in iter_chunks(src, spans):
            h.update(matrix, chunk)
    return h.intdigest()


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
    # Out to the kernel's fault-around window (64 KiB): the first touch of the next chunk maps the aligned window
    # around it, tail pages of this chunk included, which would otherwise stay mapped for good.
    start = begin // FAULT_AROUND * FAULT_AROUND
    stop = min(len(mm), -(-(begin + array.nbytes) // FAULT_AROUND) * FAULT_AROUND)
    if 0 <= start < stop:
        mm.madvise(mmap.MADV_DONTNEED, start, stop - start)


def span_bytes(src: Any, spans: tuple[RowSpan, ...]) -> int:
    """Source bytes the spans cover (for throughput figures)."""
    total = 0
    for span in spans:
        shape = tuple(src.shape(span.hf_name))[(1 if span.index is not None else 0):]
        row = 1
        for d in shape[1:]:
            row *= d
        rows = (span.stop - span.start) if shape else 1
        storage = STORAGE.get(src.dtype(span.hf_name))  # None: not a float, refused once read
        total += rows * row * (storage.itemsize if storage is not None else 4)
    return total
