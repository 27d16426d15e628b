"""EngineConfig.dense_gemm="bf16": prefill-shaped products of bf16-stored dense matrices take x rounded to bf16 (one
tensor-core product on CUDA) instead of its hi + lo split; the NumPy engine rounds by the same rule
(`limits.rounds_dense_bf16`), so the float64 engine stays the CUDA one's reference (test_engine_scenarios.py)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.synthetic import synthetic_model, write_synthetic

LONG = [list(range(1, 41))]          # 40 rows: a pass dense_gemv does not take
SHORT = [[5, 6, 7, 8, 9]]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=[S.DType.BF16, S.DType.F16])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("dense") / "m.colibri"
    write_synthetic(p, synthetic_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, experts=4, top_k=2,
                                       expert_inter=32), dense_dtype=request.param)
    return p, request.param


def test_long_passes_round_bf16_matrices_inputs_only(path):
    p, dtype = path
    with Engine(p, EngineConfig(dense_gemm="bf16")) as rounded, Engine(p) as split, \
            Engine(p, EngineConfig(dense_gemm="bf16", bf16_tensor_cores=False)) as off:
        long_r, long_s, long_off = rounded.logits(LONG)[0], split.logits(LONG)[0], off.logits(LONG)[0]
        if dtype == S.DType.BF16:
            assert 0 < rel(long_r, long_s) < 2e-2        # rounded, by bf16's 8 bits at most
        else:
            np.testing.assert_array_equal(long_r, long_s)   # float16 matrices go to f32 cuBLAS: never rounded
        np.testing.assert_array_equal(long_off, long_s)     # no tensor cores: no bf16 products at all
        np.testing.assert_array_equal(rounded.logits(SHORT)[0], split.logits(SHORT)[0])   # dense_gemv's passes


def test_an_unknown_value_is_refused():
    with pytest.raises(InvalidInput, match="dense_gemm"):
        EngineConfig(dense_gemm="fp8")
