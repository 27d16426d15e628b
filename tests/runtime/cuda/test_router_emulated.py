"""router.cu on the CPU (cuda_host_emulation.py: a fiber per CUDA thread, blocks in shuffled orders so that various
blocks of a token group take the last ticket) against the float64 NumPy oracle: `moe_router` against
`numpy_backend.router`, and `add_rmsnorm_route` (the post-attention add + norm fused into the router) against
`numpy_backend.add_rmsnorm` then `numpy_backend.router`, its h and x also against fused.cu's add_rmsnorm (the same
bits). Selections are checked exactly on the kernel's own logits (float64 logits could reorder near-ties) and
against the oracle's on these fixed inputs. The GPU tests are test_gpu_kernels.py, test_gpu_router_attention_features.py
and test_gpu_fused_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import numpy_backend as nb
from tests.runtime.cuda.cuda_host_emulation import GXX, RouterEmulator, build_router

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6          # fp32 math against float64, relative to the largest value
EPS = 1e-5
SHAPES = [  # T, E, k, H: one and two token groups (ROUTER_TPB 4), several blocks a group (the ticket) and one
    (1, 128, 8, 2056),      # Qwen3-like width and top-k; rows longer than 4 ROUTER_THREADS values (two passes)
    (5, 128, 8, 256),
    (1, 8, 2, 264),
    (5, 8, 3, 64),          # most threads hold no value of the row
]
MODES = {
    "softmax": dict(scoring="softmax", order="softmax_topk"),
    "softmax-normalized": dict(scoring="softmax", order="softmax_topk", normalize=True, scale=1.5),
    "sigmoid-bias": dict(scoring="sigmoid", order="softmax_topk", normalize=True, scale=2.5, bias=True),
    "topk_softmax-bias": dict(scoring="softmax", order="topk_softmax", bias=True),
    "sigmoid-grouped": dict(scoring="sigmoid", order="softmax_topk", normalize=True, bias=True, groups=True),
}


@pytest.fixture(scope="module")
def router_emulator(tmp_path_factory) -> RouterEmulator:
    return RouterEmulator(build_router(tmp_path_factory.mktemp("router_host")))


def stored(a: np.ndarray, code: str) -> np.ndarray:
    return float32_to_bf16_bits(a) if code == "bf16" else a


def routing(mode: str, E: int, rng) -> dict:
    """The router options of `mode` for E experts (groups: E / 16 groups of 16, or 4 of 2; keep 3 or 2)."""
    how = dict(MODES[mode])
    if how.pop("bias", False):
        how["bias"] = (rng.standard_normal(E) * 0.5).astype(np.float32)
    if how.pop("groups", False):
        how["groups"] = (8, 3) if E >= 16 else (4, 2)
    return how


def inputs(T: int, E: int, H: int, code: str, seed: int):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((T, H)) * 2).astype(np.float32)
    o = rng.standard_normal((T, H)).astype(np.float32)
    norm_w = stored(rng.uniform(0.5, 1.5, H).astype(np.float32), code)
    w = stored((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32), code)
    return rng, h, o, norm_w, w


def relerr(got, exp) -> float:
    return float(np.abs(nb.widen(got, np.float64) - exp).max() / np.abs(exp).max())


def check_selection(routed, k: int, how: dict, expected_ids) -> None:
    """ids exactly those of the oracle on the kernel's own logits, and the oracle's on float64 logits; weights."""
    T = routed.logits.shape[0]
    own = nb.router(np.eye(T), routed.logits.T.astype(np.float64), k, **how)
    np.testing.assert_array_equal(routed.ids, own[0])
    np.testing.assert_array_equal(routed.ids, expected_ids)
    assert relerr(routed.weights, own[1]) < TOL
    assert not routed.tickets.any(), "tickets not back at zero"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("code", ("f32", "bf16"))
def test_router(router_emulator, shape, mode, code):
    T, E, k, H = shape
    rng, x, _, _, w = inputs(T, E, H, code, seed=T * E + H)
    how = routing(mode, E, rng)
    routed = router_emulator.router(x, w, k, **how)
    assert router_emulator.errors() == (0, "")
    x64 = x.astype(np.float64)
    assert relerr(routed.logits, nb.linear(x64, w)) < TOL
    check_selection(routed, k, how, nb.router(x64, w, k, **how)[0])


@pytest.mark.parametrize("T,E,k", [(1, 128, 8), (9, 128, 8), (70, 64, 8), (6, 8, 2), (5, 320, 6), (7, 512, 32)])
@pytest.mark.parametrize("mode", MODES)
def test_select_on_given_logits(router_emulator, T, E, k, mode):
    """The GEMM route's selection launch (moe_router_select) on logits it is given: the oracle's choice on those
    logits, exactly; blocks in shuffled orders; rows of tied logits go to the lower expert."""
    rng = np.random.default_rng(T * E + k)
    how = routing(mode, E, rng)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[0, E // 2:] = logits[0, : E - E // 2]                      # exact ties in row 0
    routed = router_emulator.select(logits, k, shuffle=T, **how)
    assert router_emulator.errors() == (0, "")
    own = nb.router(np.eye(T), logits.T.astype(np.float64), k, **how)
    np.testing.assert_array_equal(routed.ids, own[0])
    assert relerr(routed.weights, own[1]) < TOL


def test_widen_bf16_is_exact(router_emulator):
    w = float32_to_bf16_bits((np.random.default_rng(4).standard_normal((24, 40)) * 3).astype(np.float32))
    np.testing.assert_array_equal(router_emulator.widen_bf16(w), nb.widen(w, np.float32))
    assert router_emulator.errors() == (0, "")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("code", ("f32", "bf16"))
def test_add_rmsnorm_route(router_emulator, norm_emulator, shape, mode, code):
    T, E, k, H = shape
    rng, h0, o, norm_w, w = inputs(T, E, H, code, seed=T * E + H + 1)
    how = routing(mode, E, rng)
    h, x = h0.copy(), np.full((T, H), np.nan, np.float32)
    routed = router_emulator.add_rmsnorm_route(h, o, norm_w, x, EPS, w, k, alpha=0.75, **how)
    assert router_emulator.errors() == (0, "")
    # h and x: fused.cu's add_rmsnorm, bit for bit
    h_unfused, x_unfused = h0.copy(), np.full((T, H), np.nan, np.float32)
    norm_emulator.add_rmsnorm(h_unfused, o, norm_w, x_unfused, EPS, alpha=0.75)
    np.testing.assert_array_equal(h, h_unfused)
    np.testing.assert_array_equal(x, x_unfused)
    # and the float64 oracle: add_rmsnorm, then the router on its output
    h64 = h0.astype(np.float64)
    x64 = nb.add_rmsnorm(h64, o.astype(np.float64), nb.widen(norm_w), EPS, alpha=0.75)
    assert relerr(h, h64) < TOL
    assert relerr(x, x64) < TOL
    assert relerr(routed.logits, nb.linear(x64, w)) < TOL
    check_selection(routed, k, how, nb.router(x64, w, k, **how)[0])


@pytest.mark.parametrize("code", ("f32", "bf16"))
def test_add_rmsnorm_route_is_the_same_whichever_block_selects(router_emulator, code):
    """Blocks in grid order and in shuffled orders (a different block of each group last): the same bits."""
    T, E, k, H = 5, 128, 8, 256
    rng, h0, o, norm_w, w = inputs(T, E, H, code, seed=3)
    how = routing("sigmoid-bias", E, rng)
    runs = []
    for shuffle in (0, 1, 2, 5):
        h, x = h0.copy(), np.full((T, H), np.nan, np.float32)
        routed = router_emulator.add_rmsnorm_route(h, o, norm_w, x, EPS, w, k, alpha=1.0, shuffle=shuffle, **how)
        assert router_emulator.errors() == (0, "")
        runs.append((h, x, routed.ids, routed.weights, routed.logits))
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            np.testing.assert_array_equal(got, first)
