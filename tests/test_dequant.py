"""colibri_format/dequant.py: the one reading of the quantized expert formats (docs/spec.md §8)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.convert.derived import FP4, Mxfp4
from colibri_format.dequant import FP4_VALUES, INT4_VALUES, dequantize_matrix, e8m0, unpack_nibbles
from colibri_format.reader import dequantize


def test_int4_nibbles_are_twos_complement_low_nibble_first() -> None:
    packed = np.array([[0x9F, 0x70, 0x08]], np.uint8)
    assert unpack_nibbles(packed, INT4_VALUES).tolist() == [[-1, -7, 0, 7, -8, 0]]
    scale = np.array([[0.5]], np.float16)
    assert dequantize_matrix(S.ExpertFormat.INT4_GROUP, packed, scale).tolist() == [[-0.5, -3.5, 0, 3.5, -4, 0]]


def test_fp4_table_is_ocp_e2m1() -> None:
    """Bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa; code 1 is the subnormal 0.5."""
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        value = (man / 2.0) if exp == 0 else (1 + man / 2.0) * 2.0 ** (exp - 1)
        assert FP4_VALUES[code] == (-value if sign else value), code
    np.testing.assert_array_equal(FP4_VALUES, FP4)            # the converter's table (checked against transformers)


def test_e8m0() -> None:
    e = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)
    got = e8m0(e, np.float64)
    np.testing.assert_array_equal(got[:-1], 2.0 ** (e[:-1].astype(int) - 127))
    assert np.isnan(got[-1]) and np.isnan(e8m0(e, np.float32)[-1])
    assert e8m0(np.array([0], np.uint8), np.float32)[0] == np.float32(2.0 ** -127)    # a float32 subnormal, exact


def test_mxfp4_equals_the_converters_decoder() -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (5, 3, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (5, 3), dtype=np.uint8)

    class Src:
        def raw_view(self, name):
            return blocks if name == "b" else scales

    got = dequantize_matrix(S.ExpertFormat.MXFP4, blocks.reshape(5, 48), scales)
    np.testing.assert_array_equal(got, Mxfp4(Src(), "b", "s").rows(None, 0, 5))


def test_int8_formats_are_the_readers() -> None:
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (4, 64), dtype=np.int8)
    scale = rng.uniform(0.01, 0.1, (4, 2)).astype(np.float32)
    np.testing.assert_array_equal(dequantize_matrix(S.ExpertFormat.INT8_GROUP, q, scale), dequantize(q, scale))
    np.testing.assert_array_equal(dequantize_matrix(S.ExpertFormat.INT8_ROW, q, scale[:, :1]),
                                  dequantize(q, scale[:, :1]))


def test_float_formats_are_not_quantized() -> None:
    with pytest.raises(ValueError):
        dequantize_matrix(S.ExpertFormat.BF16, np.zeros((1, 2), np.uint16), np.ones((1, 1), np.float32))
