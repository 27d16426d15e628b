"""What the CUDA kernels' internal stages must produce, built from `numpy_backend` (the one NumPy op set).

The decoder's ops (`numpy_backend.router`, `.moe`, `.rmsnorm`, ...) are tested against directly. A few kernels
are stages inside one of those ops: the dispatch kernel's grouping of (token, slot) pairs, the gate/up and down
GEMV/GEMM per pair, the combine, the KV append and the bf16 split for tensor cores. Their contracts are written
here from `numpy_backend` primitives, in float64. `experts(e) -> (gate_up [2I, H], down [H, I])` is the
dequantized-expert callable that `numpy_backend.moe` takes. Pair p = t * k + j is slot j of token t.
"""

from __future__ import annotations

import numpy as np

from colibri_format.dtypes import float32_to_bf16_bits, to_float32
from colibri_format.runtime import numpy_backend as nb


def dispatch_grouping(ids, num_experts: int, tile_m: int = 64) -> dict:
    """ids [P] (flattened [T, k]) -> the grouping the dispatch kernel produces (stable by pair index)."""
    ids = np.asarray(ids).reshape(-1)
    counts = np.bincount(ids, minlength=num_experts).astype(np.int32)
    offsets = np.zeros(num_experts + 1, np.int32)
    offsets[1:] = np.cumsum(counts)
    perm = np.argsort(ids, kind="stable").astype(np.int32)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm), dtype=np.int32)
    active = np.flatnonzero(counts).astype(np.int32)
    tiles = [(e, offsets[e] + j * tile_m) for e in active for j in range(-(-counts[e] // tile_m))]
    return {"counts": counts, "offsets": offsets, "perm": perm, "inv": inv, "active": active,
            "tile_expert": np.array([t[0] for t in tiles], np.int32),
            "tile_start": np.array([t[1] for t in tiles], np.int32)}


def _per_pair(ids, pair_rows) -> np.ndarray:
    """[T * k, n] in pair order from pair_rows(e, t, j) -> the rows of the pairs (t, j) routed to expert e."""
    T, k = ids.shape
    out = None
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        rows = pair_rows(int(e), t, j)
        if out is None:
            out = np.full((T * k, rows.shape[1]), np.nan)
        out[t * k + j] = rows
    return out


def pair_act(x, ids, experts, *, act=None, gate_up_bias=None) -> np.ndarray:
    """act [T * k, I]: silu(gate x[t]) * (up x[t]) with expert ids[t, j] (the gate/up kernels' output); with
    gpt-oss's extras, gate_up_bias [E, 2I] added first and the clamped SwiGLU `act` (`numpy_backend.expert_ffn`)."""
    def rows(e, t, j):
        h = nb.linear(x[t], experts(e)[0], bias=None if gate_up_bias is None else gate_up_bias[e])
        inter = h.shape[1] // 2
        return nb.silu_mul(h) if act is None else nb.clamped_swiglu(h[:, :inter], h[:, inter:], **act)
    return _per_pair(ids, rows)


def pair_down(act, ids, weights, experts, *, down_bias=None) -> np.ndarray:
    """ypair [T * k, H]: weights[t, j] * (down act[p] (+ down_bias [E, H])) with expert ids[t, j] (the down kernels'
    output)."""
    k = ids.shape[1]
    return _per_pair(ids, lambda e, t, j: weights[t, j, None] * nb.linear(
        act[t * k + j], experts(e)[1], bias=None if down_bias is None else down_bias[e]))


def combine(ypair, k: int, residual, alpha: float = 1.0) -> np.ndarray:
    """y [T, H] = residual + alpha * sum_j ypair[t * k + j] (the combine kernel)."""
    return nb.residual_add(residual, ypair.reshape(-1, k, ypair.shape[-1]).sum(1), alpha=alpha)


def split_bf16(x) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) as bf16 bits: hi = bf16(x) round-to-nearest-even, lo = bf16(x - hi) (tensor-core activations)."""
    x = np.asarray(x, np.float32)
    hi = float32_to_bf16_bits(x)
    return hi, float32_to_bf16_bits(x - to_float32(hi))


def stacked_split_bf16(rows, offsets) -> np.ndarray:
    """[2P, H] bf16 bits of rows [P, H] in sorted order: each expert's rows (positions offsets[e]..offsets[e+1]) as
    their hi then their lo (`split_bf16`), expert e's block from row 2 offsets[e] (moe_gemm_cublas.cu's stacking)."""
    hi, lo = split_bf16(rows)
    out = np.empty((2 * len(rows), rows.shape[1]), np.uint16)
    for a, b in zip(offsets[:-1], offsets[1:]):
        out[2 * a:a + b], out[a + b:2 * b] = hi[a:b], lo[a:b]
    return out


def round_rows_int8(a) -> np.ndarray:
    """a [rows, cols] with each row rounded to int8 with one scale (moe_gemm_cublas.cu's quantize_rows_int8, on
    float32: `numpy_backend.quantize_int8_groups` with the row as its group), as float64 q * s."""
    a32 = np.asarray(a, np.float32)
    q, s = nb.quantize_int8_groups(a32, a32.shape[1])
    return q.astype(np.float64) * s.astype(np.float64)


def w8a8_block(x, ids, weights, experts, residual) -> np.ndarray:
    """The routed-expert block with W8A8 products (`ops.moe_experts_cublas(activations="int8")`): x rounded to int8 a
    token, each pair's act a row, the rest in float64."""
    act = pair_act(round_rows_int8(x), ids, experts)
    return combine(pair_down(round_rows_int8(act), ids, weights, experts), ids.shape[1], residual)
