"""What every architecture adapter shares: canonical names, shapes, and tensor layouts.

An adapter describes its Hugging Face names in an `HFNames` table; `dense_tensors`
and `expert_tensors` here turn that table plus the normalized `model` dict into
canonical tensors, checking every shape against the config on the way. The
expert layouts accepted are the legacy one-tensor-per-expert form and the
transformers-v5 fused "linear" form (`gate_up [E, 2I, H]`, `down [E, H, I]`).
The layout is looked up by name per layer; orientation is fixed per
architecture and shapes only confirm it (2I == H happens in real models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from colibri_format.errors import InvalidInput
from colibri_format.spec import canonical_dense_tensors

Model = dict[str, Any]


@dataclass(frozen=True)
class RowSlice:
    """Keep rows [start, stop) of a 2-D tensor of `rows` rows (e.g. half of Granite's fused shared MLP)."""

    start: int
    stop: int
    rows: int

    def __call__(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array[self.start:self.stop])

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.stop - self.start, *shape[1:])


class DenseTensor(NamedTuple):
    """One canonical dense tensor: its name, the HF tensor it comes from, and an optional transform."""

    name: str
    hf_name: str
    transform: RowSlice | None = None


def dense_shape(src: Any, t: DenseTensor) -> tuple[int, ...]:
    shape = tuple(src.shape(t.hf_name))
    return t.transform.out_shape(shape) if t.transform else shape


def read_dense(src: Any, t: DenseTensor) -> np.ndarray:
    """The canonical tensor as float32 (transform applied)."""
    array = src.read(t.hf_name)
    return t.transform(array) if t.transform else array


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
class HFNames:
    """Where an architecture keeps its tensors; format strings take `{p}` = `model.layers.{i}`."""

    routers: tuple[str, ...]
    experts: tuple[PerExpert | FusedLinear, ...]
    dense_mlp: tuple[str, str, str] = ("{p}.mlp.gate_proj.weight", "{p}.mlp.up_proj.weight",
                                       "{p}.mlp.down_proj.weight")
    shared: tuple[str, str, str] | None = None  # gate, up, down of a separate shared expert
    shared_fused: tuple[str, str] | None = None  # gate_up [2Is, H], down [H, Is]
    shared_gate: str | None = None


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def canonical_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """Every dense tensor the `.colibri` file holds for this model, in canonical order (from the spec)."""
    return dict(canonical_dense_tensors(model))


# --- dense tensors -------------------------------------------------------------------------------

def _first_present(src: Any, candidates: tuple[str, ...], what: str) -> str:
    for name in candidates:
        if src.has(name):
            return name
    raise InvalidInput(f"checkpoint lacks the {what}: looked for {', '.join(candidates)}", field=what)


def _attention_tensors(model: Model, i: int) -> list[DenseTensor]:
    p, c = layer_prefix(i), f"layers.{i}"
    out = [DenseTensor(f"{c}.input_norm", f"{p}.input_layernorm.weight"),
           DenseTensor(f"{c}.post_attn_norm", f"{p}.post_attention_layernorm.weight")]
    out += [DenseTensor(f"{c}.attn.{x}_proj", f"{p}.self_attn.{x}_proj.weight") for x in "qkvo"]
    if model["qkv_bias"]:
        out += [DenseTensor(f"{c}.attn.{x}_bias", f"{p}.self_attn.{x}_proj.bias") for x in "qkv"]
    if model["o_bias"]:
        out.append(DenseTensor(f"{c}.attn.o_bias", f"{p}.self_attn.o_proj.bias"))
    if model["qk_norm"] != "none":
        out += [DenseTensor(f"{c}.attn.{x}_norm", f"{p}.self_attn.{x}_norm.weight") for x in "qk"]
    return out


def _moe_tensors(src: Any, model: Model, names: HFNames, i: int) -> list[DenseTensor]:
    p, c = layer_prefix(i), f"layers.{i}.moe"
    router = _first_present(src, tuple(r.format(p=p) for r in names.routers), f"router of layer {i}")
    out = [DenseTensor(f"{c}.router", router)]
    shared = model["shared_expert"]
    if shared is None:
        return out
    if names.shared_fused is not None:
        i_s = shared["intermediate_size"]
        gate_up, down = (n.format(p=p) for n in names.shared_fused)
        out += [DenseTensor(f"{c}.shared.gate_proj", gate_up, RowSlice(0, i_s, 2 * i_s)),
                DenseTensor(f"{c}.shared.up_proj", gate_up, RowSlice(i_s, 2 * i_s, 2 * i_s)),
                DenseTensor(f"{c}.shared.down_proj", down)]
    elif names.shared is not None:
        out += [DenseTensor(f"{c}.shared.{k}", n.format(p=p))
                for k, n in zip(("gate_proj", "up_proj", "down_proj"), names.shared)]
    if shared["gate"] == "sigmoid" and names.shared_gate is not None:
        out.append(DenseTensor(f"{c}.shared_gate", names.shared_gate.format(p=p)))
    return out


def _dense_mlp_tensors(names: HFNames, i: int) -> list[DenseTensor]:
    p = layer_prefix(i)
    return [DenseTensor(f"layers.{i}.mlp.{k}", n.format(p=p))
            for k, n in zip(("gate_proj", "up_proj", "down_proj"), names.dense_mlp)]


