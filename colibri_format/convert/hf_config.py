"""Reading an untrusted Hugging Face `config.json` and normalising it.

`load_config(dir)` parses the file strictly (size cap, one JSON object, no
duplicate keys, no NaN/Infinity). `Fields` gives typed, range-checked access to
it. `common_model(...)` builds the design-doc `model` dict for a plain
Mixtral-like decoder; each architecture record in `convert/adapters.py` sets the
fields its architecture changes and hands the result to `finish_model`, which
checks the cross-field invariants. Both transformers v4 and v5 spellings are accepted.
This module knows no architecture, so the adapters depend on it and not the other way round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from colibri_format.convert.safe_paths import read_capped, resolve_member, short_repr
from colibri_format.errors import InvalidInput, InvalidMetadata, UnsupportedModel
from colibri_format.spec import check_model

CONFIG_MAX_BYTES = 4 << 20
# Caps on config numbers, checked before anything is sized from them (the spec re-checks its own).
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_DIM = 1 << 20
MAX_HEADS = 4096
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 30
MAX_LIST = 1 << 16

EXPERT_COUNT_ALIASES = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
ROPE_LISTS = ("short_factor", "long_factor")  # longrope only
# Parameters without which the runtime cannot compute the frequencies of each rope type.
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                 "longrope": ("short_factor", "long_factor")}

# Key order of the `model` object in docs/design.md; finish_model checks all are present.
MODEL_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "max_position_embeddings", "rope", "qkv_bias", "o_bias",
              "qk_norm", "clip_qkv", "sliding_window", "tie_word_embeddings", "hidden_act", "moe_layers",
              "dense_intermediate_size", "num_experts", "top_k", "expert_intermediate_size", "router",
              "shared_expert", "multipliers")
# Keys written after those, and only by the architectures that use them (absent = the default; docs/design.md).
OPTIONAL_MODEL_KEYS = ("attention_sinks", "sliding_layers", "expert_bias", "expert_act", "attention_gate",
                       "layer_types", "linear_attention", "mla", "index_topk")

_REQUIRED = object()
_MAX_DOUBLE = 1.7976931348623157e308


@dataclass(frozen=True)
class ConfigDefaults:
    """What an architecture assumes for fields its config.json may leave out, and where its expert width is."""

    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    expert_width_key: str  # the config.json key of the routed experts' intermediate size
    partial_rotary_factor: float = 1.0  # when config.json names none (GLM-4.5: 0.5)
    mla: bool = False  # multi-head latent attention (kv_lora_rank / q_lora_rank) is this architecture's own


@dataclass(frozen=True)
class HFConfig:
    """A parsed config.json: the raw object, its model_type, and the XXH3-64 of its bytes."""

    raw: Mapping[str, Any]
    model_type: str
    xxh3: str


class _Reject(Exception):
    """Raised inside the JSON hooks; parse_json_object turns it into an InvalidInput naming the file."""

    def __init__(self, message: str, value: Any) -> None:
        super().__init__(message)
        self.value = value


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Reject(f"duplicate JSON key {short_repr(key)}", key)
        out[key] = value
    return out


def _reject_constant(token: str) -> None:
    raise _Reject(f"JSON constant {token} is not allowed", token)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # a literal such as 1e999 overflows to infinity
        raise _Reject(f"number {short_repr(text, 24)} overflows to infinity", text[:24])
    return value


def parse_json_object(data: bytes, *, what: str) -> dict[str, Any]:
    """Strict JSON: UTF-8, one object at the top, no duplicate keys, no NaN/Infinity, no number that
    overflows a float or exceeds Python's integer-conversion digit limit."""
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicates,
                         parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{what} is not UTF-8", field=what) from None
    except _Reject as exc:
        raise InvalidInput(f"{what}: {exc}", field=what, value=exc.value) from None
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc.msg} at char {exc.pos}", field=what,
                           offset=exc.pos) from None
    except RecursionError:
        raise InvalidInput(f"{what} nests too deeply", field=what) from None
    except ValueError as exc:  # an integer literal over the int-conversion digit limit (4300 digits)
        raise InvalidInput(f"{what} holds a number too large to read ({str(exc).split(';')[0]})",
                           field=what) from None
    if not isinstance(obj, dict):
        raise InvalidInput(f"{what} must hold a JSON object, not {type(obj).__name__}", field=what)
    return obj


