"""The CUDA engine's one door to CuPy: arrays, streams, events, copies, host registration, graph capture.

Every device call of the CUDA engine goes through a `Backend`, so that the engine's logic (buffers, paging
bookkeeping, graph fallback) can also run on the CPU in tests with a NumPy stand-in (tests/runtime/fake_cuda.py)
that has the same methods. CuPy is imported only here and in `kernels/ops.py`, and only when a backend is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_format.errors import InvalidInput

HOST_REGISTER_READ_ONLY = 8     # cudaHostRegisterReadOnly: lets a PROT_READ file mapping be pinned
MEMCPY_HOST_TO_DEVICE = 1       # cudaMemcpyHostToDevice
CUDA_R_32F, CUDA_R_16BF = 0, 14         # cudaDataType
CUBLAS_COMPUTE_32F = 68                 # cublasComputeType_t: fp32 accumulation
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0


class CupyBackend:
    """The real thing: CuPy arrays on one device, the kernels of `runtime/cuda/kernels/ops.py`."""

    name = "cupy"

    def __init__(self, device_id: int = 0) -> None:
        import cupy  # noqa: PLC0415 -- optional dependency, GPU machines only

        from colibri_format.runtime.cuda.kernels import ops  # noqa: PLC0415

        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device_id < count:
            raise InvalidInput(f"device_id {device_id} does not exist ({count} CUDA devices)", field="device_id",
                               value=device_id)
        self.xp = cupy
        self.ops = ops
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        self.host_stream = None    # the engine's compute stream: device-to-host reads are ordered after it
        ops.warm_up()   # compile and load every kernel module now: loading cannot happen inside a capture

    # --- arrays -------------------------------------------------------------------------------------------
    def ptr(self, a) -> int:
        return int(a.data.ptr)

    def to_device(self, a: np.ndarray):
        return self.xp.asarray(np.ascontiguousarray(a))

    def to_host(self, a) -> np.ndarray:
        """A blocking copy ordered after the compute stream's work (the streams do not wait on the null one)."""
        return a.get(stream=self.host_stream or self.xp.cuda.get_current_stream())

    def synchronize(self) -> None:
        self.device.synchronize()

    def set_from_host(self, dst, src: np.ndarray, stream) -> None:
        """Copy a small host array into an existing device array on `stream` (ordered with its kernels)."""
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape), stream=stream)

    def free_memory(self) -> int:
        return int(self.device.mem_info[0]) + int(self.xp.get_default_memory_pool().free_bytes())

    # --- products -------------------------------------------------------------------------------------------
    def gemm_bf16_split(self, x, w, out, hi=None, lo=None):
        """out [T, N] f32 = x [T, K] f32 @ w.T for w [N, K] bf16 bits (uint16), on the tensor cores.

        x is split into bf16 hi + lo (`ops.split_bf16`) and the two products are accumulated in fp32 by cuBLAS
        (GemmEx, CUBLAS_COMPUTE_32F): w is exact in bf16, x keeps ~16 mantissa bits, so the result matches the
        fp32 product to ~1e-5 relative. Not capturable in a graph through CuPy (eager passes only).
        """
        try:
            from cupy_backends.cuda.libs import cublas  # noqa: PLC0415
        except ImportError:  # older layouts
            from cupy.cuda import cublas  # noqa: PLC0415

        T, K = x.shape
        N = w.shape[0]
        if w.dtype != np.uint16 or w.shape[1] != K or out.shape != (T, N) or out.dtype != np.float32:
            raise ValueError(f"gemm_bf16_split: x {x.shape}, w {w.shape} {w.dtype}, out {out.shape} {out.dtype}")
        hi, lo = self.ops.split_bf16(x, hi=hi, lo=lo)
        handle = getattr(self.device, "cublas_handle", None) or self.xp.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        try:
            # column-major view: out^T [N, T] = w [N, K] (row-major = col-major K x N, transposed) @ x^T [K, T]
            for part, beta in ((hi, zero), (lo, one)):
                cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, one.ctypes.data, w.data.ptr, CUDA_R_16BF,
                              K, part.data.ptr, CUDA_R_16BF, K, beta.ctypes.data, out.data.ptr, CUDA_R_32F, N,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, mode)
        return out

    # --- streams, events ------------------------------------------------------------------------------------
    def new_stream(self):
        return self.xp.cuda.Stream(non_blocking=True)

    def record(self, stream):
        return stream.record()

    def timing_event(self, stream):
        ev = self.xp.cuda.Event()
        ev.record(stream)
        return ev

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return float(self.xp.cuda.get_elapsed_time(start, end))

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def sync_event(self, event) -> None:
        event.synchronize()

    def event_done(self, event) -> bool:
        return bool(event.done)

    # --- host memory ----------------------------------------------------------------------------------------
    def register_host(self, addr: int, nbytes: int) -> None:
        """Pin a read-only file mapping in place (raises on failure; the caller falls back to staging)."""
        self.xp.cuda.runtime.hostRegister(addr, nbytes, HOST_REGISTER_READ_ONLY)

    def unregister_host(self, addr: int) -> None:
        self.xp.cuda.runtime.hostUnregister(addr)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        mem = self.xp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, np.uint8, nbytes)

    def copy_htod(self, dst_ptr: int, src_ptr: int, nbytes: int, stream) -> None:
        self.xp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, MEMCPY_HOST_TO_DEVICE, stream.ptr)

    # --- graphs ---------------------------------------------------------------------------------------------
    def capture(self, stream, fn):
        """Record fn()'s launches on `stream` into a graph; on any error the capture is ended and re-raised."""
        stream.begin_capture()
        try:
            fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 -- the capture is already invalid; the first error matters
                pass
            raise
        return stream.end_capture()

    def launch(self, graph, stream) -> None:
        graph.launch(stream)


_FACTORY: Any = None


def set_backend_factory(factory) -> None:
    """Tests: build backends with `factory(device_id)` instead of CuPy (None restores CuPy)."""
    global _FACTORY
    _FACTORY = factory


def make_backend(device_id: int = 0):
    if _FACTORY is not None:
        return _FACTORY(device_id)
    return CupyBackend(device_id)
