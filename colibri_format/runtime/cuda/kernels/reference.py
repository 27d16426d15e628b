"""NumPy references for every CUDA kernel in this folder, computed in float64.

Each `*_reference` function states in plain array code what the kernel of the same name computes; the GPU tests
compare the kernels against these on fresh random inputs by relative error ||out - ref|| / ||ref||. bf16 values
travel as raw uint16 bits (NumPy has no bfloat16); `bf16_to_f32` / `f32_to_bf16` convert.
"""

from __future__ import annotations

import numpy as np


# ---- 16-bit float helpers -------------------------------------------------------------------------------------
def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (NaN kept as a quiet NaN)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    out[nan] = 0x7FC0
    return out


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_f64(a: np.ndarray, dtype_code: str = "") -> np.ndarray:
    """Any kernel input (float32, float16 or bf16 bits as uint16) as float64."""
    a = np.asarray(a)
    if a.dtype == np.uint16 or dtype_code == "bf16":
        return bf16_to_f32(a).astype(np.float64)
    return a.astype(np.float64)


def dequantize(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """q [R, C] int8, scale [R, C / group] f32 -> float64 [R, C]; group 0 or C means one scale per row."""
    q = q.astype(np.float64)
    cols = q.shape[1]
    g = cols if group in (0, cols) else group
    return q * np.repeat(scale.astype(np.float64), g, axis=1)[:, :cols]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# ---- router ---------------------------------------------------------------------------------------------------
def router_reference(x, w, k, bias=None, scoring="softmax", order="softmax_topk", normalize=False, scale=1.0):
    """x [T, H], w [E, H] -> (ids [T, k] int32, weights [T, k] float64, logits [T, E] float64).

    Selection is by descending key with ties to the lower expert index (stable argsort of -key).
    """
    logits = as_f64(x) @ as_f64(w).T
    if order == "topk_softmax":
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        sel = np.take_along_axis(logits, ids, -1)
        e = np.exp(sel - sel.max(-1, keepdims=True))
        return ids.astype(np.int32), e / e.sum(-1, keepdims=True) * scale, logits
    if scoring == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    key = scores if bias is None else scores + as_f64(bias)[None, :]
    ids = np.argsort(-key, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return ids.astype(np.int32), weights * scale, logits


# ---- dispatch -------------------------------------------------------------------------------------------------
def dispatch_reference(ids: np.ndarray, num_experts: int, tile_m: int = 64) -> dict:
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


# ---- experts --------------------------------------------------------------------------------------------------
def moe_act_reference(x, ids, experts, group_h=0):
    """act per pair [P, I]: silu(x[t] . gate) * (x[t] . up) of pair p = t * k + j with expert ids[t, j].

    experts[e] = (gate_up int8 [2I, H], gate_up_scale [2I, H/g], down int8 [H, I], down_scale [H, I/g]).
    """
    x = as_f64(x)
    T, k = ids.shape
    inter = experts[0][0].shape[0] // 2
    act = np.zeros((T * k, inter))
    for t in range(T):
        for j in range(k):
            gu = dequantize(experts[ids[t, j]][0], experts[ids[t, j]][1], group_h) @ x[t]
            act[t * k + j] = silu(gu[:inter]) * gu[inter:]
    return act


def moe_down_reference(act, ids, weights, experts, group_i=0):
    """ypair [P, H] = weights[p] * (act[p] . down[h]) for pair p (pair order)."""
    T, k = ids.shape
    hidden = experts[0][2].shape[0]
    y = np.zeros((T * k, hidden))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            y[t * k + j] = float(weights[t, j]) * (dequantize(experts[e][2], experts[e][3], group_i) @ act[t * k + j])
    return y


def moe_combine_reference(ypair, k, residual=None, alpha=1.0):
    y = as_f64(ypair).reshape(-1, k, ypair.shape[-1]).sum(1) * alpha
    return y if residual is None else y + as_f64(residual)


def moe_reference(x, ids, weights, experts, group_h=0, group_i=0, residual=None, alpha=1.0):
    act = moe_act_reference(x, ids, experts, group_h)
    return moe_combine_reference(moe_down_reference(act, ids, weights, experts, group_i), ids.shape[1], residual, alpha)


# ---- dense layers ---------------------------------------------------------------------------------------------
def rmsnorm_reference(x, w, eps, w_offset=0.0):
    x = as_f64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (as_f64(w) + w_offset)


def rope_reference(x, pos, cos, sin):
    """x [N, nh, hd], pos [N], cos/sin [npos, rot/2] -> rotate_half on the first rot dims."""
    x = as_f64(x).copy()
    half = cos.shape[1]
    c = as_f64(cos)[pos][:, None, :]
    s = as_f64(sin)[pos][:, None, :]
    x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:2 * half] = x2 * c + x1 * s
    return x


def kv_append_reference(k, v, k_cache, v_cache, seq, pos):
    kc, vc = as_f64(k_cache).copy(), as_f64(v_cache).copy()
    kc[seq, pos] = as_f64(k)
    vc[seq, pos] = as_f64(v)
    return kc, vc


def attention_reference(q, k_cache, v_cache, q_seq, q_len, scale, window=0):
    """q [NQ, nh, hd], caches [S, cap, nkv, hd]; row n attends to keys [max(0, len - window), len) of q_seq[n]."""
    q, kc, vc = as_f64(q), as_f64(k_cache), as_f64(v_cache)
    nq, nh, hd = q.shape
    group = nh // kc.shape[2]
    out = np.zeros_like(q)
    for n in range(nq):
        length = int(q_len[n])
        first = max(0, length - window) if window > 0 else 0
        for h in range(nh):
            keys = kc[q_seq[n], first:length, h // group]
            vals = vc[q_seq[n], first:length, h // group]
            s = keys @ q[n, h] * scale
            p = np.exp(s - s.max())
            out[n, h] = (p / p.sum()) @ vals
    return out


def embedding_reference(ids, table, mult=1.0):
    return as_f64(table)[np.asarray(ids)] * mult


def residual_add_reference(a, b, alpha=1.0):
    return as_f64(a) + alpha * as_f64(b)


def silu_mul_reference(gu):
    gu = as_f64(gu)
    inter = gu.shape[-1] // 2
    return silu(gu[..., :inter]) * gu[..., inter:]


def dense_gemv_reference(x, w, bias=None):
    y = as_f64(x) @ as_f64(w).T
    return y if bias is None else y + as_f64(bias)


# ---- fused decode-layer kernels (fused.cu) ---------------------------------------------------------------------
def add_rmsnorm_reference(h, b, w, eps, alpha=1.0):
    """(h + alpha * b, rmsnorm(h + alpha * b) * w)."""
    s = as_f64(h) + alpha * as_f64(b)
    return s, rmsnorm_reference(s, w, eps)


def qkv_rope_kv_reference(qkv, heads, kv_heads, k_cache, v_cache, seq, pos, rpos, cos, sin, norm="none",
                          q_norm=None, k_norm=None, eps=1e-6, clip=None):
    """(q [N, heads, hd], k_cache, v_cache) after the NumPy engine's q/k norm, clip, RoPE and the KV append."""
    qkv = as_f64(qkv)
    N = qkv.shape[0]
    hd = k_cache.shape[3]
    nq, nk = heads * hd, kv_heads * hd
    q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
    if norm == "full":
        q, k = rmsnorm_reference(q, q_norm, eps), rmsnorm_reference(k, k_norm, eps)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    q, k, v = q.reshape(N, heads, hd), k.reshape(N, kv_heads, hd), v.reshape(N, kv_heads, hd)
    if norm == "per_head":
        q, k = rmsnorm_reference(q, q_norm, eps), rmsnorm_reference(k, k_norm, eps)
    if cos.shape[1]:
        q, k = rope_reference(q, rpos, cos, sin), rope_reference(k, rpos, cos, sin)
    kc, vc = kv_append_reference(k, v, k_cache, v_cache, seq, pos)
    return q, kc, vc


def split_bf16_reference(x):
    """(hi, lo) as bf16 bits: hi = bf16(x) round-to-nearest-even, lo = bf16(x - hi)."""
    x = np.asarray(x, np.float32)
    hi = f32_to_bf16(x)
    lo = f32_to_bf16((x - bf16_to_f32(hi)).astype(np.float32))
    return hi, lo
