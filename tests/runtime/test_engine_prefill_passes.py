"""Prefill in passes of at most `EngineConfig.max_prefill_rows` rows (issue 15, chunked prefill): a long prompt, or
a packed batch, runs in several eager passes, each continuing the KV cache (and the recurrent state, or the MLA
latent cache) its earlier pieces wrote; logits and tokens are those of one pass. Both engines (CUDA on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.engine import prefill_passes
from tests.runtime.test_engine_scenarios import (  # noqa: F401
    BF16_ROUNDED_TOLERANCE, PROMPTS, TOLERANCE, W8A8_TOLERANCE, device, mixtral_file, rel)

LONG = list(range(3, 40))                     # 37 tokens: passes of 5 split it 8 times


def test_passes_fill_up_in_sequence_order():
    assert prefill_passes([7, 2, 3], 5) == [[(0, 0, 5)], [(0, 5, 7), (1, 0, 2), (2, 0, 1)], [(2, 1, 3)]]
    assert prefill_passes([3, 2], 5) == [[(0, 0, 3), (1, 0, 2)]]
    assert prefill_passes([12], 4) == [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 12)]]


def test_max_prefill_rows_is_checked():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidInput) as info:
            EngineConfig(max_prefill_rows=bad)
        assert info.value.field == "max_prefill_rows"


def _same_in_passes(path, device: str, prompts, precision: str = "float32", tol: float | None = None,
                    rows: int = 5, **config) -> None:
    """Passes of `rows` rows against one pass. Float activations unless `config` says otherwise: W8A8 prefill
    ('int8') rounds only passes of more than 32 rows, so passes of 5 would differ from a whole one by that alone."""
    tol = tol or TOLERANCE[device]
    cfg = dict(device=device, max_seq_len=96, precision=precision, **({"fast_expert_gemm": "split"} | config))
    with Engine(path, EngineConfig(max_prefill_rows=rows, **cfg)) as parts, Engine(path, EngineConfig(**cfg)) as whole:
        for a, b in zip(parts.logits(prompts), whole.logits(prompts)):
            assert a.shape == b.shape and rel(a, b) < tol
        assert parts.infer(prompts) == whole.infer(prompts)
        assert parts.generate_batch(prompts, 4) == whole.generate_batch(prompts, 4)
        assert parts.generate(prompts[0], max_new_tokens=4, stop_ids=[]).output_ids == \
            whole.generate(prompts[0], max_new_tokens=4, stop_ids=[]).output_ids


def test_a_long_prompt_and_a_packed_batch_in_passes(mixtral_file, device):  # noqa: F811
    _same_in_passes(mixtral_file, device, [LONG] + PROMPTS)


def test_passes_continue_a_bf16_kv_cache(mixtral_file, device):  # noqa: F811
    """Later pieces read the keys and values earlier ones stored as bf16: the rounded cache of one pass, up to the
    keys whose float order in passes of 5 rows moves them across a bf16 rounding midpoint (4.3e-5 here)."""
    _same_in_passes(mixtral_file, device, [LONG] + PROMPTS, tol=BF16_ROUNDED_TOLERANCE[device], kv_cache_dtype="bfloat16")


def test_w8a8_passes_of_more_than_32_rows_are_one_pass(mixtral_file, device):  # noqa: F811
    """W8A8 prefill ('int8') rounds each row by its own scale, so passes of 35 rows give what one pass of 70
    gives, up to the float order of attention across passes (2.9e-7 on the CPU)."""
    _same_in_passes(mixtral_file, device, [[(5 * i + 1) % 128 for i in range(70)]], tol=W8A8_TOLERANCE[device],
                    rows=35, fast_expert_gemm="int8")


@pytest.mark.parametrize("family", ["hybrid", "mla"])
def test_recurrent_state_and_latent_cache_continue_across_passes(tmp_path, family):
    if family == "hybrid":
        from tests.hf_hybrid import build, convert_file
        model = build("qwen3_next")
    else:
        from tests.hf_mla import build, convert_file
        model = build("deepseek_v3")
    path = convert_file(model, tmp_path, dtype="float32", quantize="expert")
    # float64: the chunked delta rule over spans of 5 + 2 rows rounds differently from one span of 7 in float32
    _same_in_passes(path, "cpu", [LONG, [5, 6, 7, 8, 9, 10, 11], [1, 2]], precision="float64", tol=1e-10)


def test_logits_rows_keep_their_sequence_order(mixtral_file):  # noqa: F811
    with Engine(mixtral_file, EngineConfig(max_prefill_rows=3)) as eng:
        rows = eng.logits([[1, 2, 3, 4], [5], [6, 7]])
    assert [r.shape[0] for r in rows] == [4, 1, 2] and all(np.isfinite(r).all() for r in rows)