def _check_dense(src: Any, model: Model, tensors: list[DenseTensor]) -> None:
    expected = canonical_shapes(model)
    produced = {t.name for t in tensors}
    if produced != set(expected):  # an adapter bug: the table and the model dict disagree
        raise RuntimeError(f"adapter names differ from the canonical set: {sorted(produced ^ set(expected))}")
    for t in tensors:
        if not src.has(t.hf_name):
            raise InvalidInput(f"checkpoint lacks {t.hf_name!r} (needed for {t.name})", field=t.hf_name)
        shape = tuple(src.shape(t.hf_name))
        if t.transform is not None and shape[:1] != (t.transform.rows,):
            raise InvalidInput(f"{t.hf_name!r} has shape {shape}, expected {t.transform.rows} rows",
                               field=t.hf_name, value=shape)
        if dense_shape(src, t) != expected[t.name]:
            raise InvalidInput(f"{t.hf_name!r} has shape {shape}, expected {expected[t.name]} for {t.name} "
                               "(config.json and weights disagree)", field=t.hf_name, value=shape)


def dense_tensors(src: Any, model: Model, names: HFNames) -> list[DenseTensor]:
    """All canonical dense tensors in the spec's directory order, each checked for presence and shape."""
    out = [DenseTensor("embed_tokens", "model.embed_tokens.weight"), DenseTensor("final_norm", "model.norm.weight")]
    if not model["tie_word_embeddings"]:  # tied checkpoints have no lm_head on disk
        out.append(DenseTensor("lm_head", "lm_head.weight"))
    moe = set(model["moe_layers"])
    for i in range(model["num_layers"]):
        out += _attention_tensors(model, i)
        out += _moe_tensors(src, model, names, i) if i in moe else _dense_mlp_tensors(names, i)
    _check_dense(src, model, out)
    by_name = {t.name: t for t in out}
    return [by_name[name] for name in canonical_shapes(model)]


# --- experts -------------------------------------------------------------------------------------

def expert_layout(src: Any, names: HFNames, p: str) -> PerExpert | FusedLinear:
    """The expert layout used under layer prefix `p` (`model.layers.{i}`), found by name."""
    for layout in names.experts:
        probe = layout.gate_up if isinstance(layout, FusedLinear) else layout.gate.replace("{e}", "0")
        if src.has(probe.format(p=p)):
            return layout
    raise InvalidInput(f"no expert tensors found under {p!r} in any known layout", field=p)


def check_shape(src: Any, name: str, expected: tuple[int, ...]) -> None:
    """InvalidInput unless `name` exists with exactly `expected` shape (hints at a transposed layout)."""
    if not src.has(name):
        raise InvalidInput(f"checkpoint lacks {name!r}", field=name)
    shape = tuple(src.shape(name))
    if shape != expected:
        hint = " (transposed/bmm orientation?)" if sorted(shape) == sorted(expected) else ""
        raise InvalidInput(f"{name!r} has shape {shape}, expected {expected}{hint}", field=name, value=shape)


def expert_tensors(src: Any, model: Model, names: HFNames, layer: int, expert: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate [I,H], up [I,H], down [H,I]) float32 for one expert of one MoE layer."""
    if layer not in model["moe_layers"] or not 0 <= expert < model["num_experts"]:
        raise InvalidInput(f"no expert ({layer}, {expert}) in this model", field="expert", value=(layer, expert))
    e_count, i_size, h = model["num_experts"], model["expert_intermediate_size"], model["hidden_size"]
    p = layer_prefix(layer)
    layout = expert_layout(src, names, p)
    if isinstance(layout, FusedLinear):
        gate_up_name, down_name = layout.gate_up.format(p=p), layout.down.format(p=p)
        check_shape(src, gate_up_name, (e_count, 2 * i_size, h))
        check_shape(src, down_name, (e_count, h, i_size))
        gate_up = src.read_slice(gate_up_name, expert)
        return gate_up[:i_size], gate_up[i_size:], src.read_slice(down_name, expert)
    parts = []
    for fmt, shape in ((layout.gate, (i_size, h)), (layout.up, (i_size, h)), (layout.down, (h, i_size))):
        name = fmt.format(p=p, e=expert)
        check_shape(src, name, shape)
        parts.append(src.read(name))
    return parts[0], parts[1], parts[2]


def gate_up_rows(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The blob's `gate_up [2I, H]` (gate rows first).

    For fused checkpoints `expert_tensors` returns gate and up as the two halves of one
    freshly read array; that array is handed back as is instead of being copied again.
    """
    base = gate.base
    adjacent = (base is not None and up.base is base and base.ndim == 2 and base.flags.c_contiguous
                and base.shape == (gate.shape[0] + up.shape[0], gate.shape[1])
                and gate.ctypes.data == base.ctypes.data and up.ctypes.data == base.ctypes.data + gate.nbytes)
    return base if adjacent else np.concatenate([gate, up])


# Older spellings, still used by convert/rows.py.
_layout_for = expert_layout
_check_shape = check_shape
