"""int8 quantizer: the half-step error bound, zero rows, reported errors, and argument checks."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from colibri_format.convert.quantize import benchmark_quantize, quantize_int8
from colibri_format.errors import InvalidInput
from colibri_format.reader import dequantize  # the format's inverse: what a reader of the file computes

FINITE = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def weight_and_group(draw: st.DrawFn) -> tuple[np.ndarray, int | None]:
    group = draw(st.sampled_from([None, 1, 2, 4, 8]))
    n_in = (group or 1) * draw(st.integers(1, 6))
    w = draw(arrays(np.float32, (draw(st.integers(1, 6)), n_in), elements=FINITE))
    if draw(st.booleans()):
        w[draw(st.integers(0, w.shape[0] - 1))] = 0.0  # an all-zero row
    return w, group


def expanded(scale: np.ndarray, n_in: int) -> np.ndarray:
    return np.repeat(scale, n_in // scale.shape[1], axis=1)


@settings(max_examples=150, deadline=None)
@given(weight_and_group())
def test_error_is_at_most_half_a_step_everywhere(case: tuple[np.ndarray, int | None]) -> None:
    w, group = case
    q, scale, max_rel, mean_rel = quantize_int8(w, group)
    g = group or w.shape[1]
    assert q.dtype == np.int8 and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (w.shape[0], w.shape[1] // g)
    assert np.abs(q.astype(np.int32)).max() <= 127
    deq = dequantize(q, scale)
    step = expanded(scale, w.shape[1]).astype(np.float64)
    err = np.abs(w.astype(np.float64) - deq.astype(np.float64))
    assert (err <= step / 2 * (1 + 1e-6) + 1e-30).all()
    # reported errors agree with a direct float64 computation
    row_max = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True)
    rel = np.divide(err, row_max, out=np.zeros_like(err), where=row_max > 0)
    assert max_rel == pytest.approx(rel.max(), rel=1e-4, abs=1e-7)
    assert mean_rel == pytest.approx(rel.mean(), rel=1e-4, abs=1e-7)
    # a row near the bottom of float32's normal range has a subnormal scale, rounded up by at most 2**-149
    slack = 2.0**-149 / row_max[row_max > 0].min() if (row_max > 0).any() else 0.0
    assert max_rel <= 0.5 / 127 * (1 + 1e-5) + slack


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, (3, 8), elements=FINITE))
def test_row_max_is_exactly_representable(w: np.ndarray) -> None:
    q, scale, _, _ = quantize_int8(w)
    for row in range(w.shape[0]):
        if np.abs(w[row]).max() > 0:
            assert np.abs(q[row].astype(np.int32)).max() == 127


def test_zero_rows_and_groups_give_exact_zeros_with_unit_scale() -> None:
    w = np.zeros((3, 8), np.float32)
    w[1, 4:] = [1, -2, 3, -4]
    q, scale, max_rel, mean_rel = quantize_int8(w, 4)
    assert scale[0].tolist() == [1.0, 1.0] and scale[1, 0] == 1.0
    assert not q[0].any() and not q[1, :4].any()
    deq = dequantize(q, scale)
    assert np.array_equal(deq[0], np.zeros(8)) and np.array_equal(deq[2], np.zeros(8))
    assert np.isfinite([max_rel, mean_rel]).all()


def test_group_quantization_beats_row_quantization_on_outliers() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 256), dtype=np.float32) * 0.01
    w[:, 0] = 10.0  # one outlier column ruins the per-row scale
    assert quantize_int8(w, 32).mean_rel_err < quantize_int8(w).mean_rel_err / 5


def test_large_blocked_input_matches_small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from colibri_format.convert import quantize as qmod

    w = np.random.default_rng(1).standard_normal((300, 64), dtype=np.float32)
    whole = quantize_int8(w, 16)
    monkeypatch.setattr(qmod, "BLOCK_BYTES", 7 * 64 * 4)  # 7 rows per block, ragged last block
    blocked = quantize_int8(w, 16)
    assert np.array_equal(whole.q, blocked.q) and np.array_equal(whole.scale, blocked.scale)
    assert whole.max_rel_err == pytest.approx(blocked.max_rel_err)
    assert whole.mean_rel_err == pytest.approx(blocked.mean_rel_err)


def test_non_contiguous_input_is_accepted() -> None:
    w = np.random.default_rng(2).standard_normal((8, 16), dtype=np.float32)
    assert np.array_equal(quantize_int8(w.T.copy().T).q, quantize_int8(np.ascontiguousarray(w)).q)
    assert np.array_equal(quantize_int8(w[:, ::2]).q, quantize_int8(np.ascontiguousarray(w[:, ::2])).q)


@pytest.mark.parametrize("w, group", [
    (np.ones((2, 8), np.float64), None), (np.ones(8, np.float32), None), (np.ones((2, 8), np.float32), 3),
    (np.ones((2, 8), np.float32), 0), (np.ones((2, 8), np.float32), True), (np.ones((2, 0), np.float32), None),
    (np.array([[1.0, np.nan]], np.float32), None), (np.array([[1.0, np.inf]], np.float32), None),
])
def test_bad_arguments_are_invalid_input(w: np.ndarray, group: int | None) -> None:
    with pytest.raises(InvalidInput):
        quantize_int8(w, group)


def test_benchmark_reports_throughput() -> None:
    result = benchmark_quantize(64, 256, group_size=32, repeats=1)
    assert result["gb_per_s"] > 0 and result["source_bytes"] == 64 * 256 * 4


@pytest.mark.parametrize("group", [None, 64, 8])
def test_both_group_reductions_agree(monkeypatch: pytest.MonkeyPatch, group: int | None) -> None:
    from colibri_format.convert import quantize as qmod

    w = np.random.default_rng(3).standard_normal((40, 128), dtype=np.float32)
    results = []
    for small in (0, 1 << 20):  # force the axis reduction, then the strided one
        monkeypatch.setattr(qmod, "SMALL_GROUP", small)
        results.append(quantize_int8(w, group))
    assert np.array_equal(results[0].q, results[1].q) and np.array_equal(results[0].scale, results[1].scale)
    assert results[0].max_rel_err == pytest.approx(results[1].max_rel_err, rel=1e-6)
    assert results[0].mean_rel_err == pytest.approx(results[1].mean_rel_err, rel=1e-5)


# --- tiny, subnormal and zero rows: the error statistics stay finite and exact -------------------------
def _reference_errors(w: np.ndarray, q: np.ndarray, scale: np.ndarray) -> tuple[float, float]:
    """(max, mean) of |w - q*scale| / max|w[row]| in float64 (zero rows: 0)."""
    err = np.abs(w.astype(np.float64) - q.astype(np.float64) * expanded(scale, w.shape[1]).astype(np.float64))
    row_max = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True)
    rel = np.divide(err, row_max, out=np.zeros_like(err), where=row_max > 0)
    return float(rel.max()), float(rel.mean())


def _tiny_rows(magnitude: float) -> np.ndarray:
    """Rows of one magnitude: whole, with zero groups, mixed with a normal value, all zero, and subnormal
    patterns of alternating sign."""
    v = np.float32(magnitude)
    w = np.zeros((6, 64), np.float32)
    w[0] = v * np.where(np.arange(64) % 3, 1, -0.5).astype(np.float32)
    w[1, :16] = v                      # one tiny group, three zero groups
    w[2, 16:20] = -v                   # a tiny group among zeros, the others zero
    w[3, :32] = v
    w[3, 40] = 0.75                    # tiny and zero groups in a row whose max is normal
    w[5, ::7] = v                      # row 4 stays all zero
    return w


@pytest.mark.parametrize("magnitude", [1.4e-45, 3e-45, 1e-44, 1e-42, 1e-40, 2e-39, 1e-38, 1.2e-36])
@pytest.mark.parametrize("group", [None, 16, 32])
def test_tiny_and_zero_groups_give_finite_exact_errors(magnitude: float, group: int | None) -> None:
    w = _tiny_rows(magnitude)
    with np.errstate(over="raise", invalid="raise"):  # no overflow to inf, no 0 * inf on the way
        q, scale, max_rel, mean_rel = quantize_int8(w, group)
    assert np.isfinite([max_rel, mean_rel]).all() and np.isfinite(scale).all() and (scale > 0).all()
    ref_max, ref_mean = _reference_errors(w, q, scale)
    assert max_rel == pytest.approx(ref_max, rel=1e-4, abs=1e-7)  # the reference rounds q*scale to float64
    assert mean_rel == pytest.approx(ref_mean, rel=1e-4, abs=1e-7)  # the reference rounds q*scale to float64
    assert not q[4].any() and not q[1, 16:].any()


TINY = st.floats(-2.0**-120, 2.0**-120, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([None, 4, 8]), st.data())
def test_subnormal_rows_with_zero_groups_report_what_a_float64_reference_says(group: int | None,
                                                                               data: st.DataObject) -> None:
    w = data.draw(arrays(np.float32, (data.draw(st.integers(1, 5)), 16), elements=TINY))
    for row, col in data.draw(st.lists(st.tuples(st.integers(0, w.shape[0] - 1), st.integers(0, 3)), max_size=4)):
        w[row, col * 4:(col + 1) * 4] = 0.0  # zero groups (or zero stretches of a row)
    q, scale, max_rel, mean_rel = quantize_int8(w, group)
    ref_max, ref_mean = _reference_errors(w, q, scale)
    assert max_rel == pytest.approx(ref_max, rel=1e-4, abs=1e-7)  # the reference rounds q*scale to float64
    assert mean_rel == pytest.approx(ref_mean, rel=1e-4, abs=1e-7)  # the reference rounds q*scale to float64


@pytest.mark.parametrize("value, word", [(np.nan, "NaN"), (np.inf, "+inf"), (-np.inf, "-inf")])
def test_a_non_finite_value_is_named_by_row_and_column_in_any_block(value: float, word: str) -> None:
    from colibri_format.errors import NonFiniteWeight

    w = np.ones((200, 4096), np.float32)  # 64 rows per block: row 150 is in the third
    w[150, 4000] = value
    w[170, 3] = np.nan
    for group in (None, 64):
        with pytest.raises(NonFiniteWeight, match=rf"weight holds {re.escape(word)} at index \[150, 4000\]"):
            quantize_int8(w, group)
