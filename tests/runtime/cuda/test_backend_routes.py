"""Which expert-GEMM route the CUDA backend asks of ops.moe_experts for a pass (CPU-only: the choice is plain Python
on the backend's options and the table's shape, `CupyBackend._expert_gemm`; the routes themselves are tested on the
GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.backend import CupyBackend
from colibri_format.runtime.cuda.kernels import ops
from colibri_format.runtime.cuda.limits import ATT_DECODE_MAX_ROWS, CUBLAS_INT8_MIN_EXPERT_MACS, W8A8_MIN_EXPERT_MACS

MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_experts=8)
QWEN3 = dict(hidden_size=2048, intermediate_size=768, num_experts=128)


def table(hidden_size, intermediate_size, num_experts, group_size=0):
    """An ExpertTable of that shape (host addresses: only its shape is read here)."""
    return ops.ExpertTable(np.zeros(num_experts, np.uint64), hidden_size, intermediate_size, 0, 0, 0, 0, group_size)


def route(fast_gemm, cublas, rows, pairs=None, experts=None, extras=None):
    backend = SimpleNamespace(fast_expert_gemm=fast_gemm, cublas_expert_gemm=cublas, ops=ops)
    return CupyBackend._expert_gemm(backend, rows, 2 * rows if pairs is None else pairs,
                                    experts or table(**MIXTRAL), extras)


@pytest.mark.parametrize("fast_gemm", [None, "split", "bf16", "int8"])
@pytest.mark.parametrize("cublas", [None, True, False])
def test_passes_beyond_the_capturable_size_keep_the_options(fast_gemm, cublas):
    assert route(fast_gemm, cublas, ATT_DECODE_MAX_ROWS + 1) == (fast_gemm, cublas)


@pytest.mark.parametrize("rows", [1, 8, ATT_DECODE_MAX_ROWS])
def test_capturable_passes_never_ask_for_cublas(rows):
    """A decode graph may capture these: the cuBLAS routes read counts on the host, so W8A8 falls back to the
    pipelined kernel's split activations and cuBLAS is refused."""
    assert route("int8", True, rows) == ("split", False)
    assert route("int8", None, rows) == ("split", False)
    assert route("auto", None, rows, pairs=10 ** 9) == ("split", False)
    assert route("bf16", True, rows) == ("bf16", False)
    assert route(None, None, rows) == (None, False)


