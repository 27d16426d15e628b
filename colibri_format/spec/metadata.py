"""The metadata section: strict UTF-8 JSON with a documented schema (docs/spec.md, "Metadata").

Parsing rejects duplicate keys, NaN/Infinity, nesting deeper than MAX_JSON_DEPTH, more than MAX_JSON_ELEMENTS
elements and anything over MAX_METADATA_BYTES; `check_model` validates every field the runtime relies on, by type
and range.
"""

from __future__ import annotations

import json
import math
import re

from ..errors import InvalidMetadata
from . import constants as C

ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3", "longrope"})
QK_NORMS = frozenset({"none", "per_head", "full"})
ACTIVATIONS = frozenset({"silu"})
ROUTER_SCORING = frozenset({"softmax", "sigmoid"})
ROUTER_ORDER = frozenset({"softmax_topk", "topk_softmax"})
SHARED_GATES = frozenset({"sigmoid", "none"})
LAYER_TYPES = frozenset({"full_attention", "linear_attention"})
LINEAR_ATTENTION_KEYS = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "latent_norm_eps")
EXPERT_QUANT_NAMES = frozenset(C.EXPERT_FORMAT_NAMES.values())


def encode_metadata(meta: dict) -> bytes:
    """Deterministic encoding: sorted keys, no spaces, UTF-8, NaN refused; never what a reader would refuse."""
    _check_depth(meta, None)                 # the reader's nesting bound (checked without recursion, first)
    try:
        text = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        raw = text.encode("utf-8")           # a lone surrogate fails here (UnicodeEncodeError is a ValueError)
    except (TypeError, ValueError) as exc:
        raise InvalidMetadata(f"metadata cannot be encoded as strict JSON: {exc}", field="metadata") from None
    _check_element_count(raw, None)
    return raw


_COUNT_CHUNK = 1 << 16


def _check_element_count(raw: bytes, offset: int | None) -> None:
    """At most MAX_JSON_ELEMENTS arrays, objects and members, counted on the UTF-8 bytes before parsing (strings
    removed, then every `[`, `{` and `,` counted): a within-size file of `[{},{},...]` would otherwise cost
    gigabytes and minutes to parse.

    The escapes go first (`\\\\` before `\\"`), so every quote left opens or closes a string (no byte of a
    multi-byte character is a quote or a backslash), and the text outside strings is every other piece between
    quotes, taken a chunk at a time: linear time, memory bounded by the bytes. (A regex over the strings kept a
    backtracking mark per escape: 60 MiB of escaped text took 0.8 GB.)"""
    bare = bytes(raw).replace(b"\\\\", b"").replace(b'\\"', b"")
    count, inside = 0, False
    for start in range(0, len(bare), _COUNT_CHUNK):
        pieces = bare[start:start + _COUNT_CHUNK].split(b'"')
        outside = b"".join(pieces[1 if inside else 0::2])
        count += outside.count(b"[") + outside.count(b"{") + outside.count(b",")
        inside ^= len(pieces) % 2 == 0                 # an odd number of quotes in the chunk
    if count > C.MAX_JSON_ELEMENTS:
        raise InvalidMetadata(f"metadata holds more than {C.MAX_JSON_ELEMENTS} JSON elements", field="metadata",
                              value=count, offset=offset)


class _Reject(Exception):
    """Raised inside the JSON hooks; decode_metadata turns it into an InvalidMetadata with the offset."""

    def __init__(self, message: str, value) -> None:
        super().__init__(message)
        self.value = value


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Reject("duplicate key in metadata JSON", key)
        out[key] = value
    return out


def _no_constants(name):
    raise _Reject("NaN/Infinity are not allowed in metadata", name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):   # a literal such as 1e400 overflows to infinity
        raise _Reject("number overflows to infinity in metadata", text[:32])
    return value


_MAX_DOUBLE = 1.7976931348623157e308


