"""One forward pass of the MoE decoder on the device: the NumPy `MoEModel` (model.py), kernel by kernel.

A pass works on T packed rows (the new tokens of every sequence, concatenated). What differs between calls
lives in `StepInputs` (ids, positions, the KV row each token writes, per-row RoPE cos/sin computed on the host
exactly as the NumPy engine computes them); every intermediate lives in a `Workspace` whose buffers are made on
first use and then reused, so that a second run with the same workspace allocates nothing: the condition for
capturing it in a CUDA graph. All arithmetic is f32, as in the NumPy engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_format.runtime.rope import cos_sin, inv_frequencies, rotary_dim

ATTENTION_HEAD_DIMS = (64, 128, 256)   # head sizes the attention kernel is built for


def fused_default() -> bool:
    """Fused layer kernels (add+norm; q/k norm+RoPE+KV append) unless COLIBRI_CUDA_FUSED=0 asks for the unfused path."""
    return os.environ.get("COLIBRI_CUDA_FUSED", "1") != "0"


class Workspace:
    """Named device buffers, each made once (shape and dtype fixed by its first request)."""

    def __init__(self, xp, rows: int) -> None:
        self.xp, self.rows = xp, rows
        self._bufs: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}      # kernel workspaces (router, dispatch, attention)
        self.frozen = False                  # set while capturing: a new buffer then is a bug

    def buf(self, name: str, shape: tuple, dtype=np.float32):
        b = self._bufs.get(name)
        if b is None or b.shape != tuple(shape) or b.dtype != np.dtype(dtype):
            if self.frozen:
                raise RuntimeError(f"workspace buffer {name!r} {shape} requested during graph capture")
            b = self._bufs[name] = self.xp.empty(shape, dtype=dtype)
        return b


class KVBuffers:
    """Keys and values of S sequences, `capacity` positions each: per layer [S, capacity, nkv, hd] f32."""

    def __init__(self, xp, num_layers: int, seqs: int, capacity: int, kv_heads: int, head_dim: int) -> None:
        shape = (seqs, capacity, kv_heads, head_dim)
        self.seqs, self.capacity = seqs, capacity
        self.keys = [xp.zeros(shape, xp.float32) for _ in range(num_layers)]
        self.values = [xp.zeros(shape, xp.float32) for _ in range(num_layers)]


@dataclass
class HostStep:
    """One pass's inputs on the host (int32 / float32 arrays, T rows)."""
    ids: np.ndarray
    pos: np.ndarray      # absolute position of each row in its sequence
    seq: np.ndarray      # KV-cache row (sequence index) of each row
    cos: np.ndarray      # [T, rotary_dim / 2]
    sin: np.ndarray
    out_rows: np.ndarray  # rows whose logits are wanted


def rope_rows(args, positions: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, rot/2] for the rows of each sequence, as the NumPy engine's `_pack` computes them."""
    half = rotary_dim(args.rope, args.head_dim) // 2
    tables = [cos_sin(p, *inv_frequencies(args.rope, args.head_dim, args.max_pos, int(p[-1]) + 1))
              for p in positions]
    cos = np.concatenate([t[0][:, :half] for t in tables])
    sin = np.concatenate([t[1][:, :half] for t in tables])
    return np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)


def host_step(args, chunks: list[np.ndarray], starts: list[int], seqs: list[int], all_logits: bool) -> HostStep:
    positions = [s + np.arange(len(c)) for c, s in zip(chunks, starts)]
    cos, sin = rope_rows(args, positions)
    bounds = np.cumsum([0] + [len(c) for c in chunks])
    rows = np.arange(bounds[-1]) if all_logits else bounds[1:] - 1
    seq = np.concatenate([np.full(len(c), s) for c, s in zip(chunks, seqs)])
    return HostStep(np.concatenate(chunks).astype(np.int32), np.concatenate(positions).astype(np.int32),
                    seq.astype(np.int32), cos, sin, rows.astype(np.int32))


