"""Which kernel `DeviceDense.linear` runs a product on (CPU-only: the choice is plain Python on the backend's switch
and the shapes; the kernels are tested by test_dense_gemv_emulated.py and on the GPU by test_gpu_kernels.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.dense import GEMV_PASS_ROWS, DeviceDense
from tests.runtime.cuda.host_arrays import HostArray


class RowSliceable(HostArray):
    """A HostArray whose row slices are HostArrays (dense_gemv's passes slice x)."""

    def __getitem__(self, key):
        return RowSliceable(self.host[key])


def products(rows: int, *, min_rows: int, dtype=np.uint16, K: int = 64, N: int = 32) -> list[tuple[str, int]]:
    """(kernel, rows) of each launch `linear` makes for x [rows, K] and a [N, K] matrix of `dtype`."""
    calls = []
    ops = SimpleNamespace(dense_gemv=lambda x, w, bias, out: calls.append(("dense_gemv", x.shape[0])),
                          dense_gemv_tc=lambda x, w, bias, out: calls.append(("dense_gemv_tc", x.shape[0])))
    dense = DeviceDense.__new__(DeviceDense)       # its arrays set by hand: no device to upload to
    dense.be = SimpleNamespace(ops=ops, dense_tc_min_rows=min_rows)
    dense.arrays = {"w": HostArray(np.zeros((N, K), dtype))}
    dense.linear(RowSliceable(np.zeros((rows, K), np.float32)), "w", None, np.zeros((rows, N), np.float32))
    return calls


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 32])
def test_off_by_default_every_pass_of_up_to_8_rows_runs_dense_gemv(rows):
    assert limits.DG_TC_MIN_ROWS == 0
    want = [("dense_gemv", min(GEMV_PASS_ROWS, rows - t0)) for t0 in range(0, rows, GEMV_PASS_ROWS)]
    assert products(rows, min_rows=limits.DG_TC_MIN_ROWS) == want


@pytest.mark.parametrize("rows", [2, 8, 9, 32])
def test_switched_on_a_pass_of_enough_rows_is_one_tensor_core_launch(rows):
    assert products(rows, min_rows=2) == [("dense_gemv_tc", rows)]
    assert products(1, min_rows=2) == [("dense_gemv", 1)]


@pytest.mark.parametrize("dtype, K, N", [(np.float32, 64, 32), (np.float16, 64, 32), (np.uint16, 48, 32),
                                         (np.uint16, 64, 8)])
def test_matrices_the_tensor_core_kernel_cannot_take_keep_dense_gemv(dtype, K, N):
    """Not bf16, K not a multiple of 32, or fewer than 16 rows (dense_gemv's 4-row shared-gate matrix)."""
    assert products(8, min_rows=2, dtype=dtype, K=K, N=N) == [("dense_gemv", 8)]


def normed_products(rows: int, *, min_rows: int) -> list[tuple[str, int]]:
    """(kernel, rows) of each launch `normed_linear` makes for h [rows, 64] and a bf16 [32, 64] matrix."""
    calls = []
    record = lambda name: (lambda x, *a, **kw: calls.append((name, x.shape[0])))   # noqa: E731
    ops = SimpleNamespace(dense_gemv=record("dense_gemv"), dense_gemv_tc=record("dense_gemv_tc"),
                          dense_gemv_normed=record("dense_gemv_normed"),
                          dense_gemv_tc_normed=record("dense_gemv_tc_normed"))
    dense = DeviceDense.__new__(DeviceDense)
    dense.be = SimpleNamespace(ops=ops, dense_tc_min_rows=min_rows, rmsnorm=record("rmsnorm"))
    dense.arrays = {"w": HostArray(np.zeros((32, 64), np.uint16)), "norm": np.ones(64, np.float32)}
    dense._f32 = {"norm": np.ones(64, np.float32)}
    h = RowSliceable(np.zeros((rows, 64), np.float32))
    dense.normed_linear(h, "norm", 1e-6, "w", None, np.zeros((rows, 32), np.float32), h)
    return calls


@pytest.mark.parametrize("rows, min_rows, want", [
    (1, 0, [("dense_gemv_normed", 1)]), (1, 1, [("dense_gemv_normed", 1)]),     # one token: the SIMT fold
    (8, 0, [("rmsnorm", 8), ("dense_gemv", 8)]), (8, 2, [("dense_gemv_tc_normed", 8)]),
    (32, 2, [("dense_gemv_tc_normed", 32)])])
def test_normed_products_fold_the_norm_where_a_kernel_can(rows, min_rows, want):
    assert normed_products(rows, min_rows=min_rows) == want


@pytest.mark.parametrize("rows, option, cores, stored, ncols, want", [
    (33, "bf16", True, True, 64, True), (4096, "bf16", True, True, 64, True),
    (32, "bf16", True, True, 64, False),            # dense_gemv's pass: never rounded
    (20, "bf16", True, True, 60, True),             # a shape dense_gemv refuses, from BF16_SPLIT_MIN_ROWS rows
    (8, "bf16", True, True, 60, False),             # below it: f32 cuBLAS
    (33, "split", True, True, 64, False), (33, "bf16", False, True, 64, False), (33, "bf16", True, False, 64, False)])
def test_the_dense_bf16_rule(rows, option, cores, stored, ncols, want):
    """limits.rounds_dense_bf16, the one rule of DeviceDense and NumpyDense: option 'bf16', bf16 matrices on the
    tensor cores, in the passes the cuBLAS products take."""
    assert limits.rounds_dense_bf16(option, cores, rows, ncols, 32, stored) is want


def test_a_bf16_pass_is_one_rounded_product():
    calls = []
    ops = SimpleNamespace(round_bf16=lambda x: calls.append(("round_bf16", x.shape[0])) or x,
                          gemm_bf16=lambda x, w, out: calls.append(("gemm_bf16", x.shape[0])),
                          dense_gemv=lambda *a, **kw: calls.append(("dense_gemv", 0)))
    dense = DeviceDense.__new__(DeviceDense)
    dense.be = SimpleNamespace(ops=ops, dense_tc_min_rows=0, dense_gemm="bf16",
                               gemm_bf16_split=lambda *a: calls.append(("split", 0)))
    dense.bf16_gemm, dense.arrays = True, {"w": HostArray(np.zeros((32, 64), np.uint16))}
    dense.linear(RowSliceable(np.zeros((40, 64), np.float32)), "w", None, np.zeros((40, 32), np.float32))
    assert calls == [("round_bf16", 40), ("gemm_bf16", 40)]
    dense.be.dense_gemm, calls[:] = "split", []
    dense.linear(RowSliceable(np.zeros((40, 64), np.float32)), "w", None, np.zeros((40, 32), np.float32))
    assert calls == [("split", 0)]
