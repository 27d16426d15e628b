"""Fallback reader for `pytorch_model*.bin` (pickled) checkpoints.

Pickles can run code, so this path is opt-in (`allow_pickle=True`) and uses
`torch.load(weights_only=True, mmap=True)`, which only rebuilds tensors and
maps their storage instead of reading it. torch is imported here only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from colibri_format.errors import InvalidInput, UnsupportedModel

MIN_TORCH = (2, 10)  # weights_only hardening (CVE-2025-32434 and later fixes)
_FLOAT_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                "torch.float64": "float64"}


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise UnsupportedModel("reading pytorch_model*.bin needs torch; convert to safetensors first") from exc
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        raise UnsupportedModel(f"reading pickled checkpoints needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} "
                               f"(found {torch.__version__})")
    return torch


class TorchBinFile:
    """One pickled state dict, memory-mapped, tensors checked on load."""

    def __init__(self, path: Path, display_name: str) -> None:
        self.name = display_name
        self.size = path.stat().st_size
        torch = _torch()
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many types for a bad or hostile pickle
            raise InvalidInput(f"{display_name}: not a loadable weights-only torch checkpoint: {exc}") from exc
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise InvalidInput(f"{display_name}: expected a flat dict of name -> tensor")
        self._state = state

    def __contains__(self, name: str) -> bool:
        return name in self._state

    @property
    def names(self) -> list[str]:
        return list(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def dtype(self, name: str) -> str:
        return _FLOAT_NAMES.get(str(self._state[name].dtype), str(self._state[name].dtype))

    def native_view(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bfloat16 as uint16 bit patterns): a read-only NumPy view of the tensor
        torch mapped, copying nothing, so slicing it reads only those rows, as with safetensors. (A copy per call
        would copy a fused [E, 2I, H] expert tensor once per expert: E times the tensor for each one.)"""
        torch = _torch()
        tensor = self._state[name]
        if str(tensor.dtype) not in _FLOAT_NAMES:
            raise UnsupportedModel(f"{self.name}: tensor {name!r} has dtype {tensor.dtype}", field=name)
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        view = tensor.numpy()
        if tensor.dtype == torch.int16:
            view = view.view(np.uint16)
        view = view.view()  # a view of our own: marking it read-only leaves torch's array as it was
        view.flags.writeable = False
        return view

    def close(self) -> None:
        self._state = {}
