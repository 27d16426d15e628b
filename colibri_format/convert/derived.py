"""Tensors the converter computes from checkpoint tensors while it reads them, a row range at a time.

Two kinds, both seen by the rest of the converter as ordinary float32 checkpoint tensors under a name:
- dequantized sources (`quantization_config`): FP8 e4m3 weights with a `weight_scale_inv` per block
  (DeepSeek-V3, GLM-4.5, MiniMax-M2: `W[i, j] = fp8[i, j] * scale_inv[i // bm, j // bn]`, shapes that are not
  multiples of the block included), and MXFP4 weights as `*_blocks` (uint8 [..., R, G, 16], two FP4 values a
  byte, the low nibble first) with `*_scales` (uint8 [..., R, G], E8M0: 2^(s - 127)) (gpt-oss);
- re-layouts an architecture needs (gpt-oss keeps its experts in-features first with gate and up columns
  interleaved; the converter wants nn.Linear rows with the gate rows first).

`prepare_source(src, derive)` wraps a `SourceCheckpoint`: the derived tensors replace the ones they are made
of (which no longer count as checkpoint tensors, so they are neither converted nor reported unused). Rows are
computed when `convert/rows.py` slices them; nothing holds a whole tensor, except the gpt-oss transpose of a
bf16 checkpoint, which keeps one expert matrix per reading thread.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from colibri_format.convert import native
from colibri_format.convert.safe_paths import short_repr
from colibri_format.dtypes import to_float32
from colibri_format.errors import InvalidInput, NonFiniteWeight, UnsupportedModel


class Derived(Protocol):
    """A computed tensor: its shape, and float32 rows [start, stop) of it (of its `index`-th slice if set)."""

    shape: tuple[int, ...]

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray: ...


class _View:
    """What convert/rows.py asks of a tensor: `view[i]` (one slice of a 3-D tensor), `view[a:b]` (rows), ndim, shape."""

    def __init__(self, tensor: Derived, index: int | None = None) -> None:
        self.tensor, self.index = tensor, index
        self.shape = tensor.shape[1:] if index is not None else tensor.shape
        self.ndim = len(self.shape)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)) and self.index is None and self.ndim == 3:
            return _View(self.tensor, int(key))
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.shape[0])
            return self.tensor.rows(self.index, start, stop)
        raise TypeError(f"derived tensors are read by row ranges, not {key!r}")


class DerivedSource:
    """A checkpoint whose `derived` tensors are computed and whose `consumed` tensors are hidden; everything else
    (files, config, fingerprints) is the wrapped checkpoint's."""

    def __init__(self, src: Any, derived: dict[str, Derived], consumed: set[str]) -> None:
        self._src, self._derived, self._consumed = src, derived, consumed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._src, name)

    def has(self, name: str) -> bool:
        return name in self._derived or (name not in self._consumed and self._src.has(name))

    def is_derived(self, name: str) -> bool:
        return name in self._derived or bool(getattr(self._src, "is_derived", lambda _: False)(name))

    def tensor_names(self) -> list[str]:
        return sorted({n for n in self._src.tensor_names() if n not in self._consumed} | set(self._derived))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._derived[name].shape) if name in self._derived else self._src.shape(name)

    def dtype(self, name: str) -> str:
        return "float32" if name in self._derived else self._src.dtype(name)

    def native_view(self, name: str) -> Any:
        t = self._derived.get(name)
        if t is None:
            return self._src.native_view(name)
        return t.rows(None, 0, t.shape[0]) if len(t.shape) == 1 else _View(t)

    def raw_view(self, name: str) -> np.ndarray:
        return self._src.raw_view(name)

    def derived_tensor(self, name: str) -> Derived | None:
        t = self._derived.get(name)
        if t is None and name not in self._consumed:
            t = getattr(self._src, "derived_tensor", lambda _: None)(name)
        return t

    def exact_int8(self, name: str, index: int | None, start: int, stop: int, group: int | None
                   ) -> tuple[np.ndarray, np.ndarray] | None:
        """(int8 rows, float32 scales per group) that hold rows [start, stop) exactly, when the source stores
        them that way already (MXFP4 at group 32: no second rounding); None otherwise."""
        t = self.derived_tensor(name)
        if group != MXFP4_GROUP or t is None or not hasattr(t, "int8_rows"):
            return None
        return t.int8_rows(index, start, stop)

    def exact_mxfp4(self, name: str, index: int | None, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(blocks uint8 [n, C/2], E8M0 scales uint8 [n, C/32]) of rows [start, stop) as the MXFP4 checkpoint stores
        them (for mxfp4 experts: copied, not requantized); None when the tensor is not MXFP4."""
        t = self.derived_tensor(name)
        return None if t is None or not hasattr(t, "mxfp4_rows") else t.mxfp4_rows(index, start, stop)

    def exact_int4(self, name: str, index: int | None, start: int, stop: int, group: int | None
                   ) -> tuple[np.ndarray, np.ndarray] | None:
        """(int4_group rows uint8 [n, C/2], float16 scales [n, C/g]) of rows [start, stop) as a pack-quantized int4
        checkpoint stores them, when its groups are `group` inputs wide and float16 holds its scales exactly (for
        int4_group experts: copied, not requantized); None otherwise."""
        t = self.derived_tensor(name)
        return None if t is None or not hasattr(t, "int4_rows") else t.int4_rows(index, start, stop, group)

    def is_mxfp4(self, name: str) -> bool:
        t = self.derived_tensor(name)
        return t is not None and hasattr(t, "mxfp4_rows")

    def positional_reader(self, name: str, view: Any) -> Any:
        """None for a computed tensor (convert/rows.py then slices its view); the checkpoint's answer otherwise."""
        if name in self._derived:
            return None
        finder = getattr(self._src, "positional_reader", None)
        return finder(name, view) if finder is not None else None

    def element_offset(self, name: str, index: tuple[int, ...]) -> int | None:
        return None if name in self._derived else self._src.element_offset(name, index)

    def read(self, name: str) -> np.ndarray:
        t = self._derived.get(name)
        if t is None:
            return self._src.read(name)
        if len(t.shape) == 3:
            return np.stack([t.rows(e, 0, t.shape[1]) for e in range(t.shape[0])])
        return t.rows(None, 0, t.shape[0])

    def __enter__(self) -> DerivedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._src.close()


# --- FP8 e4m3 with block scales -----------------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff NaN)."""
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where(b & 0x80, -value, value)
    value[(b & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3 = _e4m3_table()


class Fp8Blocks:
    """`fp8 [..., R, C] * scale_inv [..., ceil(R / bm), ceil(C / bn)]`, one scale per bm x bn block."""

    def __init__(self, src: Any, name: str, scale_name: str, block: tuple[int, int]) -> None:
        self.q, self.scale, self.block = src.raw_view(name), src.native_view(scale_name), block
        self.shape = tuple(self.q.shape)
        if len(self.shape) not in (2, 3):
            raise InvalidInput(f"FP8 tensor {name!r} has rank {len(self.shape)}; a matrix or a stack of them is needed",
                               field=name, value=self.shape)
        *lead, r, c = self.shape
        expected = (*lead, -(-r // block[0]), -(-c // block[1]))
        if tuple(self.scale.shape) != expected:
            raise InvalidInput(f"{scale_name!r} has shape {tuple(self.scale.shape)}, expected {expected} for "
                               f"{name!r} {self.shape} in blocks of {block[0]} x {block[1]}", field=scale_name,
                               value=tuple(self.scale.shape))

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        q = self.q if index is None else self.q[index]
        scale = self.scale if index is None else self.scale[index]
        bm, bn = self.block
        rows = np.ascontiguousarray(q[start:stop])
        s = np.ascontiguousarray(to_float32(np.asarray(scale[start // bm:(stop - 1) // bm + 1])))  # their blocks
        lib = native.library()
        if lib is not None and rows.size:      # the same products in one pass (_native.c colibri_fp8_rows)
            values = np.empty(rows.shape, np.float32)
            lib.colibri_fp8_rows(rows.ctypes.data, rows.shape[0], rows.shape[1], s.ctypes.data, start, bm, bn,
                                 E4M3.ctypes.data, values.ctypes.data)
            return values
        values = E4M3[rows]
        s = np.repeat(s, bm, axis=0)[start - start // bm * bm:][:stop - start]
        values *= np.repeat(s, bn, axis=1)[:, :values.shape[1]]
        return values


# --- MXFP4: FP4 (e2m1) values in blocks of 32 with an E8M0 scale -------------------------------------------------
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
FP4_TIMES_2 = (2 * FP4).astype(np.int8)     # every FP4 value doubled is an integer: int8 holds MXFP4 exactly
MXFP4_GROUP = 32


class Mxfp4:
    """`*_blocks` uint8 [..., R, G, 16] + `*_scales` uint8 [..., R, G] -> float32 [..., R, G * 32]."""

    def __init__(self, src: Any, blocks: str, scales: str) -> None:
        self.blocks, self.scales = src.raw_view(blocks), src.raw_view(scales)
        if self.blocks.ndim < 3 or self.blocks.shape[-1] != 16 or self.scales.shape != self.blocks.shape[:-1]:
            raise InvalidInput(f"MXFP4 tensors {blocks!r} {tuple(self.blocks.shape)} and {scales!r} "
                               f"{tuple(self.scales.shape)} do not pair (blocks [..., R, G, 16], scales [..., R, G])",
                               field=blocks, value=tuple(self.blocks.shape))
        *lead, r, g, _ = self.blocks.shape
        self.shape = (*lead, r, g * 32)

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        b = (self.blocks if index is None else self.blocks[index])[start:stop]
        e = (self.scales if index is None else self.scales[index])[start:stop]
        out = np.empty(b.shape[:-1] + (32,), np.float32)            # [n, G, 32]
        out[..., 0::2] = FP4[b & 0x0F]
        out[..., 1::2] = FP4[b >> 4]
        with np.errstate(over="ignore", invalid="ignore"):        # e = 0xFF (NaN in OCP MX): inf/NaN, refused later
            out *= np.ldexp(np.float32(1.0), e.astype(np.int32) - 127)[..., None]
        return out.reshape(out.shape[0], -1)

    def int8_rows(self, index: int | None, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The same rows as int8 groups of 32, exactly: q = 2 * FP4 value (an integer in [-12, 12]) and
        scale = 2^(s - 128) per block, so q * scale is the dequantized value; NaN for a scale byte 0xFF (NaN in
        OCP MX), which the caller refuses."""
        b = (self.blocks if index is None else self.blocks[index])[start:stop]
        e = (self.scales if index is None else self.scales[index])[start:stop]
        q = np.empty(b.shape[:-1] + (32,), np.int8)
        q[..., 0::2] = FP4_TIMES_2[b & 0x0F]
        q[..., 1::2] = FP4_TIMES_2[b >> 4]
        scales = np.ldexp(np.float32(1.0), e.astype(np.int32) - 128).astype(np.float32)
        scales[e == 0xFF] = np.nan
        return q.reshape(q.shape[0], -1), scales


    def mxfp4_rows(self, index: int | None, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The same rows as stored: blocks as uint8 [n, G * 16] (two FP4 values a byte, low nibble first) and their
        E8M0 scales uint8 [n, G], copies of the checkpoint's bytes."""
        b = (self.blocks if index is None else self.blocks[index])[start:stop]
        e = (self.scales if index is None else self.scales[index])[start:stop]
        return np.array(b, np.uint8).reshape(b.shape[0], -1), np.array(e, np.uint8)


# --- compressed-tensors "pack-quantized" int4 (Kimi-K2-Thinking, K2.5) ------------------------------------------
# The layout as the compressed-tensors package writes and reads it (source read: vllm-project/compressed-tensors,
# src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py, `pack_to_int32` / `unpack_from_int32`,
# and quantization/lifecycle/forward.py's dequantize; the package is not installed here, and transformers'
# integrations/compressed_tensors.py only hands the tensors to it):
# - `<module>.weight_packed` int32 [R, ceil(C / 8)] (packed along the input dim): input column c of row r is the
#   4-bit field at bits 4 * (c % 8) of word [r, c // 8], the lowest bits holding the first column; a row's last
#   word is padded with zero fields;
# - a field is offset-8 unsigned: q = field - 8 in [-8, 7] (not two's complement); so the little-endian bytes of a
#   word, each XOR 0x88, are int4_group's two's-complement pairs, low nibble first;
# - `<module>.weight_scale` [R, ceil(C / g)] ("group" strategy, g = group_size) or [R, 1] ("channel"), in the
#   checkpoint's float dtype; `<module>.weight_shape` int [2] = (R, C); symmetric schemes store no zero point;
# - W[r, c] = q[r, c] * scale[r, c // g]. compressed-tensors computes that product in the scale's dtype (rounding
#   it to bf16); here it is float32, which holds it exactly (an 8- or 11-bit significand times 4 bits).
# Which modules are packed: those the config group's `targets` match (a `re:` regex, `re.match`ed against the
# module name, or a class name such as "Linear") and `ignore` does not; Kimi: targets ["Linear"], ignore lm_head,
# attention, shared experts and the dense MLPs, so the routed experts are packed. The tensors present decide what
# is dequantized; the config decides how, and a packed module the config ignores or no group targets is refused.
PACKED_SUFFIXES = ("_packed", "_scale", "_shape")
PACK_FORMAT = "pack-quantized"


class PackedInt:
    """`weight_packed` int32 [R, ceil(C * bits / 32)] + `weight_scale` [R, ceil(C / g)] -> float32 [R, C]."""

    def __init__(self, src: Any, name: str, bits: int, group: int | None) -> None:
        self.name, self.bits = name, bits
        self.packed, self.scale = src.int_view(name + "_packed"), src.native_view(name + "_scale")
        per_word = 32 // bits
        if self.packed.dtype != np.int32 or self.packed.ndim != 2:
            raise InvalidInput(f"{name + '_packed'!r} is {self.packed.dtype} {tuple(self.packed.shape)}; packed "
                               "weights are int32 matrices", field=name + "_packed", value=tuple(self.packed.shape))
        r, words = self.packed.shape
        c = words * per_word
        if src.has(name + "_shape"):
            stored = np.asarray(src.int_view(name + "_shape")).reshape(-1)
            if stored.size != 2 or stored[0] != r or not words * per_word - per_word < stored[1] <= words * per_word:
                raise InvalidInput(f"{name + '_packed'!r} has shape {(r, words)}, which does not hold "
                                   f"{name + '_shape'!r} {stored.tolist()} ({per_word} values of {bits} bits a word)",
                                   field=name + "_packed", value=(r, words))
            c = int(stored[1])
        self.scheme_group = group                           # the config's: None for "channel"
        self.group = c if group is None else group          # "channel": one scale a row
        expected = (r, -(-c // self.group))
        if tuple(self.scale.shape) != expected:
            raise InvalidInput(f"{name + '_scale'!r} has shape {tuple(self.scale.shape)}, expected {expected} for "
                               f"{name!r} ({r} x {c}) in groups of {self.group}", field=name + "_scale",
                               value=tuple(self.scale.shape))
        self.shape = (r, c)

    def _scales(self, start: int, stop: int) -> np.ndarray:
        """float32 scales of rows [start, stop); a NaN or infinite one is refused, naming it."""
        s = to_float32(np.asarray(self.scale[start:stop]))
        bad = np.argwhere(~np.isfinite(s))
        if bad.size:
            r, g = (int(i) for i in bad[0])
            raise NonFiniteWeight(f"{self.name + '_scale'}: the scale of row {start + r}, group {g} is {s[r, g]}, so "
                                  "the weights it scales are not numbers", field=self.name + "_scale",
                                  value=str(s[r, g]))
        return s

    def _q(self, start: int, stop: int) -> np.ndarray:
        """The signed values of rows [start, stop), int8 [n, C]: the words' little-endian bytes hold the columns in
        order (4 bits: two a byte, the low nibble first; 8 bits: one a byte), each offset by 2^(bits - 1)."""
        b = np.ascontiguousarray(self.packed[start:stop]).view(np.uint8)
        if self.bits == 8:
            return (b ^ np.uint8(0x80)).view(np.int8)[:, :self.shape[1]]
        q = np.empty(b.shape + (2,), np.uint8)
        np.bitwise_and(b, 0x0F, out=q[..., 0])
        np.right_shift(b, 4, out=q[..., 1])
        q = q.view(np.int8)
        q -= 8
        return q.reshape(b.shape[0], -1)[:, :self.shape[1]]

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        s = self._scales(start, stop)
        values = self._q(start, stop).astype(np.float32)
        n, c = values.shape
        if c % self.group == 0:
            values.reshape(n, c // self.group, self.group)[...] *= s[..., None]
        else:
            values *= np.repeat(s, self.group, axis=1)[:, :c]
        return values

    def int4_rows(self, index: int | None, start: int, stop: int, group: int | None
                  ) -> tuple[np.ndarray, np.ndarray] | None:
        """The same rows as int4_group stores them, when they are 4-bit groups of `group` inputs whose scales float16
        holds exactly: (uint8 [n, C/2], the stored bytes XOR 0x88; float16 [n, C/g]); None otherwise (the rows are
        then requantized; bf16 -> float16 is exact for scales in float16's normal range)."""
        if self.bits != 4 or group is None or group != self.scheme_group or self.shape[1] % group:
            return None
        s = self._scales(start, stop)
        with np.errstate(over="ignore"):
            s16 = s.astype(np.float16)
        if not np.array_equal(s16.astype(np.float32), s):
            return None
        words = np.ascontiguousarray(self.packed[start:stop])
        pairs = words.view(np.uint8).reshape(words.shape[0], -1)[:, :self.shape[1] // 2] ^ np.uint8(0x88)
        return pairs, s16


def packed_provenance(src: Any, expert_format: str, group_size: int | None,
                      requantized: int | None) -> dict[str, Any] | None:
    """The provenance entry of a pack-quantized source (None for any other): its schemes and how its values were
    read for this output. `requantized`: experts with a non-zero quantization error, where int4 values are copied
    (those had a group whose scale float16 does not hold exactly, so their rows were quantized again)."""
    info = getattr(src, "packed_source", None)
    if not isinstance(info, dict):
        return None
    copied = expert_format == "int4_group" and {"bits": 4, "group_size": group_size} in info["schemes"]
    read = ("int4_group experts: the 4-bit values and their scales (as float16) copied where float16 holds the "
            "scale exactly, rows with a scale it does not hold requantized from the dequantized values; every other "
            "tensor dequantized to float32 (q * scale, exact) while read" if copied else
            "dequantized to float32 (q * scale, exact) while read, then stored in the output's formats")
    out = {**info, "read": read}
    if copied:
        out["experts_requantized"] = requantized or 0
    return out


def _matches(pattern: str, module: str, classes: bool = True) -> bool:
    """compressed-tensors' match of a target / ignore entry: `re:<regex>` re.match-ed against the module name; a
    plain entry the module's name itself, or (`classes`: targets) a class name (a capitalised word such as "Linear",
    which every packed module, a linear layer, is taken to be). A class name in `ignore` is not matched: the classes
    are not known here, and the packed tensors present decide what is quantized."""
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], module) is not None
        except re.error:
            raise InvalidInput(f"quantization_config: {short_repr(pattern)} is not a regular expression",
                               field="quantization_config", value=pattern) from None
    return pattern == module or (classes and pattern[:1].isupper() and "." not in pattern)


def _scheme(quant: dict[str, Any], key: str, group: Any, tensor: str) -> tuple[int, int | None]:
    """(bits, group size or None for one scale a row) of a config group, refused unless it is a weight-only,
    symmetric int scheme in pack-quantized format, by groups or channels, without activation ordering."""
    where = f"quantization_config.config_groups.{key}"
    fmt = group.get("format") or quant.get("format")
    if fmt != PACK_FORMAT:
        raise UnsupportedModel(f"{tensor}: compressed-tensors format {short_repr(fmt)} is not supported (only "
                               f"{PACK_FORMAT!r}, int4 / int8 by groups or channels)", field=f"{where}.format",
                               value=fmt)
    w = group.get("weights")
    if not isinstance(w, dict):
        raise UnsupportedModel(f"{tensor}: {where} quantizes no weights", field=f"{where}.weights")
    for what in ("input_activations", "output_activations"):
        if group.get(what) is not None:
            raise UnsupportedModel(f"{tensor}: {where} quantizes {what.replace('_', ' ')}, which the converter would "
                                   "not reproduce (weight-only schemes are converted)", field=f"{where}.{what}")
    checks = (("type", w.get("type") == "int", "'int'"), ("num_bits", w.get("num_bits") in (4, 8), "4 or 8"),
              ("strategy", w.get("strategy") in ("group", "channel"), "'group' or 'channel'"),
              ("symmetric", w.get("symmetric", True) is True, "true (zero points are not supported)"),
              ("actorder", w.get("actorder") is None, "null (activation-ordered groups are not supported)"),
              ("dynamic", w.get("dynamic", False) is False, "false"))
    for field, ok, expected in checks:
        if not ok:
            raise UnsupportedModel(f"{tensor}: {where}.weights.{field} is {short_repr(w.get(field))}; the converter "
                                   f"reads {expected}", field=f"{where}.weights.{field}", value=w.get(field))
    if w["strategy"] == "channel":
        return w["num_bits"], None
    g = w.get("group_size")
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 1 << 20:
        raise InvalidInput(f"{tensor}: {where}.weights.group_size must be a positive integer, got {short_repr(g)}",
                           field=f"{where}.weights.group_size", value=g)
    return w["num_bits"], g


def _compressed_tensors(src: Any, quant: dict[str, Any]) -> tuple[dict[str, Derived], set[str]]:
    for key in ("sparsity_config", "transform_config"):
        if quant.get(key):
            raise UnsupportedModel(f"compressed-tensors {key.split('_')[0]} compression is not supported",
                                   field=f"quantization_config.{key}")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedModel(f"compressed-tensors quantization_status {short_repr(status)} is not supported (only "
                               "'compressed' checkpoints)", field="quantization_config.quantization_status",
                               value=status)
    groups = quant.get("config_groups")
    ignore = quant.get("ignore") or []
    if not isinstance(groups, dict) or not groups or not isinstance(ignore, list) \
            or not all(isinstance(p, str) for p in ignore):
        raise InvalidInput("quantization_config needs config_groups (an object) and ignore (a list of strings)",
                           field="quantization_config.config_groups")
    derived: dict[str, Derived] = {}
    consumed: set[str] = set()
    names = src.tensor_names()
    for name in names:
        weight = name[:-len("_scale")]
        if name.endswith(".weight_scale") and not src.has(weight + "_packed"):
            stored = src.dtype(weight) if src.has(weight) else "absent"
            raise UnsupportedModel(f"{name!r} scales a weight that is not pack-quantized ({weight!r} is {stored}); of "
                                   "compressed-tensors' formats only 'pack-quantized' int4 / int8 is read", field=name)
        if name.endswith((".weight_zero_point", ".weight_g_idx")):
            what = "zero points (asymmetric)" if name.endswith("zero_point") else "activation-ordered groups (g_idx)"
            raise UnsupportedModel(f"{name!r}: compressed-tensors {what} are not supported; the converter reads "
                                   "symmetric pack-quantized weights", field=name)
    for packed in names:
        if not packed.endswith(".weight_packed"):
            continue
        weight, module = packed[:-len("_packed")], packed[:-len(".weight_packed")]
        if any(_matches(p, module, classes=False) for p in ignore):
            raise InvalidInput(f"{packed!r} is packed, but quantization_config ignores {module!r}", field=packed)
        targeted = [(k, g) for k, g in groups.items() if isinstance(g, dict) and isinstance(g.get("targets"), list)
                    and any(isinstance(t, str) and _matches(t, module) for t in g["targets"])]
        by_regex = [(k, g) for k, g in targeted if any(t.startswith("re:") and _matches(t, module)
                                                        for t in g["targets"])]
        if not targeted:
            raise InvalidInput(f"{packed!r} is packed, but no quantization_config group targets {module!r}",
                               field=packed)
        key, group = (by_regex or targeted)[0]
        bits, size = _scheme(quant, key, group, packed)
        if not src.has(weight + "_scale"):
            raise InvalidInput(f"packed weight {packed!r} has no {weight + '_scale'!r}", field=packed)
        derived[weight] = PackedInt(src, weight, bits, size)
        consumed |= {weight + s for s in PACKED_SUFFIXES if src.has(weight + s)}
    return derived, consumed


# --- the sources of a checkpoint ----------------------------------------------------------------------------------
def _block(quant: dict[str, Any]) -> tuple[int, int]:
    block = quant.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        raise InvalidInput(f"quantization_config weight_block_size must be two positive integers, got "
                           f"{short_repr(block)}", field="weight_block_size", value=block)
    return block[0], block[1]


def _fp8(src: Any, quant: dict[str, Any]) -> tuple[dict[str, Derived], set[str]]:
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise UnsupportedModel(f"FP8 checkpoints in format {short_repr(fmt)} are not supported (only e4m3)",
                               field="quantization_config.fmt", value=fmt)
    block = _block(quant)
    derived, consumed = {}, set()
    for scale in src.tensor_names():
        if not scale.endswith(".weight_scale_inv"):
            continue
        weight = scale[:-len("_scale_inv")]
        if not src.has(weight) or src.dtype(weight) != "f8_e4m3":
            raise InvalidInput(f"{scale!r} scales no FP8 e4m3 tensor {weight!r}", field=scale)
        derived[weight] = Fp8Blocks(src, weight, scale, block)
        consumed.add(scale)
    return derived, consumed


def _mxfp4(src: Any) -> tuple[dict[str, Derived], set[str]]:
    derived, consumed = {}, set()
    for blocks in src.tensor_names():
        if not blocks.endswith("_blocks"):
            continue
        name = blocks[:-len("_blocks")]
        scales = name + "_scales"
        if not src.has(scales):
            raise InvalidInput(f"MXFP4 tensor {blocks!r} has no {scales!r}", field=blocks)
        derived[name] = Mxfp4(src, blocks, scales)
        consumed |= {blocks, scales}
    return derived, consumed


Derive = Callable[[Any], tuple[dict[str, Derived], set[str]]]


def prepare_source(src: Any, derive: Derive | None = None) -> Any:
    """`src` with its quantized weights dequantized (per `quantization_config`) and the architecture's re-layouts
    (`derive`) applied; `src` itself when there is nothing to derive."""
    quant = src.config.raw.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        src = DerivedSource(src, *_fp8(src, quant))
    elif isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        src = DerivedSource(src, *_mxfp4(src))
    elif isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors":
        derived, consumed = _compressed_tensors(src, quant)
        src = DerivedSource(src, derived, consumed)
        schemes = sorted({(t.bits, t.scheme_group) for t in derived.values()},
                         key=lambda b: (b[0], b[1] or 0))
        src.packed_source = {"quant_method": "compressed-tensors", "format": PACK_FORMAT, "tensors": len(derived),
                             "schemes": [{"bits": b, "group_size": g} for b, g in schemes]}
    if derive is not None:
        src = DerivedSource(src, *derive(src))
    return src


# --- gpt-oss experts ----------------------------------------------------------------------------------------------
def _deinterleave(n: int) -> np.ndarray:
    """Positions of [gate 0..n/2, up 0..n/2] in a vector that alternates gate, up."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


class _RowsOf:
    """Rows of `base` (a derived or stored [E, R, C] tensor) in the order `order`."""

    def __init__(self, src: Any, name: str, order: np.ndarray) -> None:
        self.src, self.name, self.order = src, name, order
        self.shape = tuple(src.shape(name))

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        view = self.src.native_view(self.name)[index]
        pick = self.order[start:stop]
        if isinstance(view, np.ndarray):
            return to_float32(np.asarray(view[pick]))
        first, last = int(pick.min()), int(pick.max()) + 1      # a derived tensor computes a row range
        return view[first:last][pick - first]

    def __getattr__(self, name: str) -> Any:
        """`int8_rows` / `mxfp4_rows` of the base tensor, in this tensor's row order (when the base has them)."""
        if name not in ("int8_rows", "mxfp4_rows"):
            raise AttributeError(name)
        base = getattr(self.src, "derived_tensor", lambda _: None)(self.name)
        if base is None or not hasattr(base, name):
            raise AttributeError(name)

        def ordered_rows(index: int | None, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
            pick = self.order[start:stop]
            first, last = int(pick.min()), int(pick.max()) + 1
            q, scale = getattr(base, name)(index, first, last)
            return q[pick - first], scale[pick - first]
        return ordered_rows


class _Transposed:
    """[E, C, R] stored in-features first -> [E, R', C] rows in the order `order` of its columns; one transposed
    expert kept per reading thread (a column read touches every row of it)."""

    def __init__(self, src: Any, name: str, order: np.ndarray) -> None:
        self.src, self.name, self.order = src, name, order
        e, c, r = src.shape(name)
        self.shape = (e, r, c)
        self._last = threading.local()

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        last = getattr(self._last, "expert", None)
        if last is None or last[0] != index:
            m = to_float32(np.asarray(self.src.native_view(self.name)[index]))     # [C, R]
            last = self._last.expert = (index, np.ascontiguousarray(m.T[self.order]))
        return last[1][start:stop]


class _Columns:
    """[E, N] with its columns in the order `order` (gpt-oss's interleaved gate/up bias)."""

    def __init__(self, src: Any, name: str, order: np.ndarray) -> None:
        self.src, self.name, self.order = src, name, order
        self.shape = tuple(src.shape(name))

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        return to_float32(np.asarray(self.src.native_view(self.name)[start:stop]))[:, self.order]


def gpt_oss_experts(src: Any) -> tuple[dict[str, Derived], set[str]]:
    """gpt-oss experts as nn.Linear rows, gate rows first: `mlp.experts.gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I], `gate_up_proj_bias` [E, 2I]. The bf16 checkpoint stores them in-features first
    (gate_up [E, H, 2I], down [E, I, H]) with gate and up columns interleaved; an MXFP4 one stores the blocks
    out-features first (dequantized by `_mxfp4` to [E, 2I, H] and [E, H, I]), rows interleaved likewise."""
    derived: dict[str, Derived] = {}
    for name in src.tensor_names():
        if not name.endswith(".mlp.experts.gate_up_proj"):
            continue
        down = name[:-len("gate_up_proj")] + "down_proj"
        _, a, b = src.shape(name)
        if getattr(src, "is_derived", lambda _: False)(name):
            derived[name] = _RowsOf(src, name, _deinterleave(a))           # MXFP4: [E, 2I, H], rows interleaved
        else:
            derived[name] = _Transposed(src, name, _deinterleave(b))       # bf16: [E, H, 2I], columns interleaved
            if src.has(down):
                derived[down] = _Transposed(src, down, np.arange(src.shape(down)[2]))
        if src.has(name + "_bias"):
            derived[name + "_bias"] = _Columns(src, name + "_bias", _deinterleave(src.shape(name + "_bias")[1]))
    return derived, set()


# --- Qwen3-Next / Qwen3.5 -----------------------------------------------------------------------------------------
class _Rows2D:
    """Rows `order` of a stored matrix (or vector), as float32, plus `shift`; a stored [C, 1, K] conv weight is read
    as [C, K]."""

    def __init__(self, src: Any, name: str, order: np.ndarray | None = None, shift: float = 0.0) -> None:
        self.src, self.name, self.shift = src, name, np.float32(shift)
        shape = tuple(src.shape(name))
        shape = (shape[0], shape[2]) if len(shape) == 3 and shape[1] == 1 else shape
        self.order = np.arange(shape[0]) if order is None else order
        self.shape = (len(self.order), *shape[1:])

    def rows(self, index: int | None, start: int, stop: int) -> np.ndarray:
        view = self.src.native_view(self.name)
        pick = self.order[start:stop]
        first, last = (int(pick.min()), int(pick.max()) + 1) if len(pick) else (0, 0)
        block = to_float32(np.asarray(view[first:last]))[pick - first]
        block = block.reshape(len(pick), *self.shape[1:])
        return block + self.shift if self.shift else block     # float32 + float32: transformers' (1.0 + w.float())


ZERO_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
                      ".self_attn.k_norm.weight")


def _qkvz_orders(raw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row orders of Qwen3-Next's fused projections: in_proj_qkvz groups [q | k | v | z] per key head, in_proj_ba
    [b | a] per key head (`fix_query_key_value_ordering`); returns the q|k|v, z, b and a rows."""
    f = {k: raw.get(k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                 "linear_value_head_dim")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in f.values()):
        raise InvalidInput(f"config.json: the linear-attention dims must be positive integers, got {f}",
                           field="linear_num_key_heads")
    nk, nv, dk, dv = f.values()
    if nv % nk:
        raise InvalidInput(f"config.json: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}",
                           field="linear_num_value_heads", value=nv)
    r = nv // nk
    group = 2 * dk + 2 * r * dv
    base = np.arange(nk)[:, None] * group
    q, k = (base + np.arange(dk)).reshape(-1), (base + dk + np.arange(dk)).reshape(-1)
    v = (base + 2 * dk + np.arange(r * dv)).reshape(-1)
    z = (base + 2 * dk + r * dv + np.arange(r * dv)).reshape(-1)
    ba = np.arange(nk)[:, None] * 2 * r
    return (np.concatenate([q, k, v]), z, (ba + np.arange(r)).reshape(-1), (ba + r + np.arange(r)).reshape(-1))


def text_config(raw: Any) -> Any:
    """A vision-language config's text part (`text_config`; Qwen3.5), with the top-level fields that describe the
    whole checkpoint (tied embeddings, quantization) carried over; `raw` itself when it has none."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    return {**text, **{k: raw[k] for k in ("tie_word_embeddings", "quantization_config") if k in raw}}


LANGUAGE_MODEL = "model.language_model."


def qwen3_next_tensors(src: Any) -> tuple[dict[str, Derived], set[str]]:
    """Qwen3-Next / Qwen3.5 tensors in the canonical form:
    - zero-centred RMSNorm weights (`x * (1 + w)`: input, post-attention, final, q and k norms) stored as 1 + w,
      computed in float32 exactly as transformers does; the linear layers' gated norm multiplies by w itself;
    - a gated attention's q_proj [heads x (q | gate), H] split into q_proj and gate_proj ([heads x hd, H] each);
    - Qwen3-Next's fused in_proj_qkvz / in_proj_ba split into the q|k|v, z, b and a rows (Qwen3.5 stores those
      separately already), and the [C, 1, K] conv1d weight read as [C, K];
    - a vision-language checkpoint's text weights (`model.language_model.*`, Qwen3.5) under `model.*`."""
    raw = text_config(src.config.raw)
    derived: dict[str, Derived] = {}
    consumed: set[str] = set()
    hd = raw.get("head_dim")
    for name in src.tensor_names():
        out = "model." + name[len(LANGUAGE_MODEL):] if name.startswith(LANGUAGE_MODEL) else name
        if name.endswith(ZERO_CENTRED_NORMS) or name.endswith("model.norm.weight"):
            derived[out] = _Rows2D(src, name, shift=1.0)
        elif name.endswith(".self_attn.q_proj.weight") and isinstance(hd, int) and hd > 0:
            rows = src.shape(name)[0]
            heads = np.arange(rows // (2 * hd))[:, None] * 2 * hd
            derived[out] = _Rows2D(src, name, (heads + np.arange(hd)).reshape(-1))
            derived[out[:-len("q_proj.weight")] + "gate_proj.weight"] = _Rows2D(
                src, name, (heads + hd + np.arange(hd)).reshape(-1))
        elif name.endswith(".linear_attn.conv1d.weight"):
            derived[out] = _Rows2D(src, name)
        elif name.endswith(".linear_attn.in_proj_qkvz.weight"):
            p, q = name[:-len("in_proj_qkvz.weight")], out[:-len("in_proj_qkvz.weight")]
            qkv, z, b, a = _qkvz_orders(raw)
            if src.shape(name)[0] != len(qkv) + len(z):
                raise InvalidInput(f"{name!r} has {src.shape(name)[0]} rows, expected {len(qkv) + len(z)}",
                                   field=name, value=tuple(src.shape(name)))
            derived[q + "in_proj_qkv.weight"] = _Rows2D(src, name, qkv)
            derived[q + "in_proj_z.weight"] = _Rows2D(src, name, z)
            if src.has(p + "in_proj_ba.weight"):
                derived[q + "in_proj_b.weight"] = _Rows2D(src, p + "in_proj_ba.weight", b)
                derived[q + "in_proj_a.weight"] = _Rows2D(src, p + "in_proj_ba.weight", a)
                consumed.add(p + "in_proj_ba.weight")
            consumed.add(name)
        elif name.endswith(".linear_attn.in_proj_ba.weight"):
            pass                                        # split with in_proj_qkvz above
        elif out != name:                               # renamed only
            shape = tuple(src.shape(name))
            derived[out] = _RowsOf(src, name, np.arange(shape[1])) if len(shape) == 3 else _Rows2D(src, name)
        if out != name:
            consumed.add(name)
    return derived, consumed


# --- multi-head latent attention (DeepSeek-V3 family) ---------------------------------------------------------------
ALWAYS_INTERLEAVED = ("deepseek_v32", "glm_moe_dsa")     # transformers rotates interleaved pairs whatever the config


def _mla_dims(raw: Any) -> tuple[int, int, int, int, int, int]:
    keys = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank",
            "num_hidden_layers")
    f = {k: raw.get(k) for k in keys}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in f.values()):
        raise InvalidInput(f"config.json: the multi-head latent attention dims must be positive integers, got {f}",
                           field="kv_lora_rank")
    return tuple(f.values())


def mla_tensors(src: Any) -> tuple[dict[str, Derived], set[str]]:
    """MLA tensors in the canonical form, for the layers below num_hidden_layers (the MTP layers past it are skipped):
    - kv_b_proj [heads x (k_nope | v), r] split into k_b_proj [heads x k_nope, r] and v_b_proj [heads x v, r] (the
      absorbed decode form reads them as [heads, dim, r]);
    - with interleaved RoPE (`rope_interleave`, default true; always for V3.2 / GLM-5): the rope rows of each q head
      (q_b_proj or q_proj) and of the shared rope key (kv_a_proj_with_mqa) reordered evens first, odds second, so
      rotate-half RoPE computes exactly what transformers' pairwise rotation does (q.k is a sum over the pairs)."""
    raw = src.config.raw
    heads, nope, rope, v, r, layers = _mla_dims(raw)
    interleave = raw.get("model_type") in ALWAYS_INTERLEAVED or raw.get("rope_interleave", True) is not False
    pairs = _deinterleave(rope) if interleave else np.arange(rope)
    q_rows = (np.arange(heads)[:, None] * (nope + rope) + np.concatenate([np.arange(nope), nope + pairs])).reshape(-1)
    kv_rows = np.concatenate([np.arange(r), r + pairs])
    head = np.arange(heads)[:, None] * (nope + v)
    derived: dict[str, Derived] = {}
    consumed: set[str] = set()
    for name in src.tensor_names():
        parts = name.split(".")
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or int(parts[2]) >= layers:
            continue
        base = name[:-len("kv_b_proj.weight")]
        expected = None
        if name.endswith(".self_attn.kv_b_proj.weight"):
            expected = heads * (nope + v)
            derived[base + "k_b_proj.weight"] = _Rows2D(src, name, (head + np.arange(nope)).reshape(-1))
            derived[base + "v_b_proj.weight"] = _Rows2D(src, name, (head + nope + np.arange(v)).reshape(-1))
            consumed.add(name)
        elif interleave and name.endswith((".self_attn.q_b_proj.weight", ".self_attn.q_proj.weight")):
            expected = len(q_rows)
            derived[name] = _Rows2D(src, name, q_rows)
        elif interleave and name.endswith(".self_attn.kv_a_proj_with_mqa.weight"):
            expected = len(kv_rows)
            derived[name] = _Rows2D(src, name, kv_rows)
        if expected is not None and tuple(src.shape(name))[:1] != (expected,):
            raise InvalidInput(f"{name!r} has shape {tuple(src.shape(name))}, expected {expected} rows (config.json "
                               "and weights disagree)", field=name, value=tuple(src.shape(name)))
    return derived, consumed
