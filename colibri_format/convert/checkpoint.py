"""`open_hf_checkpoint`: one call that gives the conversion pipeline everything from the HF side.

It opens the weights, normalizes config.json through the architecture's adapter,
and then exposes dense tensors and experts under canonical names only, so the
pipeline never sees a Hugging Face tensor name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri_format.convert.arch import Adapter, get_adapter
from colibri_format.convert.arch.common import DenseTensor, dense_shape, read_dense
from colibri_format.convert.hf_config import normalize_config
from colibri_format.convert.source import SourceCheckpoint, open_checkpoint
from colibri_format.convert.tokenizer_files import read_tokenizer


@dataclass(frozen=True)
class HFCheckpoint:
    """An opened checkpoint with its normalized `model` dict and adapter."""

    source: SourceCheckpoint
    architecture: str
    model: dict[str, Any]
    adapter: Adapter

    @property
    def weights_dtype(self) -> str:
        """Storage dtype of the embedding ('bfloat16', 'float16', 'float32'): a default for the file's dense dtype."""
        return self.source.dtype("model.embed_tokens.weight")

    def dense_tensors(self) -> list[DenseTensor]:
        """Canonical dense tensors in directory order, shapes already checked against the config."""
        return self.adapter.dense_tensors(self.source, self.model)

    def dense_shape(self, tensor: DenseTensor) -> tuple[int, ...]:
        return dense_shape(self.source, tensor)

    def read_dense(self, tensor: DenseTensor) -> np.ndarray:
        return read_dense(self.source, tensor)

    def expert_keys(self) -> Iterator[tuple[int, int]]:
        """(layer, expert) in the file's canonical blob order."""
        for layer in self.model["moe_layers"]:
            for expert in range(self.model["num_experts"]):
                yield layer, expert

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I,H], up [I,H], down [H,I]) as float32."""
        return self.adapter.expert_tensors(self.source, self.model, layer, expert)

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
