"""common.cuh's transposed warp reductions on the CPU (cuda_host_emulation.py: a fiber a lane, shuffles emulated)
against NumPy sums: `warp_sums` (every lane gets every sum, the same bits in every lane), `warp_sums_store` (each sum
stored once) and `warp_item_sums` (each output of a GEMV item emitted exactly once, a gate row with its up row's
sum), for value counts from 1 to 64 and counts that are not powers of two. The kernels that use them
(attention_decode, the router, dense_gemv, the expert GEMVs) have their own emulated tests."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.cuda.cuda_host_emulation import GXX, WARP_ITEM_SHAPES, WARP_SUMS_COUNTS, _ptr, build_layers
from tests.runtime.cuda.test_dense_gemv_emulated import relerr

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")
TOL = 1e-6


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_layers(tmp_path_factory.mktemp("layers_warp"))


def lane_values(rng, *shape) -> np.ndarray:
    """[32, *shape] float32 values of mixed signs and magnitudes (a sum's order shows in its rounding)."""
    return (rng.standard_normal((32, *shape)) * 10.0 ** rng.integers(-3, 4, (32, *shape))).astype(np.float32)


@pytest.mark.parametrize("n", WARP_SUMS_COUNTS)
def test_warp_sums_and_their_store(lib, n):
    rng = np.random.default_rng(n)
    v = lane_values(rng, n)
    sums = np.full((32, n), np.nan, np.float32)
    stored = np.full(n, np.nan, np.float32)
    getattr(lib, f"emu_warp_sums_{n}")(_ptr(v), _ptr(sums), _ptr(stored))
    assert int(lib.emu_error_count()) == 0
    exp = v.astype(np.float64).sum(0)
    assert relerr(sums[0], exp) < TOL
    assert (sums.view(np.uint32) == sums[0].view(np.uint32)).all(), "lanes disagree"
    assert np.array_equal(stored.view(np.uint32), sums[0].view(np.uint32))


@pytest.mark.parametrize("rows,tokens,gate_up", WARP_ITEM_SHAPES, ids=lambda s: str(s))
def test_warp_item_sums_emits_each_output_once(lib, rows, tokens, gate_up):
    rng = np.random.default_rng(rows * 10 + tokens)
    v = lane_values(rng, rows, tokens)
    n = rows * tokens
    a = np.full(n, np.nan, np.float32)
    b = np.full(n, np.nan, np.float32)
    counts = np.zeros(n, np.int32)
    fn = getattr(lib, f"emu_warp_item_sums_{rows}_{tokens}_{str(gate_up).lower()}")
    fn(_ptr(v), _ptr(a), _ptr(b), _ptr(counts))
    assert int(lib.emu_error_count()) == 0
    exp = v.astype(np.float64).sum(0)                        # [rows, tokens]
    outs = rows // 2 if gate_up else rows
    emitted = counts.reshape(rows, tokens)
    assert (emitted[:outs] == 1).all() and (emitted[outs:] == 0).all(), emitted
    assert relerr(a.reshape(rows, tokens)[:outs], exp[:outs]) < TOL
    if gate_up:
        assert relerr(b.reshape(rows, tokens)[:outs], exp[outs:]) < TOL
    else:
        assert (b.reshape(rows, tokens)[:outs] == 0).all()

