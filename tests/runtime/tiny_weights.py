"""Test-only canonical weights held in memory, the `.colibri` file they make, and direct decoder passes.

The engine reads `.colibri` files only. A test builds a `TinyWeights` record (canonical tensor names of
docs/design.md, experts as (gate_up [2I, H], down [H, I])), writes it with the real writer (`write_colibri`),
and opens the file with `Engine(path)`. `decoder_pass` drives the engine's own `Decoder` over caller-owned
`KVBuffers`, for tests of ragged packing and KV caching below the engine's public calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri_format.runtime.forward import KVBuffers, StepInputs, Workspace, host_step, make_kv

ExpertArrays = tuple[np.ndarray, np.ndarray]     # (gate_up [2I, H], down [H, I])


@dataclass
class TinyWeights:
    """A model's metadata `model` object, dense tensors by canonical name, experts by (layer, expert)."""
    model: dict[str, Any]
    dense: dict[str, np.ndarray]
    experts: dict[tuple[int, int], ExpertArrays]
    metadata: dict[str, Any] = field(default_factory=dict)   # "architecture", "tokenizer" for the file


def write_colibri(weights: TinyWeights, path, experts: str = "float32", dense: str = "float32",
                  group_size: int | None = None):
    """Write `weights` with colibri_format.writer (experts: float32 | float16 | bfloat16 | int8_row | int8_group);
    returns the file's path."""
    from colibri_format import spec as S
    from colibri_format.convert.quantize import quantize_int8
    from colibri_format.writer import ColibriWriter

    fmt = {v: k for k, v in S.EXPERT_FORMAT_NAMES.items()}[experts]
    model = weights.model
    with ColibriWriter(path, model, dense_dtype=S.DTYPE_NAMES[dense], expert_format=fmt,
                       group_size=group_size or 0) as w:
        for name, _ in S.canonical_dense_tensors(model):
            w.write_dense(name, np.asarray(weights.dense[name], np.float32))
        for (layer, e), (gate_up, down) in weights.experts.items():
            if fmt in S.QUANTIZED_FORMATS:
                gu, dn = quantize_int8(gate_up, group_size), quantize_int8(down, group_size)
                arrays = {"gate_up": gu.q, "gate_up_scale": gu.scale, "down": dn.q, "down_scale": dn.scale}
            else:
                arrays = {"gate_up": gate_up, "down": down}
            w.write_expert(layer, e, arrays)
        quant = {"experts": experts, "bits": 8 if fmt in S.QUANTIZED_FORMATS else None, "group_size": group_size,
                 "dense_dtype": dense, "error": {"max_rel": 0.0, "mean_rel": 0.0, "per_expert": []}}
        meta = {"format": "colibri", "spec_version": "1.0",
                "architecture": weights.metadata.get("architecture", "unknown"), "model": model,
                "quantization": quant, "provenance": {}, "tokenizer": weights.metadata.get("tokenizer")}
        return w.finalize(meta)


# --- the engine's decoder, driven directly ---------------------------------------------------------------

def kv_buffers(eng, seqs: int, capacity: int) -> KVBuffers:
    """Empty KV buffers for `seqs` sequences of up to `capacity` positions, on the engine's backend."""
    with eng.stream:
        return make_kv(eng.be, eng.args, seqs, capacity)


def decoder_pass(eng, kv: KVBuffers, chunks: list, seqs: list[int], starts: list[int],
                 all_logits: bool = False) -> np.ndarray:
    """One packed pass of `eng.decoder`: chunk j is sequence seqs[j] (a row of `kv`) at positions starts[j]...;
    host float32 logits of every row (all_logits) or of each chunk's last row."""
    chunks = [np.asarray(c, np.int64) for c in chunks]
    host = host_step(eng.args, chunks, starts, seqs, all_logits)
    T = len(host.ids)
    with eng.stream:
        inp = StepInputs(eng.be, T, eng.half)
        inp.fill(host, eng.stream)
        eng.experts.begin_token(T)
        rows = None if all_logits else eng.be.to_device(host.out_rows)
        out = eng.decoder.run(inp, kv, Workspace(eng.be), T, rows, max_len=int(host.pos.max()) + 1)
        return np.array(eng.be.to_host(out), np.float32)
