"""The host emulation itself (cuda_host_shim.h): a block's threads as fibers meet at __syncthreads with their own
threadIdx, and a barrier some threads never reach is reported instead of hanging."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.runtime.cuda.cuda_host_emulation import GXX, LibraryEmulator, _compile

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

SOURCE = '#include "cuda_host_shim.h"\n' + r"""
extern "C" void reverse_in_shared(int* out) {      // every thread writes its index, meets, reads its mirror's
    emu_launch({3, 1, 1}, 64, 0, [out] {
        __shared__ int seen[64];
        seen[threadIdx.x] = 100 * blockIdx.x + threadIdx.x;
        __syncthreads();
        out[64 * blockIdx.x + threadIdx.x] = seen[63 - threadIdx.x];
    });
}

extern "C" void unbalanced_barrier() {             // thread 0 leaves; the others wait for it
    emu_launch({1, 1, 1}, 64, 0, [] {
        if (threadIdx.x == 0) return;
        __syncthreads();
    });
}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("shim"), "shim_check", SOURCE, [])


def test_threads_meet_at_the_block_barrier(library):
    out = np.full(192, -1, np.int32)
    library.reverse_in_shared(ctypes.c_void_p(out.ctypes.data))
    want = np.concatenate([100 * b + np.arange(63, -1, -1) for b in range(3)])
    np.testing.assert_array_equal(out, want)
    assert LibraryEmulator(library).errors() == (0, "")


def test_a_barrier_some_threads_never_reach_is_reported(library):
    library.unbalanced_barrier()
    count, text = LibraryEmulator(library).errors()
    assert count == 1 and "deadlock" in text