def load_config(checkpoint_dir: str | Path) -> HFConfig:
    """Read and strictly parse `<dir>/config.json`."""
    path = resolve_member(Path(checkpoint_dir), "config.json", field="config.json")
    data = read_capped(path, max_bytes=CONFIG_MAX_BYTES, field="config.json")
    raw = parse_json_object(data, what="config.json")
    return HFConfig(raw=raw, model_type=model_type_of(raw), xxh3=xxhash.xxh3_64_hexdigest(data))


def model_type_of(raw: Mapping[str, Any]) -> str:
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InvalidInput("config.json has no string 'model_type'", field="model_type", value=model_type)
    return model_type


class Fields:
    """Typed, range-checked getters over a config mapping; `None` counts as absent."""

    def __init__(self, raw: Mapping[str, Any], where: str = "config.json") -> None:
        self.raw = raw
        self.where = where

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _fail(self, key: str, value: Any, expected: str) -> InvalidInput:
        return InvalidInput(f"{self.where}: {key!r} must be {expected}, got {short_repr(value)}", field=key,
                            value=value)

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise InvalidInput(f"{self.where}: required field {key!r} is missing", field=key)
            return default
        return value

    def integer(self, key: str, default: Any = _REQUIRED, *, lo: int = 1, hi: int = MAX_DIM) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        # bool is an int subclass in Python; JSON true must not pass as 1.
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self._fail(key, value, f"an integer in [{lo}, {hi}]")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, lo: float = -math.inf,
               hi: float = math.inf, lo_open: bool = False) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and -_MAX_DOUBLE <= value <= _MAX_DOUBLE  # never float(huge int): OverflowError
        ok = ok and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
        if not ok:
            raise self._fail(key, value, f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]")
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if not isinstance(value, bool) and value is not default:
            raise self._fail(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if not isinstance(value, str) and value is not default:
            raise self._fail(key, value, "a string")
        return value

    def int_list(self, key: str, default: Any = _REQUIRED, *, lo: int = 0, hi: int = MAX_DIM) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, list) or len(value) > MAX_LIST:
            raise self._fail(key, value, f"a list of at most {MAX_LIST} integers")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                raise self._fail(key, value, f"a list of integers in [{lo}, {hi}]")
        return list(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, dict):
            raise self._fail(key, value, "a JSON object")
        return value


# quantization_config methods whose weights the converter dequantizes while reading (convert/derived.py;
# compressed-tensors: its pack-quantized int4 / int8 format only)
DEQUANTIZED_METHODS = ("fp8", "mxfp4", "compressed-tensors")


def reject_unsupported_features(raw: Mapping[str, Any], mla: bool = False) -> None:
    """Features no adapter handles, whatever the model_type claims (multi-head latent attention unless `mla`: the
    DeepSeek-V3 family's adapters map it)."""
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        if method not in DEQUANTIZED_METHODS:
            raise UnsupportedModel(f"pre-quantized checkpoints are not supported (quantization_config, "
                                   f"quant_method={short_repr(method)}: only {', '.join(DEQUANTIZED_METHODS)} "
                                   "sources are dequantized; GPTQ/AWQ/...); use the bf16/fp16/fp32 release",
                                   field="quantization_config", value=method)
    for key in ("kv_lora_rank", "q_lora_rank"):
        if raw.get(key) is not None and not mla:
            raise UnsupportedModel(f"multi-head latent attention ({key!r}) is not supported", field=key)


def expert_count(f: Fields) -> int:
    """The routed-expert count under any of its aliases; aliases must agree."""
    found = {key: f.integer(key, None, lo=1, hi=MAX_EXPERTS) for key in EXPERT_COUNT_ALIASES}
    values = {v for v in found.values() if v is not None}
    if not values:
        raise InvalidInput(f"{f.where}: no expert count (one of {', '.join(EXPERT_COUNT_ALIASES)})",
                           field="num_experts")
    if len(values) > 1:
        present = {k: v for k, v in found.items() if v is not None}
        raise InvalidInput(f"{f.where}: expert-count aliases disagree: {present}", field="num_experts",
                           value=present)
    return values.pop()


