"""moe_gemv4.cu on the CPU (cuda_host_emulation.py: its kernels built with g++, a thread per CUDA thread, warp
shuffles emulated): the float-input 4-bit decode GEMVs against `numpy_backend`'s expert math in float64, for
int4_group (groups of 32/64/128) and mxfp4 blobs: the nibble decodes, the per-chunk group scales, token passes of
1-8 rows, the last-item shift and the fill on read, all walked by common.cuh's packed4_gemv (shared with the dp4a
kernels, test_moe_gemv4_dp4a_emulated.py). The GPU tests are in test_gpu_4bit.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GXX, Gemv4Emulator, build_gemv4
from tests.runtime.cuda.synthetic_experts import packed_experts, named_pairs, routed_pairs, valid_ids
from tests.runtime.cuda.test_moe_gemv4_tc_emulated import check_fills, check_pair_rows, host_dispatch, rel

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6   # fp32 products and accumulation against float64 on the same float inputs

# (format, group, experts, k, H, I, pairs routed to each expert)
CASES = [(S.ExpertFormat.INT4_GROUP, 32, 4, 2, 224, 96, [3, 0, 1, 2]),
         (S.ExpertFormat.INT4_GROUP, 64, 3, 2, 320, 192, [2, 2, 0]),
         (S.ExpertFormat.INT4_GROUP, 128, 5, 2, 384, 128, [1, 0, 4, 1, 2]),
         (S.ExpertFormat.MXFP4, 32, 4, 2, 256, 96, [1, 3, 2, 0])]


def case_id(c) -> str:
    return f"{c[0].name.lower()}-g{c[1]}-H{c[4]}-I{c[5]}"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Gemv4Emulator(build_gemv4(tmp_path_factory.mktemp("moe_gemv4_host")))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("tokc", [1, 2, 4, 8])
def test_emulated_kernels_match_float64(emulator, case, tokc):
    check_against_float64(emulator, case, tokc, fill=False)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=case_id)
def test_fill_on_read_copies_what_it_reads(emulator, case):
    check_against_float64(emulator, case, 2, fill=True)


def check_against_float64(emulator: Gemv4Emulator, case, tokc: int, fill: bool) -> None:
    rng = np.random.default_rng(4)
    fmt, group, E, k, H, I, counts = case
    layout, experts, blobs = packed_experts(rng, fmt, group, E, H, I)
    r = routed_pairs(rng, blobs, layout.size, counts, k, H)
    ptrs, ids, x, w, slots, fills = r.ptrs, r.ids, r.x, r.w, r.slots, r.fills
    P = ids.size
    d = host_dispatch(ids, E)

    act = np.full((P, I), np.nan, np.float32)
    emulator.gate_up(tokc, x, ptrs, fills if fill else None, layout, d, k, act)
    assert emulator.errors() == (0, "")
    act_pairs = act[d["inv"]]
    assert rel(act_pairs, expect.pair_act(x.astype(np.float64), ids, experts)) < TOL

    y = np.full((P, H), np.nan, np.float32)
    emulator.down(tokc, act, ptrs, fills if fill else None, layout, d, w, y)
    assert emulator.errors() == (0, "")
    exp_y = expect.pair_down(act_pairs.astype(np.float64), ids, w.astype(np.float64), experts)
    assert rel(y, exp_y) < TOL
    if fill:
        check_fills(blobs, slots, layout, ids, E)


# The by-pair kernels (ops.moe_experts_4bit's one-token passes, no dispatch): (format, group, experts, H, I, ids
# [T, k]): one token over distinct experts (the engine's case), two tokens sharing an expert, ids outside [0, E).
PAIR_CASES = [(S.ExpertFormat.INT4_GROUP, 32, 6, 224, 96, [[3, 0, 5, 1]]),
              (S.ExpertFormat.INT4_GROUP, 128, 4, 384, 128, [[2, 1], [1, 3]]),
              (S.ExpertFormat.MXFP4, 32, 4, 256, 96, [[0, 7, 2], [-1, 3, 2]])]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"{c[0].name.lower()}-g{c[1]}-T{len(c[5])}")
@pytest.mark.parametrize("fill", [False, True])
def test_by_pair_kernels_match_float64_and_the_dispatch_path(emulator, case, fill):
    fmt, group, E, H, I, ids = case
    rng = np.random.default_rng(11)
    layout, experts, blobs = packed_experts(rng, fmt, group, E, H, I)
    r = named_pairs(rng, blobs, layout.size, E, ids, H)
    ptrs, ids, x, w, slots, fills = r.ptrs, r.ids, r.x, r.w, r.slots, r.fills
    T, k = ids.shape
    valid, named = valid_ids(ids, E)

    act = np.full((T * k, I), np.nan, np.float32)
    emulator.gate_up_pairs(x, ids, ptrs, fills if fill else None, layout, act, E)
    y = np.full((T * k, H), np.nan, np.float32)
    emulator.down_pairs(act, ids, ptrs, fills if fill else None, layout, w, y, E)
    assert emulator.errors() == (0, "")
    check_pair_rows(act, y, valid, expect.pair_act(x.astype(np.float64), named, experts),
                    expect.pair_down(act.astype(np.float64), named, w.astype(np.float64), experts), TOL)
    if fill:
        check_fills(blobs, slots, layout, ids[valid], E)
    if valid.all():     # the dispatch path's one-token kernels compute each pair's row alike, to the bit
        d = host_dispatch(ids, E)
        act_d = np.full((T * k, I), np.nan, np.float32)
        emulator.gate_up(1, x, ptrs, None, layout, d, k, act_d)
        y_d = np.full((T * k, H), np.nan, np.float32)
        emulator.down(1, act_d, ptrs, None, layout, d, w, y_d)
        np.testing.assert_array_equal(act, act_d[d["inv"]])
        np.testing.assert_array_equal(y, y_d)
