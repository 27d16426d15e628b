"""Random int8 experts packed as `.colibri` expert blobs for the kernel tests (small, built on the host; the
benchmark-sized ones and the oracle's blob view are `runtime.cuda.bench.device_experts` / `numpy_experts`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_format import spec as S
from colibri_format.runtime.cuda.bench import layout_for, numpy_experts
from colibri_format.runtime.cuda.kernels.ops import ExpertTable


def _scales(rng: np.random.Generator, rows: int, cols: int, group: int) -> np.ndarray:
    ngroups = 1 if not group else cols // group
    # about what a quantizer gives for N(0, 1/cols) weights: max|w| / 127
    return (rng.uniform(0.5, 1.5, (rows, ngroups)) * 3.0 / (127.0 * np.sqrt(cols))).astype(np.float32)


def host_experts(rng: np.random.Generator, num_experts: int, hidden: int, inter: int, group: int = 0):
    """(layout, experts(e) -> (gate_up, down) float64 via `numpy_experts`, blobs uint8 [E * layout.size])."""
    layout = layout_for(hidden, inter, group)
    blobs = np.zeros(num_experts * layout.size, np.uint8)
    for e in range(num_experts):
        gu = rng.integers(-127, 128, (2 * inter, hidden), dtype=np.int8)
        gus = _scales(rng, 2 * inter, hidden, group)
        dn = rng.integers(-127, 128, (hidden, inter), dtype=np.int8)
        dns = _scales(rng, hidden, inter, group)
        for name, arr in (("gate_up", gu), ("gate_up_scale", gus), ("down", dn), ("down_scale", dns)):
            off = e * layout.size + layout.array(name).offset
            raw = arr.reshape(-1).view(np.uint8)
            blobs[off:off + raw.size] = raw
    return layout, numpy_experts(blobs, layout), blobs


def blob_array(blobs: np.ndarray, layout, e: int, name: str, dtype) -> np.ndarray:
    """Expert e's raw array `name` (e.g. 'gate_up' int8, 'down_scale' float32) out of host blobs, its layout shape."""
    a = layout.array(name)
    start = e * layout.size + a.offset
    return blobs[start:start + a.shape[0] * a.shape[1] * np.dtype(dtype).itemsize].view(dtype).reshape(a.shape)


def packed_experts(rng: np.random.Generator, fmt, group: int, num_experts: int, hidden: int, inter: int):
    """4-bit blobs (int4_group, mxfp4): (layout, experts(e) -> float64 (gate_up, down), host blobs uint8 [E * size]);
    random codes, scales about what a quantizer gives for N(0, 1/H) weights."""
    layout = S.blob_layout(hidden, inter, fmt, group)
    blobs = np.zeros(num_experts * layout.size, np.uint8)
    for e in range(num_experts):
        for a in layout.arrays:
            n = a.shape[0] * a.shape[1]
            if a.dtype in (S.DType.I4X2, S.DType.FP4X2):
                raw = rng.integers(0, 256, n, dtype=np.uint8)
            elif a.dtype == S.DType.E8M0:
                raw = rng.integers(118, 124, n, dtype=np.uint8)                    # 2^-9 .. 2^-4
            else:
                raw = (rng.uniform(0.5, 1.5, n) * 3.0 / (7.0 * np.sqrt(hidden))).astype(np.float16).view(np.uint8)
            off = e * layout.size + a.offset
            blobs[off:off + raw.size] = raw
    return layout, numpy_experts(blobs, layout), blobs


def upload(blobs: np.ndarray, num_experts: int, layout):
    """Copies packed blobs to the device; returns (device buffer, ExpertTable). Keep the buffer alive."""
    import cupy as cp  # noqa: PLC0415

    buf = cp.asarray(blobs)
    ptrs = cp.asarray(np.array([buf.data.ptr + e * layout.size for e in range(num_experts)], np.uint64))
    return buf, ExpertTable.from_layout(ptrs, layout)


@dataclass
class RoutedPairs:
    """A small routed decode problem over host blobs (the emulated expert-kernel tests)."""
    ptrs: np.ndarray    # uint64 [E]: host address of each expert's blob (the kernels' table of blob addresses)
    ids: np.ndarray     # int32 [T, k]: expert e routed counts[e] times, shuffled
    x: np.ndarray       # float32 [T, H], N(0, 1)
    w: np.ndarray       # float32 [T, k]: routing weights
    slots: np.ndarray   # zeroed like the blobs: the admitted slots fill on read writes
    fills: np.ndarray   # uint64 [E]: the slot of every even expert, 0 (not admitted) for the odd ones


def routed_pairs(rng: np.random.Generator, blobs: np.ndarray, blob_size: int, counts: list[int], k: int,
                 hidden: int) -> RoutedPairs:
    ids = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    rng.shuffle(ids)
    return named_pairs(rng, blobs, blob_size, len(counts), ids.reshape(-1, k), hidden)


def named_pairs(rng: np.random.Generator, blobs: np.ndarray, blob_size: int, num_experts: int, ids,
                hidden: int) -> RoutedPairs:
    """The problem of `routed_pairs` for given ids [T, k] (ids outside [0, num_experts) kept as they are)."""
    ids = np.asarray(ids, np.int32)
    ptrs = np.array([blobs.ctypes.data + e * blob_size for e in range(num_experts)], np.uint64)
    x = rng.standard_normal((ids.shape[0], hidden)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    slots = np.zeros_like(blobs)
    fills = np.array([slots.ctypes.data + e * blob_size if e % 2 == 0 else 0 for e in range(num_experts)], np.uint64)
    return RoutedPairs(ptrs, ids, x, w, slots, fills)


def valid_ids(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(the pairs whose id names an expert, the ids with the others replaced by expert 0)."""
    valid = (ids >= 0) & (ids < num_experts)
    return valid, np.where(valid, ids, 0)
