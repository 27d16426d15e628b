"""Where a Hugging Face checkpoint keeps each canonical tensor: the one reading of its layout.

An architecture names its tensors in an `HFNames` table (its record in convert/adapters.py). From that
table and the normalized `model` dict, `dense_tensors` and `expert_spans` say which rows of which
checkpoint tensors make up each canonical tensor, checking every shape against the config on the way.
Whatever reads weights (the converter, the tests) reads these spans with `rows.iter_chunks`, so the
layout is interpreted here only.

Expert layouts: the legacy one-tensor-per-expert form and the transformers-v5 fused "linear" form
(`gate_up [E, 2I, H]`, `down [E, H, I]`). The layout is looked up by name per layer; orientation is
fixed per architecture and shapes only confirm it (2I == H happens in real models).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from colibri_format.errors import InvalidInput
from colibri_format.spec import canonical_dense_tensors

Model = dict[str, Any]


@dataclass(frozen=True)
class RowSpan:
    """Rows [start, stop) of `hf_name` (of `hf_name[index]` when `index` is set: one expert of a fused tensor)."""

    hf_name: str
    index: int | None
    start: int
    stop: int


@dataclass(frozen=True)
class PerExpert:
    """Legacy layout: one [I,H]/[I,H]/[H,I] tensor per expert; `{p}` = layer prefix, `{e}` = expert."""

    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class FusedLinear:
    """Fused layout in nn.Linear orientation: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    gate_up: str
    down: str


@dataclass(frozen=True)
class Skip:
    """Checkpoint tensors left out on purpose: names that fully match `pattern` (a regular expression), and
    why. Every tensor a conversion neither uses nor skips this way is an error (or, allowed, listed)."""

    pattern: str
    reason: str


@dataclass(frozen=True)
class HFNames:
    """Where an architecture keeps its MoE and MLP tensors; format strings take `{p}` = `model.layers.{i}`.

    Attention, norm and embedding names are the same in every supported architecture (see below).
    """

    routers: tuple[str, ...]  # spellings of the router weight; the first one present is used
    experts: tuple[PerExpert | FusedLinear, ...]  # layouts to probe, per layer
    dense_mlp: tuple[str, str, str] = ("{p}.mlp.gate_proj.weight", "{p}.mlp.up_proj.weight",
                                       "{p}.mlp.down_proj.weight")
    shared: tuple[str, str, str] | None = None  # gate, up, down of a separate shared expert
    shared_fused: tuple[str, str] | None = None  # gate_up [2Is, H] (gate rows first), down [H, Is]
    shared_gate: str | None = None
    router_bias: tuple[str, ...] = ()  # spellings of the router bias ([E]; model.router.bias)
    expert_bias: tuple[str, str] | None = None  # gate_up [E, 2I] (gate first), down [E, H] (model.expert_bias)
    skip: tuple[Skip, ...] = ()  # what this architecture's checkpoints carry that the format leaves out


class DenseTensor(NamedTuple):
    """One canonical dense tensor and the rows of the checkpoint tensor it is made of."""

    name: str
    span: RowSpan


@dataclass(frozen=True)
class ExpertSpans:
    """The rows of one expert's blob matrices: gate_up [2I, H] (gate rows first) and down [H, I]."""

    gate_up: tuple[RowSpan, ...]
    down: tuple[RowSpan, ...]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


# --- dense tensors -------------------------------------------------------------------------------

class _Wanted(NamedTuple):
    """A canonical tensor's checkpoint tensor; `part` = (start, stop, total rows) when only some rows count."""

    name: str
    hf_name: str
    part: tuple[int, int, int] | None = None


def _first_present(src: Any, candidates: tuple[str, ...], what: str) -> str:
    for name in candidates:
        if src.has(name):
            return name
    raise InvalidInput(f"checkpoint lacks the {what}: looked for {', '.join(candidates)}", field=what)


LINEAR_ATTENTION = (("qkv_proj", "in_proj_qkv.weight"), ("z_proj", "in_proj_z.weight"), ("b_proj", "in_proj_b.weight"),
                    ("a_proj", "in_proj_a.weight"), ("conv", "conv1d.weight"), ("A_log", "A_log"),
                    ("dt_bias", "dt_bias"), ("norm", "norm.weight"), ("o_proj", "out_proj.weight"))


# MLA: k_b_proj / v_b_proj are split from kv_b_proj by convert/derived.py::mla_tensors
MLA_ATTENTION = (("kv_a_proj", "kv_a_proj_with_mqa.weight"), ("kv_a_norm", "kv_a_layernorm.weight"),
                 ("k_b_proj", "k_b_proj.weight"), ("v_b_proj", "v_b_proj.weight"), ("o_proj", "o_proj.weight"))
MLA_QUERY = (("q_a_proj", "q_a_proj.weight"), ("q_a_norm", "q_a_layernorm.weight"), ("q_b_proj", "q_b_proj.weight"))


