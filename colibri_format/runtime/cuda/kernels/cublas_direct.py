"""cublasGemmEx through cuBLAS's C API (ctypes), on a handle of our own, so that its products can be captured in a
CUDA graph.

CuPy's cuBLAS wrappers set the handle's stream inside every call and refuse to do so while a stream is capturing
(NotImplementedError), which kept every pass with a dense product out of a graph. Here the stream and the workspace
are set only when the stream changes (host-side settings, legal during a capture, which the eager pass before a
capture has already made), and each stream gets a workspace of its own, made on its first product: cuBLAS then
allocates nothing during a capture, and two streams never share scratch. The caller passes the cupy module (this
module imports it nowhere: the package imports without CuPy).
"""

from __future__ import annotations

import ctypes
import ctypes.util

WORKSPACE_BYTES = 32 << 20      # cuBLAS's recommended workspace on Hopper

_c_int, _vp = ctypes.c_int, ctypes.c_void_p
_GEMM_EX_ARGS = [_vp, _c_int, _c_int, _c_int, _c_int, _c_int, _vp, _vp, _c_int, _c_int, _vp, _c_int, _c_int, _vp,
                 _vp, _c_int, _c_int, _c_int, _c_int]


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than success."""


def _check(status: int, call: str) -> None:
    if status:
        raise CublasError(f"{call} failed with cuBLAS status {status}")


def _loaded_cublas() -> str:
    """The path of the libcublas CuPy loaded (the same library, not a second copy), else the linker's."""
    from cupy_backends.cuda.libs import cublas  # noqa: F401, PLC0415 -- loads libcublas into the process

    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return path
    found = ctypes.util.find_library("cublas")
    if found is None:
        raise CublasError("libcublas is not loaded and cannot be found")
    return found


class Handle:
    """One device's cuBLAS handle (the current device when made), with a workspace per stream it has run on."""

    def __init__(self, cp) -> None:
        self.cp = cp
        self.lib = ctypes.CDLL(_loaded_cublas())
        self._gemm = self.lib.cublasGemmEx
        self._gemm.argtypes, self._gemm.restype = _GEMM_EX_ARGS, _c_int
        handle = _vp()
        _check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self._workspaces: dict[int, object] = {}
        self._stream: int | None = None

    def use_stream(self, stream_ptr: int) -> None:
        """Make `stream_ptr` the handle's stream, with its own workspace (setStream resets the workspace: set
        after it). A stream's first use allocates its workspace: an eager call, never inside a capture."""
        if stream_ptr == self._stream:
            return
        cp = self.cp
        ws = self._workspaces.get(stream_ptr)
        if ws is None:
            if cp.cuda.runtime.streamIsCapturing(stream_ptr):
                raise CublasError("a cuBLAS product's first call on a stream is inside a graph capture: run the "
                                  "pass once eagerly first")
            ws = self._workspaces[stream_ptr] = cp.empty(WORKSPACE_BYTES, cp.uint8)
        _check(self.lib.cublasSetStream_v2(self.handle, _vp(stream_ptr)), "cublasSetStream")
        _check(self.lib.cublasSetWorkspace_v2(self.handle, _vp(ws.data.ptr), ctypes.c_size_t(WORKSPACE_BYTES)),
               "cublasSetWorkspace")
        self._stream = stream_ptr

    def release(self, stream_ptr: int) -> None:
        """Free `stream_ptr`'s workspace: the caller has synchronized that stream and runs no more products on it
        (an engine closing). The handle is set again, stream and workspace, before its next product."""
        self._workspaces.pop(stream_ptr, None)
        if stream_ptr == self._stream:
            self._stream = None

    def gemm_ex(self, stream_ptr: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
                a_type: int, lda: int, b: int, b_type: int, ldb: int, beta: int, c: int, c_type: int, ldc: int,
                compute: int, algo: int) -> None:
        """cublasGemmEx on `stream_ptr` (column-major, as cuBLAS; alpha and beta: host addresses, the handle's
        default host pointer mode; a, b, c: device addresses)."""
        self.use_stream(stream_ptr)
        _check(self._gemm(self.handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c,
                          c_type, ldc, compute, algo), "cublasGemmEx")


_HANDLES: dict[int, Handle] = {}


def handle(cp) -> Handle:
    """The current device's handle (made on first use); cp: the cupy module."""
    dev = cp.cuda.runtime.getDevice()
    h = _HANDLES.get(dev)
    if h is None:
        h = _HANDLES[dev] = Handle(cp)
    return h


def release(cp, stream_ptr: int) -> None:
    """`Handle.release` on the current device's handle, if it has one."""
    h = _HANDLES.get(cp.cuda.runtime.getDevice())
    if h is not None:
        h.release(stream_ptr)
