"""Canonical tensors of a Hugging Face checkpoint as whole float32 arrays, for tests.

The converter never holds a whole tensor; tests compare whole tensors. These helpers read the very spans
the converter streams (colibri_format/convert/layout.py) and join their chunks, so a test sees exactly the
converter's input under canonical names. `open_hf_checkpoint` bundles that for the runtime tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri_format.convert import layout
from colibri_format.convert.adapters import Adapter, get_adapter, normalize_config
from colibri_format.convert.layout import DenseTensor, RowSpan
from colibri_format.convert.rows import iter_chunks
from colibri_format.convert.source import SourceCheckpoint, open_checkpoint
from colibri_format.convert.tokenizer_files import read_tokenizer
from colibri_format.dtypes import to_float32


def read_rows(src: Any, spans: tuple[RowSpan, ...]) -> np.ndarray:
    """The spans' rows joined into one float32 array."""
    return np.concatenate([to_float32(chunk) for chunk in iter_chunks(src, spans)])


def read_dense(src: Any, tensor: DenseTensor) -> np.ndarray:
    return read_rows(src, (tensor.span,))


def expert_tensors(src: Any, model: dict[str, Any], adapter: Adapter, layer: int, expert: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate [I,H], up [I,H], down [H,I]) float32 for one expert of one MoE layer."""
    spans = layout.expert_spans(src, model, adapter.names, layer, expert)
    gate_up = read_rows(src, spans.gate_up)
    i_size = model["expert_intermediate_size"]
    return gate_up[:i_size], gate_up[i_size:], read_rows(src, spans.down)


@dataclass(frozen=True)
class HFCheckpoint:
    """An opened checkpoint with its normalized `model` dict and architecture record."""

    source: SourceCheckpoint
    architecture: str
    model: dict[str, Any]
    adapter: Adapter

    def dense_tensors(self) -> list[DenseTensor]:
        """Canonical dense tensors in directory order, shapes already checked against the config."""
        return layout.dense_tensors(self.source, self.model, self.adapter.names)

    def read_dense(self, tensor: DenseTensor) -> np.ndarray:
        return read_dense(self.source, tensor)

    def expert_keys(self) -> Iterator[tuple[int, int]]:
        """(layer, expert) in the file's canonical blob order."""
        for layer in self.model["moe_layers"]:
            for expert in range(self.model["num_experts"]):
                yield layer, expert

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I,H], up [I,H], down [H,I]) as float32."""
        return expert_tensors(self.source, self.model, self.adapter, layer, expert)

    def tokenizer(self) -> dict[str, Any] | None:
        return read_tokenizer(self.source.root)

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_hf_checkpoint(checkpoint_dir: str | Path, *, allow_pickle: bool = False) -> HFCheckpoint:
    """Open and normalize a Hugging Face MoE checkpoint folder (raises the ColibriFormatError family)."""
    source = open_checkpoint(checkpoint_dir, allow_pickle=allow_pickle)
    try:
        architecture, model = normalize_config(source.config.raw)
        return HFCheckpoint(source, architecture, model, get_adapter(architecture))
    except BaseException:
        source.close()
        raise
