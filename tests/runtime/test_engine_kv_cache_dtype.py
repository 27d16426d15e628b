"""EngineConfig.kv_cache_dtype="bfloat16": keys and values cached as bf16 bits (half the bytes), rounded to nearest
even from the float32 values the attention would have cached, read back exactly; on the NumPy backend here (the CUDA
kernels read and write the same bits: tests/runtime/test_engine_scenarios.py on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.dtypes import float32_to_bf16_bits
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.synthetic import synthetic_model, write_synthetic

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("kv") / "m.colibri"
    write_synthetic(p, synthetic_model(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, experts=4, top_k=2,
                                       expert_inter=32))
    return p


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_cache_holds_bf16_bits_and_logits_stay_close(path):
    with Engine(path, EngineConfig(kv_cache_dtype="bfloat16")) as half, Engine(path) as full:
        assert half.stats()["kv_cache_dtype"] == "bfloat16" and full.stats()["kv_cache_dtype"] == "float32"
        runner = half.decode_runner(2, 16)
        assert all(k.dtype == np.uint16 for k in runner.kv.keys + runner.kv.values if k is not None)
        for got, want in zip(half.logits(PROMPTS), full.logits(PROMPTS)):
            assert 0 < rel(got, want) < 2e-2          # rounded (not equal), and only by bf16's 8 bits
        assert half.generate_batch(PROMPTS, 4) == [half.generate(p, max_new_tokens=4, stop_ids=[]).output_ids
                                                   for p in PROMPTS]


def test_written_entries_are_the_rounded_values_and_read_back_exactly():
    """qkv_rope_kv stores bf16(k) and bf16(v) (round to nearest even, as float32_to_bf16_bits); attention reads
    them back exactly: the same output as a float32 cache holding the rounded values."""
    rng = np.random.default_rng(0)
    heads, kv_heads, hd, T = 4, 2, 8, 5
    qkv = rng.standard_normal((T, (heads + 2 * kv_heads) * hd)).astype(np.float32)
    cos, sin = np.ones((16, hd // 2), np.float32), np.zeros((16, hd // 2), np.float32)
    seq, pos = np.zeros(T, np.int32), np.arange(T, dtype=np.int32)
    half = [np.zeros((1, 16, kv_heads, hd), np.uint16) for _ in range(2)]
    full = [np.zeros((1, 16, kv_heads, hd), np.float32) for _ in range(2)]
    q = nb.qkv_rope_kv(qkv, heads, kv_heads, *half, seq, pos, pos, cos, sin)
    nb.qkv_rope_kv(qkv, heads, kv_heads, *full, seq, pos, pos, cos, sin)
    for h, f in zip(half, full):
        np.testing.assert_array_equal(h[0, :T], float32_to_bf16_bits(f[0, :T]))
    rounded = [nb.widen(h, np.float32) for h in half]
    lens = np.arange(1, T + 1, dtype=np.int32)
    np.testing.assert_array_equal(nb.attention(q, *half, seq, lens, 0.3), nb.attention(q, *rounded, seq, lens, 0.3))


@pytest.mark.parametrize("family", ["hybrid", "mla"])
def test_hybrid_and_latent_models_take_the_option(tmp_path, family):
    """Gated DeltaNet layers keep no keys (their attention layers' caches are bf16); multi-head latent attention keeps
    its latent cache as computed, and the stats say so. Both run and stay close to the float32 cache."""
    if family == "hybrid":
        from tests.hf_hybrid import build, convert_file
        model = build("qwen3_next")
    else:
        from tests.hf_mla import build, convert_file
        model = build("deepseek_v3")
    path = convert_file(model, tmp_path, dtype="float32", quantize="expert")
    with Engine(path, EngineConfig(kv_cache_dtype="bfloat16")) as half, Engine(path) as full:
        runner = half.decode_runner(1, 16)
        kept = [k for k in runner.kv.keys if k is not None]
        if family == "mla":
            assert half.stats()["kv_cache_dtype"] == "float32" and all(k.dtype == np.float32 for k in kept)
        else:
            assert half.stats()["kv_cache_dtype"] == "bfloat16" and kept and all(k.dtype == np.uint16 for k in kept)
            assert len(kept) < half.args.num_layers                     # the DeltaNet layers keep none
        for got, want in zip(half.logits(PROMPTS), full.logits(PROMPTS)):
            assert rel(got, want) < (1e-6 if family == "mla" else 2e-2)