def pairs_at_threshold(shape, macs: int = CUBLAS_INT8_MIN_EXPERT_MACS) -> int:
    """The fewest routed pairs whose mean work a matrix reaches `macs` (default: the cuBLAS W8A8 threshold)."""
    per_pair = shape["hidden_size"] * shape["intermediate_size"]
    return -(-macs * shape["num_experts"] // per_pair)


def test_auto_takes_w8a8_from_the_measured_mean_work():
    """Mixtral's W8A8 threshold (limits.W8A8_MIN_EXPERT_MACS) lies below 128 tokens x top-2 (measured faster there)
    and its cuBLAS one between 32 and 64 pairs an expert; the cuBLAS option is passed on unchanged."""
    w8a8 = pairs_at_threshold(MIXTRAL, W8A8_MIN_EXPERT_MACS)
    assert 2 * (ATT_DECODE_MAX_ROWS + 1) > w8a8 and 32 * 8 < pairs_at_threshold(MIXTRAL) <= 64 * 8
    assert route("auto", None, 256, pairs=512) == ("int8", None)
    assert route("auto", None, 128, pairs=256) == ("int8", None)
    assert route("auto", True, 64, pairs=w8a8) == ("int8", True)
    assert route("auto", False, 64, pairs=w8a8 - 1) == ("split", False)


def test_auto_keeps_small_experts_grouped_scales_and_extras_on_the_pipelined_kernel():
    """Qwen3's 128 small experts: W8A8 (the pipelined kernel's s8 MMAs) at 4096 and 512 tokens, where its device
    time was measured shorter, float activations at 256 and below (not timed); the cuBLAS route would need ~300k
    pairs (its per-expert calls cost more than they save there). Grouped scales and gpt-oss's extras have no W8A8
    route."""
    assert route("auto", None, 4096, pairs=4096 * 8, experts=table(**QWEN3)) == ("int8", None)
    assert route("auto", None, 512, pairs=512 * 8, experts=table(**QWEN3)) == ("int8", None)
    assert route("auto", None, 256, pairs=256 * 8, experts=table(**QWEN3)) == ("split", None)
    assert pairs_at_threshold(QWEN3) > 200_000
    grouped = table(**MIXTRAL, group_size=128)
    assert route("auto", None, 4096, pairs=8192, experts=grouped) == ("split", None)
    assert route("auto", None, 4096, pairs=8192, extras=object()) == ("split", None)


@pytest.mark.parametrize("mode", [None, "split", "bf16", "int8", "auto"])
@pytest.mark.parametrize("shape", [MIXTRAL, QWEN3], ids=["mixtral", "qwen3"])
@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("extras", [None, object()], ids=["plain", "extras"])
def test_the_cuda_routes_round_where_the_numpy_twin_does(mode, shape, group, extras):
    """limits.rounds_rows_int8 (the NumPy engine's rule) says W8A8 exactly where the CUDA backend's route runs int8
    products: its option resolved per pass, then ops.moe_experts' own conditions (grouped GEMM, a per-row model)."""
    experts = table(**shape, group_size=group)
    fmt = S.ExpertFormat.INT8_GROUP if group else S.ExpertFormat.INT8_ROW
    layout = S.blob_layout(shape["hidden_size"], shape["intermediate_size"], fmt, group)
    per_pair = shape["hidden_size"] * shape["intermediate_size"]
    for rows in (8, ATT_DECODE_MAX_ROWS, ATT_DECODE_MAX_ROWS + 1, 512):
        for pairs in (2 * rows, -(-W8A8_MIN_EXPERT_MACS * shape["num_experts"] // per_pair),
                      -(-CUBLAS_INT8_MIN_EXPERT_MACS * shape["num_experts"] // per_pair)):
            fast, _ = route(mode, None, rows, pairs=pairs, experts=experts, extras=extras)
            cuda = (fast == "int8" and ops.gemm_path(rows, 2, shape["num_experts"])
                    and ops.uses_fast_gemm(fast, experts, extras))
            numpy_twin = limits.rounds_rows_int8(mode, rows, pairs, shape["num_experts"], layout, extras is not None)
            assert cuda == numpy_twin, (rows, pairs)


def test_the_router_route_follows_the_backends_switch():
    """CupyBackend.router sends passes of router_gemm_min_rows rows or more through cuBLAS (ops.router's by_gemm),
    the switch prefill_host.py --router sets on an open engine (and kernel_choices carries, so graphs follow it)."""
    seen = []
    stub_ops = SimpleNamespace(router=lambda x, w, k, **kw: seen.append(kw["by_gemm"]),
                               router_by_gemm=ops.router_by_gemm)
    backend = SimpleNamespace(ops=stub_ops, router_gemm_min_rows=limits.ROUTER_GEMM_MIN_ROWS,
                              _router_workspace=lambda ws, rows, experts: None)
    w = np.zeros((64, 16), np.float32)      # several blocks of ROUTER_EPB experts
    for rows in (1, limits.ROUTER_GEMM_MIN_ROWS - 1, limits.ROUTER_GEMM_MIN_ROWS, 4096):
        CupyBackend.router(backend, np.zeros((rows, 16), np.float32), w, 2, ws=None, out_ids=None, out_weights=None)
    backend.router_gemm_min_rows = 1 << 30
    CupyBackend.router(backend, np.zeros((4096, 16), np.float32), w, 2, ws=None, out_ids=None, out_weights=None)
    assert seen == [False, False, True, True, False]


@pytest.mark.parametrize("experts", [1, limits.ROUTER_EPB, limits.ROUTER_EPB + 1, 128])
def test_only_routers_of_several_expert_blocks_take_the_gemm_route(experts):
    """A router of at most ROUTER_EPB experts (Mixtral's 8) keeps the fused kernel at every length: its one block a
    token group reads x once, and the GEMM route would add two launches to an eager pass's host time."""
    several = experts > limits.ROUTER_EPB
    assert ops.router_by_gemm(4096, experts) is several
    assert ops.router_by_gemm(limits.ROUTER_GEMM_MIN_ROWS, experts) is several
    assert ops.router_by_gemm(limits.ROUTER_GEMM_MIN_ROWS - 1, experts) is False
