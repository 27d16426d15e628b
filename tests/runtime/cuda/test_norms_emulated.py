"""layers.cu's rmsnorm and fused.cu's add_rmsnorm on the CPU (cuda_host_emulation.py) against the float64 NumPy
norms: rows held in registers (D % 4 == 0, up to 4 * NORM_VECS * threads elements, aligned) and the strided loop
(odd widths, wider rows, misaligned views), in place, 16-bit inputs, outputs and weights. The GPU tests are in
test_gpu_kernels.py and test_gpu_fused_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from tests.runtime.cuda.cuda_host_emulation import GXX

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6          # fp32 math against float64, relative to the largest output
EPS = 1e-5
REGISTER_MAX = 4 * limits.NORM_VECS * 256          # the widest row ops.rmsnorm's 256-thread blocks hold
WIDTHS = (4, 40, 1000, 2048, 2880, 4096, REGISTER_MAX, REGISTER_MAX + 4, 4095, 37)


def at_offset(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of a that starts `offset` elements into a fresh buffer (offset 1: not vector-aligned)."""
    buf = np.zeros(a.size + offset, a.dtype)
    view = buf[offset:].reshape(a.shape)
    view[...] = a
    return view


def stored(a: np.ndarray, code: str) -> np.ndarray:
    return {"f32": a, "bf16": float32_to_bf16_bits(a), "f16": a.astype(np.float16)}[code]


def relerr(got, exp) -> float:
    return float(np.abs(nb.widen(got, np.float64) - exp).max() / np.abs(exp).max())


@pytest.mark.parametrize("D", WIDTHS)
@pytest.mark.parametrize("offset", (0, 1))
@pytest.mark.parametrize("kernel", ("f32_f32_f32", "f32_f32_bf16", "f32_bf16_f16", "bf16_f32_f32"))
def test_rmsnorm(norm_emulator, D, offset, kernel):
    rng = np.random.default_rng(D + offset)
    cx, co, cw = kernel.split("_")
    x = at_offset(stored(rng.standard_normal((2, D)).astype(np.float32) * 3, cx), offset)
    w = at_offset(stored(rng.standard_normal(D).astype(np.float32), cw), offset)
    out = at_offset(stored(np.full((2, D), np.nan, np.float32), co), offset)
    norm_emulator.rmsnorm(x, w, out, EPS, w_offset=0.5)
    assert norm_emulator.errors() == (0, "")
    exp = nb.rmsnorm(nb.widen(x, np.float64), nb.widen(w, np.float64) + 0.5, EPS)
    assert relerr(out, exp) < (TOL if co == "f32" else 1e-2), kernel


@pytest.mark.parametrize("D,threads", [(4096, 256), (128, 128), (64, 32), (200, 32)])
def test_rmsnorm_in_place_and_narrow_blocks(norm_emulator, D, threads):
    """out = x (the MLA latent norms) and the blocks ops.rmsnorm launches for narrow rows."""
    rng = np.random.default_rng(D)
    x = rng.standard_normal((3, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    exp = nb.rmsnorm(x.astype(np.float64), w.astype(np.float64), EPS)
    norm_emulator.rmsnorm(x, w, x, EPS, threads=threads)
    assert norm_emulator.errors() == (0, "")
    assert relerr(x, exp) < TOL


@pytest.mark.parametrize("D", WIDTHS)
@pytest.mark.parametrize("offset", (0, 1))
@pytest.mark.parametrize("wcode", ("f32", "bf16"))
def test_add_rmsnorm(norm_emulator, D, offset, wcode):
    rng = np.random.default_rng(7 * D + offset)
    h0 = rng.standard_normal((2, D)).astype(np.float32)
    b = at_offset(rng.standard_normal((2, D)).astype(np.float32), offset)
    w = at_offset(stored(rng.standard_normal(D).astype(np.float32), wcode), offset)
    h = at_offset(h0, offset)
    x = at_offset(np.full((2, D), np.nan, np.float32), offset)
    norm_emulator.add_rmsnorm(h, b, w, x, EPS, alpha=0.75)
    assert norm_emulator.errors() == (0, "")
    h_exp = h0.astype(np.float64) + 0.75 * b.astype(np.float64)
    assert relerr(h, h_exp) < TOL
    assert relerr(x, nb.rmsnorm(h_exp, nb.widen(w, np.float64), EPS)) < TOL


@pytest.mark.parametrize("D", (4096, 4095))
def test_add_rmsnorm_residual_is_its_own_update(norm_emulator, D):
    """h and b the same buffer (h += alpha h): every element read before any is written."""
    rng = np.random.default_rng(D)
    h0 = rng.standard_normal((1, D)).astype(np.float32)
    h = h0.copy()
    w = rng.standard_normal(D).astype(np.float32)
    x = np.full((1, D), np.nan, np.float32)
    norm_emulator.add_rmsnorm(h, h, w, x, EPS, alpha=1.0)
    assert norm_emulator.errors() == (0, "")
    assert relerr(h, 2.0 * h0.astype(np.float64)) < TOL
    assert relerr(x, nb.rmsnorm(2.0 * h0.astype(np.float64), w.astype(np.float64), EPS)) < TOL
