"""Where the engine's numbers come from: one small protocol, two implementations.

`FileWeights` wraps an open `.colibri` reader; `DictWeights` holds plain arrays so that unit tests can build a
model without writing a file. Both hand out float32: dense tensors are upcast once and cached, experts are
dequantized on every call (caching experts is the expert cache's job, not this layer's).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from colibri_format.errors import InvalidInput

ExpertArrays = tuple[np.ndarray, np.ndarray]  # (gate_up f32 [2I, H], down f32 [H, I])


@runtime_checkable
class WeightProvider(Protocol):
    model: dict[str, Any]      # metadata["model"]
    metadata: dict[str, Any]   # the whole metadata object (tokenizer, quantization, ...)

    def dense(self, name: str) -> np.ndarray: ...
    def has(self, name: str) -> bool: ...
    def expert(self, layer: int, expert: int) -> ExpertArrays: ...
    def expert_nbytes(self, layer: int, expert: int) -> int: ...
    def close(self) -> None: ...


class _DenseCache:
    """Upcasts each dense tensor to float32 once; later calls return the same array."""

    def __init__(self) -> None:
        self._f32: dict[str, np.ndarray] = {}

    def get(self, name: str, load) -> np.ndarray:
        if name not in self._f32:
            self._f32[name] = np.ascontiguousarray(load(name), dtype=np.float32)
        return self._f32[name]


class DictWeights:
    """Weights held in memory: `dense[name]` arrays and `experts[(layer, e)] = (gate_up, down)`."""

    def __init__(self, model: dict[str, Any], dense: dict[str, np.ndarray],
                 experts: dict[tuple[int, int], ExpertArrays], metadata: dict[str, Any] | None = None) -> None:
        self.model = model
        self.metadata = metadata if metadata is not None else {"model": model, "tokenizer": None}
        self._dense = dense
        self._experts = experts
        self._cache = _DenseCache()

    def dense(self, name: str) -> np.ndarray:
        if name not in self._dense:
            raise InvalidInput(f"no dense tensor named {name!r}", field="dense", value=name)
        return self._cache.get(name, self._dense.__getitem__)

    def has(self, name: str) -> bool:
        return name in self._dense

    def expert(self, layer: int, expert: int) -> ExpertArrays:
        gate_up, down = self._experts[(layer, expert)]
        return np.asarray(gate_up, np.float32), np.asarray(down, np.float32)

    def expert_nbytes(self, layer: int, expert: int) -> int:
        return sum(a.nbytes for a in self._experts[(layer, expert)])

    def close(self) -> None:
        pass


class FileWeights:
    """Weights read from a `.colibri` file through `colibri_format.open` (zero-copy views, lazy verification)."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.model = reader.model
        self.metadata = reader.metadata
        self._cache = _DenseCache()

    @classmethod
    def open(cls, path: str, verify: str = "first-use") -> "FileWeights":
        import colibri_format  # late: the reader package imports the runtime's siblings, not the reverse

        return cls(colibri_format.open(path, verify=verify))

    def dense(self, name: str) -> np.ndarray:
        return self._cache.get(name, self._reader.dense_f32)

    def has(self, name: str) -> bool:
        return self._reader.has_dense(name)

    def expert(self, layer: int, expert: int) -> ExpertArrays:
        return self._reader.expert_f32(layer, expert)

    def expert_nbytes(self, layer: int, expert: int) -> int:
        return len(self._reader.expert_blob(layer, expert))  # the whole blob: what one paging transfer moves

    def close(self) -> None:
        self._cache = _DenseCache()  # drop views into the map so that closing can unmap it
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()
