"""moe_gemv.cu on the CPU (cuda_host_emulation.py: its kernels built with g++, a thread per CUDA thread, warp
shuffles emulated): the int8 decode GEMVs (tokens a pass t1-t8, the one-token plans w2 and w4 = limits.GEMV_W4_PLAN,
row and group scales, gpt-oss's extras, fill on read) against `numpy_backend`'s expert math in float64, and other
GEMV_W4_PLAN candidates (what benchmarks/gemv_sweep.py times) computing the same products. The GPU tests are in
test_gpu_kernels.py and test_gpu_gpt_oss.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.cuda_host_emulation import GEMV_KINDS, GXX, GemvEmulator, GemvExtras, build_gemv
from tests.runtime.cuda.synthetic_experts import host_experts, named_pairs, routed_pairs, valid_ids
from tests.runtime.cuda.test_moe_gemv4_tc_emulated import check_fills, check_pair_rows, host_dispatch, rel

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not on PATH")

TOL = 2e-6   # fp32 products and accumulation against float64 on the same float inputs

# (group, experts, k, H, I, pairs routed to each expert): H = 224 is 14 chunks of 16 bytes (a warp's lanes half
# idle), 544 is 34 (two rounds of 32 lanes at one chunk a lane); one expert idle, one routed more often than a t8
# pass holds
CASES = [(0, 4, 2, 224, 96, [3, 0, 1, 2]),
         (32, 3, 2, 224, 160, [2, 2, 0]),
         (0, 3, 2, 544, 64, [9, 1, 0]),
         (64, 4, 2, 512, 128, [1, 0, 2, 1])]


def case_id(c) -> str:
    return f"g{c[0]}-H{c[3]}-I{c[4]}"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return GemvEmulator(build_gemv(tmp_path_factory.mktemp("moe_gemv_host")))


@pytest.mark.parametrize("case", CASES[:2], ids=case_id)
@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_emulated_kernels_match_float64(emulator, case, kind):
    check_against_float64(emulator, case, kind, fill=False)


@pytest.mark.parametrize("case", CASES[2:], ids=case_id)
@pytest.mark.parametrize("kind", ["t8", "w2", "w4"])
def test_longer_rows_and_more_tokens(emulator, case, kind):
    """Rows of more chunks than a warp's lanes take at once, and more tokens of one expert than a pass holds."""
    check_against_float64(emulator, case, kind, fill=False)


