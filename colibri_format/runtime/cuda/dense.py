"""Dense weights on the device, uploaded once in their stored dtype, and the products that use them.

Matrices stay f32, f16 or bf16 (bf16 as raw uint16 bits) as the file stores them. Decode-sized batches (at most
`GEMV_MAX_ROWS` rows) multiply through the project's `dense_gemv` kernel in passes of `GEMV_PASS_ROWS` rows, or,
for bf16 matrices where the backend's `dense_tc_min_rows` asks for it, through `dense_gemv_tc` (the tensor cores,
every row in one launch); both read the stored dtype and can be captured in a CUDA graph, so decode steps of up to
32 sequences (colibri serve's larger batch buckets) replay as graphs. Larger batches (prefill) multiply bf16 matrices on
the tensor cores (x split into bf16 hi + lo) and others as f32 (upcast into a scratch matrix unless mirrored) on
cuBLAS through `ops.gemm_bf16` / `ops.gemm_f32`, which read each weight once however many rows and can be captured
(a prefill graph, `runner.PrefillRunner`). Vectors (norms are read
as stored by the kernels; biases, the router bias and the shared-expert gate) are kept as f32 as well.
"""

from __future__ import annotations

import numpy as np

from colibri_format.runtime.cuda.limits import (ATT_DECODE_MAX_ROWS, DG_PLANS, DG_TC_ROWS, NORMED_GEMV_MAX_ROWS,
                                                 bf16_products, dense_gemv_takes)
from colibri_format.runtime.dense import fused_dense_tensors

GEMV_PASS_ROWS = max(DG_PLANS)         # rows of one dense_gemv launch (it reads each weight once per pass)
GEMV_MAX_ROWS = ATT_DECODE_MAX_ROWS    # rows up to which dense products use dense_gemv passes (graph-capturable),
                                       # not cuBLAS: decode-sized steps, as for attention_decode
MIRROR_SHARE = 0.25  # f32 copies of the matrices (for cuBLAS) are kept if they take at most this share of free memory


def upcast(xp, w):
    """A device matrix in f32 (bf16 bits are widened exactly by a shift)."""
    if w.dtype == np.float32:
        return w
    if w.dtype == np.uint16:
        return (w.astype(xp.uint32) << 16).view(xp.float32)
    return w.astype(xp.float32)


class DeviceDense:
    """Every dense tensor of a file on the device; `{p}.gate_up` fuses a dense MLP's gate and up rows."""

    GATE_ROWS = 4

    def __init__(self, reader, be) -> None:
        self.be, self.xp = be, be.xp
        self.arrays: dict = {}
        self._f32: dict = {}
        self.mirror: dict = {}
        self.nbytes = 0
        self.bf16_gemm = be.bf16_tensor_cores     # bf16 matrices beyond GEMV_MAX_ROWS rows on the tensor cores
        for name, host in fused_dense_tensors(reader):
            if name.endswith(".shared_gate"):   # [1, H]: padded with zero rows so dense_gemv (N >= 4) takes it
                host = np.concatenate([host, np.zeros((self.GATE_ROWS - 1, host.shape[1]), host.dtype)])
            self.arrays[name] = be.to_device(np.ascontiguousarray(host))
            self.nbytes += host.nbytes
        self._make_mirror()

    def _make_mirror(self) -> None:
        """f32 copies of the matrices for cuBLAS (prefill, batches over GEMV_MAX_ROWS), if memory allows."""
        mats = {n: a for n, a in self.arrays.items() if a.ndim == 2 and a.shape[0] >= 4}
        need = sum(a.size * 4 for a in mats.values())
        if need > MIRROR_SHARE * self.be.free_memory():
            return
        for name, a in mats.items():
            self.mirror[name] = a if a.dtype == np.float32 else self.xp.ascontiguousarray(upcast(self.xp, a))

    def has(self, name: str) -> bool:
        return name in self.arrays

    def __getitem__(self, name: str):
        return self.arrays[name]

    def f32(self, name: str):
        """The tensor as f32 (kept: used for biases and other small vectors)."""
        if name not in self._f32:
            self._f32[name] = self.xp.ascontiguousarray(upcast(self.xp, self.arrays[name]))
        return self._f32[name]

    def _gemv_rows(self, x, w) -> bool:
        """Whether x's rows multiply through `dense_gemv` passes (decode-sized batches) rather than cuBLAS."""
        return dense_gemv_takes(x.shape[0], x.shape[1], w.shape[0])

    def normed_linear(self, h, norm: str, eps: float, name: str, bias: str | None, out, x_out):
        """out [T, N] f32 = rmsnorm(h; norm) @ W.T (+ bias) and x_out [T, K] f32 = rmsnorm(h): up to
        `NORMED_GEMV_MAX_ROWS` rows in one `dense_gemv_normed` launch (the norm folded into the product), passes
        `dense_gemv_tc` takes in one `dense_gemv_tc_normed` launch, other rows norm then `linear`."""
        w = self.arrays[name]
        b = self.f32(bias) if bias is not None else None
        gemv = self._gemv_rows(h, w)
        if gemv and h.shape[0] <= NORMED_GEMV_MAX_ROWS:
            return self.be.ops.dense_gemv_normed(h, self.f32(norm), eps, w, x_out=x_out, bias=b, out=out)
        if gemv and self._tensor_core_rows(h, w):
            return self.be.ops.dense_gemv_tc_normed(h, self.f32(norm), eps, w, x_out=x_out, bias=b, out=out)
        self.be.rmsnorm(h, self.arrays[norm], eps, out=x_out)
        return self.linear(x_out, name, bias, out)

    def _tensor_core_rows(self, x, w) -> bool:
        """Whether a decode-sized pass takes `dense_gemv_tc` (bf16 weights on the tensor cores, every row in one
        launch) rather than `dense_gemv` passes: passes of the backend's `dense_tc_min_rows` rows or more (0: none)."""
        T, K = x.shape
        least = self.be.dense_tc_min_rows
        return (bool(least) and T >= least and w.dtype == np.uint16 and K % 32 == 0 and w.shape[0] >= DG_TC_ROWS
                and x._c_contiguous and x.data.ptr % 16 == 0 and w.data.ptr % 16 == 0)

    def linear(self, x, name: str, bias: str | None, out):
        """out [T, N] f32 = x [T, K] f32 @ W.T (+ bias)."""
        w = self.arrays[name]
        b = self.f32(bias) if bias is not None else None
        T = x.shape[0]
        if self._gemv_rows(x, w):
            if self._tensor_core_rows(x, w):
                return self.be.ops.dense_gemv_tc(x, w, bias=b, out=out)
            for t0 in range(0, T, GEMV_PASS_ROWS):
                t1 = min(T, t0 + GEMV_PASS_ROWS)
                self.be.ops.dense_gemv(x[t0:t1], w, bias=b, out=out[t0:t1])
            return out
        if not bf16_products(self.bf16_gemm, T, x.shape[1], w.shape[0], w.dtype == np.uint16):
            w32 = self.mirror.get(name)
            w32 = w32 if w32 is not None else upcast(self.xp, w)
            if x._c_contiguous and out._c_contiguous:
                self.be.ops.gemm_f32(x, w32, out)       # capturable
            else:                                       # strided views: CuPy's matmul (a capture then fails: eager)
                self.xp.matmul(x, w32.T, out=out)
        elif self.be.dense_gemm == "bf16":              # limits.rounds_dense_bf16: one product of x rounded
            self.be.ops.gemm_bf16(self.be.ops.round_bf16(x), w, out)
        else:
            self.be.gemm_bf16_split(x, w, out)
        if b is not None:
            out += b
        return out