def _attention(model: Model, i: int) -> list[_Wanted]:
    p, c = layer_prefix(i), f"layers.{i}"
    out = [_Wanted(f"{c}.input_norm", f"{p}.input_layernorm.weight"),
           _Wanted(f"{c}.post_attn_norm", f"{p}.post_attention_layernorm.weight")]
    if (model.get("layer_types") or ())[i:i + 1] == ["linear_attention"]:   # Qwen3-Next / Qwen3.5 Gated DeltaNet
        return out + [_Wanted(f"{c}.linear.{k}", f"{p}.linear_attn.{n}") for k, n in LINEAR_ATTENTION]
    if model.get("mla") is not None:                                       # DeepSeek-V3 family
        query = (("q_proj", "q_proj.weight"),) if model["mla"]["q_lora_rank"] is None else MLA_QUERY
        return out + [_Wanted(f"{c}.attn.{k}", f"{p}.self_attn.{n}") for k, n in query + MLA_ATTENTION]
    out += [_Wanted(f"{c}.attn.{x}_proj", f"{p}.self_attn.{x}_proj.weight") for x in "qkvo"]
    if model["qkv_bias"]:
        out += [_Wanted(f"{c}.attn.{x}_bias", f"{p}.self_attn.{x}_proj.bias") for x in "qkv"]
    if model["o_bias"]:
        out.append(_Wanted(f"{c}.attn.o_bias", f"{p}.self_attn.o_proj.bias"))
    if model["qk_norm"] != "none":
        out += [_Wanted(f"{c}.attn.{x}_norm", f"{p}.self_attn.{x}_norm.weight") for x in "qk"]
    if model.get("attention_sinks"):
        out.append(_Wanted(f"{c}.attn.sinks", f"{p}.self_attn.sinks"))
    if model.get("attention_gate"):      # split from q_proj by convert/derived.py::qwen3_next_tensors
        out.append(_Wanted(f"{c}.attn.gate_proj", f"{p}.self_attn.gate_proj.weight"))
    return out


def _moe(src: Any, model: Model, names: HFNames, i: int) -> list[_Wanted]:
    p, c = layer_prefix(i), f"layers.{i}.moe"
    router = _first_present(src, tuple(r.format(p=p) for r in names.routers), f"router of layer {i}")
    out = [_Wanted(f"{c}.router", router)]
    if model["router"]["bias"]:
        bias = _first_present(src, tuple(b.format(p=p) for b in names.router_bias), f"router bias of layer {i}")
        out.append(_Wanted(f"{c}.router_bias", bias))
    if model.get("expert_bias") and names.expert_bias is not None:
        gate_up, down = (n.format(p=p) for n in names.expert_bias)
        out += [_Wanted(f"{c}.expert_gate_up_bias", gate_up), _Wanted(f"{c}.expert_down_bias", down)]
    shared = model["shared_expert"]
    if shared is None:
        return out
    if names.shared_fused is not None:
        i_s = shared["intermediate_size"]
        gate_up, down = (n.format(p=p) for n in names.shared_fused)
        out += [_Wanted(f"{c}.shared.gate_proj", gate_up, (0, i_s, 2 * i_s)),
                _Wanted(f"{c}.shared.up_proj", gate_up, (i_s, 2 * i_s, 2 * i_s)),
                _Wanted(f"{c}.shared.down_proj", down)]
    elif names.shared is not None:
        out += [_Wanted(f"{c}.shared.{k}", n.format(p=p))
                for k, n in zip(("gate_proj", "up_proj", "down_proj"), names.shared)]
    if shared["gate"] == "sigmoid" and names.shared_gate is not None:
        out.append(_Wanted(f"{c}.shared_gate", names.shared_gate.format(p=p)))
    return out


def _dense_mlp(names: HFNames, i: int) -> list[_Wanted]:
    p = layer_prefix(i)
    return [_Wanted(f"layers.{i}.mlp.{k}", n.format(p=p))
            for k, n in zip(("gate_proj", "up_proj", "down_proj"), names.dense_mlp)]


def _resolve(src: Any, w: _Wanted, expected: tuple[int, ...]) -> DenseTensor:
    """The rows of `w` after checking that the checkpoint tensor exists and has the canonical shape."""
    if not src.has(w.hf_name):
        raise InvalidInput(f"checkpoint lacks {w.hf_name!r} (needed for {w.name})", field=w.hf_name)
    shape = tuple(src.shape(w.hf_name))
    if w.part is not None and shape[:1] != (w.part[2],):
        raise InvalidInput(f"{w.hf_name!r} has shape {shape}, expected {w.part[2]} rows", field=w.hf_name,
                           value=shape)
    start, stop = (w.part[0], w.part[1]) if w.part else (0, shape[0] if shape else 0)
    if (stop - start, *shape[1:]) != expected:
        raise InvalidInput(f"{w.hf_name!r} has shape {shape}, expected {expected} for {w.name} "
                           "(config.json and weights disagree)", field=w.hf_name, value=shape)
    return DenseTensor(w.name, RowSpan(w.hf_name, None, start, stop))


