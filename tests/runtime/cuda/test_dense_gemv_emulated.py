"""layers.cu's dense_gemv on the CPU (cuda_host_emulation.py) against float64 NumPy: every token plan, K split
over 1, 2, 4 and 8 warps (and the split `ops.dense_gemv` picks), ragged K and N, bias, blocks in shuffled order;
dense_gemv_normed (the input rmsnorm folded in) against rmsnorm then the product.
Every plan benchmarks/dense_gemv_sweep.py times computes the default plan's outputs to the bit. The GPU test is
test_gpu_kernels.py::test_dense_gemv."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda.cuda_host_emulation import GXX, DenseGemvEmulator, build_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from dense_gemv_sweep import CANDIDATES, SPLITS, plan_defines  # noqa: E402

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6          # fp32 sums against float64, relative to the largest output


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return DenseGemvEmulator(build_layers(tmp_path_factory.mktemp("layers_host")))


def case(T: int, N: int, K: int, code: str, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w32 = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    w = float32_to_bf16_bits(w32) if code == "bf16" else w32
    return x, w, nb.widen(w, np.float64)


def relerr(got, exp) -> float:
    return float(np.abs(got.astype(np.float64) - exp).max() / np.abs(exp).max())


@pytest.mark.parametrize("T", (1, 2, 3, 5, 8))
@pytest.mark.parametrize("N,K", [(9, 520), (33, 2056), (130, 64), (6, 4104)])
@pytest.mark.parametrize("splits", (None, 1, 2, 4, 8))
@pytest.mark.parametrize("code", ("f32", "bf16"))
def test_dense_gemv_against_float64(emulator, T, N, K, splits, code):
    x, w, w64 = case(T, N, K, code, seed=T * 1000 + N + K)
    bias = np.linspace(-1, 1, N).astype(np.float32) if N % 2 else None
    y = emulator.gemv(x, w, bias=bias, splits=splits, order=T + N)
    assert emulator.errors() == (0, "")
    assert relerr(y, nb.linear(x.astype(np.float64), w64, bias=bias)) < TOL


@pytest.mark.parametrize("T", (1, 3, 8))
@pytest.mark.parametrize("N,K", [(9, 520), (33, 2056), (6, 4104)])
@pytest.mark.parametrize("splits", (None, 1, 4, 8))
@pytest.mark.parametrize("code", ("f32", "bf16"))
def test_the_normed_gemv_is_rmsnorm_then_the_product(emulator, T, N, K, splits, code):
    """dense_gemv_normed = rmsnorm (float64) then the product, and its x_out the normed rows, at every split; rows
    of different scales (a wrong row's or slice's norm would show)."""
    x, w, w64 = case(T, N, K, code, seed=7 * T + N + K)
    x *= np.geomspace(0.05, 20.0, T, dtype=np.float32)[:, None]
    gamma = np.linspace(0.5, 1.5, K).astype(np.float32)
    bias = np.linspace(-1, 1, N).astype(np.float32) if N % 2 else None
    eps = 1e-6
    y, x_out = emulator.gemv_normed(x, gamma, eps, w, bias=bias, splits=splits, order=T + N)
    assert emulator.errors() == (0, "")
    normed = nb.rmsnorm(x.astype(np.float64), gamma.astype(np.float64), eps)
    assert relerr(x_out, normed) < TOL
    assert relerr(y, nb.linear(normed, w64, bias=bias)) < TOL


def test_the_split_fills_the_machine_without_oversplitting():
    """On 132 SMs (DG_WARPS_PER_SM warps each): Qwen3's o_proj takes 4 warps an item at one token and 8 at eight,
    its q/k/v none at one token and 2 at eight, lm_head none; a row of one chunk is never split; f32 rows (half the
    keys a chunk) split alike."""
    sms = 132
    assert limits.DG_WARPS_PER_SM == 32 and limits.DG_MAX_SPLITS == 8 and limits.DG_PLANS[1][0] == 2
    assert ops.dense_gemv_splits(2048, 4096, 1, 2, sms) == 4
    assert ops.dense_gemv_splits(2048, 4096, 8, 2, sms) == 8
    assert ops.dense_gemv_splits(5120, 2048, 1, 2, sms) == 1
    assert ops.dense_gemv_splits(5120, 2048, 8, 2, sms) == 2
    assert ops.dense_gemv_splits(151936, 2048, 1, 2, sms) == 1
    assert ops.dense_gemv_splits(16, 256, 1, 2, sms) == 1
    assert ops.dense_gemv_splits(16, 512, 1, 2, sms) == 2
    assert ops.dense_gemv_splits(16, 512, 1, 4, sms) == 4
    assert (limits.DG_THREADS // 32) % limits.DG_MAX_SPLITS == 0


# (one-token plan, eight-token plan) pairs of the sweep's candidates, one build each: the extremes of rows a warp
# item and loads in flight (the sweep checks every candidate against the default plan on the GPU too)
PLAN_PAIRS = [((1, 8), (8, 1)), ((4, 2), (1, 4)), ((2, 2), (2, 2))]


@pytest.mark.parametrize("pair", PLAN_PAIRS, ids=str)
def test_other_plans_compute_the_default_plans_bits(emulator, tmp_path, pair):
    """Other plans give the default plans' outputs, to the bit, at every split."""
    assert all(p in CANDIDATES[t] for t, p in zip((1, 8), pair))
    plans = dict(zip((1, 8), pair))
    other = DenseGemvEmulator(build_layers(tmp_path, **plan_defines(1, plans[1]), **plan_defines(8, plans[8])),
                              rows={**{t: p[0] for t, p in limits.DG_PLANS.items()}, 1: plans[1][0], 8: plans[8][0]})
    for T, N, K in ((1, 9, 2056), (8, 13, 1032), (5, 40, 520)):
        x, w, _ = case(T, N, K, "bf16", seed=T + N)
        for splits in SPLITS:
            want = emulator.gemv(x, w, splits=splits)
            np.testing.assert_array_equal(other.gemv(x, w, splits=splits), want, err_msg=f"{plans} T={T} {splits}")
    assert other.errors() == (0, "")


