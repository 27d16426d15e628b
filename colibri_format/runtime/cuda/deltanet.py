"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5) on the CUDA engine: the backend's `gated_delta_net`, with the
arguments, semantics and numbers (up to rounding) of `numpy_backend.gated_delta_net`.

The rows of a pass come in spans (a sequence's consecutive rows) described by a plan [4, spans] on the device
(kernels/ops.py). Two ways to make it:
- a decode step (`strict` false: one row per sequence, as a DecodeRunner packs it): `deltanet_decode_plan` builds the
  plan and advances the state lengths on the device, so the whole layer is kernels on static buffers and the step
  can be captured in a CUDA graph; the delta rule runs recurrent (form "chunked" excepted: it takes the host path);
- any other pass (a prefill): positions and lengths are read on the host (a sync), continuations checked as on the
  NumPy engine, fresh sequences' states zeroed, and each span runs recurrent (`deltanet_recurrent`) or chunked
  (`numpy_backend.delta_rule_chunked` on CuPy arrays) per `form`.
Both then share the conv, prepare and gated-norm kernels. Small weights stored in 16 bits are widened to f32 once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from colibri_format.runtime.cuda.dense import upcast
from colibri_format.runtime.numpy_backend import DELTA_FORMS, continues_state, delta_rule_chunked


class Buffers(NamedTuple):
    plan: object      # [4, T] int32
    u: object         # [T, C] conv output
    q: object         # [T, nk, dk]
    k: object
    beta: object      # [T, nv]
    g: object
    o: object         # [T, nv, dv] delta-rule output


class DeltaNet:
    """The op of one CupyBackend: f32 copies of 16-bit weights and the decode steps' static buffers, kept."""

    def __init__(self, be) -> None:
        self.be, self.xp, self.ops = be, be.xp, be.ops
        self._f32: dict = {}
        self._decode: dict = {}

    def __call__(self, qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, seq, pos, conv_state, delta_state, lengths, *,
                 heads: tuple[int, int], dims: tuple[int, int], eps: float, strict: bool = True, form: str = "auto",
                 out=None):
        if form not in DELTA_FORMS:
            raise ValueError(f"unknown Gated DeltaNet form {form!r} (one of {', '.join(DELTA_FORMS)})")
        ops, (nk, nv), (dk, dv) = self.ops, heads, dims
        w, A, dtb, nw = (self.f32(t) for t in (conv_w, A_log, dt_bias, norm_w))
        T, C = qkv.shape
        if not strict and form != "chunked":
            key = (T, C, nk, nv, dk, dv)
            if key not in self._decode:
                self._decode[key] = self.buffers(*key)
            buf = self._decode[key]
            plan = recurrent = ops.deltanet_decode_plan(seq, pos, lengths, out=buf.plan)
            chunked = []
        else:
            buf = self.buffers(T, C, nk, nv, dk, dv)
            plan, recurrent, chunked = self.host_plan(seq, pos, lengths, conv_state, delta_state, strict, form)
        u = ops.deltanet_conv(qkv, w, conv_state, plan, out=buf.u)
        q, k, beta, g = ops.deltanet_prepare(u, b, a, A, dtb, heads=heads, dk=dk, q_out=buf.q, k_out=buf.k,
                                             beta_out=buf.beta, g_out=buf.g)
        if recurrent is not None:
            ops.deltanet_recurrent(q, k, u, g, beta, delta_state, recurrent, value_heads=nv, out=buf.o)
        for r0, n, s in chunked:
            rows = slice(r0, r0 + n)
            qh, kh = (self.xp.repeat(t[rows], nv // nk, axis=1) for t in (q, k))
            v = u[rows, 2 * nk * dk:].reshape(n, nv, dv)
            buf.o[rows] = delta_rule_chunked(qh, kh, v, g[rows], beta[rows], delta_state[s], xp=self.xp)
        return ops.deltanet_gated_norm(buf.o, z, nw, eps, out=out)

    def host_plan(self, seq, pos, lengths, conv_state, delta_state, strict: bool, form: str):
        """(plan of every span, plan of the spans the recurrent kernel runs or None, [(first row, rows, sequence)] of
        the chunked ones) of an eager pass; checks each sequence's start, zeroes fresh states, advances lengths."""
        be = self.be
        seq_h, pos_h = be.to_host(seq).astype(np.int64), be.to_host(pos).astype(np.int64)
        held = be.to_host(lengths).copy()
        spans = []
        for s in dict.fromkeys(seq_h.tolist()):
            rows = np.flatnonzero(seq_h == s)
            if rows[-1] - rows[0] + 1 != len(rows):
                raise ValueError(f"the rows of sequence {s} are not consecutive in the pass")
            p0 = int(pos_h[rows[0]])
            fresh = not continues_state(s, p0, int(held[s]), strict)
            if fresh:
                conv_state[s] = 0
                delta_state[s] = 0
            held[s] = p0 + len(rows)
            spans.append((int(rows[0]), len(rows), s, int(fresh)))
        be.set_from_host(lengths, held, None)
        chunked = [sp for sp in spans if form == "chunked" or (form == "auto" and sp[1] > 1)]
        recurrent = [sp for sp in spans if sp not in chunked]
        return (self.plan(spans), self.plan(recurrent) if recurrent else None,
                [(r0, n, s) for r0, n, s, _ in chunked])

    def plan(self, spans: list[tuple[int, int, int, int]]):
        """The device plan [4, spans] int32 of (first row, rows, sequence, fresh) tuples."""
        return self.be.to_device(np.array(spans, np.int32).T.copy())

    def buffers(self, T: int, C: int, nk: int, nv: int, dk: int, dv: int) -> Buffers:
        xp = self.xp
        return Buffers(xp.empty((4, T), np.int32), xp.empty((T, C), np.float32), xp.empty((T, nk, dk), np.float32),
                       xp.empty((T, nk, dk), np.float32), xp.empty((T, nv), np.float32),
                       xp.empty((T, nv), np.float32), xp.empty((T, nv, dv), np.float32))

    def f32(self, a):
        """`a` as f32: itself, or a widened copy made once per weight (decode steps then allocate nothing)."""
        if a.dtype == np.float32:
            return a
        key = (self.be.ptr(a), a.shape, str(a.dtype))
        if key not in self._f32:
            self._f32[key] = self.xp.ascontiguousarray(upcast(self.xp, a))
        return self._f32[key]
