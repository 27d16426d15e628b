"""The architecture-neutral MoE decoder in NumPy: what a `.colibri` file's `model` object means, executed.

Every quirk of a supported family is a field of the metadata `model` object (docs/design.md), never a branch on
the architecture name. A batch is packed without padding: the new tokens of all sequences are concatenated into
T rows for the per-token work (norms, projections, experts) and split again only for attention, where each
sequence reads its own KV cache. All arithmetic is float32, as in transformers' fp32 eager forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from colibri_format.errors import UnsupportedModel
from colibri_format.runtime.expert_source import ExpertSource
from colibri_format.runtime.kv_cache import KVCache
from colibri_format.runtime.rope import apply_rope, cos_sin, inv_frequencies

RouteObserver = Callable[[int, np.ndarray], None]  # (layer, chosen experts [T, k])


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    max_pos: int
    rope: dict
    qkv_bias: bool
    o_bias: bool
    qk_norm: str                  # none | per_head | full
    clip_qkv: float | None
    sliding_window: int | None
    tied: bool
    moe_layers: frozenset
    top_k: int
    router: dict
    shared_expert: dict | None
    embedding_mult: float
    residual_mult: float
    attention_scale: float
    logits_div: float

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> "ModelArgs":
        _check_supported(m)
        mult = {"embedding": 1.0, "residual": 1.0, "attention": None, "logits": 1.0, **(m.get("multipliers") or {})}
        head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
        return cls(
            vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_layers=m["num_layers"],
            n_heads=m["num_attention_heads"], n_kv_heads=m["num_key_value_heads"], head_dim=head_dim,
            eps=m["rms_norm_eps"], max_pos=m["max_position_embeddings"], rope=m.get("rope") or {"theta": 10000.0},
            qkv_bias=bool(m.get("qkv_bias")), o_bias=bool(m.get("o_bias")), qk_norm=m.get("qk_norm") or "none",
            clip_qkv=m.get("clip_qkv"), sliding_window=m.get("sliding_window") or None,  # 0 means disabled
            tied=bool(m.get("tie_word_embeddings")), moe_layers=frozenset(m.get("moe_layers") or ()),
            top_k=m.get("top_k") or 0, router=m.get("router") or {}, shared_expert=m.get("shared_expert"),
            embedding_mult=mult["embedding"], residual_mult=mult["residual"],
            attention_scale=mult["attention"] or 1.0 / math.sqrt(head_dim), logits_div=mult["logits"])


def _check_supported(m: dict[str, Any]) -> None:
    checks = [("hidden_act", m.get("hidden_act", "silu"), {"silu"}),
              ("qk_norm", m.get("qk_norm") or "none", {"none", "per_head", "full"}),
              ("router.scoring", (m.get("router") or {}).get("scoring", "softmax"), {"softmax", "sigmoid"}),
              ("router.order", (m.get("router") or {}).get("order", "softmax_topk"), {"softmax_topk", "topk_softmax"})]
    for name, value, allowed in checks:
        if value not in allowed:
            raise UnsupportedModel(f"model.{name} = {value!r} is not supported (expected one of {sorted(allowed)})",
                                   field=f"model.{name}", value=value)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalises over the last axis, so it serves [T, H], [T, heads, hd] and full-width q/k alike."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T      # [T, H]


def expert_ffn(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    h = x @ gate_up.T                                     # [T, 2I]: [:, :I] gate, [:, I:] up
    inter = gate_up.shape[0] // 2
    return (silu(h[:, :inter]) * h[:, inter:]) @ down.T   # [T, H]


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]   # [T, k], best first


def route(logits: np.ndarray, router: dict, k: int, bias: np.ndarray | None = None):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k])."""
    scale = router.get("scale", 1.0)
    if router.get("order", "softmax_topk") == "topk_softmax":
        idx = top_k(logits, k)
        return softmax(np.take_along_axis(logits, idx, -1)) * scale, idx
    scores = softmax(logits) if router.get("scoring", "softmax") == "softmax" else 1.0 / (1.0 + np.exp(-logits))
    idx = top_k(scores if bias is None else scores + bias, k)    # a router bias steers selection only
    weights = np.take_along_axis(scores, idx, -1)
    if router.get("normalize_topk"):
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * scale, idx


