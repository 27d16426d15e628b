"""moe_gemv4_tc.cu on the CPU (cuda_host_emulation.py: its kernels built with g++, a thread per CUDA thread,
mma.sync and warp shuffles emulated) against `numpy_backend`'s int4_group expert math in float64: the activation
staging and its word permutation, the nibble decode, the per-chunk B columns and group scales, the k-block split
between warps (and a k-block past the row's end), token passes, and the fill on read. The GPU tests are in
test_gpu_4bit_tc.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.dtypes import to_float32
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GXX, Gemv4TcEmulator, build_gemv4_tc
from tests.runtime.cuda.synthetic_experts import packed_experts, routed_pairs

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 1e-4   # bf16 hi + lo activations, fp32 accumulation, against float64


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Gemv4TcEmulator(build_gemv4_tc(tmp_path_factory.mktemp("moe_gemv4_tc_host")))


def rel(out, expected) -> float:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(out - expected) / np.linalg.norm(expected))


def host_dispatch(ids: np.ndarray, num_experts: int) -> dict:
    """The dispatch kernel's perm, offsets, active list (padded with -1) and meta (kernel_expectations)."""
    d = expect.dispatch_grouping(ids, num_experts)
    n_active = d["active"].size
    d["active"] = np.concatenate([d["active"], np.full(num_experts - n_active, -1, np.int32)])
    d["meta"] = np.array([n_active, 0, 0, 0], np.int32)
    return d


def test_staging_is_the_split_in_word_order(emulator):
    """Pair q of part p of a row: bf16 part p of columns 8 (q // 4) + q % 4 and that + 4 (hi = bf16(x), lo =
    bf16(x - hi), like ops.split_bf16)."""
    x = np.random.default_rng(3).standard_normal((3, 96)).astype(np.float32) * 100
    staged = emulator.stage(x)
    halves = np.stack([staged & 0xFFFF, staged >> 16], axis=-1).astype(np.uint16)   # [rows, part, pair, 2]
    q = np.arange(48)
    cols = np.stack([8 * (q // 4) + q % 4, 8 * (q // 4) + q % 4 + 4], axis=-1)
    for part, want in enumerate(expect.split_bf16(x)):
        np.testing.assert_array_equal(halves[:, part], want[:, cols])
    assert emulator.errors() == (0, "")


# (group, E, k, H, I, rows per expert): k-blocks of 3/2/0 chunks past the last whole one, one warp with two
# k-steps, idle warps, empty experts, up to 9 tokens of one expert (two passes at 8 tokens a pass)
CASES = [(32, 4, 2, 224, 96, [3, 0, 1, 2]), (64, 3, 2, 320, 192, [2, 2, 0]), (128, 2, 1, 1152, 128, [9, 1]),
         (128, 5, 2, 384, 128, [1, 0, 4, 1, 2])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-H{c[3]}-I{c[4]}")
@pytest.mark.parametrize("tokc", [1, 2, 4, 8])
def test_emulated_kernels_match_float64(emulator, case, tokc):
    check_against_float64(emulator, case, tokc, fill=False)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"g{c[0]}-H{c[3]}-I{c[4]}")
def test_fill_on_read_copies_what_it_reads(emulator, case):
    check_against_float64(emulator, case, 2, fill=True)


def check_against_float64(emulator: Gemv4TcEmulator, case, tokc: int, fill: bool) -> None:
    rng = np.random.default_rng(16)
    group, E, k, H, I, counts = case
    layout, experts, blobs = packed_experts(rng, S.ExpertFormat.INT4_GROUP, group, E, H, I)
    r = routed_pairs(rng, blobs, layout.size, counts, k, H)
    ptrs, ids, x, w, slots, fills = r.ptrs, r.ids, r.x, r.w, r.slots, r.fills
    P = ids.size
    d = host_dispatch(ids, E)

    act = np.full((P, I), np.nan, np.float32)
    emulator.gate_up(tokc, emulator.stage(x), ptrs, fills if fill else None, layout, d, k, act)
    assert emulator.errors() == (0, "")
    act_pairs = act[d["inv"]]
    assert rel(act_pairs, expect.pair_act(x.astype(np.float64), ids, experts)) < TOL

    y = np.full((P, H), np.nan, np.float32)
    emulator.down(tokc, emulator.stage(act), ptrs, fills if fill else None, layout, d, w, y)
    assert emulator.errors() == (0, "")
    exp_y = expect.pair_down(act_pairs.astype(np.float64), ids, w.astype(np.float64), experts)
    assert rel(y, exp_y) < TOL
    if fill:
        check_fills(blobs, slots, layout, ids, E)


def check_fills(blobs, slots, layout, ids, num_experts: int) -> None:
    """Routed experts with a slot (even ids) hold their arrays there after gate_up + down; no other byte is written."""
    for e in range(num_experts):
        for a in layout.arrays:
            lo = e * layout.size + a.offset
            region = slots[lo:lo + a.nbytes]
            if e % 2 == 0 and e in ids:
                np.testing.assert_array_equal(region, blobs[lo:lo + a.nbytes], err_msg=f"expert {e} {a.name}")
            else:
                assert not region.any(), f"expert {e} {a.name} written without a routed slot"


def check_pair_rows(act, y, valid, exp_act, exp_y, tol: float) -> None:
    """A by-pair launch's outputs (pair order): the rows of pairs whose id names no expert are zero, the others
    within `tol` of the float64 expectations."""
    live = valid.reshape(-1)
    assert not act[~live].any() and not y[~live].any()
    assert rel(act[live], exp_act[live]) < tol
    assert rel(y[live], exp_y[live]) < tol


def test_the_decode_is_exact(emulator):
    """With activations exact in bf16 (lo = 0), the outputs are the float64 products to fp32 summation error: every
    nibble decodes to its integer (a wrong one would show as an error of ~1e-2)."""
    rng = np.random.default_rng(7)
    layout, experts, blobs = packed_experts(rng, S.ExpertFormat.INT4_GROUP, 32, 2, 256, 128)
    ptrs = np.array([blobs.ctypes.data + e * layout.size for e in range(2)], np.uint64)
    ids = np.array([[0, 1]], np.int32)
    x = to_float32(expect.split_bf16(rng.standard_normal((1, 256)))[0])
    d = host_dispatch(ids, 2)
    act = np.full((2, 128), np.nan, np.float32)
    emulator.gate_up(1, emulator.stage(x), ptrs, None, layout, d, 2, act)
    assert rel(act[d["inv"]], expect.pair_act(x.astype(np.float64), ids, experts)) < 1e-6
