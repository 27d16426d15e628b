"""A NumPy stand-in for the CUDA engine's backend (runtime/cuda/backend.py), for machines without a GPU.

"Device" arrays are NumPy arrays with real host addresses, so blob pointer tables, the slot pool and
`copy_htod` (a memmove) behave as on the GPU; the kernels are float32 NumPy versions of the `ops` wrappers with
the same signatures and output conventions (sorted dispatch order, pair order, out= buffers). Streams and events
are no-ops, and a "captured graph" re-runs the captured function. This exercises the engine's own logic
(packing, buffers, paging bookkeeping, passes, prefetch, graph fallback) on the CPU; numerical fidelity of the
real kernels is the business of tests/runtime/cuda.
"""

from __future__ import annotations

import ctypes
import time
import types

import numpy as np

from colibri_format.runtime.cuda.kernels import ops as real_ops
from colibri_format.runtime.cuda.kernels.reference import bf16_to_f32


def f32(a) -> np.ndarray:
    a = np.asarray(a)
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def _blob(ptr: int, table, name: str, shape, dtype) -> np.ndarray:
    off = getattr(table, f"off_{name}")
    count = int(np.prod(shape))
    raw = (ctypes.c_uint8 * (count * np.dtype(dtype).itemsize)).from_address(int(ptr) + off)
    return np.frombuffer(raw, dtype, count).reshape(shape)


