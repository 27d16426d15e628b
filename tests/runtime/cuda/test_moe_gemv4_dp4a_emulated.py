"""moe_gemv4_dp4a.cu on the CPU (cuda_host_emulation.py: its kernels built with g++, a thread per CUDA thread, warp
shuffles and dp4a emulated): the activation quantizer against its NumPy twin bit for bit (ties to even, zero groups,
the staged byte order), and the dp4a GEMVs against `numpy_backend`'s int4_group expert math in float64 on the same
rounded activations (q * s): the nibble split into even and odd dp4a operands, the per-chunk group scales (weight
groups of 32/64/128), token passes, the last-item shift and the fill on read. The GPU tests are in
test_gpu_4bit_dp4a.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.kernels import ops
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GXX, Gemv4Dp4aEmulator, build_gemv4_dp4a
from tests.runtime.cuda.synthetic_experts import packed_experts, named_pairs, routed_pairs, valid_ids
from tests.runtime.cuda.test_moe_gemv4_tc_emulated import check_fills, check_pair_rows, host_dispatch, rel

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6   # the same int8 activations: int32 group sums exact, fp32 scale products and accumulation vs float64


# plans other than limits.A8_PLANS (benchmarks/gemv_sweep.py's candidates): one row or eight a warp item, one or
# four chunks a lane loads at once
OTHER_PLANS = {1: ((8, 1), (1, 8)), 2: ((2, 4), (4, 4)), 4: ((4, 1), (8, 2)), 8: ((4, 2), (1, 4))}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Gemv4Dp4aEmulator(build_gemv4_dp4a(tmp_path_factory.mktemp("moe_gemv4_dp4a_host")))


@pytest.fixture(scope="module")
def other_plans(tmp_path_factory):
    return Gemv4Dp4aEmulator(build_gemv4_dp4a(tmp_path_factory.mktemp("moe_gemv4_dp4a_plans"), OTHER_PLANS))


def dequantized(q_staged, s) -> np.ndarray:
    """The float64 inputs the products see: q (column order) * s of its group."""
    q = ops.unstage_a8(q_staged).astype(np.float64)
    rows, cols = q.shape
    return (q.reshape(rows, cols // 32, 32) * np.asarray(s, np.float64)[:, :, None]).reshape(rows, cols)


def tie_rows() -> np.ndarray:
    """Groups whose max is 127 (s = 1 exactly) holding halves (ties: rint to even), a zero group, a group of one
    negative maximum, and tiny values."""
    x = np.zeros((2, 96), np.float32)
    x[0, :32] = np.concatenate([[127.0], np.arange(-15, 16) + 0.5]).astype(np.float32)
    x[0, 64:96] = -np.linspace(0, 3, 32, dtype=np.float32)            # max |v| from a negative value
    x[1, :32] = np.float32(1e-30) * np.arange(32, dtype=np.float32)
    x[1, 32:64] = np.random.default_rng(1).standard_normal(32).astype(np.float32) * 1000
    return x


def test_quantize_is_the_twin_bit_for_bit(emulator):
    rng = np.random.default_rng(5)
    for x in (tie_rows(), (rng.standard_normal((7, 256)) * rng.uniform(1e-3, 1e3, (7, 1))).astype(np.float32),
              (rng.integers(-254, 255, (4, 128)) / 2).astype(np.float32)):   # many exact ties
        q, s = emulator.quantize(x)
        assert emulator.errors() == (0, "")
        want_q, want_s = ops.quantize_activations_a8_reference(x)
        np.testing.assert_array_equal(q, want_q)
        np.testing.assert_array_equal(s.view(np.uint32), want_s.view(np.uint32))
        assert np.abs(ops.unstage_a8(q).astype(np.int32)).max() <= 127
        rounded = emulator.round(x)
        np.testing.assert_array_equal(rounded, nb.round_int8_groups(x))
        inplace = x.copy()
        emulator.round(inplace, out=inplace)
        np.testing.assert_array_equal(inplace, rounded)


def test_ties_round_to_even():
    q, s = nb.quantize_int8_groups(tie_rows())
    assert s[0, 0] == 1.0 and s[1, 2] == 0.0
    np.testing.assert_array_equal(q[0, 1:32], np.rint(np.arange(-15, 16) + 0.5).astype(np.int8))
    assert not q[1, 64:].any()


# (group, E, k, H, I, rows per expert): a lane with a second chunk pair (H 2048: 64 chunks), rows of 3 chunks,
# empty experts, up to 9 tokens of one expert (two passes at 8 tokens a pass), a last item shifted (I 96 / 4 rows)
CASES = [(32, 4, 2, 224, 96, [3, 0, 1, 2]), (64, 3, 2, 320, 192, [2, 2, 0]), (128, 2, 1, 2048, 128, [9, 1]),
         (128, 5, 2, 384, 128, [1, 0, 4, 1, 2])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-H{c[3]}-I{c[4]}")
@pytest.mark.parametrize("tokc", [1, 2, 4, 8])
def test_emulated_kernels_match_float64(emulator, case, tokc):
    check_against_float64(emulator, case, tokc, fill=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-H{c[3]}-I{c[4]}")
@pytest.mark.parametrize("tokc", [1, 2, 4, 8])
def test_other_plans_match_float64(other_plans, case, tokc):
    check_against_float64(other_plans, case, tokc, fill=tokc == 2)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"g{c[0]}-H{c[3]}-I{c[4]}")
def test_fill_on_read_copies_what_it_reads(emulator, case):
    check_against_float64(emulator, case, 2, fill=True)


def check_against_float64(emulator: Gemv4Dp4aEmulator, case, tokc: int, fill: bool) -> None:
    rng = np.random.default_rng(16)
    group, E, k, H, I, counts = case
    layout, experts, blobs = packed_experts(rng, S.ExpertFormat.INT4_GROUP, group, E, H, I)
    r = routed_pairs(rng, blobs, layout.size, counts, k, H)
    ptrs, ids, x, w, slots, fills = r.ptrs, r.ids, r.x, r.w, r.slots, r.fills
    P = ids.size
    d = host_dispatch(ids, E)

    xq, xs = emulator.quantize(x)
    act = np.full((P, I), np.nan, np.float32)
    emulator.gate_up(tokc, xq, xs, ptrs, fills if fill else None, layout, d, k, act)
    assert emulator.errors() == (0, "")
    act_pairs = act[d["inv"]]
    assert rel(act_pairs, expect.pair_act(dequantized(xq, xs), ids, experts)) < TOL

    aq, as_ = emulator.quantize(act)
    y = np.full((P, H), np.nan, np.float32)
    emulator.down(tokc, aq, as_, ptrs, fills if fill else None, layout, d, w, y)
    assert emulator.errors() == (0, "")
    exp_y = expect.pair_down(dequantized(aq, as_)[d["inv"]], ids, w.astype(np.float64), experts)
    assert rel(y, exp_y) < TOL
    if fill:
        check_fills(blobs, slots, layout, ids, E)


def test_the_rounded_inputs_are_the_numpy_engines(emulator):
    """The float64 products on the kernel's int8 inputs are numpy_backend.moe with round_int8_groups (the NumPy
    engine with int8_activations) on float32 inputs up to float32 rounding of q * s."""
    rng = np.random.default_rng(9)
    E, k, H, I = 4, 2, 256, 128
    layout, experts, blobs = packed_experts(rng, S.ExpertFormat.INT4_GROUP, 32, E, H, I)
    ids = np.array([[0, 1], [2, 1], [3, 0]], np.int32)
    x = rng.standard_normal((3, H)).astype(np.float32)
    xq, xs = emulator.quantize(x)
    np.testing.assert_array_equal(nb.round_int8_groups(x), dequantized(xq, xs).astype(np.float32))
    ptrs = np.array([blobs.ctypes.data + e * layout.size for e in range(E)], np.uint64)
    d = host_dispatch(ids, E)
    act = np.full((6, I), np.nan, np.float32)
    emulator.gate_up(1, xq, xs, ptrs, None, layout, d, k, act)
    want = expect.pair_act(nb.round_int8_groups(x.astype(np.float64)), ids, experts)
    assert rel(act[d["inv"]], want) < 1e-2     # float64 rounding of x vs float32: a tie may round one step apart


# The by-pair kernels (one-token passes, no dispatch): (group, experts, H, I, ids [T, k]): one token over distinct
# experts (the engine's case), two tokens sharing an expert, ids outside [0, E).
PAIR_CASES = [(32, 6, 224, 96, [[3, 0, 5, 1]]), (128, 4, 384, 128, [[2, 1], [1, 3]]),
              (64, 4, 256, 128, [[0, 7, 2], [-1, 3, 2]])]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"g{c[0]}-T{len(c[4])}")
@pytest.mark.parametrize("fill", [False, True])
def test_by_pair_kernels_match_float64_and_the_dispatch_path(emulator, case, fill):
    group, E, H, I, ids = case
    rng = np.random.default_rng(12)
    layout, experts, blobs = packed_experts(rng, S.ExpertFormat.INT4_GROUP, group, E, H, I)
    r = named_pairs(rng, blobs, layout.size, E, ids, H)
    ptrs, ids, x, w, slots, fills = r.ptrs, r.ids, r.x, r.w, r.slots, r.fills
    T, k = ids.shape
    valid, named = valid_ids(ids, E)

    xq, xs = emulator.quantize(x)
    act = np.full((T * k, I), np.nan, np.float32)
    emulator.gate_up_pairs(xq, xs, ids, ptrs, fills if fill else None, layout, act, E)
    aq, as_ = emulator.quantize(act)
    y = np.full((T * k, H), np.nan, np.float32)
    emulator.down_pairs(aq, as_, ids, ptrs, fills if fill else None, layout, w, y, E)
    assert emulator.errors() == (0, "")
    check_pair_rows(act, y, valid, expect.pair_act(dequantized(xq, xs), named, experts),
                    expect.pair_down(dequantized(aq, as_), named, w.astype(np.float64), experts), TOL)
    if fill:
        check_fills(blobs, slots, layout, ids[valid], E)
    if valid.all():     # the dispatch path's one-token kernels compute each pair's row alike, to the bit
        d = host_dispatch(ids, E)
        act_d = np.full((T * k, I), np.nan, np.float32)
        emulator.gate_up(1, xq, xs, ptrs, None, layout, d, k, act_d)
        np.testing.assert_array_equal(act, act_d[d["inv"]])
        aq_d, as_d = emulator.quantize(act_d)
        y_d = np.full((T * k, H), np.nan, np.float32)
        emulator.down(1, aq_d, as_d, ptrs, None, layout, d, w, y_d)
        np.testing.assert_array_equal(y, y_d)