def dense_tensors(src: Any, model: Model, names: HFNames) -> list[DenseTensor]:
    """All canonical dense tensors in the spec's directory order, each checked for presence and shape."""
    wanted = [_Wanted("embed_tokens", "model.embed_tokens.weight"), _Wanted("final_norm", "model.norm.weight")]
    if not model["tie_word_embeddings"]:  # tied checkpoints have no lm_head on disk
        wanted.append(_Wanted("lm_head", "lm_head.weight"))
    moe = set(model["moe_layers"])
    for i in range(model["num_layers"]):
        wanted += _attention(model, i)
        wanted += _moe(src, model, names, i) if i in moe else _dense_mlp(names, i)
    expected = dict(canonical_dense_tensors(model))
    by_name = {w.name: w for w in wanted}
    if set(by_name) != set(expected):  # a bug here or in a names table, not in the input
        raise RuntimeError(f"dense tensor names differ from the canonical set: {sorted(set(by_name) ^ set(expected))}")
    return [_resolve(src, by_name[name], shape) for name, shape in expected.items()]


# --- experts -------------------------------------------------------------------------------------

def _expert_layout(src: Any, names: HFNames, p: str) -> PerExpert | FusedLinear:
    for layout in names.experts:
        probe = layout.gate_up if isinstance(layout, FusedLinear) else layout.gate.replace("{e}", "0")
        if src.has(probe.format(p=p)):
            return layout
    raise InvalidInput(f"no expert tensors found under {p!r} in any known layout", field=p)


def _check_shape(src: Any, name: str, expected: tuple[int, ...]) -> None:
    if not src.has(name):
        raise InvalidInput(f"checkpoint lacks {name!r}", field=name)
    shape = tuple(src.shape(name))
    if shape != expected:
        hint = " (transposed/bmm orientation?)" if sorted(shape) == sorted(expected) else ""
        raise InvalidInput(f"{name!r} has shape {shape}, expected {expected}{hint}", field=name, value=shape)


def expert_spans(src: Any, model: Model, names: HFNames, layer: int, expert: int) -> ExpertSpans:
    """Where the rows of one expert's gate_up and down live, every source shape checked against the config."""
    if layer not in model["moe_layers"] or not 0 <= expert < model["num_experts"]:
        raise InvalidInput(f"no expert ({layer}, {expert}) in this model", field="expert", value=(layer, expert))
    e_count, i_size, h = model["num_experts"], model["expert_intermediate_size"], model["hidden_size"]
    p = layer_prefix(layer)
    layout = _expert_layout(src, names, p)
    if isinstance(layout, FusedLinear):
        gate_up, down = layout.gate_up.format(p=p), layout.down.format(p=p)
        _check_shape(src, gate_up, (e_count, 2 * i_size, h))
        _check_shape(src, down, (e_count, h, i_size))
        return ExpertSpans((RowSpan(gate_up, expert, 0, 2 * i_size),), (RowSpan(down, expert, 0, h),))
    gate, up, down = (f.format(p=p, e=expert) for f in (layout.gate, layout.up, layout.down))
    for name, shape in ((gate, (i_size, h)), (up, (i_size, h)), (down, (h, i_size))):
        _check_shape(src, name, shape)
    return ExpertSpans((RowSpan(gate, None, 0, i_size), RowSpan(up, None, 0, i_size)), (RowSpan(down, None, 0, h),))


# --- tensors left out on purpose ------------------------------------------------------------------

ROTARY = Skip(r".*\.rotary_emb\.inv_freq", "rotary inverse frequencies (recomputed from the rope parameters)")
TIED_LM_HEAD = Skip(r"lm_head\.weight", "lm_head (tie_word_embeddings: the output layer is embed_tokens)")
VISION = Skip(r"(?:model\.)?(?:visual|vision_tower|vision_model|multi_modal_projector|mm_projector)\..*",
              "vision tower (config.json has a vision_config; the conversion is text-only)")
MAX_MTP_LAYERS = 16


def _mtp(raw: Mapping[str, Any], num_layers: int) -> Skip | None:
    n = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers"))     # transformers v5 names it num_mtp_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_MTP_LAYERS:
        return None
    layers = "|".join(str(num_layers + k) for k in range(n))
    return Skip(rf"model\.layers\.(?:{layers})\..*",
                "multi-token-prediction layers (num_nextn_predict_layers; not used for generation)")


def skip_rules(model: Model, raw: Mapping[str, Any], names: HFNames) -> list[Skip]:
    """The rules that apply to this checkpoint: those every architecture shares, then the architecture's own."""
    rules = [ROTARY]
    if model["tie_word_embeddings"]:
        rules.append(TIED_LM_HEAD)
    if isinstance(raw.get("vision_config"), dict):
        rules.append(VISION)
    mtp = _mtp(raw, model["num_layers"])
    if mtp is not None:
        rules.append(mtp)
    return rules + list(names.skip)


def skipped_on_purpose(candidates: Iterable[str], rules: list[Skip]) -> dict[str, str]:
    """name -> reason for each of `candidates` a rule leaves out (the first matching rule gives the reason)."""
    compiled = [(re.compile(rule.pattern), rule.reason) for rule in rules]
    out = {}
    for name in candidates:
        for pattern, reason in compiled:
            if pattern.fullmatch(name):
                out[name] = reason
                break
    return out
