"""moe_gemm_cublas.cu on the CPU (cuda_host_emulation.py: its kernels built with g++, a thread per CUDA thread): the
gather of the pairs' rows into bf16, the exact widening of int8 matrices, the two epilogues around cuBLAS's
products, and the W8A8 route's row quantizer, int8 gather and epilogues, against NumPy (kernel_expectations,
numpy_backend) over one and several blocks (the grid-stride loops). The GPU tests, cuBLAS's products included, are
in test_gpu_moe_gemm_cublas.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import to_float32
from colibri_format.runtime import numpy_backend as nb
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GXX, GlueEmulator, build_glue
from tests.runtime.cuda.synthetic_experts import blob_array, host_experts

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return build_glue(tmp_path_factory.mktemp("moe_gemm_cublas_host"))


@pytest.fixture(params=[1, 3], ids=["1-block", "3-blocks"])
def emulator(library, request):
    return GlueEmulator(library, blocks=request.param)


def experts(rng, E: int, H: int, I: int):
    """(layout, host blobs, their addresses uint64 [E])."""
    layout, _, blobs = host_experts(rng, E, H, I)
    return layout, blobs, np.array([blobs.ctypes.data + e * layout.size for e in range(E)], np.uint64)


@pytest.mark.parametrize("split", [True, False])
def test_gather_rows(emulator, split):
    """bf16 rows in sorted order, or (split) each expert's hi rows then its lo rows, experts without rows included."""
    rng = np.random.default_rng(1)
    T, k, H = 29, 3, 52
    x = rng.standard_normal((T, H)).astype(np.float32) * 7
    perm = rng.permutation(T * k).astype(np.int32)[:80]         # fewer pairs than T * k: a partial routing
    offsets = np.array([0, 0, 17, 18, 18, 61, 80], np.int32)
    out = np.full(((2 if split else 1) * 80, H), 0xFFFF, np.uint16)
    emulator.gather(x, perm, k, offsets if split else None, out)
    assert emulator.errors() == (0, "")
    rows = x[perm // k]
    want = expect.stacked_split_bf16(rows, offsets) if split else expect.split_bf16(rows)[0]
    assert np.array_equal(out, want)


@pytest.mark.parametrize("name", ["gate_up", "down"])
def test_widening_is_exact(emulator, name):
    rng = np.random.default_rng(2)
    layout, blobs, ptrs = experts(rng, 3, 96, 48)
    for e in range(3):
        w = np.full(layout.array(name).shape, 0xFFFF, np.uint16)
        emulator.widen(ptrs, e, layout.array(name).offset, w)
        assert emulator.errors() == (0, "")
        assert np.array_equal(to_float32(w), blob_array(blobs, layout, e, name, np.int8).astype(np.float32))


@pytest.mark.parametrize("split", [True, False])
def test_gate_up_epilogue(emulator, split):
    rng = np.random.default_rng(3)
    H, I, n, e = 64, 40, 13, 1
    layout, blobs, ptrs = experts(rng, 2, H, I)
    stack = 2 if split else 1
    gu = rng.standard_normal((stack * n, 2 * I)).astype(np.float32) * 300
    out = np.full((stack * n, I), 0xFFFF, np.uint16)
    emulator.gate_up_epilogue(gu, ptrs, e, layout.array("gate_up_scale").offset, out, split)
    assert emulator.errors() == (0, "")
    s = blob_array(blobs, layout, e, "gate_up_scale", np.float32).reshape(-1).astype(np.float64)
    products = (gu[:n] + gu[n:]) if split else gu                   # a stacked product's hi and lo rows added
    want = nb.silu_mul(products.astype(np.float64) * s)
    got = to_float32(out[:n]).astype(np.float64) + (to_float32(out[n:]) if split else 0)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < (1e-5 if split else 4e-3)
    assert split or err > 1e-4         # bf16 alone really rounds (the split's lo is what keeps ~16 bits)


@pytest.mark.parametrize("split", [True, False])
def test_down_epilogue_writes_only_its_rows(emulator, split):
    rng = np.random.default_rng(4)
    H, I, P, start, n = 48, 16, 40, 9, 22
    layout, blobs, ptrs = experts(rng, 2, H, I)
    perm = rng.permutation(P).astype(np.int32)
    w = rng.uniform(0.1, 1.0, P).astype(np.float32)
    yd = rng.standard_normal(((2 if split else 1) * n, H)).astype(np.float32)
    ypair = np.full((P, H), np.nan, np.float32)
    emulator.down_epilogue(yd, ptrs, 1, layout.array("down_scale").offset, perm, start, w, ypair, split)
    assert emulator.errors() == (0, "")
    rows = perm[start:start + n]
    s = blob_array(blobs, layout, 1, "down_scale", np.float32).reshape(-1)
    products = (yd[:n] + yd[n:]) if split else yd
    assert np.array_equal(ypair[rows], (w[rows, None] * products) * s)      # float32, the kernel's order
    assert np.isnan(np.delete(ypair, rows, axis=0)).all()


# ---- W8A8 ------------------------------------------------------------------------------------------------------------
# a warp a row (16, 768, 2048: whole float4s, at most 32 x QUANT_WARP_VECS); a block a row, read once into registers
# (2052, 4096, 14336, 16384: at most GLUE_THREADS x QUANT_ROW_VECS float4s) or twice (300: not whole float4s; 16388:
# more than the registers hold)
@pytest.mark.parametrize("cols", [16, 300, 768, 2048, 2052, 4096, 14336, 16384, 16388])
def test_quantize_rows_matches_numpy_bit_for_bit(emulator, cols):
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((5, cols)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    x[2] = 0                                              # a row of zeros: scale 0, q 0
    q, s = np.full(x.shape, 99, np.int8), np.full(5, np.nan, np.float32)
    emulator.quantize_rows(x, q, s)
    assert emulator.errors() == (0, "")
    want_q, want_s = nb.quantize_int8_groups(x, cols)
    assert np.array_equal(q, want_q) and np.array_equal(s, want_s.reshape(-1))


def test_gather_int8_copies_rows_and_scales(emulator):
    rng = np.random.default_rng(5)
    T, k, H = 21, 2, 48
    q = rng.integers(-127, 128, (T, H), dtype=np.int8)
    s = rng.uniform(0.1, 1.0, T).astype(np.float32)
    perm = rng.permutation(T * k).astype(np.int32)[:37]
    out, out_s = np.zeros((37, H), np.int8), np.full(37, np.nan, np.float32)
    emulator.gather_int8(q, s, perm, k, out, out_s)
    assert emulator.errors() == (0, "")
    assert np.array_equal(out, q[perm // k]) and np.array_equal(out_s, s[perm // k])


def test_int8_epilogues_take_each_rows_expert_from_the_offsets(emulator):
    rng = np.random.default_rng(6)
    H, I, E = 48, 24, 4
    offsets = np.array([0, 7, 7, 19, 30], np.int32)               # expert 1 has no rows
    P = int(offsets[-1])
    layout, blobs, ptrs = experts(rng, E, H, I)
    expert = np.repeat(np.arange(E), np.diff(offsets))
    rs = rng.uniform(0.001, 0.01, P).astype(np.float32)
    gu = rng.integers(-300000, 300000, (P, 2 * I)).astype(np.int32)
    act = np.full((P, I), np.nan, np.float32)
    emulator.gate_up_epilogue_int8(gu, rs, offsets, ptrs, layout.array("gate_up_scale").offset, act)
    assert emulator.errors() == (0, "")
    sg = np.stack([blob_array(blobs, layout, e, "gate_up_scale", np.float32).reshape(-1) for e in expert])
    want = nb.silu_mul(gu.astype(np.float64) * rs[:, None].astype(np.float64) * sg.astype(np.float64))
    assert np.abs(act - want).max() <= 1e-5 * np.abs(want).max()
    perm = rng.permutation(P).astype(np.int32)
    w = rng.uniform(0.1, 1.0, P).astype(np.float32)
    yd = rng.integers(-300000, 300000, (P, H)).astype(np.int32)
    ypair = np.full((P, H), np.nan, np.float32)
    emulator.down_epilogue_int8(yd, rs, offsets, ptrs, layout.array("down_scale").offset, perm, w, ypair)
    assert emulator.errors() == (0, "")
    sd = np.stack([blob_array(blobs, layout, e, "down_scale", np.float32).reshape(-1) for e in expert])
    want = (w[perm, None] * (yd.astype(np.float32) * rs[:, None])) * sd       # float32, the kernel's order
    assert np.array_equal(ypair[perm], want)
