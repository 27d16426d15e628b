"""Refusing NaN, infinity and values the stored dtype cannot hold, checked on the chunks already in memory.

The fast check looks at the bits of the stored chunk (the bytes about to be written): a float is NaN or
infinite exactly when its exponent bits are all ones, so one AND and one max over the chunk viewed as
unsigned integers (into a per-thread scratch buffer) answers for the whole chunk. Checking the converted
chunk catches, in the same pass, NaN/inf in the source and overflow in the conversion (float32 -> float16
beyond 65504, float64 -> float32 beyond 3.4e38, float32 -> bfloat16 at the very top). int8 experts need no
pass of their own: the quantizer's per-group maxima are already finite or not.

Only when a chunk fails is the source chunk searched again, to name the tensor, the first bad element and its
byte offset in the shard.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from colibri_format.convert.layout import RowSpan
from colibri_format.dtypes import float32_to_bf16_bits, to_float32
from colibri_format.errors import NonFiniteWeight

# stored dtype -> (unsigned view, mask of the bits below the sign, smallest masked value that is NaN or inf)
_BITS = {np.dtype("<f2"): (np.dtype("<u2"), 0x7FFF, 0x7C00),
         np.dtype("<u2"): (np.dtype("<u2"), 0x7FFF, 0x7F80),  # bfloat16 bit patterns
         np.dtype("<f4"): (np.dtype("<u4"), 0x7FFF_FFFF, 0x7F80_0000),
         np.dtype("<f8"): (np.dtype("<u8"), 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
           "int4_group": 7 * 65504.0}       # int4 values times a float16 scale (max|w| / 7 of the group)

_scratch = threading.local()


def _buffer(nbytes: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:  # reused: fresh pages cost more than the check on some VMs
        buf = _scratch.buf = np.empty(max(nbytes, 1 << 20), np.uint8)
    return buf


def all_finite(stored: np.ndarray) -> bool:
    """Whether every value of a stored float chunk (bf16 as uint16) is finite."""
    view, mask, limit = _BITS[stored.dtype]
    bits = np.ascontiguousarray(stored).view(view).reshape(-1)
    if bits.size == 0:
        return True
    out = _buffer(bits.nbytes)[:bits.nbytes].view(view)
    np.bitwise_and(bits, view.type(mask), out=out)
    return int(out.max()) < limit


def _as_float64(chunk: np.ndarray) -> np.ndarray:
    return to_float32(chunk).astype(np.float64) if chunk.dtype == np.uint16 else chunk.astype(np.float64)


def _converted_bad(values: np.ndarray, target: str) -> np.ndarray:
    """Which finite float64 `values` become infinite once stored as `target`."""
    with np.errstate(over="ignore", invalid="ignore"):
        if target == "int4_group":
            return np.abs(values) > LARGEST[target]
        if target == "float16":
            return ~np.isfinite(values.astype(np.float16))
        as32 = values.astype(np.float32)
        if target == "bfloat16":
            bits = float32_to_bf16_bits(as32)
            return (bits & 0x7FFF) >= 0x7F80
        return ~np.isfinite(as32)


def describe(src: Any, span: RowSpan, row0: int, chunk: np.ndarray, target: str, hint: str,
             expert: tuple[int, int] | None = None) -> NonFiniteWeight:
    """The error for the first element of `chunk` (rows `row0`.. of `span`) that is NaN, infinite, or beyond
    the range of `target` ('float16' | 'bfloat16' | 'float32'): the tensor, the element's index in it, the
    (layer, expert) when the chunk belongs to an expert, and the element's byte offset in its shard."""
    values = _as_float64(chunk)
    flat = values.reshape(-1)
    bad = ~np.isfinite(flat)
    bad |= _converted_bad(np.where(bad, 0.0, flat), target)
    where = int(np.argmax(bad)) if bad.any() else 0
    local = [int(i) for i in np.unravel_index(where, values.shape)]
    if values.ndim > 1:
        local[0] += row0  # the chunk's rows start at row0 of the tensor (or of its expert)
    index = tuple(local) if span.index is None else (span.index, *local)
    value = float(flat[where])
    offset = src.element_offset(span.hf_name, index) if hasattr(src, "element_offset") else None
    name = span.hf_name
    if np.isnan(value):
        what = f"tensor {name!r} holds NaN at index {list(index)}"
    elif np.isinf(value):
        what = f"tensor {name!r} holds {'+' if value > 0 else '-'}inf at index {list(index)}"
    else:
        what = (f"tensor {name!r} holds {value:.6g} at index {list(index)}, beyond the {target} range "
                f"(largest {LARGEST[target]:.6g})")
    where = "" if expert is None else f", in expert {expert[1]} of layer {expert[0]}"
    return NonFiniteWeight(f"{what}{where}; {hint}", field=name, value=value, offset=offset)