def _expert(table, e: int):
    H, I, g = table.hidden_size, table.intermediate_size, table.group_size
    p = int(table.blob_ptrs[e])
    gu = _blob(p, table, "gate_up", (2 * I, H), np.int8).astype(np.float32)
    gus = _blob(p, table, "gate_up_scale", (2 * I, H // g if g else 1), np.float32)
    dn = _blob(p, table, "down", (H, I), np.int8).astype(np.float32)
    dns = _blob(p, table, "down_scale", (H, I // g if g else 1), np.float32)
    gu = (gu.reshape(2 * I, gus.shape[1], -1) * gus[:, :, None]).reshape(2 * I, H)
    dn = (dn.reshape(H, dns.shape[1], -1) * dns[:, :, None]).reshape(H, I)
    return gu, dn


def _silu(x):
    return x / (1.0 + np.exp(-x))


class _Ops:
    """float32 NumPy versions of the `kernels/ops.py` wrappers the engine calls."""

    Dispatch, ExpertTable, GEMM_BM = real_ops.Dispatch, real_ops.ExpertTable, real_ops.GEMM_BM

    class RouterWorkspace:
        def __init__(self, max_tokens, num_experts):
            self.max_tokens, self.num_experts = max_tokens, num_experts

    class AttentionWorkspace:
        def __init__(self, *shape):
            self.shape = shape

    calls: dict = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def embedding(self, ids, table, *, mult=1.0, out=None):
        self._count("embedding")
        out[:] = f32(table)[ids] * np.float32(mult)
        return out

    def rmsnorm(self, x, w, eps, *, out=None):
        self._count("rmsnorm")
        x = np.asarray(x, np.float32)
        out[...] = f32(w) * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)))
        return out

    def residual_add(self, a, b, *, alpha=1.0, out=None):
        out[...] = a + np.float32(alpha) * b
        return out

    def add_rmsnorm(self, h, b, w, eps, *, alpha=1.0, out=None):
        self._count("add_rmsnorm")
        h[...] = h + np.float32(alpha) * b
        return self.rmsnorm(h, w, eps, out=out)

    def qkv_rope_kv(self, qkv, heads, kv_heads, k_cache, v_cache, seq, pos, rpos, cos, sin, *, norm="none",
                    q_norm=None, k_norm=None, eps=1e-6, clip=None, q_out=None):
        self._count("qkv_rope_kv")
        N, hd = qkv.shape[0], k_cache.shape[3]
        nq, nk = heads * hd, kv_heads * hd
        q, k, v = (np.array(t, np.float32) for t in (qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]))
        if norm == "full":
            q, k = self.rmsnorm(q, q_norm, eps, out=q), self.rmsnorm(k, k_norm, eps, out=k)
        if clip is not None:
            q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
        q, k, v = q.reshape(N, heads, hd), k.reshape(N, kv_heads, hd), v.reshape(N, kv_heads, hd)
        if norm == "per_head":
            q, k = self.rmsnorm(q, q_norm, eps, out=q), self.rmsnorm(k, k_norm, eps, out=k)
        if cos.shape[1]:
            self.rope(q, rpos, cos, sin)
            self.rope(k, rpos, cos, sin)
        self.kv_append(k, v, k_cache, v_cache, seq, pos)
        q_out[...] = q
        return q_out

    def dense_gemv(self, x, w, *, bias=None, out=None):
        self._count("dense_gemv")
        out[...] = x @ f32(w).T + (bias if bias is not None else 0)
        return out

    def silu_mul(self, gu, *, out=None):
        inter = gu.shape[1] // 2
        out[...] = _silu(gu[:, :inter]) * gu[:, inter:]
        return out

    def rope(self, x, pos, cos, sin):
        half = cos.shape[1]
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:2 * half] = x2 * c + x1 * s
        return x

    def kv_append(self, k, v, k_cache, v_cache, seq, pos):
        k_cache[seq, pos] = k
        v_cache[seq, pos] = v

    def attention_splits(self, num_rows, kv_heads, group, max_len):
        return 2

    def attention(self, q, k_cache, v_cache, q_seq, q_len, scale, *, window=0, out=None, nsplit=None,
                  max_len=None, workspace=None):
        self._count("attention")
        nq, nh, hd = q.shape
        group = nh // k_cache.shape[2]
        for n in range(nq):
            length = int(q_len[n])
            first = max(0, length - window) if window > 0 else 0
            keys = k_cache[q_seq[n], first:length]          # [L, nkv, hd]
            vals = v_cache[q_seq[n], first:length]
            kh = np.repeat(keys, group, axis=1)             # [L, nh, hd]
            vh = np.repeat(vals, group, axis=1)
            s = np.einsum("hd,lhd->hl", q[n], kh) * np.float32(scale)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[n] = np.einsum("hl,lhd->hd", p, vh)
        return out

    def router(self, x, w, k, *, bias=None, scoring="softmax", order="softmax_topk", normalize=False, scale=1.0,
               workspace=None, out_ids=None, out_weights=None):
        self._count("router")
        from colibri_format.runtime.model import route

        r = {"scoring": scoring, "order": order, "normalize_topk": normalize, "scale": scale}
        weights, idx = route(x @ f32(w).T, r, k, bias)
        out_ids[...] = idx
        out_weights[...] = weights
        return out_ids, out_weights

    def dispatch(self, ids, num_experts, *, tile_m=64, out=None):
        flat = np.asarray(ids).reshape(-1)
        perm = np.argsort(flat, kind="stable").astype(np.int32)
        inv = np.empty_like(perm)
        inv[perm] = np.arange(len(perm), dtype=np.int32)
        z = np.zeros(1, np.int32)
        return real_ops.Dispatch(np.bincount(flat, minlength=num_experts), z, perm, inv, flat.copy(), z, z, z,
                                 len(flat), num_experts, tile_m)

    def moe_gate_up(self, x, table, disp, k, *, out=None, **_):
        self._count("moe_gate_up")
        for s, pair in enumerate(disp.perm):
            gu, _ = _expert(table, int(disp.active[pair]))
            y = gu @ x[pair // k]
            inter = gu.shape[0] // 2
            out[s] = _silu(y[:inter]) * y[inter:]
        return out

    def moe_down(self, act, table, disp, weights, *, out=None, **_):
        w = np.asarray(weights).reshape(-1)
        for pair in range(disp.num_pairs):
            _, dn = _expert(table, int(disp.active[pair]))
            out[pair] = w[pair] * (dn @ act[disp.inv[pair]])
        return out

    moe_gemm_gate_up = moe_gate_up
    moe_gemm_down = moe_down

    def moe_combine(self, ypair, k, *, residual=None, alpha=1.0, out=None):
        T = ypair.shape[0] // k
        out[...] = residual + np.float32(alpha) * ypair.reshape(T, k, -1).sum(1)
        return out


def _contiguous(name, fn):
    """Like the real wrappers' `_check`: every array argument must be C-contiguous."""
    def checked(*args, **kw):
        for i, a in enumerate(list(args) + list(kw.values())):
            if isinstance(a, np.ndarray) and not a.flags.c_contiguous:
                raise ValueError(f"{name}: argument {i} is not C-contiguous")
        return fn(*args, **kw)
    return checked


CHECKED = ("embedding", "rmsnorm", "add_rmsnorm", "qkv_rope_kv", "residual_add", "dense_gemv", "silu_mul", "rope", "kv_append", "attention",
           "router", "dispatch", "moe_gate_up", "moe_down", "moe_combine")


class _Stream:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


class _Graph:
    def __init__(self, fn):
        self.fn = fn


class FakeBackend:
    name = "numpy-fake"
    free_bytes = 64 << 30
    register_fails = False

    def __init__(self, device_id: int = 0) -> None:
        self.xp = np
        self.ops = _Ops()
        for name in CHECKED:
            setattr(self.ops, name, _contiguous(name, getattr(self.ops, name)))
        self.captures = 0
        self.launches = 0
        self.copies = 0

    def ptr(self, a) -> int:
        return int(a.ctypes.data)

    def to_device(self, a):
        return np.array(a, copy=True)

    def to_host(self, a):
        return np.array(a, copy=True)

    def set_from_host(self, dst, src, stream) -> None:
        dst[...] = np.asarray(src, dst.dtype).reshape(dst.shape)

    def synchronize(self) -> None:
        pass

    def free_memory(self) -> int:
        return self.free_bytes

    def new_stream(self):
        return _Stream()

    def record(self, stream):
        return object()

    def timing_event(self, stream):
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return max(end - start, 1e-9) * 1e3

    def wait(self, stream, event) -> None:
        pass

    def sync_event(self, event) -> None:
        pass

    def event_done(self, event) -> bool:
        return True

    def register_host(self, addr, nbytes) -> None:
        if self.register_fails:
            raise RuntimeError("registration refused (test)")

    def unregister_host(self, addr) -> None:
        pass

    def pinned_empty(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def copy_htod(self, dst_ptr, src_ptr, nbytes, stream) -> None:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
        self.copies += 1

    def capture(self, stream, fn):
        fn()                   # the forward pass is idempotent for fixed inputs: running it checks `frozen`
        self.captures += 1
        return _Graph(fn)

    def launch(self, graph, stream) -> None:
        self.launches += 1
        graph.fn()


def install(monkeypatch, **attrs) -> types.SimpleNamespace:
    """Make the CUDA engine build FakeBackends (attrs: class attributes such as free_bytes); returns a record."""
    from colibri_format.runtime.cuda import backend as cuda_backend

    made = types.SimpleNamespace(backends=[])
    cls = type("FakeBackendT", (FakeBackend,), dict(attrs))

    def factory(device_id):
        be = cls(device_id)
        made.backends.append(be)
        return be

    monkeypatch.setattr(cuda_backend, "_FACTORY", factory)
    return made
