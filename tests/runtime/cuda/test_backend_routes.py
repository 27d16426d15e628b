"""Which expert-GEMM route the CUDA backend asks of ops.moe_experts for a pass (CPU-only: the choice is plain Python
on the backend's options, `CupyBackend._expert_gemm`; the routes themselves are tested on the GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from colibri_format.runtime.cuda.backend import CupyBackend
from colibri_format.runtime.cuda.limits import ATT_DECODE_MAX_ROWS


def route(fast_gemm, cublas, rows):
    return CupyBackend._expert_gemm(SimpleNamespace(fast_expert_gemm=fast_gemm, cublas_expert_gemm=cublas), rows)


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
    assert route("bf16", True, rows) == ("bf16", False)
    assert route(None, None, rows) == (None, False)
