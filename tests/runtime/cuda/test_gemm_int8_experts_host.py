"""ops.gemm_int8_experts' cuBLAS arguments, checked without a GPU: CuPy and cuBLAS are stood in for by host arrays
(their "device pointers" are the NumPy buffers' addresses) and a GemmEx that computes the column-major product its
arguments describe, so the expert blobs' offsets, the row offsets of each routed expert and the leading dimensions
are exercised exactly as cuBLAS would read them. The real call is tested on the GPU in test_gpu_moe_gemm_cublas.py."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda.host_arrays import HostArray
from tests.runtime.cuda.synthetic_experts import blob_array, host_experts


def _view(ptr: int, dtype, count: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(ptr), dtype)


class RecordingCublas:
    """cublas_direct.Handle's gemm_ex computing C = alpha op(A) op(B) + beta C (column-major, int8 in, int32 out)
    on host memory."""

    def __init__(self) -> None:
        self.calls = []

    def gemm_ex(self, stream, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc,
                compute, algo):
        assert (transa, transb, a_type, b_type, c_type, compute) == (ops.CUBLAS_OP_T, ops.CUBLAS_OP_N, ops.CUDA_R_8I,
                                                                     ops.CUDA_R_8I, ops.CUDA_R_32I,
                                                                     ops.CUBLAS_COMPUTE_32I)
        assert stream == 77                         # the current stream's
        self.calls.append((m, n, k))
        op_a = _view(a, np.int8, lda * m).reshape(m, lda)[:, :k].astype(np.int64)     # A^T: A is k x m, lda
        b_mat = _view(b, np.int8, ldb * n).reshape(n, ldb)[:, :k].T.astype(np.int64)  # k x n
        c_view = _view(c, np.int32, ldc * n).reshape(n, ldc)                         # C: m x n, ldc
        one, zero = int(_view(alpha, np.int32, 1)[0]), int(_view(beta, np.int32, 1)[0])
        product = one * (op_a @ b_mat) + zero * c_view[:, :m].T.astype(np.int64)
        c_view[:, :m] = product.T.astype(np.int32)


@pytest.fixture
def host_cuda(monkeypatch):
    cublas = RecordingCublas()
    fake = types.SimpleNamespace(
        ndarray=HostArray,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=77)))
    monkeypatch.setattr(ops, "_cupy", lambda: fake)
    monkeypatch.setattr(ops.cublas_direct, "handle", lambda cp: cublas)
    return cublas


@pytest.mark.parametrize("matrix", ["gate_up", "down"])
def test_each_routed_expert_multiplies_its_rows_by_its_blob(host_cuda, matrix):
    rng = np.random.default_rng(3)
    layout, _, blobs = host_experts(rng, 3, 160, 48)
    addresses = np.array([blobs.ctypes.data + e * layout.size for e in range(3)], np.uint64)
    table = ops.ExpertTable.from_layout(addresses, layout)
    K, N = (160, 96) if matrix == "gate_up" else (48, 160)
    a = rng.integers(-127, 128, (11, K), dtype=np.int8)
    out = HostArray(np.full((11, N), -1, np.int32))
    routed = [(2, 0, 4), (0, 4, 6), (1, 10, 1)]
    ops.gemm_int8_experts(HostArray(a), out, table, addresses, matrix, routed)
    assert host_cuda.calls == [(N, n, K) for _, _, n in routed]
    for e, s, n in routed:
        want = a[s:s + n].astype(np.int64) @ blob_array(blobs, layout, e, matrix, np.int8).T.astype(np.int64)
        np.testing.assert_array_equal(out.host[s:s + n], want)


@pytest.mark.parametrize("routed, match", [([(0, 8, 4)], "do not fit"), ([(3, 0, 1)], "do not fit"),
                                           ([(0, -1, 2)], "do not fit")])
def test_rows_outside_the_arrays_are_refused_before_any_call(host_cuda, routed, match):
    rng = np.random.default_rng(4)
    layout, _, blobs = host_experts(rng, 3, 160, 48)
    addresses = np.array([blobs.ctypes.data + e * layout.size for e in range(3)], np.uint64)
    table = ops.ExpertTable.from_layout(addresses, layout)
    a, out = HostArray(np.zeros((11, 160), np.int8)), HostArray(np.zeros((11, 96), np.int32))
    with pytest.raises(ValueError, match=match):
        ops.gemm_int8_experts(a, out, table, addresses, "gate_up", routed)
    with pytest.raises(ValueError, match="K = 160"):
        ops.gemm_int8_experts(HostArray(np.zeros((11, 48), np.int8)), out, table, addresses, "gate_up", [])
    assert host_cuda.calls == []
