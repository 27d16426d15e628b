"""Conversions between NumPy arrays and the storage dtypes of the format (bf16 has no NumPy dtype).

bfloat16 values travel as `np.uint16` bit patterns; float32 -> bf16 rounds to nearest even.
"""

from __future__ import annotations

import numpy as np

from .spec.constants import DType

NUMPY_STORAGE = {DType.F32: np.dtype("<f4"), DType.F16: np.dtype("<f2"), DType.BF16: np.dtype("<u2"),
                 DType.I8: np.dtype("i1")}


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bit patterns; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_storage(array: np.ndarray, dtype: DType) -> np.ndarray:
    """Array in the storage dtype, C-contiguous little-endian. uint16 input to BF16 is taken as bf16 bits."""
    dtype = DType(dtype)
    a = np.asarray(array)
    if dtype == DType.BF16:
        out = a if a.dtype == np.uint16 else float32_to_bf16_bits(a.astype(np.float32, copy=False))
    else:
        out = a.astype(NUMPY_STORAGE[dtype], copy=False)
    return np.ascontiguousarray(out)


def to_float32(stored: np.ndarray, dtype: DType) -> np.ndarray:
    """Upcast a stored array (a view into the file) to a new float32 array."""
    if DType(dtype) == DType.BF16:
        return bf16_bits_to_float32(stored)
    return np.asarray(stored, dtype=np.float32).copy() if stored.dtype == np.float32 else stored.astype(np.float32)
