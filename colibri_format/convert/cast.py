"""bfloat16 -> float16 in a few integer passes, bit-identical to NumPy's own cast, into a caller's buffer.

NumPy converts float32 to float16 one element at a time (about 1 s per GB of bf16 source on the 2-core CI
machine, the largest single cost of converting a checkpoint whose embedding and head are a third of its
bytes). A bf16 value whose float16 image is a normal number needs no rounding at all: bf16 keeps 7 mantissa
bits, float16 10, so only the exponent is rebiased (`((bits & 0x7FFF) - 0x3800) << 3`, the sign put back).
The other values (zero, what float16 holds only as a subnormal, beyond 65504, inf, NaN) are found in the same
passes and converted by NumPy's path (`to_storage(to_float32(...))`), so every value comes out exactly as
`to_storage(to_float32(bits), DType.F16)` gives it (tested on all 65,536 bf16 patterns).

The scratch space is one uint16 buffer per thread, reused, as the converter's other per-chunk buffers are. Where
`pip install` built the converter's C loops (convert/native.py) one pass does it instead: normal values rebiased,
smaller ones rounded to float16 zeros and subnormals as IEEE rounds them, and only the values beyond float16 left
to NumPy's path; the same bits (tested on every pattern, both ways).
"""

from __future__ import annotations

import threading

import numpy as np

from colibri_format.convert import native
from colibri_format.dtypes import to_float32, to_storage
from colibri_format.spec.constants import DType

# bf16 magnitudes (bits & 0x7FFF) whose float16 image is a normal number: exponent 113..142
_NORMAL_LO, _NORMAL_HI = 0x3880, 0x477F
_OUT_OF_RANGE = 0x4780  # this magnitude and above: beyond float16 (65536 and up, inf, NaN)

_scratch = threading.local()


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].size < n:  # reused: fresh pages cost more than the cast on some VMs
        size = max(n, 1 << 20)
        bufs = _scratch.bufs = (np.empty(size, np.uint16), np.empty(size, np.bool_))
    return bufs[0][:n], bufs[1][:n]


def bf16_to_f16(bits: np.ndarray, out: np.ndarray) -> bool:
    """Write the float16 bit patterns of the bf16 values `bits` (uint16, any shape) into `out` (uint16 or
    float16, as many elements, C-contiguous); return whether every result is finite."""
    src = np.ascontiguousarray(bits).reshape(-1)
    dst = out.reshape(-1).view(np.uint16)
    if dst.size != src.size:
        raise ValueError(f"bf16_to_f16: {src.size} values into a buffer of {dst.size}")
    if src.size == 0:
        return True
    lib = native.library()
    if lib is not None:
        if lib.colibri_bf16_to_f16(src.ctypes.data, src.size, dst.ctypes.data) == 0:
            return True
        return _beyond_float16(src, dst)
    t, irregular = _buffers(src.size)
    np.bitwise_and(src, np.uint16(0x7FFF), out=t)            # magnitude
    np.subtract(t, np.uint16(_NORMAL_LO), out=t)            # 0 .. span for the normal range, wrapped otherwise
    np.greater(t, np.uint16(_NORMAL_HI - _NORMAL_LO), out=irregular)
    np.add(t, np.uint16(_NORMAL_LO - 0x3800), out=dst)
    np.left_shift(dst, np.uint16(3), out=dst)                # rebiased exponent and mantissa
    np.bitwise_and(src, np.uint16(0x8000), out=t)
    np.bitwise_or(dst, t, out=dst)                           # the sign
    where = np.flatnonzero(irregular)
    if where.size == 0:
        return True
    odd = src[where]
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float16: inf, as NumPy's cast gives it
        dst[where] = to_storage(to_float32(odd), DType.F16).view(np.uint16)
    return not bool(((odd & np.uint16(0x7FFF)) >= np.uint16(_OUT_OF_RANGE)).any())


def _beyond_float16(src: np.ndarray, dst: np.ndarray) -> bool:
    """After the compiled cast: NumPy's images of the values beyond float16 (inf; NaN as NumPy keeps it); False."""
    where = np.flatnonzero((src & np.uint16(0x7FFF)) >= np.uint16(_OUT_OF_RANGE))
    with np.errstate(over="ignore", invalid="ignore"):
        dst[where] = to_storage(to_float32(src[where]), DType.F16).view(np.uint16)
    return False
