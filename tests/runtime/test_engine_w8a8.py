"""The NumPy engine's twin of the CUDA W8A8 prefill (EngineConfig.fast_expert_gemm 'int8', or 'auto' (the default)
on large experts; limits.rounds_rows_int8): passes of more than 32 rows over int8 per-row experts compute the float
products of their inputs rounded to int8 a row (numpy_backend.round_int8_rows), smaller passes and other formats the
float ones, so that the CUDA engine's W8A8 prefill has an oracle that rounds as it does."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda import limits
from colibri_format.synthetic import synthetic_model, write_synthetic

MODEL = dict(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, expert_inter=96)
LONG = [(7 * i + 3) % 64 for i in range(40)]          # one 40-row prefill pass
SHORT = LONG[:limits.ATT_DECODE_MAX_ROWS]               # a pass a decode graph could capture: never rounded


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("w8a8") / "m.colibri", synthetic_model(**MODEL), seed=3)


def logits(path, prompt, **config) -> np.ndarray:
    with Engine(path, EngineConfig(**config)) as eng:
        return eng.logits([prompt])[0]


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_long_passes_compute_the_float_products_of_rounded_inputs(path, precision, monkeypatch):
    rounded = logits(path, LONG, precision=precision, fast_expert_gemm="int8")
    plain = logits(path, LONG, precision=precision, fast_expert_gemm="split")
    assert not np.array_equal(rounded, plain)
    assert np.linalg.norm(rounded - plain) / np.linalg.norm(plain) < 0.05
    monkeypatch.setattr(nb, "expert_ffn", functools.partial(nb.expert_ffn, round_input=nb.round_int8_rows))
    np.testing.assert_array_equal(rounded, logits(path, LONG, precision=precision, fast_expert_gemm="split"))


def test_passes_a_decode_graph_could_capture_keep_float_inputs(path):
    np.testing.assert_array_equal(logits(path, SHORT, fast_expert_gemm="int8"),
                                  logits(path, SHORT, fast_expert_gemm="split"))


def test_auto_rounds_from_the_mean_work_limit(path, monkeypatch):
    """The tiny experts are far below limits.W8A8_MIN_EXPERT_MACS: 'auto' (the default) computes the float products
    there, and the int8 ones once the limit is moved below them."""
    plain = logits(path, LONG, fast_expert_gemm="split")
    np.testing.assert_array_equal(logits(path, LONG), plain)
    monkeypatch.setattr(limits, "W8A8_MIN_EXPERT_MACS", 0)
    np.testing.assert_array_equal(logits(path, LONG, fast_expert_gemm="auto"),
                                  logits(path, LONG, fast_expert_gemm="int8"))



def test_round_int8_rows_is_the_row_quantizer():
    x = np.random.default_rng(1).standard_normal((5, 48)).astype(np.float32)
    x[2] = 0
    q, s = nb.quantize_int8_groups(x, 48)
    np.testing.assert_array_equal(nb.round_int8_rows(x), q.astype(np.float32) * s)


def test_only_int8_per_row_experts_without_extras_round():
    layout = S.blob_layout(64, 96, S.ExpertFormat.INT8_ROW)
    assert limits.rounds_rows_int8("int8", 40, 80, 4, layout, extras=False)
    assert not limits.rounds_rows_int8("int8", 40, 80, 4, layout, extras=True)
    assert not limits.rounds_rows_int8("int8", 32, 64, 4, layout, extras=False)
    assert not limits.rounds_rows_int8("split", 40, 80, 4, layout, extras=False)
    for fmt, group in ((S.ExpertFormat.INT8_GROUP, 32), (S.ExpertFormat.INT4_GROUP, 32), (S.ExpertFormat.F32, 0)):
        assert not limits.rounds_rows_int8("int8", 40, 80, 4, S.blob_layout(64, 96, fmt, group), extras=False)