@pytest.mark.parametrize("kind", ["t2", "w4"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=case_id)
def test_fill_on_read_copies_what_it_reads(emulator, case, kind):
    check_against_float64(emulator, case, kind, fill=True)


@pytest.mark.parametrize("kind", ["t1", "t8", "w4"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=case_id)
def test_extras_match_float64(emulator, case, kind):
    """gpt-oss's variants: biases before the activation and the routing weight, the clamped SwiGLU (a limit that
    clamps some products)."""
    rng = np.random.default_rng(11)
    E, I, H = case[1], case[4], case[3]
    extras = GemvExtras(rng.standard_normal((E, 2 * I)).astype(np.float32) * 0.5,
                        rng.standard_normal((E, H)).astype(np.float32) * 0.5, alpha=1.702, limit=1.5, up_offset=1.0)
    check_against_float64(emulator, case, kind, fill=False, extras=extras)


# other one-token plans ((rows a warp item, 16-byte loads a lane issues at once) for gate_up, down)
OTHER_W4_PLANS = [((8, 2), (8, 1))]   # more rows a warp item and loads in flight (one of gemv_sweep.py's candidates)


@pytest.mark.parametrize("plan", OTHER_W4_PLANS, ids=str)
def test_other_one_token_plans_match_float64(tmp_path, plan):
    other = GemvEmulator(build_gemv(tmp_path, plan))
    for case in CASES[1:3]:
        check_against_float64(other, case, "w4", fill=case is CASES[1])


def check_against_float64(emulator: GemvEmulator, case, kind: str, fill: bool,
                          extras: GemvExtras | None = None) -> None:
    rng = np.random.default_rng(5)
    group, E, k, H, I, counts = case
    layout, experts, blobs = host_experts(rng, E, H, I, group)
    r = routed_pairs(rng, blobs, layout.size, counts, k, H)
    P = r.ids.size
    d = host_dispatch(r.ids, E)
    act_kw = {} if extras is None else {"act": {"alpha": extras.alpha, "limit": extras.limit,
                                                "up_offset": extras.up_offset},
                                        "gate_up_bias": extras.gate_up_bias.astype(np.float64)}

    act = np.full((P, I), np.nan, np.float32)
    emulator.gate_up(kind, r.x, r.ptrs, r.fills if fill else None, layout, d, k, act, extras)
    assert emulator.errors() == (0, "")
    act_pairs = act[d["inv"]]
    assert rel(act_pairs, expect.pair_act(r.x.astype(np.float64), r.ids, experts, **act_kw)) < TOL

    y = np.full((P, H), np.nan, np.float32)
    emulator.down(kind, act, r.ptrs, r.fills if fill else None, layout, d, r.w, y, extras)
    assert emulator.errors() == (0, "")
    down_bias = None if extras is None else extras.down_bias.astype(np.float64)
    exp_y = expect.pair_down(act_pairs.astype(np.float64), r.ids, r.w.astype(np.float64), experts,
                             down_bias=down_bias)
    assert rel(y, exp_y) < TOL
    if fill:
        check_fills(blobs, r.slots, layout, r.ids, E)


# The by-pair w4 kernels (ops.moe_experts' one-token passes, no dispatch): (group, experts, hidden, inter, ids [T, k]).
# One token over distinct experts (the engine's case); two tokens sharing an expert; a pass naming ids outside
# [0, E) (zero rows, no fill).
PAIR_CASES = [(0, 6, 224, 96, [[3, 0, 5, 1]]),
              (32, 4, 544, 64, [[2, 1], [1, 3]]),
              (64, 4, 512, 128, [[0, 7, 2], [-1, 3, 2]])]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"g{c[0]}-H{c[2]}-T{len(c[4])}")
@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("with_extras", [False, True])
def test_by_pair_kernels_match_float64_and_the_dispatch_path(emulator, case, fill, with_extras):
    """Plain and gpt-oss's extras (biases, the clamped SwiGLU with a limit that clamps some products)."""
    group, E, H, I, ids = case
    rng = np.random.default_rng(9)
    layout, experts, blobs = host_experts(rng, E, H, I, group)
    r = named_pairs(rng, blobs, layout.size, E, ids, H)
    ptrs, ids, x, w, slots, fills = r.ptrs, r.ids, r.x, r.w, r.slots, r.fills
    T, k = ids.shape
    valid, named = valid_ids(ids, E)
    extras = GemvExtras(rng.standard_normal((E, 2 * I)).astype(np.float32) * 0.5,
                        rng.standard_normal((E, H)).astype(np.float32) * 0.5, alpha=1.702, limit=1.5,
                        up_offset=1.0) if with_extras else None
    act_kw = {} if extras is None else {"act": {"alpha": extras.alpha, "limit": extras.limit,
                                                "up_offset": extras.up_offset},
                                        "gate_up_bias": extras.gate_up_bias.astype(np.float64)}
    down_bias = None if extras is None else extras.down_bias.astype(np.float64)

    act = np.full((T * k, I), np.nan, np.float32)
    emulator.gate_up_pairs(x, ids, ptrs, fills if fill else None, layout, act, E, extras)
    y = np.full((T * k, H), np.nan, np.float32)
    emulator.down_pairs(act, ids, ptrs, fills if fill else None, layout, w, y, E, extras)
    assert emulator.errors() == (0, "")
    check_pair_rows(act, y, valid, expect.pair_act(x.astype(np.float64), named, experts, **act_kw),
                    expect.pair_down(act.astype(np.float64), named, w.astype(np.float64), experts, down_bias=down_bias),
                    TOL)
    if fill:
        check_fills(blobs, slots, layout, ids[valid], E)
    if valid.all():     # the dispatch path's w4 kernels compute each pair's row alike, to the bit
        d = host_dispatch(ids, E)
        act_d = np.full((T * k, I), np.nan, np.float32)
        emulator.gate_up("w4", x, ptrs, None, layout, d, k, act_d, extras)
        y_d = np.full((T * k, H), np.nan, np.float32)
        emulator.down("w4", act_d, ptrs, None, layout, d, w, y_d, extras)
        np.testing.assert_array_equal(act, act_d[d["inv"]])
        np.testing.assert_array_equal(y, y_d)
