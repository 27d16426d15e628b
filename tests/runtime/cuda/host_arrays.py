"""A stand-in for the CuPy arrays the kernel wrappers (`kernels/ops.py`) check, over NumPy arrays: tests of the
wrappers' host logic without a GPU."""

from __future__ import annotations

import types

import numpy as np


class HostArray:
    """What ops._check and gemm_int8_experts read of a CuPy array, over a NumPy array."""

    def __init__(self, a: np.ndarray) -> None:
        self.host = np.ascontiguousarray(a)
        self.dtype, self.shape, self.ndim, self.flags = self.host.dtype, self.host.shape, self.host.ndim, self.host.flags
        self._c_contiguous = self.host.flags.c_contiguous      # what ops._check reads (CuPy's own attribute)
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data, device_id=0)

    @property
    def size(self) -> int:
        return self.host.size
