"""Quantized expert matrices to floats: the one reading of the quantized expert formats (docs/spec.md §8).

`dequantize_matrix(fmt, q, scale, dtype)` turns a stored matrix and its scales, as a blob holds them, into
`dtype` values `[rows, inputs]`:

- int8_row / int8_group: `q[r, c] * scale[r, c // g]` (float32 scales);
- int4_group: two's-complement 4-bit `q` in the low nibble (even inputs) and the high nibble (odd inputs) of each
  byte, times a float16 scale per group;
- mxfp4: FP4 E2M1 nibbles in the same order, times 2^(e - 127) for the E8M0 byte `e` of each group of 32
  (e = 0xFF, which the spec forbids, gives NaN).

In float32 every product is exact for int4_group (a 4-bit integer times a float16) and for mxfp4 whenever the
result is a normal float32, so the float32 engine and the float64 oracle see the same weights.
"""

from __future__ import annotations

import numpy as np

from .spec.constants import ExpertFormat

# value of each nibble: two's-complement int4, and OCP FP4 E2M1 (bit 3 sign, 2 exponent bits of bias 1, 1 mantissa)
INT4_VALUES = np.array([0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1], np.int8)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def unpack_nibbles(packed: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[rows, n] bytes -> [rows, 2n] `table` values: input 2k from the low nibble of byte k, 2k+1 from the high."""
    packed = np.asarray(packed, np.uint8)
    out = np.empty((packed.shape[0], 2 * packed.shape[1]), table.dtype)
    out[:, 0::2] = table[packed & 0x0F]
    out[:, 1::2] = table[packed >> 4]
    return out


def e8m0(scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """E8M0 bytes -> 2^(e - 127) in `dtype` (exact where `dtype` holds it; 0xFF -> NaN)."""
    e = np.asarray(scale, np.uint8)
    with np.errstate(over="ignore"):
        out = np.ldexp(np.ones(e.shape, dtype), e.astype(np.int32) - 127)
    out[e == 0xFF] = np.nan
    return out


def _grouped(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows, cols = values.shape
    groups = scale.shape[1]
    values = values.reshape(rows, groups, cols // groups)
    values *= scale[:, :, None]
    return values.reshape(rows, cols)


def dequantize_matrix(fmt: ExpertFormat, q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A stored quantized matrix and its scales (as the blob holds them) -> a new `dtype` array [rows, inputs]."""
    fmt = ExpertFormat(fmt)
    if fmt in (ExpertFormat.INT8_ROW, ExpertFormat.INT8_GROUP):
        return _grouped(np.asarray(q).astype(dtype), np.asarray(scale).astype(dtype))
    if fmt == ExpertFormat.INT4_GROUP:
        return _grouped(unpack_nibbles(q, INT4_VALUES).astype(dtype), np.asarray(scale).astype(dtype))
    if fmt == ExpertFormat.MXFP4:
        return _grouped(unpack_nibbles(q, FP4_VALUES).astype(dtype), e8m0(scale, dtype))
    raise ValueError(f"{fmt.name} is not a quantized expert format")