@dataclass
class Batch:
    """Packing of one forward pass: sequence s owns rows spans[s] of the T packed rows."""
    spans: list[slice]
    positions: list[np.ndarray]   # absolute positions of each sequence's new tokens
    caches: list[KVCache]
    cos: np.ndarray               # [T, rotary_dim]
    sin: np.ndarray


class MoEModel:
    def __init__(self, model: dict[str, Any], dense: Callable[[str], np.ndarray], get_expert: ExpertSource,
                 has: Callable[[str], bool] | None = None, on_route: RouteObserver | None = None) -> None:
        self.args = ModelArgs.from_dict(model)
        self.w = dense
        self.has = has or (lambda name: True)
        self.get_expert = get_expert
        self.on_route = on_route

    def new_cache(self) -> KVCache:
        return KVCache(self.args.num_layers, self.args.n_kv_heads, self.args.head_dim)

    def forward(self, chunks: list[np.ndarray], caches: list[KVCache], all_logits: bool = False) -> list[np.ndarray]:
        """New token ids per sequence -> logits per sequence: [V] for the last token, or [n, V] if all_logits."""
        batch = self._pack(chunks, caches)
        h = self.w("embed_tokens")[np.concatenate(chunks)] * self.args.embedding_mult    # [T, H]
        for i in range(self.args.num_layers):
            h = self.block(i, h, batch)
        for cache, chunk in zip(caches, chunks):
            cache.commit(len(chunk))
        rows = [s if all_logits else slice(s.stop - 1, s.stop) for s in batch.spans]
        logits = self.head(np.concatenate([h[r] for r in rows]))                        # [R, V]
        sizes = np.cumsum([r.stop - r.start for r in rows])[:-1]
        return [x if all_logits else x[0] for x in np.split(logits, sizes)]

    def _pack(self, chunks: list[np.ndarray], caches: list[KVCache]) -> Batch:
        a = self.args
        bounds = np.cumsum([0] + [len(c) for c in chunks])
        spans = [slice(int(b), int(e)) for b, e in zip(bounds[:-1], bounds[1:])]
        positions = [cache.length + np.arange(len(c)) for c, cache in zip(chunks, caches)]
        tables = [cos_sin(p, *inv_frequencies(a.rope, a.head_dim, a.max_pos, int(p[-1]) + 1)) for p in positions]
        cos, sin = (np.concatenate(t) for t in zip(*tables))
        return Batch(spans, positions, caches, cos, sin)

    def block(self, i: int, h: np.ndarray, batch: Batch) -> np.ndarray:
        a, p = self.args, f"layers.{i}"
        h = h + self.attention(i, rms_norm(h, self.w(f"{p}.input_norm"), a.eps), batch) * a.residual_mult
        x = rms_norm(h, self.w(f"{p}.post_attn_norm"), a.eps)
        ffn = self.moe(i, x) if i in a.moe_layers else self.dense_mlp(f"{p}.mlp", x)
        return h + ffn * a.residual_mult

    def head(self, h: np.ndarray) -> np.ndarray:
        out = self.w("embed_tokens") if self.args.tied or not self.has("lm_head") else self.w("lm_head")
        return (rms_norm(h, self.w("final_norm"), self.args.eps) @ out.T) / self.args.logits_div

    # --- attention -------------------------------------------------------------------------------------------

    def attention(self, i: int, x: np.ndarray, batch: Batch) -> np.ndarray:
        q, k, v = self.qkv(i, x)                               # [T, nh, hd], [T, nkv, hd], [T, nkv, hd]
        q, k = apply_rope(q, batch.cos, batch.sin), apply_rope(k, batch.cos, batch.sin)
        out = np.empty_like(q)
        for span, pos, cache in zip(batch.spans, batch.positions, batch.caches):
            keys, values = cache.extend(i, k[span], v[span])   # [L, nkv, hd]
            out[span] = self.sdpa(q[span], keys, values, pos)
        p = f"layers.{i}.attn"
        return self.linear(out.reshape(len(x), -1), f"{p}.o_proj", f"{p}.o_bias" if self.args.o_bias else None)

    def qkv(self, i: int, x: np.ndarray):
        a, p = self.args, f"layers.{i}.attn"
        q, k, v = (self.linear(x, f"{p}.{n}_proj", f"{p}.{n}_bias" if a.qkv_bias else None) for n in "qkv")
        if a.qk_norm == "full":                                # OLMoE: norm the whole projection, pre-split
            q, k = rms_norm(q, self.w(f"{p}.q_norm"), a.eps), rms_norm(k, self.w(f"{p}.k_norm"), a.eps)
        if a.clip_qkv is not None:
            q, k, v = (np.clip(t, -a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.reshape(len(x), a.n_heads, a.head_dim)
        k, v = k.reshape(len(x), a.n_kv_heads, a.head_dim), v.reshape(len(x), a.n_kv_heads, a.head_dim)
        if a.qk_norm == "per_head":                            # Qwen3: norm each head, post-split, pre-RoPE
            q, k = rms_norm(q, self.w(f"{p}.q_norm"), a.eps), rms_norm(k, self.w(f"{p}.k_norm"), a.eps)
        return q, k, v

    def sdpa(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: np.ndarray) -> np.ndarray:
        n, nh, hd = q.shape
        nkv = keys.shape[1]
        qg = q.reshape(n, nkv, nh // nkv, hd).transpose(1, 2, 0, 3)         # [nkv, g, n, hd]; head h uses kv h // g
        scores = qg @ keys.transpose(1, 2, 0)[:, None] * self.args.attention_scale   # [nkv, g, n, L]
        scores = np.where(self.mask(pos, len(keys)), scores, -np.inf)
        out = softmax(scores) @ values.transpose(1, 0, 2)[:, None]           # [nkv, g, n, hd]
        return out.transpose(2, 0, 1, 3).reshape(n, nh, hd)

    def mask(self, pos: np.ndarray, length: int) -> np.ndarray:
        kv = np.arange(length)[None, :]
        allowed = kv <= pos[:, None]                                         # [n, L] causal
        if self.args.sliding_window:
            allowed &= kv > pos[:, None] - self.args.sliding_window
        return allowed

    # --- feed-forward ----------------------------------------------------------------------------------------

    def moe(self, i: int, x: np.ndarray) -> np.ndarray:
        a, p = self.args, f"layers.{i}.moe"
        bias = self.w(f"{p}.router_bias") if a.router.get("bias") else None
        weights, idx = route(x @ self.w(f"{p}.router").T, a.router, a.top_k, bias)   # [T, k], [T, k]
        if self.on_route is not None:
            self.on_route(i, idx)
        out = self.routed(i, x, weights, idx)
        if a.shared_expert is not None:
            out = out + self.shared(p, x)
        return out

    def routed(self, i: int, x: np.ndarray, weights: np.ndarray, idx: np.ndarray) -> np.ndarray:
        out = np.zeros_like(x)
        for e in np.unique(idx):                        # only experts some token picked are ever fetched
            rows, slot = np.nonzero(idx == e)           # a token picks an expert at most once: rows are unique
            gate_up, down = self.get_expert(i, int(e))
            out[rows] += weights[rows, slot, None] * expert_ffn(x[rows], gate_up, down)
        return out

    def shared(self, p: str, x: np.ndarray) -> np.ndarray:
        y = self.dense_mlp(f"{p}.shared", x)
        if self.args.shared_expert.get("gate", "none") == "sigmoid":
            y = y / (1.0 + np.exp(-(x @ self.w(f"{p}.shared_gate").T)))    # per-token scalar gate [T, 1]
        return y

    def dense_mlp(self, p: str, x: np.ndarray) -> np.ndarray:
        return swiglu(x, self.w(f"{p}.gate_proj"), self.w(f"{p}.up_proj"), self.w(f"{p}.down_proj"))

    def linear(self, x: np.ndarray, weight: str, bias: str | None = None) -> np.ndarray:
        y = x @ self.w(weight).T
        return y + self.w(bias) if bias is not None else y
