"""dispatch.cu's moe_dispatch on the CPU (cuda_host_emulation.py: the kernel source built with g++, a fiber per CUDA
thread, warp match masks and shuffles emulated) against kernel_expectations.dispatch_grouping, the stable grouping of
the (token, slot) pairs by expert that every expert kernel reads: counts, offsets, perm, inv, the active list, the
prefill GEMM's tile lists and the count of ids out of range. The GPU tests are in test_gpu_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime.cuda import limits
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GXX, DispatchEmulator, build_dispatch

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return DispatchEmulator(build_dispatch(tmp_path_factory.mktemp("dispatch_host")))


# (pairs, experts): one chunk of the block's threads, several chunks with a partial last one, Qwen3-like top-8 of 128
# over 96 tokens, a single expert, more experts than pairs
CASES = [(40, 8), (3 * limits.DISPATCH_THREADS + 17, 16), (96 * 8, 128), (300, 1), (5, 64)]


@pytest.mark.parametrize("spread", [None, (1, 1 << 20), "blocks"])
@pytest.mark.parametrize("pairs,experts", CASES)
def test_dispatch_is_the_stable_grouping(emulator, pairs, experts, spread):
    """One block (moe_dispatch), and the three launches over one block or over several (limits.dispatch_blocks'
    grid, a partial last chunk, the ranking blocks in a shuffled order): the same outputs."""
    rng = np.random.default_rng(pairs + experts)
    ids = rng.integers(0, experts, pairs).astype(np.int32)
    if spread == "blocks":
        spread = limits.dispatch_blocks(pairs, multiprocessors=3, min_pairs=1)
    got = emulator.dispatch(ids, experts, blocks=spread, order=5)
    assert emulator.errors() == (0, "")
    want = expect.dispatch_grouping(ids, experts, limits.GEMM_BM)
    for name in ("counts", "offsets", "perm", "inv"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    n_active, n_tiles = len(want["active"]), len(want["tile_expert"])
    np.testing.assert_array_equal(got["active"][:n_active], want["active"])
    assert (got["active"][n_active:] == -1).all()
    np.testing.assert_array_equal(got["tile_expert"][:n_tiles], want["tile_expert"])
    np.testing.assert_array_equal(got["tile_start"][:n_tiles], want["tile_start"])
    assert (got["tile_expert"][n_tiles:] == -1).all()
    assert list(got["meta"][:3]) == [n_active, n_tiles, 0]


def test_ids_out_of_range_are_counted_and_left_out(emulator):
    """Ids outside [0, E) (here -1, 8 and 9 with 8 experts) are counted in meta[2], get no position (inv -1) and
    leave the others' grouping as if they were not there."""
    ids = np.array([3, -1, 0, 9, 3, 2, 8, 1] * 3, np.int32)[:20]
    got = emulator.dispatch(ids, 8, blocks=(3, 7))
    assert emulator.errors() == (0, "")
    assert got["meta"][2] == np.count_nonzero((ids < 0) | (ids >= 8))
    ids = np.array([3, -1, 0, 9, 3, 2, 8, 1], np.int32)
    got = emulator.dispatch(ids, 8)
    assert emulator.errors() == (0, "")
    assert got["meta"][2] == 3
    valid = np.flatnonzero((ids >= 0) & (ids < 8))
    want = expect.dispatch_grouping(ids[valid], 8, limits.GEMM_BM)
    np.testing.assert_array_equal(got["counts"], want["counts"])
    np.testing.assert_array_equal(got["offsets"], want["offsets"])
    np.testing.assert_array_equal(got["perm"][:valid.size], valid[want["perm"]])
    assert (got["inv"][[1, 3, 6]] == -1).all()
    np.testing.assert_array_equal(got["inv"][valid], want["inv"])
