"""Symmetric int8 quantization of channel-last `[out, in]` weights, per row or per group; and int4_group
(`quantize_int4_into`, at the end: the same scheme with 4-bit values and float16 scales).

For each row and each group of `g` consecutive input columns (`g = in` for
per-row): `scale = max|w| / 127`, `q = rint(w / scale)` in [-127, 127], and the
dequantized value is `q * scale`. `np.rint` rounds half to even; any rounding of
the halfway case keeps `|w - q*scale| <= scale/2`, which is the bound tested.
An all-zero group gets scale 1.0 so that it dequantizes to exact zeros. A group whose largest magnitude
is below `TINY_GROUP_MAX` = 127 x the smallest normal float32 (~1.5e-36: subnormal-only or near-subnormal
values) gets a subnormal scale, which float32 holds with fewer bits: it is rounded *up* from the exact
`max|w| / 127`, so `|w / scale|` never passes 127 and the half-step bound holds for the stored scale (the
relative error may then exceed 0.5/127 by the scale's rounding, at most 2**-149 / max|w|). NaN or
infinity anywhere is refused (`NonFiniteWeight`, naming the first one's row and column): int8 cannot hold them.

Reported error, per element: `|w - q*scale| / max|w[row]|`, computed as
`|w/scale - q| * scale / max|w[row]|` (exact arithmetic, i.e. without the
float32 rounding of the dequantized product). `max_rel_err` is its maximum, `mean_rel_err` its mean over all
elements, where each `|w/scale - q|` is first truncated to a whole number of `ERROR_UNITS` (2^-24 of the scale,
so the mean is low by less than 2^-24 / 127 of a row's max) and the units are summed as integers: the sum is exact
in any order, so it depends on neither the blocking, nor NumPy's summation order, nor which loop ran. Zero rows
and zero groups count as error 0; both stay finite for any finite input, subnormal rows included. Per-row
quantization therefore reports at most 0.5/127 ~ 0.0039. These are what docs/design.md stores under
`quantization.error`.

`quantize_into` is the converter's form: the stored source chunk (bf16 as uint16 bits, float16, float32 or
float64) in, q and scales written into the caller's buffers (the int8 rows go straight into the writer's
buffer); `quantize_int8` is it on a float32 matrix. The group maxima are taken on the magnitude bits
(`bits & 0x7FFF` orders the magnitudes of finite values), the scales for the whole chunk at once, then one pass
over the values: the compiled loop of convert/native.py for bf16 and float32 sources where `pip install` built it
(one pass, ~0.2 s per source GB on the 2-core machine), else NumPy's passes over ~1 MiB blocks through two reused
per-thread float32 buffers (so they run from cache: ~0.7-1.3 s per GB), small groups reduced with strided
element-wise calls (see `_reduce_groups`). Both compute the same float32 division and round-half-even, so q,
scales and both errors are bit-identical (tested). `benchmark_quantize` measures it. `quantize_int4_into` has the
same two forms, for round-to-nearest and for searched scales (the search's float32 sums in a fixed lane order,
`_lane_sum`, so both forms choose the same scales), and integer error units per group.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import NamedTuple

import numpy as np

from colibri_format.convert import native
from colibri_format.errors import InvalidInput, NonFiniteWeight

QMAX = 127
TINY_GROUP_MAX = np.float32(QMAX * np.finfo(np.float32).tiny)  # below it, amax / 127 would be subnormal
BLOCK_BYTES = 1 << 20  # rows per pass sized so the temporaries stay in cache
SMALL_GROUP = 32  # at or below this group size, reduce with strided element-wise calls
# At or above this group size the division by the broadcast scales runs with a ufunc buffer one group long:
# with NumPy's default (8192 elements) a broadcast operand whose inner extent is shorter is copied through
# the buffer, which doubles the cost of the division (same values either way; smaller groups lose by it).
UNBUFFERED_GROUP = 512
# Maxima of groups at least this long are taken in one `reduceat` over the whole block (NumPy's reduce along a short
# last axis pays a fixed cost per group): the |error| maxima from this size, on the int32 patterns of the non-negative
# float32 values (they order as the values do, and integer maxima skip the NaN checks of float ones), the source
# magnitude maxima from MAG_REDUCEAT_GROUP. Same maxima either way (a maximum does not depend on the order).
ERR_REDUCEAT_GROUP = 32
# A value's error |w/scale - q| (at most 1/2) is counted in units of 2^-24 of its scale, truncated, and summed as
# integers: the sum is exact in any order, so the compiled loop and NumPy's reductions agree to the bit.
ERROR_UNITS = 1 << 24
MAG_REDUCEAT_GROUP = 64


class Quantized(NamedTuple):
    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # float32 [out, in // g]
    max_rel_err: float
    mean_rel_err: float


def _group(w: np.ndarray, group_size: int | None) -> int:
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype != np.float32:
        raise InvalidInput(f"quantize_int8 needs a 2-D float32 array, got "
                           f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}", field="weight")
    n_in = w.shape[1]
    g = n_in if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or n_in % g:
        raise InvalidInput(f"group_size {group_size!r} must be a positive divisor of the input dim {n_in}",
                           field="group_size", value=group_size)
    return g


def quantize_int8(w: np.ndarray, group_size: int | None = None) -> Quantized:
    """Quantize `w` [out, in] float32 (any layout) to int8 with one float32 scale per row and group."""
    g = _group(w, group_size)
    n_out, n_in = w.shape
    q = np.empty((n_out, n_in), np.int8)
    scale = np.empty((n_out, n_in // g), np.float32)
    max_rel, mean_rel = quantize_into(np.ascontiguousarray(w), g, q, scale)
    return Quantized(q, scale, max_rel, mean_rel)


# --- the converter's form: stored chunk in, caller's buffers out ------------------------------------------
_work = threading.local()


def _block_buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-thread float32 x and r of at least n elements, allocated once and reused."""
    bufs = getattr(_work, "bufs", None)
    if bufs is None or bufs[0].size < n:
        size = max(n, BLOCK_BYTES // 4)
        bufs = _work.bufs = (np.empty(size, np.float32), np.empty(size, np.float32))
    return bufs[0][:n], bufs[1][:n]


def _pack_buffers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-thread scratch for packing n int4 codes (n even): int8 codes [n] and two uint16 [n // 2], reused."""
    half = n // 2 * 2                                  # bytes of n // 2 uint16
    buf = getattr(_work, "pack", None)
    if buf is None or buf.size < n + 2 * half:
        buf = _work.pack = np.empty(max(n + 2 * half, BLOCK_BYTES // 4 * 3), np.uint8)
    return buf[:n].view(np.int8), buf[n:n + half].view(np.uint16), buf[n + half:n + 2 * half].view(np.uint16)


def _pack_nibbles(r: np.ndarray, out: np.ndarray) -> None:
    """The int4 codes of a block of rint values r (float32 [rows, G, g], in [-8, 7]) two a byte into `out` (uint8
    [rows, in // 2]): input 2k in the low nibble of byte k, 2k+1 in the high one, two's complement. The int8 codes
    are read as little-endian uint16 pairs, so the packing is four contiguous passes (strided byte slices cost ~4x)."""
    rows, n_in = out.shape[0], r.shape[1] * r.shape[2]
    if not np.little_endian:  # pragma: no cover - every platform NumPy ships for is little-endian
        codes = r.astype(np.int8).view(np.uint8).reshape(rows, n_in)
        np.bitwise_or(codes[:, 0::2] & np.uint8(0x0F), (codes[:, 1::2] & np.uint8(0x0F)) << np.uint8(4), out=out)
        return
    codes, low, high = _pack_buffers(rows * n_in)
    np.copyto(codes.reshape(r.shape), r, casting="unsafe")      # two's complement bytes
    pairs = codes.view(np.uint16)                               # code 2k in the low byte, 2k+1 in the high one
    np.bitwise_and(pairs, np.uint16(0x000F), out=low)
    np.right_shift(pairs, np.uint16(4), out=high)
    np.bitwise_and(high, np.uint16(0x00F0), out=high)
    np.bitwise_or(low, high, out=low)
    np.copyto(out, low.reshape(rows, n_in // 2), casting="unsafe")


def _magnitude_buffer(n: int, dtype: type) -> np.ndarray:
    """Per-thread unsigned scratch for the magnitude bits of a whole chunk, reused."""
    buf = getattr(_work, "mag", None)
    nbytes = n * np.dtype(dtype).itemsize
    if buf is None or buf.nbytes < nbytes:
        buf = _work.mag = np.empty(max(nbytes, 1 << 21), np.uint8)
    return buf[:nbytes].view(dtype)


def quantize_into(chunk: np.ndarray, group_size: int | None, q_out: np.ndarray, scale_out: np.ndarray
                  ) -> tuple[float, float]:
    """Quantize a stored chunk [out, in] (bf16 as uint16 bits, float16, float32 or float64) into `q_out` (int8
    [out, in], C-contiguous) and `scale_out` (float32 [out, in // g]); return (max_rel_err, mean_rel_err).

    A NaN or infinity (also float64 beyond float32) is a NonFiniteWeight naming its row and column. The group
    maxima and scales are computed for the whole chunk at once, then the values are quantized in one pass of the
    compiled loop (bf16 and float32 sources, where it is built: convert/native.py) or block by block in NumPy;
    both give the same q, scales and errors (module docstring).
    """
    if chunk.ndim != 2 or chunk.dtype not in _MAGNITUDE:
        raise InvalidInput(f"quantize_into needs a 2-D stored float chunk, got {chunk.dtype} {chunk.shape}",
                           field="weight")
    n_out, n_in = chunk.shape
    g = _group(np.empty((0, n_in), np.float32), group_size)
    if q_out.shape != chunk.shape or q_out.dtype != np.int8 or not q_out.flags.c_contiguous \
            or scale_out.shape != (n_out, n_in // g) or scale_out.dtype != np.float32:
        raise InvalidInput("quantize_into: output buffers do not match the chunk", field="weight")
    src = np.ascontiguousarray(chunk)
    rows = max(1, BLOCK_BYTES // max(1, 4 * n_in))
    amax = _group_maxima(src, g)  # [n_out, G] float32
    if not np.isfinite(amax).all():
        _refuse_non_finite(amax, src, _block_buffers(min(rows, n_out) * n_in)[0], rows, g)
    _, weight = _scales(amax, scale_out)
    err_max = np.empty(amax.shape, np.float32)
    err_units = np.empty(amax.shape, np.int64)
    lib = native.library()
    if lib is not None and src.dtype in _NATIVE_QUANTIZE:
        scale = np.ascontiguousarray(scale_out)
        getattr(lib, _NATIVE_QUANTIZE[src.dtype])(src.ctypes.data, scale.ctypes.data, amax.size, g, q_out.ctypes.data,
                                                  err_max.ctypes.data, err_units.ctypes.data)
    else:
        _quantize_blocks(src, g, rows, scale_out, q_out, err_max, err_units)
    np.multiply(err_max, weight, out=err_max)
    err_sum = float((err_units * (weight.astype(np.float64) / ERROR_UNITS)).sum())
    return float(err_max.max()) if err_max.size else 0.0, err_sum / max(1, n_out * n_in)


_NATIVE_QUANTIZE = {np.dtype(np.uint16): "colibri_quantize_bf16", np.dtype(np.float32): "colibri_quantize_f32"}


def _quantize_blocks(src: np.ndarray, g: int, rows: int, scale: np.ndarray, q_out: np.ndarray, err_max: np.ndarray,
                     err_units: np.ndarray) -> None:
    """The NumPy form of the values pass: q, and each group's largest |error| and its sum in ERROR_UNITS, block by
    block of `rows` rows through the per-thread float32 buffers."""
    for start, stop, x, r in _upcast_blocks(src, g, rows):
        _divide(x, scale[start:stop], x)   # w in units of its scale, |x| <= 127
        np.rint(x, out=r)
        np.copyto(q_out[start:stop].reshape(x.shape), r, casting="unsafe")
        _tally_errors(x, r, np.float32(ERROR_UNITS), err_max[start:stop], err_units[start:stop])


def _upcast_blocks(src: np.ndarray, g: int, rows: int):
    """(start, stop, x, r) for each block of `rows` rows of src [out, in]: x float32 [rows, in // g, g] holds the
    block's values, r a scratch of that shape (both the per-thread buffers, reused from block to block)."""
    n_out, n_in = src.shape
    x_buf, r_buf = _block_buffers(min(rows, n_out) * n_in)
    for start in range(0, n_out, rows):
        stop = min(start + rows, n_out)
        shape = (stop - start, n_in // g, g)
        n = (stop - start) * n_in
        x, r = x_buf[:n].reshape(shape), r_buf[:n].reshape(shape)
        _upcast(src[start:stop], x)
        yield start, stop, x, r


def _tally_errors(x: np.ndarray, r: np.ndarray, units, err_max: np.ndarray, err_units: np.ndarray) -> None:
    """A block's rounding errors |x - r| (x, in scale units, is overwritten; r's bytes become the counts): each
    group's largest into err_max, and the sum of its errors in `units` a step (truncated) into err_units."""
    np.subtract(x, r, out=x)
    np.abs(x, out=x)
    _abs_error_max(x, err_max)
    np.multiply(x, units, out=x)
    counts = r.view(np.int32)
    np.copyto(counts, x, casting="unsafe")  # truncated toward zero: these values are >= 0 (and < 2^31)
    _reduce_groups(np.add, counts, err_units)


# --- int4_group: two's-complement 4-bit values, two a byte, one float16 scale per group -------------------------
QMAX4 = 7
F16_MAX = float(np.finfo(np.float16).max)       # 65504: a group whose max|w| / 7 passes it cannot be stored


def quantize_int4_into(chunk: np.ndarray, group_size: int, q_out: np.ndarray, scale_out: np.ndarray, *,
                       search: bool = False) -> tuple[float, float]:
    """Quantize a stored chunk [out, in] (bf16 as uint16 bits, float16, float32 or float64) to the int4_group
    format: `scale_out` (float16 [out, in // g]) gets max|w| / 7 of each group rounded *up* to a float16 (1 for an
    all-zero group), `q_out` (uint8 [out, in // 2], C-contiguous) the round-to-nearest-even values q = rint(w / scale)
    in [-7, 7], two a byte: input 2k in the low nibble of byte k, 2k+1 in the high nibble (two's complement).
    Returns (max_rel_err, mean_rel_err) measured as for int8 (|w - q*scale| / max|w[row]|).

    Rounding the scale up keeps |w / scale| <= 7, so no value clips and |w - q*scale| <= scale/2 for the stored
    scale. NaN/inf, or a group whose max|w| / 7 exceeds the largest float16 (65504), is a NonFiniteWeight naming
    the row and column. Deterministic: the same bits whatever the chunking, thread or machine (float32 arithmetic
    on values whose rounding does not depend on the block).

    `search`: each group's scale is instead the one of least squared error among that scale, max|w| / d for d in
    SEARCH_DIVISORS, -w_m / 8 (w_m the group's value of largest magnitude: it becomes q = -8 exactly, the range
    [-8, 7] used whole, as llama.cpp's Q4_0 does) and one least-squares refit of the best (sum(w q) / sum(q q)),
    each a float16, q = rint(w / scale) clipped to [-8, 7]. The first scale stays unless another is strictly
    better, so no group's error grows; a clipped value may then lie beyond half a step."""
    if chunk.ndim != 2 or chunk.dtype not in _MAGNITUDE:
        raise InvalidInput(f"quantize_int4_into needs a 2-D stored float chunk, got {chunk.dtype} {chunk.shape}",
                           field="weight")
    n_out, n_in = chunk.shape
    if group_size is None:
        raise InvalidInput("int4 quantization needs a group size", field="group_size", value=group_size)
    g = _group(np.empty((0, n_in), np.float32), group_size)
    if g % 2 or q_out.shape != (n_out, n_in // 2) or q_out.dtype != np.uint8 \
            or scale_out.shape != (n_out, n_in // g) or scale_out.dtype != np.float16:
        raise InvalidInput("quantize_int4_into: output buffers do not match the chunk", field="weight")
    src = np.ascontiguousarray(chunk)
    rows = max(1, BLOCK_BYTES // max(1, 4 * n_in))
    x_buf, r_buf = _block_buffers(min(rows, n_out) * n_in)
    amax = _group_maxima(src, g)
    _refuse_non_finite(amax, src, x_buf, rows, g, "int4")
    scale = _scales_f16(amax, src, g)
    err_max = np.empty(amax.shape, np.float32)
    err_units = np.empty(amax.shape, np.int64)
    units = _int4_error_units(amax, scale)
    lib = native.library()
    if lib is not None and src.dtype in _NATIVE_QUANTIZE4 and q_out.flags.c_contiguous \
            and (not search or g <= NATIVE_SEARCH_MAX_G):
        out = (q_out.ctypes.data, err_max.ctypes.data, err_units.ctypes.data)
        if search:
            getattr(lib, _NATIVE_SEARCH4[src.dtype])(src.ctypes.data, scale.ctypes.data, units.ctypes.data,
                                                     _SEARCH_DIVISORS.ctypes.data, len(SEARCH_DIVISORS), amax.size,
                                                     g, *out)
        else:
            getattr(lib, _NATIVE_QUANTIZE4[src.dtype])(src.ctypes.data, scale.ctypes.data, units.ctypes.data,
                                                       amax.size, g, *out)
    else:
        _quantize4_blocks(src, g, rows, scale, units, q_out, err_max, err_units, search)
    scale_out[...] = scale                 # float16 values already: exact
    # |w - q*scale| / rowmax == |x - q| * |scale| / rowmax (zero groups: error 0; a group's scale is at least 2^-24,
    # the smallest float16, so for a row of tiny values the factor passes 1 but stays finite)
    row_max = amax.max(axis=1, keepdims=True)
    weight = np.where(amax > 0, np.abs(scale), np.float32(0)) / np.where(row_max > 0, row_max, np.float32(1))
    np.multiply(err_max, weight, out=err_max)
    err_sum = float((err_units * (weight.astype(np.float64) / units.astype(np.float64))).sum())
    return float(err_max.max()) if err_max.size else 0.0, err_sum / max(1, n_out * n_in)


def _int4_error_units(amax: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Each group's error units a scale step (float32 [out, G]): ERROR_UNITS, but for a group whose largest value is
    under half its scale (tiny weights below the smallest float16 step: every q is 0 and each error is |w / s|),
    2^23 of that value, so the truncation keeps its errors; at most 2^126. Round-to-nearest errors x units stay
    <= 2^23 (searched ones, clipped, below 2^25), so a run of INT32_RUN of them sums in int32 (_native.c)."""
    ratio = amax.astype(np.float64) / scale.astype(np.float64)
    with np.errstate(divide="ignore"):
        fine = np.where(ratio > 0, float(ERROR_UNITS // 2) / ratio, float(ERROR_UNITS))
    return np.where(ratio >= 0.5, float(ERROR_UNITS), np.minimum(fine, 2.0 ** 126)).astype(np.float32)


_NATIVE_QUANTIZE4 = {np.dtype(np.uint16): "colibri_quantize4_bf16", np.dtype(np.float32): "colibri_quantize4_f32"}
_NATIVE_SEARCH4 = {np.dtype(np.uint16): "colibri_quantize4_search_bf16",
                   np.dtype(np.float32): "colibri_quantize4_search_f32"}
NATIVE_SEARCH_MAX_G = 128   # _native.c's INT32_RUN: the compiled search holds a group in one run


def _quantize4_blocks(src: np.ndarray, g: int, rows: int, scale: np.ndarray, units: np.ndarray, q_out: np.ndarray,
                      err_max: np.ndarray, err_units: np.ndarray, search: bool) -> None:
    """The NumPy form of the int4 values pass (`search` also refits `scale` in place): packed q, and each group's
    largest |error| and its sum in `units` a step, block by block of `rows` rows."""
    for start, stop, x, r in _upcast_blocks(src, g, rows):
        if search:
            scale[start:stop] = _search_scales(x, scale[start:stop])
        _divide(x, scale[start:stop], x)   # w in units of its scale, |x| <= 7 (searched: may pass 8)
        np.rint(x, out=r)
        if search:
            np.clip(r, -8, 7, out=r)
        _pack_nibbles(r, q_out[start:stop])
        _tally_errors(x, r, units[start:stop, :, None], err_max[start:stop], err_units[start:stop])  # errors < 2


def quantize_int4(w: np.ndarray, group_size: int, *, search: bool = False) -> Quantized:
    """`w` [out, in] float32 to int4_group: q packed uint8 [out, in // 2], scale float16 [out, in // g]
    (`quantize_int4_into` on the whole matrix)."""
    g = _group(w, group_size) if group_size is not None else group_size
    q = np.empty((w.shape[0], w.shape[1] // 2), np.uint8)
    scale = np.empty((w.shape[0], w.shape[1] // g if g else 0), np.float16)
    max_rel, mean_rel = quantize_int4_into(w, g, q, scale, search=search)
    return Quantized(q, scale, max_rel, mean_rel)


def _scales_f16(amax: np.ndarray, src: np.ndarray, g: int) -> np.ndarray:
    """float16 scales max|w| / 7 rounded up (1 for zero groups), as float32 values. The nearest float16 of the
    exact quotient, when below it, moves up one step: the next bit pattern, as these are >= +0 (the largest finite
    float16 goes to inf, refused below); NumPy's float16 `where` and `nextafter` cost ~8x more."""
    exact = amax.astype(np.float64) / QMAX4
    with np.errstate(over="ignore"):
        s16 = exact.astype(np.float16)
    bits = s16.view(np.uint16)
    bits += (s16.astype(np.float64) < exact).view(np.uint8)
    scale = s16.astype(np.float32)
    scale[amax == 0] = 1.0
    if not np.isfinite(scale).all():
        row, group = (int(i) for i in np.argwhere(~np.isfinite(scale))[0])
        cols = slice(group * g, (group + 1) * g)
        col = group * g + int(np.argmax(np.abs(_row_f32(src, row)[cols])))
        raise NonFiniteWeight(f"weight {float(amax[row, group]):.6g} at index [{row}, {col}] is too large for int4 "
                              f"with float16 scales (at most {QMAX4} x {F16_MAX:g} a group)", field="weight",
                              value=float(amax[row, group]))
    return scale


SEARCH_DIVISORS = (7.25, 7.5, 7.75, 8.0, 8.5)
_SEARCH_DIVISORS = np.array(SEARCH_DIVISORS, np.float32)      # what the compiled search divides by


SEARCH_LANES = 8   # the search's float32 sums: interleaved lanes (element k in lane k % 8), then a fixed tree


def _as_f16(s: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return s.astype(np.float16).astype(np.float32)


def _lane_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis of v [r, G, g] in a fixed order, the one _native.c's search takes: v padded with +0 to
    whole lanes' rounds, each lane sums its elements in turn, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))."""
    r, G, g = v.shape
    if g % SEARCH_LANES:
        v = np.concatenate([v, np.zeros((r, G, -g % SEARCH_LANES), v.dtype)], axis=-1)
        g = v.shape[-1]
    lanes = v.reshape(r, G, g // SEARCH_LANES, SEARCH_LANES)
    acc = lanes[:, :, 0, :].copy()
    for i in range(1, g // SEARCH_LANES):
        acc += lanes[:, :, i, :]
    pairs = acc[..., 0::2] + acc[..., 1::2]
    quads = pairs[..., 0::2] + pairs[..., 1::2]
    return quads[..., 0] + quads[..., 1]


def _group_sse(x: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(squared error of each group [r, G] with scales s, clipped q [r, G, g]); inf for a zero or infinite scale."""
    ok = np.isfinite(s) & (s != 0)
    safe = np.where(ok, s, np.float32(1))[..., None]
    q = np.clip(np.rint(x / safe), -8, 7)
    d = x - q * safe
    return np.where(ok, _lane_sum(d * d), np.float32(np.inf)), q


def _search_scales(x: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The least-squared-error scale of each group of x [r, G, g] (see quantize_int4_into's `search`)."""
    mag = np.abs(x)
    amax = mag.max(-1)
    wm = np.take_along_axis(x, mag.argmax(-1)[..., None], -1)[..., 0]
    best = base.copy()
    best_err, _ = _group_sse(x, best)
    for cand in [amax / np.float32(d) for d in SEARCH_DIVISORS] + [-wm / np.float32(8)]:
        s = _as_f16(cand)
        err, _ = _group_sse(x, s)
        better = err < best_err
        best, best_err = np.where(better, s, best), np.where(better, err, best_err)
    _, q = _group_sse(x, best)
    den = _lane_sum(q * q)
    fit = _as_f16(_lane_sum(x * q) / np.where(den > 0, den, np.float32(1)))
    err, _ = _group_sse(x, fit)
    better = (err < best_err) & (den > 0)
    return np.where(better, fit, best).astype(np.float32)


def _row_f32(src: np.ndarray, row: int) -> np.ndarray:
    out = np.empty(src.shape[1], np.float32)
    _upcast(src[row:row + 1], out)
    return out


# stored dtype -> (unsigned view of its bits, mask of the magnitude bits)
_MAGNITUDE = {np.dtype(np.uint16): (np.uint16, 0x7FFF), np.dtype(np.float16): (np.uint16, 0x7FFF),
              np.dtype(np.float32): (np.uint32, 0x7FFF_FFFF), np.dtype(np.float64): (None, 0)}


def _group_maxima(src: np.ndarray, g: int) -> np.ndarray:
    """max |w| of every row and group of a stored chunk as float32 (inf or NaN where such a value is), from the
    magnitude bits: for finite values they order as the magnitudes do, so no float copy is needed."""
    n_out, n_in = src.shape
    view, mask = _MAGNITUDE[src.dtype]
    if view is None:  # float64: the maxima narrowed (rounding is monotonic, so it commutes with max)
        with np.errstate(over="ignore", invalid="ignore"):
            return _reduce_groups(np.maximum, np.abs(src).reshape(n_out, n_in // g, g)).astype(np.float32)
    bits = src.view(view)
    lib = native.library()
    if lib is not None:
        top = np.empty((n_out, n_in // g), view)
        fn = lib.colibri_group_max_bits16 if view is np.uint16 else lib.colibri_group_max_bits32
        fn(bits.ctypes.data, top.size, g, top.ctypes.data)
        return _magnitudes_as_float32(top, src.dtype)
    mag = _magnitude_buffer(src.size, view)
    np.bitwise_and(bits.reshape(-1), view(mask), out=mag)
    if g >= MAG_REDUCEAT_GROUP:
        top = np.maximum.reduceat(mag, _group_starts(mag.size, g)).reshape(n_out, n_in // g)
    else:
        top = _reduce_groups(np.maximum, mag.reshape(n_out, n_in // g, g))
    return _magnitudes_as_float32(top, src.dtype)


def _magnitudes_as_float32(top: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Group maxima of magnitude bits (unsigned, of the stored dtype) as float32 values."""
    if dtype == np.uint16:  # bf16: the float32 with these top 16 bits
        return (top.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return top.view(dtype).astype(np.float32)


def _upcast(block: np.ndarray, out: np.ndarray) -> None:
    """A block of stored values into the float32 buffer `out` (same element count)."""
    if block.dtype == np.uint16:
        _widen_bf16(block, out)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # float64 beyond float32: inf (found by the maxima)
            np.copyto(out.reshape(block.shape), block, casting="unsafe")


def _scales(amax: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fill `scale` from the finite group maxima; return (err_scale, weight): what a group's error is measured in,
    and the factor from a group's error in scale units to the row-relative error."""
    np.divide(amax, np.float32(QMAX), out=scale)
    err_scale = scale
    tiny = amax < TINY_GROUP_MAX
    if tiny.any():  # rare: zero groups, and groups whose scale is subnormal (module docstring)
        small = amax[tiny]
        exact = small.astype(np.float64) / QMAX
        rounded = exact.astype(np.float32)
        rounded = np.where(rounded.astype(np.float64) < exact, np.nextafter(rounded, np.float32(1)), rounded)
        scale[tiny] = np.where(small == 0, np.float32(1), rounded)  # zero group: q = 0, exact
        # A zero group's scale 1.0 over the max of a row of tiny values (below ~3e-39) would overflow float32
        # to inf, and 0 * inf is NaN: measure zero groups with scale 0 instead (their error is 0).
        err_scale = np.where(amax > 0, scale, np.float32(0))
    row_max = amax.max(axis=1, keepdims=True)
    # err_scale <= row_max (a group's scale is at most its max / 127, or the smallest subnormal when that max is
    # itself that subnormal), so the weight is at most 1: finite whatever the row's magnitude
    return err_scale, err_scale / np.where(row_max > 0, row_max, np.float32(1))  # zero rows: error 0


def _divide(w3: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """out = w3 / scale[:, :, None] (see UNBUFFERED_GROUP)."""
    g = w3.shape[2]
    if g >= UNBUFFERED_GROUP:
        with np.errstate():  # restores the buffer size on exit
            np.setbufsize(g)
            np.divide(w3, scale[:, :, None], out=out)
    else:
        np.divide(w3, scale[:, :, None], out=out)


def _widen_bf16(bits: np.ndarray, out: np.ndarray) -> None:
    """bf16 bit patterns into float32 `out` (same element count): widen, then shift in place."""
    wide = out.reshape(bits.shape).view(np.uint32)
    np.copyto(wide, bits)
    np.left_shift(wide, np.uint32(16), out=wide)


def _refuse_non_finite(amax: np.ndarray, src: np.ndarray, x_buf: np.ndarray, rows: int, g: int,
                       what: str = "int8") -> None:
    """Raise the error for the first NaN or infinity of `src` when its group maxima `amax` hold one: the block of
    `rows` rows holding it is upcast into `x_buf` and searched."""
    if np.isfinite(amax).all():
        return
    n_out, n_in = src.shape
    bad = int(np.argmax(~np.isfinite(amax).all(axis=1)))
    first = bad // rows * rows
    x = x_buf[:(min(first + rows, n_out) - first) * n_in].reshape(-1, n_in // g, g)
    _upcast(src[first:first + x.shape[0]], x)
    raise _non_finite(x, first, what)


def _non_finite(w3: np.ndarray, row0: int, what: str = "int8") -> NonFiniteWeight:
    """The error for the first NaN or infinity of a block (searched only once the block failed)."""
    rows, groups, g = w3.shape
    flat = w3.reshape(rows, groups * g)
    row, col = (int(i) for i in np.argwhere(~np.isfinite(flat))[0])
    value = float(flat[row, col])
    kind = "NaN" if np.isnan(value) else f"{'+' if value > 0 else '-'}inf"
    return NonFiniteWeight(f"weight holds {kind} at index [{row0 + row}, {col}], which {what} cannot hold",
                           field="weight", value=value)


@functools.lru_cache(maxsize=32)
def _group_starts(n: int, g: int) -> np.ndarray:
    """The first index of every group of g in n values (read-only, shared by threads): `reduceat`'s indices."""
    starts = np.arange(0, n, g, dtype=np.intp)
    starts.flags.writeable = False
    return starts


def _abs_error_max(x3: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """max over the last axis of a C-contiguous [rows, G, g] float32 block of finite values >= +0 (|errors|), into
    `out` ([rows, G], C-contiguous) when given."""
    rows, groups, g = x3.shape
    if g < ERR_REDUCEAT_GROUP or not x3.flags.c_contiguous or x3.size == 0 \
            or (out is not None and not out.flags.c_contiguous):
        return _reduce_groups(np.maximum, x3, out)
    if out is None:
        out = np.empty((rows, groups), np.float32)
    np.maximum.reduceat(x3.reshape(-1).view(np.int32), _group_starts(x3.size, g), out=out.reshape(-1).view(np.int32))
    return out


def _reduce_groups(ufunc: np.ufunc, x3: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ufunc-reduce [rows, G, g] over g (into `out` when given).

    NumPy reduces a short contiguous last axis one tiny inner loop per group; for small
    groups, g strided element-wise calls over all groups at once are 2-4x faster.
    """
    g = x3.shape[2]
    if g > SMALL_GROUP:
        return ufunc.reduce(x3, axis=2, out=out)
    acc = x3[..., 0].copy() if out is None else out
    if out is not None:
        np.copyto(acc, x3[..., 0])
    for k in range(1, g):
        ufunc(acc, x3[..., k], out=acc)
    return acc


def benchmark_quantize(n_out: int = 4096, n_in: int = 4096, group_size: int | None = None,
                       repeats: int = 3, seed: int = 0) -> dict[str, float]:
    """Best-of-`repeats` throughput of quantize_int8 on random float32 weights (for benchmarks/convert.py)."""
    w = np.random.default_rng(seed).standard_normal((n_out, n_in), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        quantize_int8(w, group_size)
        best = min(best, time.perf_counter() - start)
    return {"seconds": best, "source_bytes": float(w.nbytes), "gb_per_s": w.nbytes / best / 1e9,
            "n_out": float(n_out), "n_in": float(n_in), "group_size": float(group_size or n_in)}