def _finite_number(v) -> bool:
    """A finite float, or an int a double can hold; bool excluded. Never converts a huge int to float."""
    return (type(v) is int and -_MAX_DOUBLE <= v <= _MAX_DOUBLE) or (type(v) is float and math.isfinite(v))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_depth(obj, offset: int | None) -> None:
    """Nesting within MAX_JSON_DEPTH, and every string (keys too) real Unicode text: a `\\ud800` escape
    decodes to a lone surrogate that no UTF-8 encoder (or terminal) accepts."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > C.MAX_JSON_DEPTH:
            raise InvalidMetadata("metadata nested too deeply", field="metadata", value=depth, offset=offset)
        strings = [*node, *(v for v in node.values() if isinstance(v, str))] if isinstance(node, dict) else \
            [v for v in node if isinstance(v, str)] if isinstance(node, list) else [node] if isinstance(node, str) else []
        for text in strings:
            if _SURROGATE.search(text):
                raise InvalidMetadata("metadata string holds a lone surrogate (not Unicode text)", field="metadata",
                                      value=text[:32], offset=offset)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def decode_metadata(raw: bytes, offset: int | None = None) -> dict:
    """Parse metadata bytes into a dict; every fault is an InvalidMetadata."""
    if len(raw) > C.MAX_METADATA_BYTES:
        raise InvalidMetadata("metadata larger than the limit", field="metadata_size", value=len(raw), offset=offset)
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMetadata(f"metadata is not UTF-8 (byte {exc.start})", field="metadata",
                              offset=None if offset is None else offset + exc.start) from None
    _check_element_count(raw, offset)
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants,
                         parse_float=_finite_float)
    except _Reject as exc:
        raise InvalidMetadata(str(exc), field="metadata", value=exc.value, offset=offset) from None
    except RecursionError:
        raise InvalidMetadata("metadata nested too deeply", field="metadata", offset=offset) from None
    except json.JSONDecodeError as exc:
        raise InvalidMetadata(f"metadata is not valid JSON: {exc.msg} at char {exc.pos}", field="metadata",
                              offset=offset) from None
    except ValueError as exc:   # e.g. an integer literal over the int-conversion digit limit
        raise InvalidMetadata(f"metadata holds an unrepresentable number: {exc}", field="metadata",
                              offset=offset) from None
    if not isinstance(obj, dict):
        raise InvalidMetadata("metadata must be a JSON object", field="metadata", value=type(obj).__name__,
                              offset=offset)
    _check_depth(obj, offset)
    return obj


# --- schema -----------------------------------------------------------------------------------------
def _get(obj: dict, key: str, path: str):
    if key not in obj:
        raise InvalidMetadata("missing metadata field", field=f"{path}.{key}")
    return obj[key]


def _int(obj, key, path, lo, hi):
    v = _get(obj, key, path)
    if type(v) is not int or not lo <= v <= hi:
        raise InvalidMetadata(f"must be an integer in [{lo}, {hi}]", field=f"{path}.{key}", value=v)
    return v


def _num(obj, key, path, lo=-math.inf, hi=math.inf, allow_none=False, exclusive_lo=False):
    v = _get(obj, key, path)
    if v is None and allow_none:
        return v
    ok = _finite_number(v) and v <= hi and (v > lo if exclusive_lo else v >= lo)
    if not ok:
        raise InvalidMetadata("must be a finite number in range", field=f"{path}.{key}", value=v)
    return v


def _bool(obj, key, path):
    v = _get(obj, key, path)
    if type(v) is not bool:
        raise InvalidMetadata("must be true or false", field=f"{path}.{key}", value=v)
    return v


def _choice(obj, key, path, choices):
    v = _get(obj, key, path)
    if not isinstance(v, str) or v not in choices:
        raise InvalidMetadata(f"must be one of {sorted(choices)}", field=f"{path}.{key}", value=v)
    return v


def _dict(obj, key, path):
    v = _get(obj, key, path)
    if not isinstance(v, dict):
        raise InvalidMetadata("must be an object", field=f"{path}.{key}", value=type(v).__name__)
    return v


def _check_rope(rope: dict) -> None:
    _choice(rope, "type", "model.rope", ROPE_TYPES)
    _num(rope, "theta", "model.rope", 0, 1e12, exclusive_lo=True)
    if "partial_rotary_factor" in rope:      # RoPE on the first factor * head_dim channels of a head only
        _num(rope, "partial_rotary_factor", "model.rope", 0, 1.0, exclusive_lo=True)
    for key, value in rope.items():
        if key == "type":
            continue
        if isinstance(value, list):
            if len(value) > C.MAX_DIM or not all(_finite_number(x) for x in value):
                raise InvalidMetadata("rope list must hold finite numbers", field=f"model.rope.{key}")
        elif value is not None and not (type(value) is bool or _finite_number(value)):
            raise InvalidMetadata("rope parameter must be a finite number", field=f"model.rope.{key}", value=value)


def _check_layers(model: dict) -> None:
    n = model["num_layers"]
    moe = _get(model, "moe_layers", "model")
    if (not isinstance(moe, list) or not moe or len(moe) > n
            or any(type(x) is not int or not 0 <= x < n for x in moe)
            or any(b <= a for a, b in zip(moe, moe[1:]))):
        raise InvalidMetadata("moe_layers must be a non-empty increasing list of layer indices",
                              field="model.moe_layers", value=moe)
    if len(moe) < n:
        _int(model, "dense_intermediate_size", "model", 1, C.MAX_EXPERT_INTERMEDIATE)


def check_model(model: dict) -> dict:
    """Validate the `model` object (types, ranges, internal consistency). Returns it unchanged."""
    p = "model"
    _int(model, "vocab_size", p, 1, C.MAX_DIM)
    _int(model, "hidden_size", p, 1, C.MAX_HIDDEN)
    _int(model, "num_layers", p, 1, C.MAX_LAYERS)
    heads = _int(model, "num_attention_heads", p, 1, 4096)
    kv = _int(model, "num_key_value_heads", p, 1, heads)
    if heads % kv:
        raise InvalidMetadata("num_attention_heads must be a multiple of num_key_value_heads",
                              field="model.num_key_value_heads", value=kv)
    _int(model, "head_dim", p, 1, 4096)
    _num(model, "rms_norm_eps", p, 0, 1.0, exclusive_lo=True)
    _int(model, "max_position_embeddings", p, 1, 1 << 30)
    _check_rope(_dict(model, "rope", p))
    _bool(model, "qkv_bias", p)
    _bool(model, "o_bias", p)
    _choice(model, "qk_norm", p, QK_NORMS)
    _num(model, "clip_qkv", p, 0, 1e9, allow_none=True, exclusive_lo=True)
    if _get(model, "sliding_window", p) is not None:
        _int(model, "sliding_window", p, 1, 1 << 30)
    _bool(model, "tie_word_embeddings", p)
    _choice(model, "hidden_act", p, ACTIVATIONS)
    experts = _int(model, "num_experts", p, 1, C.MAX_EXPERTS)
    _int(model, "top_k", p, 1, min(experts, C.MAX_TOP_K))
    _int(model, "expert_intermediate_size", p, 1, C.MAX_EXPERT_INTERMEDIATE)
    _check_layers(model)
    router = _dict(model, "router", p)
    _choice(router, "scoring", "model.router", ROUTER_SCORING)
    _choice(router, "order", "model.router", ROUTER_ORDER)
    _bool(router, "normalize_topk", "model.router")
    _bool(router, "bias", "model.router")
    _num(router, "scale", "model.router", 0, 1e6, exclusive_lo=True)
    _check_groups(router, experts, model["top_k"])
    shared = _get(model, "shared_expert", p)
    if shared is not None:
        if not isinstance(shared, dict):
            raise InvalidMetadata("must be null or an object", field="model.shared_expert")
        _int(shared, "intermediate_size", "model.shared_expert", 1, C.MAX_EXPERT_INTERMEDIATE)
        _choice(shared, "gate", "model.shared_expert", SHARED_GATES)
    mult = _dict(model, "multipliers", p)
    for key in ("embedding", "residual", "logits"):
        _num(mult, key, "model.multipliers", 0, 1e9, exclusive_lo=True)
    _num(mult, "attention", "model.multipliers", 0, 1e9, allow_none=True, exclusive_lo=True)
    _check_optional(model)
    return model


def _check_groups(router: dict, experts: int, top_k: int) -> None:
    """Grouped top-k (optional keys, absent = one group): experts split into n_group equal groups, a token keeps
    the topk_group groups whose two best selection keys sum highest, and picks its top_k among their experts."""
    if "n_group" not in router and "topk_group" not in router:
        return
    groups = _int(router, "n_group", "model.router", 1, experts)
    keep = _int(router, "topk_group", "model.router", 1, groups)
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise InvalidMetadata("n_group must divide num_experts into groups of at least 2 experts",
                              field="model.router.n_group", value=groups)
    if top_k > keep * (experts // groups):
        raise InvalidMetadata("top_k exceeds the experts of the topk_group kept groups",
                              field="model.router.topk_group", value=keep)


def _check_optional(model: dict) -> None:
    """Keys a file carries only when its model uses them (absent: the default in brackets)."""
    n = model["num_layers"]
    if "attention_sinks" in model:            # [false] one learned logit per head in every softmax
        _bool(model, "attention_sinks", "model")
    layers = model.get("sliding_layers")      # [null: every layer] the layers sliding_window applies to
    if layers is not None:
        if (not isinstance(layers, list) or len(layers) > n or any(type(x) is not int or not 0 <= x < n for x in layers)
                or any(b <= a for a, b in zip(layers, layers[1:])) or model["sliding_window"] is None):
            raise InvalidMetadata("sliding_layers must be an increasing list of layer indices, with a sliding_window",
                                  field="model.sliding_layers", value=layers)
    _check_hybrid(model)
    _check_mla(model)
    if "expert_bias" in model:                # [false] moe.expert_gate_up_bias / expert_down_bias per MoE layer
        _bool(model, "expert_bias", "model")
    act = model.get("expert_act")             # [null: silu(gate) * up] the clamped SwiGLU of gpt-oss
    if act is not None:
        if not isinstance(act, dict):
            raise InvalidMetadata("must be null or an object", field="model.expert_act")
        _num(act, "alpha", "model.expert_act", 0, 1e6, exclusive_lo=True)
        _num(act, "limit", "model.expert_act", 0, 1e9, allow_none=True, exclusive_lo=True)
        _num(act, "up_offset", "model.expert_act", -1e9, 1e9)


def _check_hybrid(model: dict) -> None:
    """Qwen3-Next / Qwen3.5 fields: `attention_gate` [false] (attn.gate_proj: attention output times
    sigmoid(x gate_proj^T)), `layer_types` [null: every layer full attention] and `linear_attention` (the Gated
    DeltaNet dims, present exactly when some layer is linear_attention)."""
    if "attention_gate" in model:
        _bool(model, "attention_gate", "model")
    kinds = model.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != model["num_layers"]
                              or any(not isinstance(k, str) or k not in LAYER_TYPES for k in kinds)):
        raise InvalidMetadata(f"layer_types must list one of {sorted(LAYER_TYPES)} per layer",
                              field="model.layer_types", value=kinds if isinstance(kinds, list) else None)
    linear = bool(kinds) and "linear_attention" in kinds
    lin = model.get("linear_attention")
    if linear != (lin is not None):
        raise InvalidMetadata("linear_attention must be an object exactly when layer_types names a linear_attention "
                              "layer", field="model.linear_attention", value=None if lin is None else "object")
    if lin is None:
        return
    if not isinstance(lin, dict) or set(lin) != set(LINEAR_ATTENTION_KEYS):
        raise InvalidMetadata(f"linear_attention must hold exactly {', '.join(LINEAR_ATTENTION_KEYS)}",
                              field="model.linear_attention")
    for key in LINEAR_ATTENTION_KEYS[:-1]:
        _int(lin, key, "model.linear_attention", 1, 4096)
    _int(lin, "conv_kernel", "model.linear_attention", 1, 64)
    if lin["num_value_heads"] % lin["num_key_heads"]:
        raise InvalidMetadata("linear_attention.num_value_heads must be a multiple of num_key_heads",
                              field="model.linear_attention.num_value_heads", value=lin["num_value_heads"])


def _check_mla(model: dict) -> None:
    """Multi-head latent attention (DeepSeek-V3 family): `mla` [absent: none] makes every layer's attention MLA, with
    head_dim = qk_nope_head_dim + qk_rope_head_dim (the q.k width of a head) and none of the other attention options;
    `index_topk` [absent: none] says the checkpoint's attention keeps each query's index_topk best keys (DeepSeek
    Sparse Attention) and the file holds no indexer: attention is exact up to that many tokens."""
    mla = model.get("mla")
    if "index_topk" in model:
        _int(model, "index_topk", "model", 1, 1 << 30)
        if mla is None:
            raise InvalidMetadata("index_topk needs mla", field="model.index_topk", value=model["index_topk"])
    if mla is None:
        return
    if not isinstance(mla, dict) or set(mla) != set(MLA_KEYS):
        raise InvalidMetadata(f"mla must hold exactly {', '.join(MLA_KEYS)}", field="model.mla")
    if mla["q_lora_rank"] is not None:
        _int(mla, "q_lora_rank", "model.mla", 1, C.MAX_HIDDEN)
    _int(mla, "kv_lora_rank", "model.mla", 1, C.MAX_HIDDEN)
    nope = _int(mla, "qk_nope_head_dim", "model.mla", 1, 4096)
    rope = _int(mla, "qk_rope_head_dim", "model.mla", 2, 4096)
    if rope % 2:
        raise InvalidMetadata("must be even (RoPE rotates pairs)", field="model.mla.qk_rope_head_dim", value=rope)
    _int(mla, "v_head_dim", "model.mla", 1, 4096)
    _num(mla, "latent_norm_eps", "model.mla", 0, 1.0, exclusive_lo=True)
    if model["head_dim"] != nope + rope:
        raise InvalidMetadata("with mla, head_dim must equal qk_nope_head_dim + qk_rope_head_dim",
                              field="model.head_dim", value=model["head_dim"])
    if model["num_key_value_heads"] != model["num_attention_heads"]:
        raise InvalidMetadata("with mla, num_key_value_heads must equal num_attention_heads",
                              field="model.num_key_value_heads", value=model["num_key_value_heads"])
    others = {"qkv_bias": model["qkv_bias"], "o_bias": model["o_bias"], "qk_norm": model["qk_norm"] != "none",
              "clip_qkv": model["clip_qkv"] is not None, "sliding_window": model["sliding_window"] is not None,
              "attention_sinks": bool(model.get("attention_sinks")),
              "attention_gate": bool(model.get("attention_gate")), "layer_types": bool(model.get("layer_types")),
              "rope.partial_rotary_factor": "partial_rotary_factor" in model["rope"]}
    used = [k for k, v in others.items() if v]
    if used:
        raise InvalidMetadata(f"mla attention has no {used[0]}", field=f"model.{used[0]}")


def check_metadata(meta: dict) -> dict:
    """Validate the top-level metadata object and its `model` and `quantization` parts."""
    if meta.get("format") != "colibri":
        raise InvalidMetadata('metadata "format" must be "colibri"', field="format", value=meta.get("format"))
    for key in ("spec_version", "architecture"):
        v = _get(meta, key, "metadata")
        if not isinstance(v, str) or not 0 < len(v) <= 64:
            raise InvalidMetadata("must be a short string", field=key, value=v)
    check_model(_dict(meta, "model", "metadata"))
    quant = _dict(meta, "quantization", "metadata")
    _choice(quant, "experts", "quantization", EXPERT_QUANT_NAMES)
    _choice(quant, "dense_dtype", "quantization", frozenset(C.DTYPE_NAMES))
    _dict(meta, "provenance", "metadata")
    tok = _get(meta, "tokenizer", "metadata")
    if tok is not None:
        if not isinstance(tok, dict):
            raise InvalidMetadata("must be null or an object", field="tokenizer")
        if "tokenizer_json" in tok and not isinstance(tok["tokenizer_json"], str):
            raise InvalidMetadata("must be a string", field="tokenizer.tokenizer_json")
    return meta
