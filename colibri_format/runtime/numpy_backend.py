"""The NumPy backend: the decoder's ops in plain array code, and a host "device" for the expert pool.

Two roles, one code:
- running: `NumpyBackend(np.float32)` is the CPU engine (float32 arithmetic, as transformers' fp32 eager);
- the oracle: the same functions on float64 inputs are what every CUDA kernel is tested against
  (tests/runtime/cuda/test_gpu_*.py compare `runtime.cuda.kernels.ops.X` with `numpy_backend.X`).

Every op takes its output through `out=` exactly as the kernel wrapper of the same name does, so the decoder
calls both backends alike. Inputs may be float32, float16 or bf16 bits (uint16); they are widened to the dtype of
the activation `x` (float32 or float64). The "device" of this backend is host memory: a device pointer is a host
address, a copy is a memmove, streams and events are no-ops and there are no graphs.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np

from colibri_format.dequant import dequantize_matrix
from colibri_format.dtypes import NUMPY_STORAGE, float32_to_bf16_bits
from colibri_format.errors import InvalidInput
from colibri_format.runtime.cuda.limits import A8_GROUP, rounds_activations, rounds_dense_bf16, rounds_rows_int8
from colibri_format.runtime.dense import fused_dense_tensors
from colibri_format.spec.constants import QUANTIZED_FORMATS


# ---- element helpers -------------------------------------------------------------------------------------------
def widen(a, dtype=np.float64, xp=np) -> np.ndarray:
    """Any kernel input (float32, float16 or bf16 bits as uint16: a weight, or a bf16 KV cache,
    EngineConfig.kv_cache_dtype) as `dtype`. `xp`: NumPy, or CuPy for the CUDA backend's array-operation attention."""
    a = xp.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(xp.uint32) << 16).view(xp.float32).astype(dtype, copy=False)   # bf16 bits: exact
    return a.astype(dtype, copy=False)


def cache_entries(values, cache_dtype) -> np.ndarray:
    """What a KV cache of `cache_dtype` stores for `values`: bf16 bits rounded to nearest even from float32 (the
    CUDA kernels round their float32 values the same way), or the values themselves."""
    return float32_to_bf16_bits(values.astype(np.float32)) if cache_dtype == np.uint16 else values


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _store(out, value: np.ndarray) -> np.ndarray:
    if out is None:
        return value
    out[...] = value
    return out


# ---- dense layers ----------------------------------------------------------------------------------------------
def embedding(ids, table, *, mult: float = 1.0, out=None, dtype=np.float32):
    return _store(out, widen(np.asarray(table)[np.asarray(ids)], dtype) * dtype(mult))


def rmsnorm(x, w, eps: float, *, out=None):
    """x * rsqrt(mean(x^2) + eps) * w over the last axis (serves [T, H], [T, heads, hd] and full-width q/k)."""
    x = np.asarray(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps)) * widen(w, x.dtype)
    return _store(out, y)


def add_rmsnorm(h, b, w, eps: float, *, alpha: float = 1.0, out=None):
    """h += alpha * b (in place), then out = rmsnorm(h) * w."""
    h += h.dtype.type(alpha) * b
    return rmsnorm(h, w, eps, out=out)


def residual_add(a, b, *, alpha: float = 1.0, out=None):
    return _store(out, a + a.dtype.type(alpha) * b)


def silu_mul(gu, *, out=None):
    inter = gu.shape[-1] // 2
    return _store(out, silu(gu[..., :inter]) * gu[..., inter:])


def linear(x, w, *, bias=None, out=None):
    """y = x @ w.T (+ bias), w in any stored dtype."""
    y = x @ widen(w, x.dtype).T
    return _store(out, y if bias is None else y + widen(bias, x.dtype))


def rope(x, rpos, cos, sin):
    """In place on x [N, heads, hd]: rotate_half RoPE of the first 2*cos.shape[1] dims with table rows rpos."""
    half = cos.shape[1]
    if half == 0:
        return x
    c = widen(cos, x.dtype)[np.asarray(rpos)][:, None, :]
    s = widen(sin, x.dtype)[np.asarray(rpos)][:, None, :]
    x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:2 * half] = x2 * c + x1 * s
    return x


