"""cublas_direct's stream and workspace bookkeeping, checked without a GPU: CuPy and the cuBLAS library are stood in
for, recording what would be set. The products themselves run on the GPU (test_gpu_moe_gemm_cublas.py, and every
prefill of the engine tests)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from colibri_format.runtime.cuda.kernels import cublas_direct


class FakeLib:
    def __init__(self) -> None:
        self.calls = []
        self.status = 0

    def cublasSetStream_v2(self, handle, stream):
        self.calls.append(("stream", stream.value))
        return self.status

    def cublasSetWorkspace_v2(self, handle, ptr, size):
        self.calls.append(("workspace", ptr.value, size.value))
        return 0


def fake_handle(capturing=()):
    addresses = itertools.count(4096, 4096)
    cp = SimpleNamespace(uint8="uint8", empty=lambda n, dtype: SimpleNamespace(data=SimpleNamespace(ptr=next(addresses))),
                         cuda=SimpleNamespace(runtime=SimpleNamespace(streamIsCapturing=lambda s: s in capturing,
                                                                      getDevice=lambda: 0)))
    h = object.__new__(cublas_direct.Handle)
    h.cp, h.lib, h.handle, h._workspaces, h._stream = cp, FakeLib(), None, {}, None
    return h


def test_a_stream_is_set_once_with_a_workspace_of_its_own():
    h = fake_handle()
    h.use_stream(7)
    h.use_stream(7)
    h.use_stream(9)
    size = cublas_direct.WORKSPACE_BYTES
    assert h.lib.calls == [("stream", 7), ("workspace", 4096, size), ("stream", 9), ("workspace", 8192, size)]
    h.use_stream(7)                               # back to 7: its own workspace again, none made
    assert h.lib.calls[-1] == ("workspace", 4096, size) and len(h._workspaces) == 2


def test_a_released_stream_frees_its_workspace_and_the_handle_is_set_again():
    h = fake_handle()
    h.use_stream(7)
    h.release(7)
    assert h._workspaces == {} and h._stream is None
    h.use_stream(7)                               # a new stream at that address: a new workspace, set again
    assert h.lib.calls[-2:] == [("stream", 7), ("workspace", 8192, cublas_direct.WORKSPACE_BYTES)]
    h.release(12345)                              # a stream it never ran on: nothing to do
    assert h._stream == 7


def test_no_workspace_is_made_inside_a_capture():
    h = fake_handle(capturing={7})
    with pytest.raises(cublas_direct.CublasError, match="inside a graph capture"):
        h.use_stream(7)
    assert h.lib.calls == [] and h._workspaces == {}


def test_a_failed_call_names_it():
    h = fake_handle()
    h.lib.status = 7
    with pytest.raises(cublas_direct.CublasError, match="cublasSetStream failed with cuBLAS status 7"):
        h.use_stream(3)