# ---- dense_gemv_tc: bf16 weights on the tensor cores, up to 32 tokens in one launch ------------------------------
TC_TOL = 1e-6       # fp32 sums of the split inputs in the MMAs' order, against float64 of the same split inputs


@pytest.mark.parametrize("T", (1, 2, 7, 8, 9, 16, 17, 32))
@pytest.mark.parametrize("N,K", [(16, 32), (37, 2080), (130, 64), (20, 4096)])
@pytest.mark.parametrize("splits", (None, 1, 2, 8))
def test_dense_gemv_tc_against_its_twin(emulator, T, N, K, splits):
    """Every tile count (8, 16, 32 tokens) and token count, N off the 16-row items (the last item shifted back, its
    overlapping rows stored once), K split over warps (more splits than slices leave warps without work), bias;
    blocks in shuffled order. The twin rounds x to bf16 hi + lo as the kernel does."""
    x, w, w64 = case(T, N, K, "bf16", seed=31 * T + N + K)
    x *= np.geomspace(0.01, 100.0, K, dtype=np.float32)          # columns of every scale: a lost lo part shows
    bias = np.linspace(-1, 1, N).astype(np.float32) if N % 2 else None
    y = emulator.gemv_tc(x, w, bias=bias, splits=splits, order=T + N)
    assert emulator.errors() == (0, "")
    assert relerr(y, ops.dense_gemv_tc_reference(x, w, bias)) < TC_TOL
    assert relerr(y, nb.linear(x.astype(np.float64), w64, bias=bias)) < 2e-5    # the split's ~16 mantissa bits


