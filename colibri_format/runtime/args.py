"""What a `.colibri` file's `model` object asks of the decoder, checked once when an engine opens.

Every quirk of a supported family is a field of the metadata `model` object (docs/design.md), never a branch on
the architecture name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from colibri_format.errors import UnsupportedModel
from colibri_format.runtime.rope import rotary_dim


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
    attention_sinks: bool = False          # one learned logit per head joins each softmax (layers.{i}.attn.sinks)
    sliding_layers: frozenset | None = None    # layers that use sliding_window (None: all of them)
    expert_bias: bool = False              # moe.expert_gate_up_bias [E, 2I] / expert_down_bias [E, H]
    expert_act: dict | None = None         # None: silu(gate) * up; else the clamped SwiGLU {alpha, limit, up_offset}
    attention_gate: bool = False           # attention output times sigmoid(x attn.gate_proj^T) (Qwen3-Next)
    linear_layers: frozenset = frozenset()  # Gated DeltaNet layers (model.layer_types "linear_attention")
    linear: dict | None = None             # their dims (model.linear_attention)
    mla: dict | None = None                # multi-head latent attention in every layer (model.mla)
    index_topk: int | None = None          # DSA checkpoint without its indexer: exact up to this many tokens

    @property
    def rope_head_dim(self) -> int:
        """The channels of a head the RoPE tables are computed for: head_dim (times partial_rotary_factor where set),
        or MLA's qk_rope_head_dim (the rope part of each q head and the shared rope key)."""
        return self.mla["qk_rope_head_dim"] if self.mla else self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """Cached values per token over all layers: keys and values of every head, or MLA's compressed latent and
        rope key (kv_lora_rank + qk_rope_head_dim, shared by all heads)."""
        if self.mla:
            return self.num_layers * (self.mla["kv_lora_rank"] + self.mla["qk_rope_head_dim"])
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full attention)."""
        if not self.sliding_window or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return 0
        return int(self.sliding_window)

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
            attention_scale=mult["attention"] or 1.0 / math.sqrt(head_dim), logits_div=mult["logits"],
            attention_sinks=bool(m.get("attention_sinks")),
            sliding_layers=frozenset(m["sliding_layers"]) if m.get("sliding_layers") is not None else None,
            expert_bias=bool(m.get("expert_bias")), expert_act=m.get("expert_act"),
            attention_gate=bool(m.get("attention_gate")),
            linear_layers=frozenset(i for i, k in enumerate(m.get("layer_types") or ()) if k == "linear_attention"),
            linear=m.get("linear_attention"), mla=m.get("mla"), index_topk=m.get("index_topk"))


def _check_supported(m: dict[str, Any]) -> None:
    checks = [("hidden_act", m.get("hidden_act", "silu"), {"silu"}),
              ("qk_norm", m.get("qk_norm") or "none", {"none", "per_head", "full"}),
              ("router.scoring", (m.get("router") or {}).get("scoring", "softmax"), {"softmax", "sigmoid"}),
              ("router.order", (m.get("router") or {}).get("order", "softmax_topk"), {"softmax_topk", "topk_softmax"})]
    for name, value, allowed in checks:
        if value not in allowed:
            raise UnsupportedModel(f"model.{name} = {value!r} is not supported (expected one of {sorted(allowed)})",
                                   field=f"model.{name}", value=value)
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    rot = rotary_dim(m.get("rope") or {}, head_dim)
    if rot < 2 or rot % 2 or rot > head_dim:
        raise UnsupportedModel(f"model.rope.partial_rotary_factor rotates {rot} of head_dim {head_dim} channels "
                               "(needs an even number in [2, head_dim])", field="model.rope.partial_rotary_factor",
                               value=(m.get("rope") or {}).get("partial_rotary_factor"))
    router = m.get("router") or {}
    if router.get("n_group", 1) > 1 and router.get("order", "softmax_topk") != "softmax_topk":
        raise UnsupportedModel("grouped top-k (model.router.n_group) needs router.order softmax_topk",
                               field="model.router.n_group", value=router["n_group"])
