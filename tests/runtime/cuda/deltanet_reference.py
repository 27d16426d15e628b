"""NumPy twins of the deltanet.cu kernels, with the plan semantics of kernels/ops.py (spans of a sequence's
consecutive rows: plan [4, spans] = first row, rows, sequence, fresh), built from numpy_backend's functions.

Two uses: the GPU tests compare each kernel with its twin; `ReferenceOps` / `HostBackend` stand in for kernels/ops.py
and the CUDA backend so that runtime/cuda/deltanet.py's planning runs on the CPU against
numpy_backend.gated_delta_net."""

from __future__ import annotations

import numpy as np

from colibri_format.runtime import numpy_backend as nb


def decode_plan(seq, pos, lengths) -> np.ndarray:
    """A decode step's plan (row n is its own span); lengths [S] advanced in place."""
    plan = np.zeros((4, len(seq)), np.int32)
    for n, (s, p) in enumerate(zip(np.asarray(seq).tolist(), np.asarray(pos).tolist())):
        plan[:, n] = n, 1, s, int(p == 0 or lengths[s] != p)
        lengths[s] = p + 1
    return plan


def conv(x, w, state, plan) -> np.ndarray:
    u = np.zeros_like(x)
    for r0, n, s, fresh in plan.T.tolist():
        if fresh:
            state[s] = 0
        u[r0:r0 + n] = nb.causal_conv(x[r0:r0 + n], w, state[s])
    return u


def prepare(u, b, a, A_log, dt_bias, heads: tuple[int, int], dk: int, l2_eps: float = 1e-6):
    (nk, _), T, dt = heads, u.shape[0], u.dtype.type
    q = nb.l2norm(u[:, :nk * dk].reshape(T, nk, dk), l2_eps) * dt(dk ** -0.5)
    k = nb.l2norm(u[:, nk * dk:2 * nk * dk].reshape(T, nk, dk), l2_eps)
    return q, k, 1.0 / (1.0 + np.exp(-b)), -np.exp(A_log) * nb.softplus(a + dt_bias)


def recurrent(q, k, u, g, beta, state, plan, value_heads: int) -> np.ndarray:
    (T, nk, _), nv, dv = q.shape, value_heads, state.shape[-1]
    v = u[:, u.shape[1] - nv * dv:].reshape(T, nv, dv)
    o = np.zeros((T, nv, dv), u.dtype)
    for r0, n, s, fresh in plan.T.tolist():
        if fresh:
            state[s] = 0
        rows = slice(r0, r0 + n)
        o[rows] = nb.delta_rule(*(np.repeat(t[rows], nv // nk, axis=1) for t in (q, k)), v[rows], g[rows], beta[rows],
                                state[s])
    return o


def gated_norm(o, z, w, eps: float) -> np.ndarray:
    T, nv, dv = o.shape
    return (nb.rmsnorm(o, w, eps) * nb.silu(z.reshape(T, nv, dv))).reshape(T, nv * dv)


class ReferenceOps:
    """kernels/ops.py's deltanet_* wrappers served by the twins, on NumPy arrays (outputs through `out=`)."""

    @staticmethod
    def deltanet_decode_plan(seq, pos, lengths, *, out):
        out[...] = decode_plan(seq, pos, lengths)
        return out

    @staticmethod
    def deltanet_conv(x, w, state, plan, *, out):
        out[...] = conv(x, w, state, plan)
        return out

    @staticmethod
    def deltanet_prepare(u, b, a, A_log, dt_bias, *, heads, dk, q_out, k_out, beta_out, g_out):
        for buf, value in zip((q_out, k_out, beta_out, g_out), prepare(u, b, a, A_log, dt_bias, heads, dk)):
            buf[...] = value
        return q_out, k_out, beta_out, g_out

    @staticmethod
    def deltanet_recurrent(q, k, u, g, beta, state, plan, *, value_heads, out):
        rows = np.concatenate([np.arange(r0, r0 + n) for r0, n in plan[:2].T.tolist()])
        out[rows] = recurrent(q, k, u, g, beta, state, plan, value_heads)[rows]     # other rows: untouched
        return out

    @staticmethod
    def deltanet_gated_norm(o, z, w, eps, *, out=None):
        value = gated_norm(o, z, w, eps)
        if out is None:
            return value
        out[...] = value
        return out


class HostBackend(nb.NumpyBackend):
    """The NumPy backend with the reference deltanet ops: what runtime/cuda/deltanet.DeltaNet needs of a backend."""

    ops = ReferenceOps
