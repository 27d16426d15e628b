"""Rotary position embeddings: the inverse frequencies of every `rope.type` the format names, and their use.

Semantics follow Hugging Face's RoPE initialisers (same parameter names, same defaults), in the "rotate_half"
convention: a head vector is split into two halves that rotate together, not into interleaved pairs.
Types whose frequencies depend on the sequence length (`dynamic`, `longrope`) are evaluated statelessly at the
total length of the sequence being computed.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from colibri_format.errors import UnsupportedModel

# rope types whose frequencies do not depend on the sequence's length: their cos/sin rows can come from one table
LENGTH_FREE_TYPES = frozenset({"default", "linear", "yarn", "llama3"})
TABLE_MIN_ROWS = 256      # the smallest cos/sin table (rows: positions [0, rows))
TABLE_CACHE_SIZE = 8      # tables kept (a model has one set of frequencies; a table grows by doubling)


def rotary_dim(rope: dict[str, Any], head_dim: int) -> int:
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [dim/2]


def _linear(rope, dim, max_pos, seq_len):
    return _base_inv_freq(rope["theta"], dim) / rope["factor"], 1.0


def _dynamic(rope, dim, max_pos, seq_len):
    # NTK-aware: grow the base only once the sequence outgrows the trained context.
    seq_len = max(seq_len, max_pos)
    factor = rope["factor"]
    base = rope["theta"] * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(rope, factor):
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_correction_range(rope, dim, orig):
    def dim_for(rotations):  # the dimension whose wavelength fits `rotations` turns into the original context
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope["theta"]))

    low, high = dim_for(rope.get("beta_fast") or 32), dim_for(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(rope, dim, max_pos, seq_len):
    orig = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor") or max_pos / orig
    low, high = _yarn_correction_range(rope, dim, orig)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp                         # 1 = keep the original frequency (high-frequency dims)
    base = _base_inv_freq(rope["theta"], dim)
    inv_freq = (base / factor) * (1.0 - extrapolate) + base * extrapolate
    return inv_freq, _yarn_attention_factor(rope, factor)


def _llama3(rope, dim, max_pos, seq_len):
    inv_freq = _base_inv_freq(rope["theta"], dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope.get("original_max_position_embeddings") or max_pos
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return np.where(medium, blended, scaled), 1.0


def _longrope(rope, dim, max_pos, seq_len):
    orig = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor") or max_pos / orig
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = np.asarray(rope["long_factor"] if seq_len > orig else rope["short_factor"], dtype=np.float64)
    return _base_inv_freq(rope["theta"], dim) / ext, attention_factor


_INIT = {
    "default": lambda rope, dim, max_pos, seq_len: (_base_inv_freq(rope["theta"], dim), 1.0),
    "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3, "longrope": _longrope,
}


def inv_frequencies(rope: dict[str, Any], head_dim: int, max_pos: int, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rotary_dim/2], cos/sin scale) for a sequence of total length `seq_len`."""
    kind = rope.get("type", "default")
    if kind not in _INIT:
        raise UnsupportedModel(f"rope type {kind!r} is not supported", field="model.rope.type", value=kind)
    return _INIT[kind](rope, rotary_dim(rope, head_dim), max_pos, seq_len)


def cos_sin_half(positions: np.ndarray, inv_freq: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """positions [T] -> cos, sin [T, rotary_dim / 2] float32: one value a frequency."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]   # [T, dim/2]
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


@functools.lru_cache(maxsize=TABLE_CACHE_SIZE)
def _table(inv_freq_bytes: bytes, scale: float, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """cos_sin_half of positions [0, rows) (read-only: callers index it, which copies)."""
    cos, sin = cos_sin_half(np.arange(rows), np.frombuffer(inv_freq_bytes, np.float64), scale)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def cos_sin_rows(rope: dict[str, Any], head_dim: int, max_pos: int,
                 positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos_sin_half of one sequence's `positions` (non-negative) at the frequencies of its total length
    (positions[-1] + 1). For LENGTH_FREE_TYPES, when a table of positions [0, 2^j) costs at most twice the rows
    asked for (a prefill from position 0), the rows are read from that table, made once: the same values, each
    computed as cos_sin_half computes it (a prefill of 512 tokens spent ~1.4 ms of host time here)."""
    positions = np.asarray(positions)
    inv_freq, scale = inv_frequencies(rope, head_dim, max_pos, int(positions[-1]) + 1)
    rows = max(TABLE_MIN_ROWS, 1 << int(positions.max()).bit_length())
    if rope.get("type", "default") not in LENGTH_FREE_TYPES or rows > 2 * max(len(positions), TABLE_MIN_ROWS // 2):
        return cos_sin_half(positions, inv_freq, scale)
    cos, sin = _table(np.ascontiguousarray(inv_freq, np.float64).tobytes(), float(scale), rows)
    return cos[positions], sin[positions]