def head_dim(f: Fields, hidden: int, heads: int) -> int:
    """Explicit `head_dim` when given (Qwen3-MoE: 128 != hidden/heads), else hidden/heads."""
    if f.has("head_dim"):
        return f.integer("head_dim", hi=MAX_DIM)
    if hidden % heads:
        raise InvalidInput(f"{f.where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
                           field="num_attention_heads", value=heads)
    return hidden // heads


def sliding_window(f: Fields) -> int | None:
    """0/null mean no window; Qwen's `use_sliding_window: false` switches it off too."""
    if f.flag("use_sliding_window", True) is False:
        return None
    window = f.integer("sliding_window", None, lo=0, hi=MAX_POSITIONS)
    return window or None


def _rope_source(f: Fields) -> tuple[Mapping[str, Any], Any]:
    # v5: rope_parameters {rope_type, rope_theta, ...}; v4: rope_theta + rope_scaling {type|rope_type, ...}.
    params = f.mapping("rope_parameters")
    if params is not None:
        return params, params.get("rope_theta", f.raw.get("rope_theta"))
    return f.mapping("rope_scaling") or {}, f.raw.get("rope_theta")


def _partial_rotary_factor(f: Fields, p: Fields, default: float, hd: int | None = None) -> float:
    """The share of head_dim (`hd`, else the config's) that RoPE rotates: `partial_rotary_factor` (rope parameters,
    else top level), or `rotary_dim` / head_dim (MiniMax), else `default`; the rotated width must be even and
    non-zero."""
    if hd is None:
        hd = head_dim(f, f.integer("hidden_size"), f.integer("num_attention_heads", hi=MAX_HEADS))
    if p.has("partial_rotary_factor"):
        factor = p.number("partial_rotary_factor", lo=0.0, hi=1.0, lo_open=True)
    elif f.has("partial_rotary_factor"):
        factor = f.number("partial_rotary_factor", lo=0.0, hi=1.0, lo_open=True)
    elif f.has("rotary_dim"):
        factor = f.integer("rotary_dim", hi=hd) / hd
    else:
        factor = default
    width = int(hd * factor)
    if width < 2 or width % 2:
        raise InvalidInput(f"{f.where}: partial_rotary_factor {factor} rotates {width} of head_dim {hd} "
                           "channels; RoPE needs an even, non-zero number", field="partial_rotary_factor",
                           value=factor)
    return factor


def rope(f: Fields, default_theta: float, default_partial: float = 1.0, rotated: int | None = None) -> dict[str, Any]:
    """The design-doc `rope` object: type, theta, the HF scaling parameters under their HF names, and
    `partial_rotary_factor` when RoPE rotates only part of each head (of `rotated` channels, else head_dim)."""
    params, theta = _rope_source(f)
    p = Fields(params, where=f"{f.where} rope")
    if any(isinstance(v, dict) for v in params.values()):  # v5 per-layer-type rope (Gemma-style)
        raise UnsupportedModel("per-layer-type rope_parameters are not supported", field="rope_parameters")
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise p._fail("rope_type", kind, "a string")
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"rope type {short_repr(kind)} is not supported (supported: {', '.join(ROPE_TYPES)})",
                               field="rope_type", value=kind)
    theta_f = Fields({"rope_theta": theta}, where=f.where).number("rope_theta", default_theta, lo=0.0,
                                                                   lo_open=True)
    out: dict[str, Any] = {"type": kind, "theta": theta_f}
    for key in ROPE_NUMBERS:
        if p.has(key):
            out[key] = p.number(key)
    if kind == "yarn" and p.has("truncate"):  # gpt-oss: false (an unrounded correction range)
        out["truncate"] = p.flag("truncate")
    partial = _partial_rotary_factor(f, p, default_partial, rotated)
    if partial != 1.0:
        out["partial_rotary_factor"] = partial
    if kind == "longrope":
        for key in ROPE_LISTS:
            if p.has(key):
                out[key] = _number_list(p, key)
    missing = [key for key in ROPE_REQUIRED.get(kind, ()) if key not in out]
    if missing:
        raise InvalidInput(f"{f.where}: rope type {kind!r} needs {', '.join(missing)}", field="rope_parameters",
                           value=kind)
    return out


def _number_list(f: Fields, key: str) -> list[float]:
    value = f.raw[key]
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise f._fail(key, value, "a list of numbers")
    return [Fields({key: v}, where=f.where).number(key) for v in value]


