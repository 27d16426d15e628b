"""The CUDA engine against the NumPy engine on real `.colibri` files (GPU only; skipped without CuPy/GPU).

Tiny transformers checkpoints of every supported architecture (head_dim 64 so the attention kernel runs; one
model with head_dim 8 for the array-operation fallback) are converted with int8 experts by the real pipeline.
Both engines read the same int8 blobs, so they differ only by float32 summation order: logits agree to
LOGIT_TOL and greedy tokens are equal. Also: graph replay = eager, paging vs the NumPy engine (outputs, hits,
misses, evictions), prefetch, the staging fallback, verify-on-page-in and the over-budget error.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.convert.pipeline import convert
from colibri_format.errors import CorruptExpert, InvalidInput
from colibri_format.runtime import Engine, EngineConfig

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared")
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)   # head_dim 64
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42]]
LOGIT_TOL = 2e-3


def make_file(tmp_path_factory, arch: str, dtype: str = "float32", **overrides):
    from tests.hf_models import make_tiny_checkpoint

    out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
    if arch == "qwen3_moe" and "hidden_size" in overrides:
        overrides = {**overrides, "head_dim": overrides["hidden_size"] // overrides["num_attention_heads"]}
    make_tiny_checkpoint(arch, out / "hf", **overrides)
    path = out / "model.colibri"
    convert(out / "hf", path, dtype=dtype, quantize="expert", workers=1, verify=False)
    return path


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=ARCHS)
def arch_file(request, tmp_path_factory):
    return make_file(tmp_path_factory, request.param, **WIDE)


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory):
    return make_file(tmp_path_factory, "mixtral", num_hidden_layers=3, **WIDE)


def test_matches_numpy_engine_on_every_architecture(arch_file):
    with Engine(arch_file) as cpu, Engine(arch_file, EngineConfig(device="cuda", max_seq_len=64)) as gpu:
        assert type(gpu).__name__ == "CudaEngine" and gpu.fwd.fused
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert got.shape == exp.shape and rel(got, exp) < LOGIT_TOL
        assert gpu.infer(PROMPTS) == cpu.infer(PROMPTS)
        a = gpu.generate([3, 4, 5], max_new_tokens=10, stop_ids=[])
        b = cpu.generate([3, 4, 5], max_new_tokens=10, stop_ids=[])
        assert a.output_ids == b.output_ids
        assert gpu.stats()["graphs"] == {"1x64": "captured"}


def test_unfused_layer_path_still_matches(arch_file, monkeypatch):
    """COLIBRI_CUDA_FUSED=0: the unfused kernel chain (rmsnorm, residual_add, rope, kv_append) stays correct."""
    monkeypatch.setenv("COLIBRI_CUDA_FUSED", "0")
    with Engine(arch_file) as cpu, Engine(arch_file, EngineConfig(device="cuda", max_seq_len=64)) as gpu:
        assert not gpu.fwd.fused
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < LOGIT_TOL
        assert gpu.generate([3, 4, 5], max_new_tokens=6, stop_ids=[]).output_ids == \
            cpu.generate([3, 4, 5], max_new_tokens=6, stop_ids=[]).output_ids


def test_bf16_dense_weights(tmp_path_factory):
    path = make_file(tmp_path_factory, "qwen3_moe", dtype="bfloat16", **WIDE)
    with Engine(path) as cpu, Engine(path, EngineConfig(device="cuda")) as gpu:
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < LOGIT_TOL
        assert gpu.generate([3, 4], max_new_tokens=6, stop_ids=[]).output_ids == \
            cpu.generate([3, 4], max_new_tokens=6, stop_ids=[]).output_ids


def test_small_heads_use_the_fallback_attention(tmp_path_factory):
    path = make_file(tmp_path_factory, "mixtral")                                  # head_dim 8
    with Engine(path) as cpu, Engine(path, EngineConfig(device="cuda", max_seq_len=64)) as gpu:
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < LOGIT_TOL
        assert gpu.generate([3, 4], max_new_tokens=5, stop_ids=[]).output_ids == \
            cpu.generate([3, 4], max_new_tokens=5, stop_ids=[]).output_ids


def test_graph_replay_equals_eager(mixtral_file):
    from colibri_format.runtime.cuda.engine_cuda import CudaEngine

    cfg = EngineConfig(device="cuda")
    with CudaEngine(mixtral_file, cfg) as g, CudaEngine(mixtral_file, cfg, use_graphs=False) as e:
        prompts = [[1, 2, 3], [9, 8], [4], [7, 7, 7, 7]]
        assert g.generate_batch(prompts, 12) == e.generate_batch(prompts, 12)
        assert g.stats()["graphs"]["4x64"] == "captured"
        assert e.stats()["graphs"]["4x64"] == "graphs disabled"
        ra, rb = g._runner(4, 64), e._runner(4, 64)
        la = g.be.to_host(ra.step(np.array([1, 2, 3, 4]), np.array([20, 21, 22, 23]))).copy()
        lb = e.be.to_host(rb.step(np.array([1, 2, 3, 4]), np.array([20, 21, 22, 23])))
        assert np.array_equal(la, lb)                   # same kernels, same order: bit-identical


def test_batch_generation_matches_single_sequences(mixtral_file):
    with Engine(mixtral_file) as cpu, Engine(mixtral_file, EngineConfig(device="cuda")) as gpu:
        for prompt, got in zip(PROMPTS, gpu.generate_batch(PROMPTS, 6)):
            assert got == cpu.generate(prompt, max_new_tokens=6, stop_ids=[]).output_ids


@pytest.mark.parametrize("policy,scope,capacity", [("lru", "global", 3), ("lrfu", "global", 5),
                                                   ("lru", "per_layer", 2), ("lfu", "per_layer", 1)])
def test_paging_matches_numpy_engine(mixtral_file, policy, scope, capacity):
    cfg = dict(max_cached_experts=capacity, cache_policy=policy, cache_scope=scope)
    with Engine(mixtral_file, EngineConfig(**cfg)) as cpu, \
            Engine(mixtral_file, EngineConfig(device="cuda", **cfg)) as gpu:
        assert not gpu.experts.resident and gpu.stats()["host_source"] == "registered"
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < LOGIT_TOL
        a = gpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        b = cpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        assert a.output_ids == b.output_ids
        assert (a.stats.cache_hits, a.stats.cache_misses) == (b.stats.cache_hits, b.stats.cache_misses)
        assert a.stats.bytes_paged == b.stats.bytes_paged
        assert gpu.cache.stats().evictions == cpu.cache.stats().evictions > 0


def test_prefetch_keeps_outputs(mixtral_file):
    from colibri_format.runtime.cuda.engine_cuda import CudaEngine

    cfg = dict(max_cached_experts=8, cache_policy="lrfu")
    with Engine(mixtral_file, EngineConfig(**cfg)) as cpu:
        want = cpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids
    with CudaEngine(mixtral_file, EngineConfig(device="cuda", **cfg), prefetch=True) as gpu:
        assert gpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids == want
        assert gpu.stats()["paging"]["prefetch_loads"] > 0


def test_staging_ring_when_registration_fails(mixtral_file, monkeypatch):
    from colibri_format.runtime.cuda.backend import CupyBackend

    def refuse(self, addr, nbytes):
        raise RuntimeError("refused (test)")

    monkeypatch.setattr(CupyBackend, "register_host", refuse)
    cfg = dict(max_cached_experts=3)
    with Engine(mixtral_file, EngineConfig(**cfg)) as cpu, \
            Engine(mixtral_file, EngineConfig(device="cuda", **cfg)) as gpu:
        assert gpu.stats()["host_source"] == "staging"
        assert gpu.infer(PROMPTS) == cpu.infer(PROMPTS)


def test_corrupt_expert_is_caught_on_page_in(tmp_path_factory):
    import colibri_format

    path = make_file(tmp_path_factory, "mixtral", **WIDE)
    with colibri_format.open(path, verify="never") as f:
        offset = f.blob_offset(1, 2)
    with open(path, "r+b") as fh:
        fh.seek(offset + 7)
        b = fh.read(1)
        fh.seek(offset + 7)
        fh.write(bytes([b[0] ^ 0x5A]))
    with pytest.raises(CorruptExpert):
        Engine(path, EngineConfig(device="cuda"))
    with Engine(path, EngineConfig(device="cuda", max_cached_experts=2)) as gpu, pytest.raises(CorruptExpert):
        for start in range(0, 60, 3):
            gpu.infer([[start % 128, (start + 1) % 128, (start + 2) % 128]])


def test_over_budget_names_the_largest_that_fits(mixtral_file, monkeypatch):
    import colibri_format
    from colibri_format.runtime.cuda.backend import CupyBackend
    from colibri_format.runtime.cuda.pager import MEMORY_RESERVE

    with colibri_format.open(mixtral_file) as f:
        blob = len(f.expert_blob(0, 0))
    monkeypatch.setattr(CupyBackend, "free_memory", lambda self: MEMORY_RESERVE + 5 * blob)
    with pytest.raises(InvalidInput, match="largest max_cached_experts that fits is 3"):
        Engine(mixtral_file, EngineConfig(device="cuda"))


def test_long_prefill_uses_the_grouped_gemm_and_cublas(mixtral_file):
    prompt = [(7 * i + 3) % 128 for i in range(48)]                 # 48 rows: GEMM experts, cuBLAS dense
    with Engine(mixtral_file) as cpu, Engine(mixtral_file, EngineConfig(device="cuda")) as gpu:
        got, exp = gpu.logits([prompt, prompt[:5]]), cpu.logits([prompt, prompt[:5]])
        assert all(rel(a, b) < LOGIT_TOL for a, b in zip(got, exp))
        assert gpu.generate(prompt, max_new_tokens=4, stop_ids=[]).output_ids == \
            cpu.generate(prompt, max_new_tokens=4, stop_ids=[]).output_ids
