"""moe_gemm_fast.cu on the CPU (cuda_host_emulation.py: its kernels built with g++, a thread per CUDA thread,
mma.sync and cp.async emulated) against `numpy_backend`'s expert math in float64: the kernel's tiling, shared-memory
swizzles, k permutation, pipeline and epilogues, checked where no GPU is; the W8A8 (_int8) kernels against float64
of the int8-rounded inputs. The GPU tests are in
test_gpu_moe_gemm_fast.py.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from colibri_format.dtypes import to_float32
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GXX, Emulator, build
from tests.runtime.cuda.synthetic_experts import host_experts, routed_pairs

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = {True: 1e-4, False: 1e-2}   # split (hi + lo) activations, bf16 activations


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(build(tmp_path_factory.mktemp("moe_gemm_fast_host")))


def rel(out, expected) -> float:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(out - expected) / np.linalg.norm(expected))


def host_dispatch(ids: np.ndarray, num_experts: int) -> dict:
    """The dispatch kernel's outputs (kernel_expectations), tile lists padded with -1 to the launch's length."""
    d = expect.dispatch_grouping(ids, num_experts, limits.GEMM_BM)
    P = ids.size
    slots = P // limits.GEMM_BM + min(num_experts, P) + 1    # ops.max_tiles
    pad = slots - d["tile_expert"].size
    d["tile_expert"] = np.concatenate([d["tile_expert"], np.full(pad, -1, np.int32)])
    d["tile_start"] = np.concatenate([d["tile_start"], np.zeros(pad, np.int32)])
    return d


def test_every_byte_widens_to_its_bf16_value(emulator):
    """All 256 int8 values in each of the 4 byte positions, through the kernel's widening (i8x4_to_bf16x2)."""
    values = np.arange(-128, 128, dtype=np.int8)
    words = np.stack([np.roll(values, 64 * j) for j in range(4)], axis=1).copy().view(np.uint32).ravel()
    pairs = emulator.widen_bytes(words)
    halves = np.stack([pairs & 0xFFFF, pairs >> 16], axis=-1).reshape(-1, 4).astype(np.uint16)
    np.testing.assert_array_equal(to_float32(halves), words.view(np.int8).reshape(-1, 4).astype(np.float32))


# (E, k, H, I, rows per expert): partial column blocks and K steps, 1/63/64/65-row experts, empty experts
CASES = [(8, 2, 336, 208, [1, 63, 64, 65, 0, 7, 0, 2]), (3, 1, 64, 272, [130, 0, 2]), (2, 2, 160, 32, [5, 65])]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", [True, False])
def test_emulated_kernels_match_float64(emulator, case, split):
    check_against_float64(emulator, case, split)


@pytest.mark.parametrize("stages", [2, 4])
def test_other_pipeline_depths(tmp_path, stages):
    """The depths benchmarks/prefill_gemm.py --sweep tries compute the same products."""
    check_against_float64(Emulator(build(tmp_path, stages), stages), CASES[0], True)


@pytest.mark.parametrize("activations", ["split", "bf16", "int8"])
def test_two_k_steps_a_stage_change_no_bit(tmp_path, emulator, activations):
    """FAST_STAGE_STEPS = 2 (each stage holds two K steps, a weight row's 128 bytes asked at once; timed by
    benchmarks/prefill_gemm.py --sweep) runs the same MMAs in the same order: the same outputs bit for bit, with a
    partial last stage (H 336: its second step half zeros; I 32: its second step all zeros)."""
    steps = 2 if limits.FAST_STAGE_STEPS == 1 else 1
    other = Emulator(build(tmp_path, stage_steps=steps), stage_steps=steps)
    for case in (CASES[0], CASES[2]):
        default, changed = (run_case(emu, case, activations, seed=18) for emu in (emulator, other))
        np.testing.assert_array_equal(changed.act, default.act)
        np.testing.assert_array_equal(changed.y, default.y)


# several tiles an expert (70, 130 rows), empty experts, and K stages enough (5 and 7 of 64 columns, at least
# FAST_STAGES) for a persistent block to run its ring on across items
PERSISTENT_CASE = (6, 2, 320, 448, [70, 1, 0, 33, 64, 130])


@pytest.fixture(scope="module")
def persistent_lib(tmp_path_factory):
    """The kernels built with FAST_PERSISTENT = 1."""
    return build(tmp_path_factory.mktemp("moe_gemm_fast_persistent"), persistent=1)


@pytest.mark.parametrize("activations", ["split", "bf16", "int8"])
@pytest.mark.parametrize("blocks", [None, 1, 3, 7])
def test_a_persistent_grid_changes_no_bit(emulator, persistent_lib, activations, blocks):
    """Built with FAST_PERSISTENT, a grid of `blocks` blocks, each taking every blocks-th work item with its copies
    running on into the next item (ops._fast_launch's persistent grid), writes what the default build's classic grid
    (an item a block) writes, bit for bit: the item slots, the ring's hand-over between items and the epilogue of
    each item in turn; and so does that build on the classic grid (blocks None)."""
    persistent = Emulator(persistent_lib, blocks=blocks)
    classic, ran = (run_case(emu, PERSISTENT_CASE, activations, seed=19) for emu in (emulator, persistent))
    np.testing.assert_array_equal(ran.act, classic.act)
    np.testing.assert_array_equal(ran.y, classic.y)