def hidden_act(f: Fields) -> str:
    act = f.text("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {short_repr(act)} is not supported (only 'silu')", field="hidden_act",
                               value=act)
    return act


def common_model(f: Fields, defaults: ConfigDefaults) -> dict[str, Any]:
    """Every design-doc field for a plain Mixtral-like MoE decoder (all layers MoE, no biases)."""
    reject_unsupported_features(f.raw, defaults.mla)  # here, so calling an adapter directly cannot skip it
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads", hi=MAX_HEADS)
    num_layers = f.integer("num_hidden_layers", hi=MAX_LAYERS)
    if defaults.mla:    # a head's q.k width; RoPE turns its rope part (hidden / heads may not even divide: GLM-4.7-Flash)
        rotated = f.integer("qk_rope_head_dim", hi=4096)
        hd = f.integer("qk_nope_head_dim", hi=4096) + rotated
    else:
        hd = rotated = head_dim(f, hidden, heads)
    return {
        "vocab_size": f.integer("vocab_size", hi=MAX_VOCAB),
        "hidden_size": hidden,
        "num_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": f.integer("num_key_value_heads", heads, hi=MAX_HEADS),
        "head_dim": hd,
        "rms_norm_eps": f.number("rms_norm_eps", defaults.rms_norm_eps, lo=0.0, hi=1.0, lo_open=True),
        "max_position_embeddings": f.integer("max_position_embeddings", defaults.max_position_embeddings,
                                             hi=MAX_POSITIONS),
        "rope": rope(f, defaults.rope_theta, defaults.partial_rotary_factor, rotated),
        "qkv_bias": False, "o_bias": False, "qk_norm": "none", "clip_qkv": None,
        "sliding_window": None,
        "tie_word_embeddings": f.flag("tie_word_embeddings", False),
        "hidden_act": hidden_act(f),
        "moe_layers": list(range(num_layers)),
        "dense_intermediate_size": None,
        "num_experts": expert_count(f),
        "top_k": f.integer("num_experts_per_tok", hi=MAX_EXPERTS),
        "expert_intermediate_size": f.integer(defaults.expert_width_key),
        "router": {"scoring": "softmax", "order": "softmax_topk", "normalize_topk": True, "bias": False,
                   "scale": 1.0},
        "shared_expert": None,
        "multipliers": {"embedding": 1.0, "residual": 1.0, "attention": None, "logits": 1.0},
    }


def finish_model(model: dict[str, Any]) -> dict[str, Any]:
    """Check cross-field invariants and return the dict in design-doc key order."""
    missing = [k for k in MODEL_KEYS if k not in model]
    extra = [k for k in model if k not in MODEL_KEYS and k not in OPTIONAL_MODEL_KEYS]
    if missing or extra:  # a bug in an adapter, not in the input
        raise RuntimeError(f"adapter produced a bad model dict: missing {missing}, extra {extra}")
    heads, kv = model["num_attention_heads"], model["num_key_value_heads"]
    if heads % kv:
        raise InvalidInput(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                           field="num_key_value_heads", value=kv)
    if model["top_k"] > model["num_experts"]:
        raise InvalidInput(f"num_experts_per_tok {model['top_k']} exceeds the expert count "
                           f"{model['num_experts']}", field="num_experts_per_tok", value=model["top_k"])
    if len(model["moe_layers"]) == model["num_layers"]:
        model["dense_intermediate_size"] = None  # no dense layer uses it
    elif model["dense_intermediate_size"] is None:
        raise InvalidInput("config.json: dense layers need 'intermediate_size'", field="intermediate_size")
    ordered = {k: model[k] for k in MODEL_KEYS + OPTIONAL_MODEL_KEYS if k in model}
    try:
        check_model(ordered)  # the format's own limits, so a bad config fails here, not at write time
    except InvalidMetadata as exc:
        raise InvalidInput(f"config.json describes a model the format cannot hold: {exc}", field=exc.field,
                           value=exc.value) from exc
    return ordered


def moe_layer_indices(f: Fields, num_layers: int) -> list[int]:
    """Qwen-style sparse layers: not in `mlp_only_layers` and (i+1) % decoder_sparse_step == 0."""
    dense_only = set(f.int_list("mlp_only_layers", [], lo=0, hi=MAX_LAYERS))
    step = f.integer("decoder_sparse_step", 1, hi=MAX_LAYERS)
    return [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
