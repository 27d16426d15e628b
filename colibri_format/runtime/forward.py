"""The decoder, written once: embedding, attention, the MoE layer (routing, experts, combine, shared expert),
norms and multipliers, over the ops of a backend (`numpy_backend.NumpyBackend` or `cuda.backend.CupyBackend`).

A pass packs the new tokens of all sequences into T rows without padding: per-token work (norms, products,
experts) runs on the T rows; attention reads each row's own sequence from the KV buffers. Buffers come from a
`Workspace` (made once, reused by every pass of a runner, so a CUDA pass can be captured as a graph). The expert
pool answers only "where are this layer's experts" (a table of addresses that changes between passes, never
within one); the backend's moe op adds the routed experts' output to the residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from colibri_format.runtime.rope import cos_sin_rows


class Workspace:
    """Named buffers of a backend, each made once (shape and dtype fixed by its first request)."""

    def __init__(self, be) -> None:
        self.be = be
        self._bufs: dict[str, Any] = {}
        self.extra: dict[Any, Any] = {}      # backend scratch (router, dispatch, attention workspaces)
        self.frozen = False                  # set while capturing a graph: a new buffer then is a bug

    def buf(self, name: str, shape: tuple, dtype=None):
        dtype = np.dtype(dtype) if dtype is not None else self.be.dtype
        b = self._bufs.get(name)
        if b is None or b.shape != tuple(shape) or b.dtype != dtype:
            if self.frozen:
                raise RuntimeError(f"workspace buffer {name!r} {shape} requested during graph capture")
            b = self._bufs[name] = self.be.empty(shape, dtype)
        return b


class KVBuffers:
    """Keys and values of S sequences, `capacity` positions each: per layer [S, capacity, nkv, hd], in `dtype` (the
    backend's compute dtype, or uint16: bf16 bits, EngineConfig.kv_cache_dtype). Layers in `linear` (Gated DeltaNet)
    keep no keys; their per-sequence recurrent state is `self.state` instead. With `latent` > 0 (multi-head latent
    attention) each layer keeps one [S, capacity, latent] array in `keys` (the normed compressed kv and the roped
    shared key of each token: kv_lora_rank + qk_rope_head_dim values), always in the compute dtype (mla.cu reads
    float32), and no values."""

    def __init__(self, be, num_layers: int, seqs: int, capacity: int, kv_heads: int, head_dim: int,
                 linear: frozenset = frozenset(), linear_dims: dict | None = None, latent: int = 0,
                 dtype=None) -> None:
        self.seqs, self.capacity = seqs, capacity
        if latent:
            self.keys = self._layers(be, range(num_layers), num_layers, (seqs, capacity, latent))
            self.values = [None] * num_layers
        else:
            attn = [i for i in range(num_layers) if i not in linear]
            shape = (seqs, capacity, kv_heads, head_dim)
            self.keys = self._layers(be, attn, num_layers, shape, dtype)
            self.values = self._layers(be, attn, num_layers, shape, dtype)
        self.state = RecurrentState(be, sorted(linear), seqs, linear_dims) if linear else None

    @staticmethod
    def _layers(be, layers, num_layers: int, shape: tuple, dtype=None) -> list:
        """Zeroed [shape] arrays of `layers` (None for the others): views of one allocation, zeroed at once (a
        fresh prefill makes these buffers: one zeroing launch instead of two a layer)."""
        layers = list(layers)
        block = be.zeros((len(layers), *shape), be.dtype if dtype is None else dtype)
        views = dict(zip(layers, block))
        return [views.get(i) for i in range(num_layers)]

    def move(self, src: int, dst: int, length: int | None = None) -> None:
        """Sequence `src` copied into sequence `dst` (colibri serve compacting its slots): its cache rows of positions
        [0, length) (default: all) in every layer, and its recurrent state; `src` keeps its copy. Plain array copies
        (NumPy, or CuPy on the current stream: run it on the engine's compute stream, ordered with the passes)."""
        n = self.capacity if length is None else length
        if src == dst or not (0 <= src < self.seqs and 0 <= dst < self.seqs and 0 <= n <= self.capacity):
            raise ValueError(f"cannot move sequence {src} to {dst} ({n} positions) in buffers of {self.seqs} "
                             f"sequences x {self.capacity} positions")
        for cache in (*self.keys, *self.values):
            if cache is not None and n:
                cache[dst, :n] = cache[src, :n]
        if self.state is not None:
            self.state.move(src, dst)


def make_kv(be, args, seqs: int, capacity: int, dtype=None) -> KVBuffers:
    """The KV buffers (and, for Gated DeltaNet layers, the recurrent state) of `seqs` sequences; keys and values in
    `dtype` (None: the backend's compute dtype; uint16: bf16 bits)."""
    latent = args.mla["kv_lora_rank"] + args.mla["qk_rope_head_dim"] if args.mla else 0
    return KVBuffers(be, args.num_layers, seqs, capacity, args.n_kv_heads, args.head_dim, args.linear_layers,
                     args.linear, latent, dtype)


class RecurrentState:
    """The per-sequence state of each Gated DeltaNet layer, beside the KV cache and with its semantics: a pass whose
    rows of a sequence start at position 0 starts that sequence afresh (the state is zeroed), one that starts at
    position p continues it, which needs the state to hold exactly p tokens (`lengths`; anything else is refused:
    a recurrent state cannot be rewound; a decode step, like the KV cache, trusts its positions instead: see
    `strict`). Per layer: conv [S, channels, kernel - 1] (the last inputs of the
    causal depthwise conv) and delta [S, value heads, key dim, value dim] (the delta-rule state), in the
    compute dtype (float32 on the engine)."""

    def __init__(self, be, layers: list[int], seqs: int, dims: dict) -> None:
        channels = 2 * dims["num_key_heads"] * dims["key_head_dim"] + dims["num_value_heads"] * dims["value_head_dim"]
        self.conv = {i: be.zeros((seqs, channels, dims["conv_kernel"] - 1)) for i in layers}
        self.delta = {i: be.zeros((seqs, dims["num_value_heads"], dims["key_head_dim"], dims["value_head_dim"]))
                      for i in layers}
        self.lengths = {i: be.zeros(seqs, np.int64) for i in layers}    # on the device: decode steps advance them
        self.strict = True     # false during a decode step: a slot whose state does not hold `pos` tokens (a
                               # serving loop's idle slot, fed another slot's token) restarts from zero states

    def move(self, src: int, dst: int) -> None:
        """Sequence `src`'s states (and the count of tokens they hold) copied into sequence `dst`."""
        for i in self.conv:
            self.conv[i][dst] = self.conv[i][src]
            self.delta[i][dst] = self.delta[i][src]
            self.lengths[i][dst] = self.lengths[i][src]


@dataclass
class HostStep:
    """One pass's inputs on the host (T rows)."""
    ids: np.ndarray
    pos: np.ndarray       # absolute position of each row in its sequence
    seq: np.ndarray       # KV-buffer row (sequence index) of each row
    cos: np.ndarray       # [T, rotary_dim / 2]
    sin: np.ndarray
    out_rows: np.ndarray  # rows whose logits are wanted


def rope_rows(args, positions: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, rot/2] for the rows of each sequence (frequencies at each sequence's total length)."""
    tables = [cos_sin_rows(args.rope, args.rope_head_dim, args.max_pos, p) for p in positions]
    cos = np.concatenate([t[0] for t in tables])
    sin = np.concatenate([t[1] for t in tables])
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
        self.dev = be.zeros(n, np.int32)
        r = rows
        self.ids, self.pos, self.seq, self.qlen, self.rpos = (self.dev[i * r:(i + 1) * r] for i in range(5))
        self.cos = self.dev[5 * r:5 * r + r * half].view(np.float32).reshape(r, half)
        self.sin = self.dev[5 * r + r * half:].view(np.float32).reshape(r, half)

    def host_rows(self, T: int) -> tuple[np.ndarray, np.ndarray]:
        """The host copies of the first T rows' sequence ids and query lengths (seq, qlen) of the last `fill`."""
        r = self.rows
        return self.host[2 * r:2 * r + T], self.host[3 * r:3 * r + T]

    def fill(self, step: HostStep, stream) -> None:
        self.image(step, out=self.host)
        self.be.set_from_host(self.dev, self.host, stream)

    def image(self, step: HostStep, out: np.ndarray | None = None) -> np.ndarray:
        """The device buffer's contents for `step`, on the host (int32; cos and sin as their float32 bits)."""
        r, half = self.rows, self.half
        h = np.zeros_like(self.host) if out is None else out
        for i, a in enumerate((step.ids, step.pos, step.seq, step.pos + 1, np.arange(r))):
            h[i * r:(i + 1) * r] = a
        h[5 * r:5 * r + r * half].view(np.float32)[:] = step.cos.reshape(-1)
        h[5 * r + r * half:].view(np.float32)[:] = step.sin.reshape(-1)
        return h


RouteHook = Callable[[int, Any], None]     # (layer, expert ids [T, k] on the device)


class Decoder:
    """The forward pass of every supported model, over `dense` weights, an expert pool and a backend."""

    def __init__(self, args, dense, experts, be) -> None:
        self.a, self.w, self.experts, self.be = args, dense, experts, be
        self.route_hook: RouteHook | None = None    # set when routing must reach the host (traces)
        self.forced_routes = None                   # benchmarks: (layer, rows) -> a backend int32 [rows, k] array
                                                    # copied over the routing (static buffers: graphs replay it)
        self.mla_form = "auto"                      # MLA attention: auto (a sequence's single new row absorbed,
                                                    # several expanded), or "expanded" / "absorbed" throughout
        self.delta_form = "auto"                    # Gated DeltaNet: auto (a sequence's several new rows chunked,
                                                    # a single one recurrent), or "chunked" / "recurrent" throughout

    # --- the pass -------------------------------------------------------------------------------------------
    def run(self, inp: StepInputs, kv: KVBuffers, ws: Workspace, T: int, out_rows=None, max_len: int = 0):
        """Logits [R, V] of rows `out_rows` (a device int32 array; None = every row)."""
        a = self.a
        h = ws.buf("h", (T, a.hidden_size))
        self.be.embedding(inp.ids[:T], self.w["embed_tokens"], mult=float(a.embedding_mult), out=h)
        for i in range(a.num_layers):
            self.block(i, h, inp, kv, ws, T, max_len or kv.capacity)
        if out_rows is not None:    # into the workspace: a pass inside a graph capture allocates nothing
            h = self.be.xp.take(h, out_rows, axis=0, out=ws.buf("h_out", (len(out_rows), a.hidden_size)))
        return self.head(h, ws)

    def block(self, i: int, h, inp, kv, ws, T: int, max_len: int) -> None:
        a, p = self.a, f"layers.{i}"
        x = ws.buf("x", (T, a.hidden_size))
        if i in a.linear_layers or a.mla:
            self.be.rmsnorm(h, self.w[f"{p}.input_norm"], a.eps, out=x)
            o = (self.linear_attention(i, x, inp, kv, ws, T) if i in a.linear_layers
                 else self.mla_attention(i, x, inp, kv, ws, T))
        else:
            o = self.attention(i, h, x, inp, kv, ws, T, max_len)
        if i in a.moe_layers:
            ids, weights = self.norm_route(i, h, o, x, ws)
            self.moe(i, x, h, ws, ids, weights)
        else:
            self.be.add_rmsnorm(h, o, self.w[f"{p}.post_attn_norm"], a.eps, alpha=float(a.residual_mult), out=x)
            self.be.residual_add(h, self.mlp(f"{p}.mlp", x, ws, "mlp"), alpha=float(a.residual_mult), out=h)

    def head(self, h, ws: Workspace):
        a, R = self.a, h.shape[0]
        x = ws.buf("final_x", (R, a.hidden_size))
        self.be.rmsnorm(h, self.w["final_norm"], a.eps, out=x)
        name = "embed_tokens" if a.tied or not self.w.has("lm_head") else "lm_head"
        logits = ws.buf("logits", (R, a.vocab_size))
        self.w.linear(x, name, None, logits)
        if a.logits_div != 1.0:
            self.be.xp.divide(logits, logits.dtype.type(a.logits_div), out=logits)
        return logits

    # --- attention ----------------------------------------------------------------------------------------------
    def attention(self, i: int, h, x, inp, kv, ws, T: int, max_len: int):
        """o_proj(softmax(q k^T) v) of x = the input norm of h (stored to x by the q/k/v product, which applies
        it), after q/k norm, clip, RoPE and the KV append (one fused op)."""
        a, p = self.a, f"layers.{i}.attn"
        nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        qkv = ws.buf("qkv", (T, (nh + 2 * nkv) * hd))
        self.w.normed_linear(h, f"layers.{i}.input_norm", a.eps, f"{p}.qkv", f"{p}.qkv_bias" if a.qkv_bias else None,
                             qkv, x)
        norms = {"q_norm": self.w[f"{p}.q_norm"], "k_norm": self.w[f"{p}.k_norm"]} if a.qk_norm != "none" else {}
        q = self.be.qkv_rope_kv(qkv, nh, nkv, kv.keys[i], kv.values[i], inp.seq[:T], inp.pos[:T], inp.rpos[:T],
                                inp.cos[:T], inp.sin[:T], norm=a.qk_norm, eps=a.eps, clip=a.clip_qkv,
                                q_out=ws.buf("q3", (T, nh, hd)), **norms)
        att = ws.buf("att", (T, nh, hd))
        sinks = {"sinks": self.w.f32(f"{p}.sinks")} if a.attention_sinks else {}
        self.be.attention(q, kv.keys[i], kv.values[i], inp.seq[:T], inp.qlen[:T], float(a.attention_scale),
                          window=a.window(i), out=att, ws=ws, max_len=max_len, host_rows=inp.host_rows(T), **sinks)
        if a.attention_gate:
            self.sigmoid_gate(att.reshape(T, nh * hd), x, f"{p}.gate_proj", ws.buf("att_g", (T, nh * hd)))
        o = ws.buf("o", (T, a.hidden_size))
        return self.w.linear(att.reshape(T, nh * hd), f"{p}.o_proj", f"{p}.o_bias" if a.o_bias else None, o)

    def sigmoid_gate(self, y, x, name: str, g) -> None:
        """y *= sigmoid(x name^T), in place (Qwen3-Next's gated attention output)."""
        xp = self.be.xp
        self.w.linear(x, name, None, g)
        xp.negative(g, out=g)
        xp.exp(g, out=g)
        g += g.dtype.type(1.0)
        xp.divide(y, g, out=y)

    def linear_attention(self, i: int, x, inp, kv, ws, T: int):
        """A Gated DeltaNet layer: the q|k|v, z, b, a products, then the backend's op (causal conv with its rolling
        state, the gated delta rule over each sequence's state, chunked or recurrent per `delta_form`, the z-gated
        norm), then the output product."""
        p, lin = f"layers.{i}.linear", self.a.linear
        nv, dv = lin["num_value_heads"], lin["value_head_dim"]
        qkv = self.w.linear(x, f"{p}.qkv_proj", None, ws.buf("lin_qkv", (T, self.w[f"{p}.qkv_proj"].shape[0])))
        z = self.w.linear(x, f"{p}.z_proj", None, ws.buf("lin_z", (T, nv * dv)))
        b = self.w.linear(x, f"{p}.b_proj", None, ws.buf("lin_b", (T, nv)))
        g = self.w.linear(x, f"{p}.a_proj", None, ws.buf("lin_a", (T, nv)))
        st = kv.state
        y = self.be.gated_delta_net(qkv, z, b, g, self.w[f"{p}.conv"], self.w[f"{p}.A_log"], self.w[f"{p}.dt_bias"],
                                    self.w[f"{p}.norm"], inp.seq[:T], inp.pos[:T], st.conv[i], st.delta[i],
                                    st.lengths[i], heads=(lin["num_key_heads"], nv), dims=(lin["key_head_dim"], dv),
                                    eps=self.a.eps, strict=st.strict, form=self.delta_form,
                                    out=ws.buf("lin_y", (T, nv * dv)))
        return self.w.linear(y, f"{p}.o_proj", None, ws.buf("o", (T, self.a.hidden_size)))

    def mla_attention(self, i: int, x, inp, kv, ws, T: int):
        """Multi-head latent attention: q (q_proj, or q_a_proj -> norm -> q_b_proj), the compressed kv c (kv_a_proj ->
        norm) and the shared rope key, then the backend's op (RoPE, the latent cache append, attention expanded or
        absorbed), then o_proj."""
        a, p, m = self.a, f"layers.{i}.attn", self.a.mla
        nh, r, rope = a.n_heads, m["kv_lora_rank"], m["qk_rope_head_dim"]
        q = ws.buf("mla_q", (T, nh * a.head_dim))
        if m["q_lora_rank"] is None:
            self.w.linear(x, f"{p}.q_proj", None, q)
        else:
            qa = self.w.linear(x, f"{p}.q_a_proj", None, ws.buf("mla_qa", (T, m["q_lora_rank"])))
            self.be.rmsnorm(qa, self.w[f"{p}.q_a_norm"], m["latent_norm_eps"], out=qa)
            self.w.linear(qa, f"{p}.q_b_proj", None, q)
        kva = self.w.linear(x, f"{p}.kv_a_proj", None, ws.buf("mla_kva", (T, r + rope)))
        c = self.be.rmsnorm(kva[:, :r], self.w[f"{p}.kv_a_norm"], m["latent_norm_eps"], out=ws.buf("mla_c", (T, r)))
        att = self.be.mla_attention(q.reshape(T, nh, a.head_dim), c, kva[:, r:], self.w[f"{p}.k_b_proj"],
                                    self.w[f"{p}.v_b_proj"], kv.keys[i], inp.seq[:T], inp.pos[:T], inp.rpos[:T],
                                    inp.qlen[:T], inp.cos[:T], inp.sin[:T], scale=float(a.attention_scale),
                                    form=self.mla_form, out=ws.buf("mla_att", (T, nh * m["v_head_dim"])), ws=ws)
        return self.w.linear(att, f"{p}.o_proj", None, ws.buf("o", (T, a.hidden_size)))

    # --- feed-forward ----------------------------------------------------------------------------------------------
    def norm_route(self, i: int, h, o, x, ws):
        """h += residual_mult * o; x = post_attn_norm(h); the layer's router on x: (ids, weights), in one backend op
        (the CUDA backend's one launch)."""
        a = self.a
        w, k, how = self.router_args(i, h.shape[0], ws, "r")
        _, ids, weights = self.be.add_rmsnorm_route(h, o, self.w[f"layers.{i}.post_attn_norm"], a.eps, w, k,
                                                    alpha=float(a.residual_mult), out=x, **how)
        return ids, weights

    def moe(self, i: int, x, h, ws, ids, weights) -> None:
        """h += residual_mult * (routed experts + shared expert)(x): the experts of ids (the router's choice, or the
        forced routes) with their weights."""
        a = self.a
        if self.forced_routes is not None:
            self.be.xp.copyto(ids, self.forced_routes(i, x.shape[0]))
        if self.route_hook is not None:
            self.route_hook(i, ids)
        self.routed(i, x, ids, weights, h, ws)
        if a.shared_expert is not None:
            self.be.residual_add(h, self.shared(i, x, ws), alpha=float(a.residual_mult), out=h)

    def routed(self, i: int, x, ids, weights, h, ws) -> None:
        """h += residual_mult * the routed experts' weighted sum, each expert read where the pool's table says."""
        nxt = self.experts.prefetch_layer(i)
        if nxt is not None:
            self.experts.predict(nxt, self.route(nxt, x, ws, "pf")[0])
        self.be.moe(x, ids, weights, self.experts.table(i), residual=h, alpha=float(self.a.residual_mult), ws=ws,
                    **self.expert_extras(i))

    def expert_extras(self, i: int) -> dict:
        """What the experts of `layer` compute beyond silu(gate) * up (gpt-oss): the clamped SwiGLU, the biases
        (only passed when the model has them; as f32, which the CUDA kernels read)."""
        a, p = self.a, f"layers.{i}.moe"
        extras = {"act": a.expert_act} if a.expert_act is not None else {}
        if a.expert_bias:
            extras.update(gate_up_bias=self.w.f32(f"{p}.expert_gate_up_bias"),
                          down_bias=self.w.f32(f"{p}.expert_down_bias"))
        return extras

    def route(self, layer: int, x, ws, tag: str):
        """(expert ids [T, k] int32, weights [T, k]) of `layer`'s router applied to x."""
        w, k, how = self.router_args(layer, x.shape[0], ws, tag)
        return self.be.router(x, w, k, **how)

    def router_args(self, layer: int, T: int, ws, tag: str) -> tuple[Any, int, dict]:
        """(weight, top_k, the rest) of `layer`'s router over T rows, its outputs in the workspace buffers `tag`."""
        a, r = self.a, self.a.router
        p = f"layers.{layer}.moe"
        bias = self.w.f32(f"{p}.router_bias") if r.get("bias") else None
        groups = r.get("n_group", 1), r.get("topk_group", 1)
        grouped = {"groups": groups} if groups[1] < groups[0] else {}   # only when groups are masked
        return self.w[f"{p}.router"], a.top_k, dict(
            bias=bias, scoring=r.get("scoring", "softmax"), order=r.get("order", "softmax_topk"),
            normalize=bool(r.get("normalize_topk")), scale=float(r.get("scale", 1.0)), ws=ws, **grouped,
            out_ids=ws.buf(f"{tag}_ids", (T, a.top_k), np.int32), out_weights=ws.buf(f"{tag}_w", (T, a.top_k)))

    def mlp(self, p: str, x, ws, tag: str):
        """down(silu(gate x) * up x) with the fused [2I, H] gate/up weight."""
        T = x.shape[0]
        inter = self.w[f"{p}.gate_up"].shape[0] // 2
        gu = self.w.linear(x, f"{p}.gate_up", None, ws.buf(f"{tag}_gu", (T, 2 * inter)))
        act = self.be.silu_mul(gu, out=ws.buf(f"{tag}_act", (T, inter)))
        return self.w.linear(act, f"{p}.down_proj", None, ws.buf(f"{tag}_y", (T, self.a.hidden_size)))

    def shared(self, i: int, x, ws):
        """The shared expert's output [T, H], scaled by its per-token sigmoid gate when the model has one."""
        p, xp = f"layers.{i}.moe", self.be.xp
        y = self.mlp(f"{p}.shared", x, ws, "shared")
        if (self.a.shared_expert or {}).get("gate", "none") == "sigmoid":
            gate = self.w[f"{p}.shared_gate"]                # column 0 is the gate (a backend may pad rows)
            g = self.w.linear(x, f"{p}.shared_gate", None, ws.buf("shared_g", (x.shape[0], gate.shape[0])))
            xp.negative(g, out=g)
            xp.exp(g, out=g)
            g += g.dtype.type(1.0)
            xp.divide(y, g[:, :1], out=y)
        return y