@pytest.mark.parametrize("T", (3, 8, 13, 32))
def test_dense_gemv_tc_reads_each_token_of_its_own_row(emulator, T):
    """Token j's outputs are its own row's product: x row j is one bf16-exact spike at its own column, so y[j] must
    be exactly that column of W times the spike (a lane reading another token's x, another column, or a padded
    token would show as a wrong or extra term)."""
    N, K = 48, 256
    rng = np.random.default_rng(T)
    w = float32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32))
    cols = rng.permutation(K)[:T]
    spikes = np.float32(2.0) ** np.arange(-3, T - 3, dtype=np.float32)
    x = np.zeros((T, K), np.float32)
    x[np.arange(T), cols] = spikes
    y = emulator.gemv_tc(x, w, order=T)
    assert emulator.errors() == (0, "")
    want = (nb.widen(w, np.float64)[:, cols] * spikes).T
    np.testing.assert_array_equal(y, want.astype(np.float32))


@pytest.mark.parametrize("T", (2, 8, 13, 32))
@pytest.mark.parametrize("N,K", [(37, 2080), (20, 4096), (16, 64)])
@pytest.mark.parametrize("splits", (None, 1, 8))
def test_the_normed_tc_gemv_is_rmsnorm_then_the_product(emulator, T, N, K, splits):
    """dense_gemv_tc_normed = rmsnorm (float64) then the tensor-core product (its twin on the normed rows), and its
    x_out the normed rows, at every split and tile count; rows of different scales (a wrong token's or slice's norm
    would show)."""
    x, w, w64 = case(T, N, K, "bf16", seed=11 * T + N + K)
    x *= np.geomspace(0.05, 20.0, T, dtype=np.float32)[:, None]
    gamma = np.linspace(0.5, 1.5, K).astype(np.float32)
    bias = np.linspace(-1, 1, N).astype(np.float32) if N % 2 else None
    y, x_out = emulator.gemv_tc_normed(x, gamma, 1e-6, w, bias=bias, splits=splits, order=T + N)
    assert emulator.errors() == (0, "")
    normed = nb.rmsnorm(x.astype(np.float64), gamma.astype(np.float64), 1e-6)
    assert relerr(x_out, normed) < TOL
    assert relerr(y, nb.linear(normed, w64, bias=bias)) < 2e-5


def test_dense_gemv_tc_splits_fill_the_machine_without_oversplitting():
    """Items of 16 rows: Qwen3's o_proj (2048 x 4096) splits its K over 8 warps, q/k/v (5120 x 2048) over 8,
    lm_head (151936 rows) not at all; never more warps than 32-column slices."""
    sms = 132
    assert ops.dense_gemv_tc_splits(2048, 4096, sms) == 8
    assert ops.dense_gemv_tc_splits(5120, 2048, sms) == 8
    assert ops.dense_gemv_tc_splits(151936, 2048, sms) == 1
    assert ops.dense_gemv_tc_splits(16, 64, sms) == 2


@pytest.mark.parametrize("unroll", (1, 2, 8))
def test_every_tc_unroll_computes_the_default_unrolls_bits(emulator, tmp_path, unroll):
    """DG_TC_UNROLL changes how many slices a lane loads before it multiplies, not the order of a warp's MMAs on its
    accumulators: the same outputs to the bit, at every split (dense_gemv_sweep.py --tc relies on it)."""
    assert unroll != limits.DG_TC_UNROLL
    other = DenseGemvEmulator(build_layers(tmp_path, DG_TC_UNROLL=unroll))
    for T, N, K in ((3, 37, 2080), (8, 20, 4096), (17, 16, 96)):
        x, w, _ = case(T, N, K, "bf16", seed=T + N)
        for splits in (1, 2, 8):
            np.testing.assert_array_equal(other.gemv_tc(x, w, splits=splits), emulator.gemv_tc(x, w, splits=splits))
    assert other.errors() == (0, "")