def test_a_persistent_grid_with_two_k_steps_a_stage(tmp_path, emulator):
    """The same with 2 K steps a stage (3 and 4 stages an item): still bit for bit the classic grid's one-step
    results."""
    steps = 2 if limits.FAST_STAGE_STEPS == 1 else 1
    persistent = Emulator(build(tmp_path, stage_steps=steps, persistent=1), stage_steps=steps, blocks=3)
    for activations in ("split", "int8"):
        classic, ran = (run_case(emu, PERSISTENT_CASE, activations, seed=20) for emu in (emulator, persistent))
        np.testing.assert_array_equal(ran.act, classic.act)
        np.testing.assert_array_equal(ran.y, classic.y)


@pytest.mark.parametrize("activations", ["split", "bf16", "int8"])
def test_skipping_empty_row_tiles_changes_no_bit(tmp_path, emulator, activations):
    """FAST_SKIP_EMPTY_M (the MMAs of m16 row tiles past an expert's rows left out, which benchmarks/prefill_gemm.py
    --sweep times) writes what the kernel without it writes, bit for bit: 1/7/63/65-row experts leave 3, 3, 0 and
    3 of a tile's four m16 tiles empty."""
    skipping = Emulator(build(tmp_path, skip_empty_m=1 - limits.FAST_SKIP_EMPTY_M))
    default, skipped = (run_case(emu, CASES[0], activations, seed=17) for emu in (emulator, skipping))
    np.testing.assert_array_equal(skipped.act, default.act)
    np.testing.assert_array_equal(skipped.y, default.y)


class Ran(NamedTuple):
    """A case's gate_up then down on the emulated kernels: its experts (float64), routed pairs, dispatch, outputs."""
    experts: object
    pairs: object       # synthetic_experts.routed_pairs: ptrs, ids, x, w
    disp: dict
    act: np.ndarray     # [P, I], sorted order
    y: np.ndarray       # [P, H], pair order


def run_case(emulator: Emulator, case, activations: str, seed: int) -> Ran:
    """gate_up on the case's routed pairs, then down on its act, with these activations ('split', 'bf16': bf16
    halves of x and act; 'int8': x and act rounded to int8 a row); every output element written, no emulator error."""
    rng = np.random.default_rng(seed)
    E, k, H, I, counts = case
    layout, experts, blobs = host_experts(rng, E, H, I)
    r = routed_pairs(rng, blobs, layout.size, counts, k, H)
    P = r.ids.size
    d = host_dispatch(r.ids, E)
    act, y = np.full((P, I), np.nan, np.float32), np.full((P, H), np.nan, np.float32)
    if activations == "int8":
        xq, xs = nb.quantize_int8_groups(r.x, H)
        emulator.gate_up_int8(xq, np.ascontiguousarray(xs.reshape(-1)), blobs, r.ptrs, layout, d, k, act)
        aq, a_scale = nb.quantize_int8_groups(act, I)
        emulator.down_int8(aq, np.ascontiguousarray(a_scale.reshape(-1)), blobs, r.ptrs, layout, d, r.w, y)
    else:
        split = activations == "split"
        emulator.gate_up(split, *expect.split_bf16(r.x), blobs, r.ptrs, layout, d, k, act)
        emulator.down(split, *expect.split_bf16(act), blobs, r.ptrs, layout, d, r.w, y)
    assert emulator.errors() == (0, "")
    assert np.isfinite(act).all() and np.isfinite(y).all(), "an output element left unwritten"
    return Ran(experts, r, d, act, y)


def check_against_float64(emulator: Emulator, case, split: bool) -> None:
    ran = run_case(emulator, case, "split" if split else "bf16", seed=15)
    ids, w, inv = ran.pairs.ids, ran.pairs.w.astype(np.float64), ran.disp["inv"]
    act_pairs = ran.act[inv]
    assert rel(act_pairs, expect.pair_act(ran.pairs.x.astype(np.float64), ids, ran.experts)) < TOL[split]
    exp_y = expect.pair_down(act_pairs.astype(np.float64), ids, w, ran.experts)
    assert rel(ran.y, exp_y) < TOL[split]
    if not split:   # bf16 activations: exactly the float64 product of the rounded inputs, up to fp32 sums
        rounded = to_float32(expect.split_bf16(ran.act)[0])[inv].astype(np.float64)
        assert rel(ran.y, expect.pair_down(rounded, ids, w, ran.experts)) < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_int8_kernels_match_float64_of_the_rounded_inputs(emulator, case):
    """W8A8: x rounded to int8 a token and act a pair (numpy_backend.quantize_int8_groups, a row its group), then
    exact int32 sums: the float64 products of the rounded inputs up to the fp32 epilogue."""
    ran = run_case(emulator, case, "int8", seed=16)
    ids, inv = ran.pairs.ids, ran.disp["inv"]
    assert rel(ran.act[inv], expect.pair_act(expect.round_rows_int8(ran.pairs.x), ids, ran.experts)) < 1e-5
    rounded_pairs = expect.round_rows_int8(ran.act)[inv]
    assert rel(ran.y, expect.pair_down(rounded_pairs, ids, ran.pairs.w.astype(np.float64), ran.experts)) < 1e-5