class StepInputs:
    """A pass's inputs on the device, in one int32 buffer (one host-to-device copy per pass)."""

    def __init__(self, be, rows: int, half: int) -> None:
        self.be, self.rows, self.half = be, rows, half
        n = rows * (5 + 2 * half)
        self.host = np.zeros(n, np.int32)
        self.dev = be.xp.zeros(n, be.xp.int32)
        r = rows
        self.ids, self.pos, self.seq, self.qlen, self.rpos = (self.dev[i * r:(i + 1) * r] for i in range(5))
        self.cos = self.dev[5 * r:5 * r + r * half].view(be.xp.float32).reshape(r, half)
        self.sin = self.dev[5 * r + r * half:].view(be.xp.float32).reshape(r, half)

    def fill(self, step: HostStep, stream) -> None:
        r, half, h = self.rows, self.half, self.host
        for i, a in enumerate((step.ids, step.pos, step.seq, step.pos + 1, np.arange(r))):
            h[i * r:(i + 1) * r] = a
        h[5 * r:5 * r + r * half].view(np.float32)[:] = step.cos.reshape(-1)
        h[5 * r + r * half:].view(np.float32)[:] = step.sin.reshape(-1)
        self.be.set_from_host(self.dev, h, stream)


class DeviceForward:
    """The decoder's layers over device buffers; MoE layers delegate to `experts.moe(...)`."""

    def __init__(self, args, dense, experts, be) -> None:
        self.a, self.w, self.experts, self.be = args, dense, experts, be
        self.xp, self.ops = be.xp, be.ops
        self.fast_attention = args.head_dim in ATTENTION_HEAD_DIMS
        self.route_hook = None        # (layer, ids device array) -> None; set when routes must reach the host
        # fused kernels (fused.cu): residual add + post-attention norm, and q/k norm + clip + RoPE + KV append
        # in one launch each; False keeps the unfused chain (rmsnorm, residual_add, rope, kv_append)
        self.fused = fused_default() and hasattr(self.ops, "qkv_rope_kv")

    # --- the pass ---------------------------------------------------------------------------------------
    def run(self, inp: StepInputs, kv: KVBuffers, ws: Workspace, T: int, out_rows=None, max_len: int = 0,
            host: HostStep | None = None):
        """Logits [R, V] f32 of rows `out_rows` (a device int32 array; None = every row)."""
        a = self.a
        h = ws.buf("h", (T, a.hidden_size))
        table = self.w["embed_tokens"]
        self.ops.embedding(inp.ids[:T], table, mult=float(a.embedding_mult), out=h)
        for i in range(a.num_layers):
            self.block(i, h, inp, kv, ws, T, max_len, host)
        if out_rows is not None:
            h = self.xp.take(h, out_rows, axis=0)
        return self.head(h, ws)

    def head(self, h, ws: Workspace):
        a, R = self.a, h.shape[0]
        x = ws.buf("final_x", (R, a.hidden_size))
        self.ops.rmsnorm(h, self.w["final_norm"], a.eps, out=x)
        name = "embed_tokens" if a.tied or not self.w.has("lm_head") else "lm_head"
        logits = ws.buf("logits", (R, a.vocab_size))
        self.w.linear(x, name, None, logits)
        if a.logits_div != 1.0:
            self.xp.divide(logits, np.float32(a.logits_div), out=logits)
        return logits

    def block(self, i: int, h, inp, kv, ws, T: int, max_len: int, host) -> None:
        a, p = self.a, f"layers.{i}"
        x = ws.buf("x", (T, a.hidden_size))
        self.ops.rmsnorm(h, self.w[f"{p}.input_norm"], a.eps, out=x)
        o = self.attention(i, x, inp, kv, ws, T, max_len, host)
        if self.fused:
            self.ops.add_rmsnorm(h, o, self.w[f"{p}.post_attn_norm"], a.eps, alpha=float(a.residual_mult), out=x)
        else:
            self.ops.residual_add(h, o, alpha=float(a.residual_mult), out=h)
            self.ops.rmsnorm(h, self.w[f"{p}.post_attn_norm"], a.eps, out=x)
        if i in a.moe_layers:
            self.experts.moe(i, x, h, ws, self)
        else:
            y = self.mlp(f"{p}.mlp", x, ws, "mlp")
            self.ops.residual_add(h, y, alpha=float(a.residual_mult), out=h)

    # --- attention ----------------------------------------------------------------------------------------
    def attention(self, i, x, inp, kv, ws, T, max_len, host):
        a, p = self.a, f"layers.{i}.attn"
        nh, hd = a.n_heads, a.head_dim
        if self.fused:
            q3 = self._qkv_fused(i, x, inp, kv, ws, T)
        else:
            q3 = self._qkv_unfused(i, x, inp, kv, ws, T)
        att = ws.buf("att", (T, nh, hd))
        if self.fast_attention:
            self._attention_kernel(q3, kv, i, inp, ws, T, max_len, att)
        else:
            self._attention_fallback(q3, kv, i, host, att)
        o = ws.buf("o", (T, a.hidden_size))
        return self.w.linear(att.reshape(T, nh * hd), f"{p}.o_proj", f"{p}.o_bias" if a.o_bias else None, o)

    def _qkv_fused(self, i, x, inp, kv, ws, T):
        """q [T, nh, hd] after one fused launch (norms, clip, RoPE; k and v written to the cache)."""
        a, p = self.a, f"layers.{i}.attn"
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        qkv = ws.buf("qkv", (T, (nh + 2 * nkv) * hd))
        self.w.linear(x, f"{p}.qkv", f"{p}.qkv_bias" if a.qkv_bias else None, qkv)
        norms = {}
        if a.qk_norm != "none":
            norms = {"q_norm": self.w[f"{p}.q_norm"], "k_norm": self.w[f"{p}.k_norm"]}
        return self.ops.qkv_rope_kv(qkv, nh, nkv, kv.keys[i], kv.values[i], inp.seq[:T], inp.pos[:T], inp.rpos[:T],
                                    inp.cos[:T], inp.sin[:T], norm=a.qk_norm, eps=a.eps, clip=a.clip_qkv,
                                    q_out=ws.buf("q3", (T, nh, hd)), **norms)

    def _qkv_unfused(self, i, x, inp, kv, ws, T):
        a, p = self.a, f"layers.{i}.attn"
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        q, k, v = self.qkv(i, x, ws, T)
        if a.qk_norm == "full":
            self.ops.rmsnorm(q, self.w[f"{p}.q_norm"], a.eps, out=q)
            self.ops.rmsnorm(k, self.w[f"{p}.k_norm"], a.eps, out=k)
        if a.clip_qkv is not None:
            for t in (q, k, v):
                self.xp.clip(t, -a.clip_qkv, a.clip_qkv, out=t)
        q3, k3, v3 = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if a.qk_norm == "per_head":
            self.ops.rmsnorm(q3, self.w[f"{p}.q_norm"], a.eps, out=q3)
            self.ops.rmsnorm(k3, self.w[f"{p}.k_norm"], a.eps, out=k3)
        if inp.half:
            self._rope(q3, k3, inp, ws, T)
        self.ops.kv_append(k3, v3, kv.keys[i], kv.values[i], inp.seq[:T], inp.pos[:T])
        return q3

    def qkv(self, i, x, ws, T):
        """q [T, nh*hd], k, v [T, nkv*hd] from one fused product; views of it for one row, else copies."""
        a, p = self.a, f"layers.{i}.attn"
        nq, nk = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        qkv = ws.buf("qkv", (T, nq + 2 * nk))
        self.w.linear(x, f"{p}.qkv", f"{p}.qkv_bias" if a.qkv_bias else None, qkv)
        if T == 1:                         # slices of the flat row: contiguous views, no copies
            flat = qkv.reshape(-1)
            return flat[:nq].reshape(1, nq), flat[nq:nq + nk].reshape(1, nk), flat[nq + nk:].reshape(1, nk)
        parts = (qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:])
        outs = (ws.buf("q", (T, nq)), ws.buf("k", (T, nk)), ws.buf("v", (T, nk)))
        for dst, src in zip(outs, parts):
            self.xp.copyto(dst, src)
        return outs

    def _rope(self, q3, k3, inp, ws, T) -> None:
        a = self.a
        if T == 1:          # q and k are adjacent in the fused row: one launch for both
            heads = a.n_heads + a.n_kv_heads
            flat = ws.buf("qkv", (1, (heads + a.n_kv_heads) * a.head_dim)).reshape(-1)
            self.ops.rope(flat[:heads * a.head_dim].reshape(1, heads, a.head_dim), inp.rpos[:1], inp.cos[:1],
                          inp.sin[:1])
            return
        self.ops.rope(q3, inp.rpos[:T], inp.cos[:T], inp.sin[:T])
        self.ops.rope(k3, inp.rpos[:T], inp.cos[:T], inp.sin[:T])

    def _attention_kernel(self, q3, kv, i, inp, ws, T, max_len, att) -> None:
        a = self.a
        length = max_len or kv.capacity
        key = ("attention", T, length)
        if key not in ws.extra:
            ns = self.ops.attention_splits(T, a.n_kv_heads, a.n_heads // a.n_kv_heads, length)
            ws.extra[key] = (ns, self.ops.AttentionWorkspace(T, a.n_heads, a.head_dim, ns) if ns > 1 else None)
        ns, aws = ws.extra[key]
        self.ops.attention(q3, kv.keys[i], kv.values[i], inp.seq[:T], inp.qlen[:T], float(a.attention_scale),
                           window=int(a.sliding_window or 0), out=att, nsplit=ns, workspace=aws)

    def _attention_fallback(self, q3, kv, i, host: HostStep, att) -> None:
        """Any head size, with array operations (eager only): one masked softmax per sequence."""
        xp, a = self.xp, self.a
        if host is None:
            raise RuntimeError("the fallback attention needs the host copy of the pass's positions")
        group = a.n_heads // a.n_kv_heads
        for s in np.unique(host.seq):
            rows = np.flatnonzero(host.seq == s)
            pos = host.pos[rows]
            length = int(pos.max()) + 1
            keys, vals = kv.keys[i][int(s), :length], kv.values[i][int(s), :length]     # [L, nkv, hd]
            qs = q3[int(rows[0]):int(rows[-1]) + 1]                                        # rows are contiguous
            qg = qs.reshape(len(rows), a.n_kv_heads, group, a.head_dim).transpose(1, 2, 0, 3)
            scores = qg @ keys.transpose(1, 2, 0)[:, None] * np.float32(a.attention_scale)
            kvp = np.arange(length)[None, :]
            allowed = kvp <= pos[:, None]
            if a.sliding_window:
                allowed &= kvp > pos[:, None] - a.sliding_window
            scores = xp.where(xp.asarray(allowed), scores, np.float32(-np.inf))
            scores = xp.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            out = scores @ vals.transpose(1, 0, 2)[:, None]                               # [nkv, g, n, hd]
            att[int(rows[0]):int(rows[-1]) + 1] = out.transpose(2, 0, 1, 3).reshape(len(rows), a.n_heads,
                                                                                      a.head_dim)

    # --- feed-forward --------------------------------------------------------------------------------------
    def mlp(self, p: str, x, ws, tag: str):
        """down(silu(gate x) * up x) with the fused [2I, H] gate/up weight; returns a workspace buffer."""
        T = x.shape[0]
        gu_w = self.w[f"{p}.gate_up"]
        inter = gu_w.shape[0] // 2
        gu = ws.buf(f"{tag}_gu", (T, 2 * inter))
        self.w.linear(x, f"{p}.gate_up", None, gu)
        act = ws.buf(f"{tag}_act", (T, inter))
        self.ops.silu_mul(gu, out=act)
        y = ws.buf(f"{tag}_y", (T, self.a.hidden_size))
        return self.w.linear(act, f"{p}.down_proj", None, y)

    def shared(self, i: int, x, ws):
        """The shared expert's output [T, H] (with its sigmoid gate when the model has one)."""
        p = f"layers.{i}.moe"
        y = self.mlp(f"{p}.shared", x, ws, "shared")
        if (self.a.shared_expert or {}).get("gate", "none") == "sigmoid":
            xp, T = self.xp, x.shape[0]
            g = ws.buf("shared_g", (T, self.w.GATE_ROWS))
            self.w.linear(x, f"{p}.shared_gate", None, g)      # column 0 is the gate; the rest are zero rows
            xp.negative(g, out=g)
            xp.exp(g, out=g)
            g += np.float32(1.0)
            xp.divide(y, g[:, :1], out=y)
        return y
