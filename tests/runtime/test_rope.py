"""RoPE inverse frequencies and cos/sin scale against transformers' ROPE_INIT_FUNCTIONS, type by type."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from colibri_format.errors import UnsupportedModel
from colibri_format.runtime.numpy_backend import rope
from colibri_format.runtime import rope as rope_module
from colibri_format.runtime.rope import cos_sin_half, cos_sin_rows, inv_frequencies

HEAD_DIM, MAX_POS = 16, 64
CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 0.7, "beta_fast": 24.0, "beta_slow": 2.0,
                    "original_max_position_embeddings": 8},
    "yarn-untruncated": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "truncate": False,
                         "original_max_position_embeddings": 16},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "attention_factor": 0.5, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + 0.3 * i for i in range(HEAD_DIM // 2)]},
}


def hf_config(params: dict):
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=MAX_POS, rope_parameters=dict(params))


def colibri_rope(params: dict) -> dict:
    rope = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    return {"type": params["rope_type"], "theta": params["rope_theta"], **rope}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seq_len", [10, 40, 200])   # below/above original contexts, beyond max_pos
def test_inverse_frequencies_match_transformers(case, seq_len):
    params = CASES[case]
    fn = ROPE_INIT_FUNCTIONS.get(params["rope_type"])
    ref, ref_scale = fn(hf_config(params), "cpu", seq_len=seq_len) if fn else (None, None)
    if fn is None:  # "default" is computed inline by the rotary module in transformers v5
        cfg = hf_config(params)
        ref = 1.0 / params["rope_theta"] ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        ref_scale = 1.0
        assert cfg.rope_parameters["rope_type"] == "default"
    got, scale = inv_frequencies(colibri_rope(params), HEAD_DIM, MAX_POS, seq_len)
    np.testing.assert_allclose(got, np.asarray(ref, np.float64), rtol=1e-6)
    assert scale == pytest.approx(float(ref_scale), rel=1e-6)


def test_unknown_rope_type_is_refused():
    with pytest.raises(UnsupportedModel, match="rope type 'su'"):
        inv_frequencies({"type": "su", "theta": 1.0}, HEAD_DIM, MAX_POS, 8)


def test_rotate_half_convention_and_norm_preservation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, HEAD_DIM)).astype(np.float32)
    inv_freq, scale = inv_frequencies({"type": "default", "theta": 10000.0}, HEAD_DIM, MAX_POS, 5)
    cos, sin = cos_sin_half(np.arange(5), inv_freq, scale)
    y = rope(x.copy(), np.arange(5), cos, sin)
    np.testing.assert_allclose(y[0], x[0], rtol=0, atol=0)                      # position 0: identity
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    half = HEAD_DIM // 2                                                          # channel j pairs with j + hd/2
    angle = 3 * inv_freq[0]
    expected = x[3, :, 0] * np.cos(angle) - x[3, :, half] * np.sin(angle)
    np.testing.assert_allclose(y[3, :, 0], expected, rtol=1e-5)


def test_partial_rotary_passes_the_tail_through():
    x = np.random.default_rng(1).standard_normal((4, 2, HEAD_DIM)).astype(np.float32)
    partial = {"type": "default", "theta": 10000.0, "partial_rotary_factor": 0.5}
    cos, sin = cos_sin_half(np.arange(4), *inv_frequencies(partial, HEAD_DIM, MAX_POS, 4))
    assert cos.shape == (4, HEAD_DIM // 4)        # a value a rotated pair: a quarter of the head
    np.testing.assert_array_equal(rope(x.copy(), np.arange(4), cos, sin)[..., HEAD_DIM // 2:], x[..., HEAD_DIM // 2:])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("start, rows", [(0, 1), (0, 5), (0, 300), (3, 200), (130, 1), (5000, 1), (4096, 40)])
def test_cos_sin_rows_equal_the_direct_computation_bit_for_bit(case, start, rows):
    rope = colibri_rope(CASES[case])
    positions = start + np.arange(rows)
    cos, sin = cos_sin_rows(rope, HEAD_DIM, MAX_POS, positions)
    ref_cos, ref_sin = cos_sin_half(positions, *inv_frequencies(rope, HEAD_DIM, MAX_POS, start + rows))
    assert cos.dtype == sin.dtype == np.float32
    np.testing.assert_array_equal(cos, ref_cos)
    np.testing.assert_array_equal(sin, ref_sin)
    cos[...] = 0.0                                              # a copy: the table behind it is untouched
    np.testing.assert_array_equal(cos_sin_rows(rope, HEAD_DIM, MAX_POS, positions)[0], ref_cos)


def test_a_prefill_reads_one_table_and_a_far_decode_row_builds_none():
    rope_module._table.cache_clear()
    rope = colibri_rope(CASES["default"])
    cos_sin_rows(rope, HEAD_DIM, MAX_POS, np.arange(512))
    cos_sin_rows(rope, HEAD_DIM, MAX_POS, np.arange(500))       # the same table again
    assert rope_module._table.cache_info().currsize == 1 and rope_module._table.cache_info().hits == 1
    cos_sin_rows(rope, HEAD_DIM, MAX_POS, np.array([100_000]))  # a table of 2^17 rows for one row: computed directly
    cos_sin_rows(colibri_rope(CASES["dynamic"]), HEAD_DIM, MAX_POS, np.arange(512))   # length-dependent frequencies
    assert rope_module._table.cache_info().currsize == 1