def qkv_rope_kv(qkv, heads: int, kv_heads: int, k_cache, v_cache, seq, pos, rpos, cos, sin, *, norm: str = "none",
                q_norm=None, k_norm=None, eps: float = 1e-6, clip: float | None = None, q_out=None):
    """From the fused projection [N, (heads + 2 kv_heads) hd]: q/k norm ("full" before the head split, "per_head"
    after it), clip, RoPE, and k, v written to the caches at (seq[n], pos[n]); returns q [N, heads, hd]."""
    N, hd = qkv.shape[0], k_cache.shape[3]
    nq, nk = heads * hd, kv_heads * hd
    q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
    if norm == "full":                                  # OLMoE: the whole projection, pre-split
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    q, k, v = (t.reshape(N, n, hd).copy() for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
    if norm == "per_head":                              # Qwen3: each head, post-split, pre-RoPE
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    rope(q, rpos, cos, sin)
    rope(k, rpos, cos, sin)
    k_cache[np.asarray(seq), np.asarray(pos)] = cache_entries(k, k_cache.dtype)
    v_cache[np.asarray(seq), np.asarray(pos)] = cache_entries(v, v_cache.dtype)
    return _store(q_out, q)


def attention(q, k_cache, v_cache, q_seq, q_len, scale: float, *, window: int = 0, sinks=None, out=None, xp=np):
    """Row n of q [NQ, heads, hd] attends to keys [max(0, q_len[n] - window), q_len[n]) of cache sequence q_seq[n]
    (window <= 0: all). sinks [heads]: a learned logit per head that joins the softmax as one more column whose
    value is dropped (gpt-oss), so the weights of the keys sum to less than one. `xp` lets the CUDA backend run this
    for head sizes its kernel is not built for."""
    seq_h, len_h = np.asarray(q_seq).astype(np.int64), np.asarray(q_len).astype(np.int64)
    nq, nh, hd = q.shape
    nkv = k_cache.shape[2]
    o = out if out is not None else xp.empty_like(q)
    for s in np.unique(seq_h):
        rows = np.flatnonzero(seq_h == s)
        lens = len_h[rows]
        L = int(lens.max())
        keys = widen(k_cache[int(s), :L], q.dtype, xp)                            # [L, nkv, hd]
        vals = widen(v_cache[int(s), :L], q.dtype, xp)
        qg = q[rows].reshape(len(rows), nkv, nh // nkv, hd).transpose(1, 2, 0, 3)  # [nkv, g, n, hd]
        scores = qg @ keys.transpose(1, 2, 0)[:, None] * q.dtype.type(scale)    # [nkv, g, n, L]
        kv = np.arange(L)[None, :]
        allowed = kv < lens[:, None]
        if window > 0:
            allowed &= kv >= lens[:, None] - window
        scores = xp.where(xp.asarray(allowed), scores, q.dtype.type(-np.inf))
        m = scores.max(-1, keepdims=True)
        if sinks is not None:                                                   # [nh] -> [nkv, g, 1, 1]
            sink = xp.asarray(widen(sinks, q.dtype) if xp is np else sinks.astype(q.dtype)).reshape(nkv, nh // nkv, 1, 1)
            m = xp.maximum(m, sink)
        p = xp.exp(scores - m)
        den = p.sum(-1, keepdims=True)
        if sinks is not None:
            den = den + xp.exp(sink - m)
        p /= den
        o[rows] = (p @ vals.transpose(1, 0, 2)[:, None]).transpose(2, 0, 1, 3).reshape(len(rows), nh, hd)
    return o


# ---- multi-head latent attention (DeepSeek-V3 family) --------------------------------------------------------------
def mla_attention(q, c, k_rope, k_b, v_b, cache, seq, pos, rpos, q_len, cos, sin, *, scale: float, form: str = "auto",
                  out=None):
    """Multi-head latent attention over a latent cache [S, capacity, r + dr] that holds, per token, the normed
    compressed kv c (r = kv_lora_rank values) and the roped key shared by all heads (dr = qk_rope_head_dim).

    q [N, nh, dn + dr] (each head's nope part, then its rope part), c [N, r], k_rope [N, dr] (before RoPE);
    k_b [nh dn, r] and v_b [nh dv, r] expand c into each head's nope key and value. RoPE (rotate-half, table rows
    rpos) turns the rope parts; c and the roped key are written to cache[seq[n], pos[n]]; row n then attends to the
    first q_len[n] tokens of its sequence with scores scale * (q_nope . k_nope + q_rope . k_rope). Two forms give the
    same numbers up to rounding: expanded (keys and values of every cached token and head, as transformers computes)
    and absorbed (q_nope through k_b into the latent space, scores and the weighted sum over c itself, then v_b: no
    per-head key or value is formed, so the cache never needs more than c and the rope key). form "auto" absorbs for a
    sequence with one row in the pass (a decode step) and expands for more (a prefill). Returns [N, nh dv]."""
    N, nh, dq = q.shape
    r, dr = c.shape[1], k_rope.shape[1]
    dn, dt = dq - dr, q.dtype
    wk = widen(k_b, dt).reshape(nh, dn, r)
    wv = widen(v_b, dt).reshape(nh, -1, r)
    q = np.array(q, dtype=dt)
    rope(q[..., dn:], rpos, cos, sin)
    kr = np.array(k_rope, dtype=dt)[:, None, :]
    rope(kr, rpos, cos, sin)
    seq_h, len_h = np.asarray(seq).astype(np.int64), np.asarray(q_len).astype(np.int64)
    cache[seq_h, np.asarray(pos)] = np.concatenate([np.asarray(c, dt), kr[:, 0]], axis=1)
    o = np.empty((N, nh, wv.shape[1]), dt)
    for s in np.unique(seq_h):
        rows = np.flatnonzero(seq_h == s)
        lens = len_h[rows]
        lat = cache[int(s), :int(lens.max())]
        cl, kl = lat[:, :r], lat[:, r:]                                          # [L, r], [L, dr]
        qn, qr = q[rows, :, :dn], q[rows, :, dn:]                                # [n, nh, dn], [n, nh, dr]
        absorbed = form == "absorbed" or (form == "auto" and len(rows) == 1)
        if absorbed:
            ql = np.einsum("nhd,hdr->hnr", qn, wk)                              # [nh, n, r]
            scores = ql @ cl.T                                                   # [nh, n, L]
        else:
            kn = (cl @ widen(k_b, dt).T).reshape(-1, nh, dn).transpose(1, 2, 0)  # [nh, dn, L]
            scores = qn.transpose(1, 0, 2) @ kn
        scores = (scores + qr.transpose(1, 0, 2) @ kl.T) * dt.type(scale)
        allowed = np.arange(len(cl))[None, :] < lens[:, None]                    # [n, L]
        scores = np.where(allowed, scores, dt.type(-np.inf))
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)                                            # [nh, n, L]
        if absorbed:
            o[rows] = np.einsum("hnr,hvr->nhv", p @ cl, wv)
        else:
            v = (cl @ widen(v_b, dt).T).reshape(-1, nh, wv.shape[1]).transpose(1, 0, 2)     # [nh, L, dv]
            o[rows] = (p @ v).transpose(1, 0, 2)
    return _store(out, o.reshape(N, -1))


# ---- Gated DeltaNet (Qwen3-Next, Qwen3.5) ------------------------------------------------------------------------
def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), x itself above 20 (torch's threshold)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + x.dtype.type(eps))


def causal_conv(u: np.ndarray, w: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Depthwise causal conv of u [n, C] with w [C, K] after the K-1 earlier inputs `state` [C, K-1] (updated in
    place to the last K-1 inputs); silu of the result [n, C]."""
    n, K = u.shape[0], w.shape[1]
    buf = np.concatenate([state, u.T], axis=1)                           # [C, K-1+n]
    y = np.einsum("cnk,ck->nc", np.lib.stride_tricks.sliding_window_view(buf, K, axis=1), w)
    if K > 1:
        state[...] = buf[:, n:]
    return silu(y)


DELTA_CHUNK = 64        # rows per chunk of the chunked form (transformers' torch_chunk_gated_delta_rule uses 64)
DELTA_FORMS = ("auto", "chunked", "recurrent")


def delta_rule(q, k, v, g, beta, state):
    """The gated delta rule, one token at a time, over state [nv, dk, dv] (updated in place): per token
    S = S * exp(g); S += k (beta (v - k S)); o = q S. q, k [n, nv, dk], v [n, nv, dv], g, beta [n, nv]."""
    o = np.empty_like(v)
    decay = np.exp(g)
    for t in range(v.shape[0]):
        state *= decay[t][:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", state, q[t])
    return o


def _delta_chunks(q, k, v, g, beta, state, o, xp=np) -> None:
    """The chunked form over m chunks of C rows each: q, k [H, m, C, dk], v [H, m, C, dv], g, beta [H, m, C];
    writes o [H, m, C, dv] and advances state [H, dk, dv] (in place) over the m chunks in order.

    Within a chunk, with G_t = g_1 + ... + g_t (cumulative log decay from the chunk's start), the rows the recurrent
    form adds to the state, u_t = beta_t (v_t - k_t S_t^-) (S_t^- the state decayed, before row t's update), obey
    u_t + beta_t sum_{j<t} e^(G_t - G_j) (k_t.k_j) u_j = beta_t v_t - beta_t e^(G_t) k_t S_0, S_0 the state before the
    chunk: a unit lower-triangular system (I + A) U = beta V - diag(beta e^G) K S_0 (the UT transform). Its inverse
    (one C x C solve per chunk, independent of S_0; cheaper than solving for the dv + dk right-hand sides) gives
    W = (I + A)^-1 beta V and D = (I + A)^-1 diag(beta e^G) K, so U = W - D S_0.
    Then o_t = e^(G_t) q_t S_0 + sum_{j<=t} e^(G_t - G_j) (q_t.k_j) u_j and the state after the chunk is
    e^(G_C) S_0 + sum_j e^(G_C - G_j) k_j u_j. Every exponent is <= 0 (g <= 0), so nothing overflows. The only
    sequential part is the scan over chunks. `xp`: the array module of the inputs (NumPy, or CuPy on the CUDA
    engine's prefill)."""
    C, dv, dt = q.shape[2], v.shape[-1], v.dtype

    def exp(x):            # e^x of a float64 exponent, rounded to dt first
        return xp.exp(x.astype(dt))

    # G in float64 whatever the compute dtype: a difference G_t - G_j of two float32 sums near -1000 (strongly decaying
    # heads) would lose the small gaps between neighbouring rows; each exponent is rounded to `dt` once, then exp'd
    cum = xp.cumsum(g, axis=-1, dtype=np.float64)                             # [H, m, C]
    causal = xp.tri(C, dtype=bool)                                            # j <= t
    decay = exp(xp.where(causal, cum[..., :, None] - cum[..., None, :], -np.inf))  # e^(G_t - G_j), 0 for j > t
    from_start, to_end = exp(cum), exp(cum[..., -1:] - cum)
    kt = xp.swapaxes(k, -1, -2)
    A = beta[..., :, None] * (k @ kt) * decay
    below = xp.tri(C, k=-1, dtype=bool)                                       # j < t
    system = xp.where(below, A, dt.type(0)) + xp.eye(C, dtype=dt)             # I + A: unit lower triangular
    inverse = xp.linalg.solve(system, xp.broadcast_to(xp.eye(C, dtype=dt), system.shape))
    W = inverse @ (v * beta[..., None])                                       # [H, m, C, dv]
    D = inverse @ (k * (beta * from_start)[..., None])                        # [H, m, C, dk]
    scores = (q @ kt) * decay                                                 # [H, m, C, C], diagonal included
    q_in = q * from_start[..., None]                                          # reads S_0 decayed to row t
    k_out = k * to_end[..., None]                                             # writes decayed to the chunk's end
    end = from_start[..., -1]                                                 # [H, m]
    for c in range(q.shape[1]):
        U = W[:, c] - D[:, c] @ state                                         # [H, C, dv]
        o[:, c] = q_in[:, c] @ state + scores[:, c] @ U
        state *= end[:, c, None, None]
        state += xp.swapaxes(k_out[:, c], -1, -2) @ U


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = DELTA_CHUNK, group: int | None = None, xp=np):
    """The gated delta rule of `delta_rule` (same arguments, same numbers up to rounding) in the chunked form:
    the rows in chunks of `chunk` (the last one shorter), the rows of a chunk at once through matrix products and the
    inverse of one triangular matrix (see `_delta_chunks`), the chunks one after another. state [nv, dk, dv] ends as the recurrent
    form leaves it. The solves run `group` chunks at a time (default: as many as keep each [heads, chunks, C, C]
    temporary near 2M elements). `xp`: the array module of the inputs (see `_delta_chunks`)."""
    n, H, dk = k.shape
    dv = v.shape[-1]
    o = xp.empty_like(v)
    full = n - n % chunk
    group = group or max(1, (1 << 21) // (H * chunk * chunk))

    def heads_first(x, t0, m, C):                           # rows [t0, t0 + m C) as [H, m, C, ...]
        x = x[t0:t0 + m * C]
        return xp.moveaxis(x.reshape(m, C, *x.shape[1:]), 2, 0)

    spans = [(t0, min(group, (full - t0) // chunk), chunk) for t0 in range(0, full, group * chunk)]
    if n > full:
        spans.append((full, 1, n - full))
    for t0, m, C in spans:
        part = xp.empty((H, m, C, dv), v.dtype)
        _delta_chunks(*(heads_first(x, t0, m, C) for x in (q, k, v, g, beta)), state, part, xp)
        o[t0:t0 + m * C] = xp.moveaxis(part, 0, 2).reshape(m * C, H, dv)
    return o


def continues_state(s: int, p0: int, held: int, strict: bool) -> bool:
    """Whether sequence s's rows from position p0 continue its recurrent states (which hold `held` tokens) rather than
    start from zero ones: a start at 0 is fresh, one at p0 == held continues; any other start raises InvalidInput, or
    without `strict` (decode steps) is fresh."""
    if p0 == 0 or (not strict and held != p0):
        return False
    if held != p0:
        raise InvalidInput(f"sequence {s} continues at position {p0}, but its recurrent state holds {held} tokens (a "
                           "Gated DeltaNet state cannot be rewound)", field="starts", value=p0)
    return True


def gated_delta_net(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, seq, pos, conv_state, delta_state, lengths, *,
                    heads: tuple[int, int], dims: tuple[int, int], eps: float, strict: bool = True,
                    form: str = "auto", out=None):
    """One Gated DeltaNet layer after its input products (qkv [T, 2 nk dk + nv dv], z [T, nv dv], b, a [T, nv]),
    the rows of each sequence in position order: causal conv (state conv_state[s]), silu, l2-normed q and k (q also
    times dk^-1/2), each key head serving nv/nk consecutive value heads, beta = sigmoid(b), g = -exp(A_log)
    softplus(a + dt_bias), the gated delta rule over delta_state[s], then rmsnorm(o) * norm_w * silu(z) per value
    head; returns [T, nv dv]. The delta rule runs in one of two forms that give the same numbers and leave the same
    state up to rounding: recurrent (`delta_rule`, token by token) or chunked (`delta_rule_chunked`, DELTA_CHUNK rows
    at a time). form "auto" runs a sequence with several rows in the pass (a prefill) chunked and one with a single
    row (a decode step) recurrent; "chunked" or "recurrent" runs every sequence so. A sequence whose rows start at
    position 0 starts from zero states; one that starts at p continues from states that hold p tokens (`lengths[s]`);
    any other start raises InvalidInput, or with `strict` false (decode steps) starts that sequence from zero
    states."""
    if form not in DELTA_FORMS:
        raise ValueError(f"unknown Gated DeltaNet form {form!r} (one of {', '.join(DELTA_FORMS)})")
    (nk, nv), (dk, dv) = heads, dims
    dt = qkv.dtype.type
    seq_h, pos_h = np.asarray(seq).astype(np.int64), np.asarray(pos).astype(np.int64)
    y = np.empty((qkv.shape[0], nv, dv), qkv.dtype)
    w, A, dtb, nw = (widen(t, qkv.dtype) for t in (conv_w, A_log, dt_bias, norm_w))
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(A) * softplus(a + dtb)
    for s in dict.fromkeys(seq_h.tolist()):
        rows = np.flatnonzero(seq_h == s)
        p0 = int(pos_h[rows[0]])
        if not continues_state(s, p0, int(lengths[s]), strict):
            conv_state[s] = 0
            delta_state[s] = 0
        lengths[s] = p0 + len(rows)
        u = causal_conv(qkv[rows], w, conv_state[s])
        n = len(rows)
        q = l2norm(u[:, :nk * dk].reshape(n, nk, dk)) * dt(dk ** -0.5)
        k = l2norm(u[:, nk * dk:2 * nk * dk].reshape(n, nk, dk))
        v = u[:, 2 * nk * dk:].reshape(n, nv, dv)
        q, k = np.repeat(q, nv // nk, axis=1), np.repeat(k, nv // nk, axis=1)
        chunked = form == "chunked" or (form == "auto" and n > 1)
        y[rows] = (delta_rule_chunked if chunked else delta_rule)(q, k, v, g[rows], beta[rows], delta_state[s])
    gated = rmsnorm(y, nw, eps) * silu(np.asarray(z).reshape(-1, nv, dv))
    return _store(out, gated.reshape(-1, nv * dv))


# ---- routing and experts ---------------------------------------------------------------------------------------
def group_mask(key, groups: tuple[int, int]):
    """Grouped top-k (DeepSeek-V3, GLM): experts in n equal groups; a group's score is the sum of its two best keys;
    the keys of all but the `keep` best groups become -inf (ties to the lower group index)."""
    n, keep = groups
    T, E = key.shape
    best2 = -np.sort(-key.reshape(T, n, E // n), axis=-1)[..., :2]
    kept = np.argsort(-best2.sum(-1), axis=-1, kind="stable")[:, :keep]     # [T, keep]
    mask = np.zeros((T, n), bool)
    np.put_along_axis(mask, kept, True, -1)
    return np.where(np.repeat(mask, E // n, axis=1), key, key.dtype.type(-np.inf))


def router(x, w, k: int, *, bias=None, scoring: str = "softmax", order: str = "softmax_topk", normalize: bool = False,
           scale: float = 1.0, groups: tuple[int, int] | None = None, out_ids=None, out_weights=None):
    """Router logits -> (expert ids [T, k] int32, weights [T, k]); ties go to the lower expert index.

    bias: with order softmax_topk it steers the selection only (scores + bias pick, the scores weigh: DeepSeek-V3,
    GLM, MiniMax); with topk_softmax it is part of the logits (gpt-oss's biased router). groups: (n_group, topk_group)
    for grouped top-k on the selection keys."""
    logits = x @ widen(w, x.dtype).T
    if order == "topk_softmax":                          # Granite, gpt-oss: top-k on the logits, softmax over the k
        if bias is not None:
            logits = logits + widen(bias, x.dtype)
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        weights = softmax(np.take_along_axis(logits, ids, -1))
    else:
        scores = softmax(logits) if scoring == "softmax" else 1.0 / (1.0 + np.exp(-logits))
        key = scores if bias is None else scores + widen(bias, x.dtype)  # a router bias steers selection only
        if groups is not None:
            key = group_mask(key, groups)
        ids = np.argsort(-key, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(scores, ids, -1)
        if normalize:
            weights = weights / weights.sum(-1, keepdims=True)
    return _store(out_ids, ids.astype(np.int32)), _store(out_weights, weights * x.dtype.type(scale))


def clamped_swiglu(gate, up, *, alpha: float, limit: float | None, up_offset: float):
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha g), g = min(gate,
    limit) (limit None: no clamp)."""
    if limit is not None:
        gate = np.minimum(gate, gate.dtype.type(limit))
        up = np.clip(up, -up.dtype.type(limit), up.dtype.type(limit))
    return (up + up.dtype.type(up_offset)) * gate / (1.0 + np.exp(-gate.dtype.type(alpha) * gate))


def quantize_int8_groups(x, group: int = A8_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [rows, cols], s [rows, cols / group] in x's dtype): each row's groups of `group` consecutive values
    as q = rint(v / s), s = max|v| / 127 of the group (symmetric; a group of zeros: s = 0, q = 0), in x's dtype. On
    float32 x this is moe_gemv4_dp4a.cu's quantizer bit for bit (IEEE division, rint half to even);
    benchmarks/quality_activations.py's "int8_g32" form is q * s."""
    x = np.asarray(x)
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"{cols} inputs are not whole groups of {group}")
    g = x.reshape(rows, cols // group, group)
    scale = np.abs(g).max(axis=2, keepdims=True) / x.dtype.type(127)
    q = np.rint(np.divide(g, scale, out=np.zeros_like(g), where=scale > 0))
    return q.astype(np.int8).reshape(rows, cols), scale.reshape(rows, cols // group)


def round_int8_groups(x, group: int = A8_GROUP) -> np.ndarray:
    """x with each group of `group` values replaced by q * s (`quantize_int8_groups`), in x's dtype: the inputs the
    int8-activation expert products compute with (EngineConfig.int8_activations)."""
    q, s = quantize_int8_groups(x, group)
    rows, cols = q.shape
    return (q.astype(x.dtype).reshape(rows, cols // group, group) * s[:, :, None]).reshape(rows, cols)


def round_int8_rows(x) -> np.ndarray:
    """x with each row rounded to int8 with one scale (`round_int8_groups`, the row its group): the W8A8 prefill
    products' inputs (limits.rounds_rows_int8), the twin of the CUDA routes' quantize_rows_int8."""
    return round_int8_groups(x, x.shape[1])


def expert_ffn(x, gate_up, down, *, act: dict | None = None, gate_up_bias=None, down_bias=None, round_input=None):
    """down(silu(gate x) * up x) with gate_up [2I, H]: rows [:I] gate, [I:] up; with `act` (model.expert_act)
    the clamped SwiGLU instead of silu(gate) * up, and the biases (model.expert_bias) after each product.
    round_input: applied to each product's input (x, and the activation before down), e.g. `round_int8_groups`."""
    h = (x if round_input is None else round_input(x)) @ gate_up.T
    if gate_up_bias is not None:
        h = h + gate_up_bias
    inter = gate_up.shape[0] // 2
    a = silu(h[:, :inter]) * h[:, inter:] if act is None else clamped_swiglu(h[:, :inter], h[:, inter:], **act)
    y = (a if round_input is None else round_input(a)) @ down.T
    return y if down_bias is None else y + down_bias


def moe(x, ids, weights, experts, *, residual, alpha: float = 1.0, act: dict | None = None, gate_up_bias=None,
        down_bias=None, round_input=None):
    """residual += alpha * sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), slots summed in order j = 0..k-1.

    `experts(e)` gives (gate_up, down) in x's dtype; act, gate_up_bias [E, 2I] and down_bias [E, H]: see
    `expert_ffn` (gpt-oss); round_input: the products' input rounding (`expert_ffn`; None: none).
    """
    T, k = ids.shape
    ypair = np.zeros((T, k, x.shape[1]), x.dtype)
    rounding = {} if round_input is None else {"round_input": round_input}
    for e in np.unique(ids):
        arrays = experts(int(e))
        rows, slot = np.nonzero(ids == e)          # a token picks an expert at most once: rows are unique
        biases = {"gate_up_bias": None if gate_up_bias is None else widen(gate_up_bias[e], x.dtype),
                  "down_bias": None if down_bias is None else widen(down_bias[e], x.dtype)}
        ypair[rows, slot] = weights[rows, slot, None] * expert_ffn(x[rows], *arrays, act=act, **biases, **rounding)
    residual += residual.dtype.type(alpha) * ypair.sum(1)
    return residual


def count_routes(ids, totals):
    """totals[e] += the pairs of ids routed to expert e (uint32, wrapping; ids outside [0, E) ignored)."""
    flat = np.asarray(ids).reshape(-1)
    flat = flat[(flat >= 0) & (flat < totals.size)]
    np.add.at(totals, flat, np.uint32(1))
    return totals


def dequantize(q, scale, dtype=np.float64) -> np.ndarray:
    """q [R, C] int8, scale [R, C / g] -> q[r, c] * scale[r, c // g]."""
    rows, cols = q.shape
    groups = scale.shape[1]
    return (q.astype(dtype).reshape(rows, groups, cols // groups) * scale.astype(dtype)[:, :, None]).reshape(rows, cols)


def blob_arrays(address: int, layout, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(gate_up [2I, H], down [H, I]) in `dtype` from the expert blob at a host address, read through `layout`."""
    views = {}
    for a in layout.arrays:
        storage = NUMPY_STORAGE[a.dtype]
        raw = (ctypes.c_uint8 * a.nbytes).from_address(address + a.offset)
        views[a.name] = np.frombuffer(raw, storage, a.shape[0] * a.shape[1]).reshape(a.shape)
    if layout.expert_format in QUANTIZED_FORMATS:   # int8, int4_group and mxfp4 (colibri_format/dequant.py)
        fmt = layout.expert_format
        return (dequantize_matrix(fmt, views["gate_up"], views["gate_up_scale"], dtype),
                dequantize_matrix(fmt, views["down"], views["down_scale"], dtype))
    return widen(views["gate_up"], dtype), widen(views["down"], dtype)


class ExpertTable:
    """Where one MoE layer's experts are: blob addresses (host memory here). `check(e)`, when given, runs before
    an expert is read (the reader's checksum policy for blobs read in place); `route_totals` [E] uint32, when
    given, counts the pairs routed to each expert (paged experts: the pool's cache policy reads it); `fill_ptrs`
    [E] uint64, when given, names a slot each routed expert is copied into as it is read (0: none), the twin of
    the CUDA GEMV kernels' fill on read."""

    def __init__(self, blob_ptrs: np.ndarray, layout, check=None, route_totals=None, fill_ptrs=None) -> None:
        self.blob_ptrs, self.layout, self.check, self.route_totals = blob_ptrs, layout, check, route_totals
        self.fill_ptrs = fill_ptrs

    def fill(self, ids) -> None:
        """Copy each routed expert that has a fill slot into it (after its arrays were read, and checked)."""
        for e in np.unique(ids):
            dst = int(self.fill_ptrs[e])
            if dst:
                ctypes.memmove(dst, int(self.blob_ptrs[e]), int(self.layout.size))

    def experts(self, dtype):
        def arrays(e: int):
            ptr = int(self.blob_ptrs[e])
            if self.check is not None:
                self.check(e)
            return blob_arrays(ptr, self.layout, dtype)
        return arrays


# ---- the backend -----------------------------------------------------------------------------------------------
class NumpyDense:
    """The file's dense tensors widened once to the compute dtype; `{p}.gate_up` and `{p}.qkv` fused. With
    dense_gemm 'bf16' the inputs of the products `limits.rounds_dense_bf16` names are rounded to bf16 first."""

    def __init__(self, reader, dtype, dense_gemm: str = "split", bf16_tensor_cores: bool = True) -> None:
        tensors = list(fused_dense_tensors(reader))
        self.arrays = {name: widen(a, dtype) for name, a in tensors}
        self.bf16_stored = {name for name, a in tensors if a.dtype == np.uint16}
        self.dense_gemm, self.bf16_tensor_cores = dense_gemm, bf16_tensor_cores
        self.nbytes = sum(a.nbytes for a in self.arrays.values())

    def has(self, name: str) -> bool:
        return name in self.arrays

    def __getitem__(self, name: str):
        return self.arrays[name]

    f32 = __getitem__

    def linear(self, x, name: str, bias: str | None, out):
        w = self.arrays[name]
        if rounds_dense_bf16(self.dense_gemm, self.bf16_tensor_cores, x.shape[0], x.shape[1], w.shape[0],
                             name in self.bf16_stored):
            x = widen(float32_to_bf16_bits(np.asarray(x, np.float32)), x.dtype)
        return linear(x, w, bias=self.arrays[bias] if bias is not None else None, out=out)

    def normed_linear(self, h, norm: str, eps: float, name: str, bias: str | None, out, x_out):
        """out = rmsnorm(h; norm) @ W.T (+ bias), x_out = rmsnorm(h)."""
        rmsnorm(h, self.arrays[norm], eps, out=x_out)
        return self.linear(x_out, name, bias, out)


class NumpyBackend:
    """Runs the decoder on the CPU; device memory is host memory (see the module docstring)."""

    name = "numpy"
    graphs = False
    host_is_device = True
    runs_ahead = False     # every op runs as it is called: queuing decode steps ahead of the host gains nothing

    def __init__(self, dtype=np.float32, int8_activations: bool = False, fast_expert_gemm: str | None = None,
                 dense_gemm: str = "split", bf16_tensor_cores: bool = True) -> None:
        self.xp = np
        self.dtype = np.dtype(dtype)
        # EngineConfig.dense_gemm and bf16_tensor_cores: where limits.rounds_dense_bf16 says so, a dense product's
        # input is rounded to bf16 as the CUDA engine's one-product route rounds it
        self.dense_gemm, self.bf16_tensor_cores = dense_gemm, bf16_tensor_cores
        self.int8_activations = int8_activations   # EngineConfig.int8_activations: limits.rounds_activations
                                                   # experts' products round their inputs (`round_int8_groups`)
        self.fast_expert_gemm = fast_expert_gemm   # EngineConfig.fast_expert_gemm: where limits.rounds_rows_int8
                                                   # says so, passes round their inputs a row (`round_int8_rows`)

    # --- what the engine asks of a backend ------------------------------------------------------------------
    def check_support(self, model: dict, blob_layout) -> None:
        """Every model the spec describes runs here (ModelArgs has refused unknown semantics already)."""

    def graph_blocker(self, args, batch: int) -> str | None:
        return "the NumPy backend has no graphs"

    def kernel_choices(self) -> tuple:
        return ()        # no graphs: nothing is replayed

    # --- weights and ops the decoder calls -------------------------------------------------------------------
    def dense(self, reader) -> NumpyDense:
        return NumpyDense(reader, self.dtype, self.dense_gemm, self.bf16_tensor_cores)

    def expert_table(self, blob_ptrs, layout, check=None, route_totals=None, fill_ptrs=None) -> ExpertTable:
        return ExpertTable(blob_ptrs, layout, check, route_totals, fill_ptrs)

    def fills_on_read(self, rows: int, k: int, num_experts: int) -> bool:
        return True

    def embedding(self, ids, table, *, mult: float, out):
        return embedding(ids, table, mult=mult, out=out, dtype=self.dtype.type)

    rmsnorm = staticmethod(rmsnorm)
    add_rmsnorm = staticmethod(add_rmsnorm)
    residual_add = staticmethod(residual_add)
    silu_mul = staticmethod(silu_mul)
    qkv_rope_kv = staticmethod(qkv_rope_kv)
    gated_delta_net = staticmethod(gated_delta_net)

    def mla_attention(self, *args, ws, **kwargs):
        return mla_attention(*args, **kwargs)

    def attention(self, q, k_cache, v_cache, q_seq, q_len, scale: float, *, window: int, out, ws, max_len: int,
                  sinks=None, host_rows=None):     # host_rows: q_seq and q_len are host arrays here already
        return attention(q, k_cache, v_cache, q_seq, q_len, scale, window=window, sinks=sinks, out=out)

    def router(self, x, w, k: int, *, ws, out_ids, out_weights, **how):
        return router(x, w, k, out_ids=out_ids, out_weights=out_weights, **how)

    def add_rmsnorm_route(self, h, b, norm_w, eps: float, w, k: int, *, alpha: float, out, ws, out_ids,
                          out_weights, **how):
        """add_rmsnorm, then the router on its output: (out, ids, weights) (the CUDA backend's one launch)."""
        add_rmsnorm(h, b, norm_w, eps, alpha=alpha, out=out)
        return (out, *router(out, w, k, out_ids=out_ids, out_weights=out_weights, **how))

    def moe(self, x, ids, weights, table: ExpertTable, *, residual, alpha: float, ws, **expert):
        if table.route_totals is not None:
            count_routes(ids, table.route_totals)
        extras = any(v is not None for v in expert.values())
        if rounds_activations(self.int8_activations, table.layout.expert_format):
            expert = {**expert, "round_input": round_int8_groups}
        elif rounds_rows_int8(self.fast_expert_gemm, x.shape[0], ids.size, table.blob_ptrs.size, table.layout, extras):
            expert = {**expert, "round_input": round_int8_rows}
        out = moe(x, ids, weights, table.experts(x.dtype), residual=residual, alpha=alpha, **expert)
        if table.fill_ptrs is not None:
            table.fill(ids)
        return out

    # --- memory ------------------------------------------------------------------------------------------------
    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype if dtype is not None else self.dtype)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype if dtype is not None else self.dtype)

    def ptr(self, a) -> int:
        return int(a.ctypes.data)

    def to_device(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def set_from_host(self, dst, src, stream) -> None:
        dst[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)

    def free_memory(self) -> int:
        return 1 << 62      # host memory is the operating system's business: never refuse a pool here

    def copy_htod(self, dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)

    def copy_to_host_async(self, dst: np.ndarray, src, stream) -> None:
        dst[...] = src

    def count_routes(self, ids, totals):
        return count_routes(ids, totals)

    def register_host(self, addr: int, nbytes: int) -> None:
        pass

    def unregister_host(self, addr: int) -> None:
        pass

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    # --- streams, events, graphs: nothing runs asynchronously here -----------------------------------------------
    def new_stream(self) -> Any:
        return contextlib.nullcontext()

    def release_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, stream) -> None:
        return None

    timing_event = record

    def elapsed_ms(self, start, end) -> float:
        return 0.0

    def wait(self, stream, event) -> None:
        pass

    def sync_event(self, event) -> None:
        pass

    def event_done(self, event) -> bool:
        return True

    def capture(self, stream, fn, memory=None):
        raise NotImplementedError("the NumPy backend has no graphs")

    def graph_memory(self) -> None:
        return None

    def launch(self, graph, stream) -> None:
        raise NotImplementedError("the NumPy backend has no graphs")
