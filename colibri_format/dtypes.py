"""The one table of element types, and the conversions between NumPy arrays and stored values.

NumPy has no bfloat16, so bf16 values travel as `np.uint16` bit patterns everywhere: in checkpoint views,
in `.colibri` views and in arrays handed to the writer. float32 -> bf16 rounds to nearest even.
"""

from __future__ import annotations

import numpy as np

from .spec.constants import DTYPE_NAMES, DType

# Every element type a checkpoint tensor or a `.colibri` tensor may have, by name, with its NumPy storage.
STORAGE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
           "float64": np.dtype("<f8"), "int8": np.dtype("i1")}
# The same storage keyed by the format's dtype numbers (float64 cannot be stored in a `.colibri` file).
# The blob-only byte types (two 4-bit values a byte, E8M0 scales) are stored as uint8.
NUMPY_STORAGE = {**{dtype: STORAGE[name] for name, dtype in DTYPE_NAMES.items()}, DType.I8: STORAGE["int8"],
                 DType.I4X2: np.dtype("u1"), DType.FP4X2: np.dtype("u1"), DType.E8M0: np.dtype("u1")}


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bit patterns; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


def to_storage(array: np.ndarray, dtype: DType) -> np.ndarray:
    """Array in the storage dtype, C-contiguous little-endian. uint16 input to BF16 is taken as bf16 bits."""
    dtype = DType(dtype)
    a = np.asarray(array)
    if dtype == DType.BF16:
        out = a if a.dtype == np.uint16 else float32_to_bf16_bits(a.astype(np.float32, copy=False))
    else:
        out = a.astype(NUMPY_STORAGE[dtype], copy=False)
    return np.ascontiguousarray(out)


def to_float32(stored: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Stored float values (bf16 as uint16 bits) as float32, in a new array or in `out` (same shape).

    The stored array is never aliased, so a view into a mapped file may be released afterwards.
    """
    if out is None:
        out = np.empty(stored.shape, np.float32)
    if stored.dtype == np.uint16:
        # widen into the output, then shift in place: about 2x faster than one mixed-type left_shift
        bits = out.view(np.uint32)
        bits[...] = stored
        np.left_shift(bits, 16, out=bits)
    elif stored.dtype.kind == "f":
        np.copyto(out, stored, casting="unsafe")  # float64 narrows; float16/32 are exact
    else:
        raise TypeError(f"{stored.dtype} values are not stored floats")
    return out
