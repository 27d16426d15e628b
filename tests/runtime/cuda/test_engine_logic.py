"""The CUDA engine's logic on the CPU: NumPy stand-ins for CuPy and the kernels (fake_cuda.py).

The same files, prompts and checks as tests/runtime/cuda/test_gpu_cuda_engine.py, minus kernel numerics: packing, KV rows,
RoPE rows, buffers reused under "capture", expert slot pool, paging through ExpertCache (hits, misses and
evictions equal to the NumPy engine's), multi-pass layers, prefetch, staging fallback, verify-on-page-in and the
budget error.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.convert.pipeline import convert
from colibri_format.errors import CorruptExpert, InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from tests.runtime.fake_cuda import install

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared")
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)   # head_dim 64: the kernel path
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42]]


def make_file(tmp_path_factory, arch: str, dtype: str = "float32", **overrides):
    from tests.hf_models import make_tiny_checkpoint

    out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
    if arch == "qwen3_moe" and "hidden_size" in overrides:
        overrides = {**overrides, "head_dim": overrides["hidden_size"] // overrides["num_attention_heads"]}
    make_tiny_checkpoint(arch, out / "hf", **overrides)
    path = out / "model.colibri"
    convert(out / "hf", path, dtype=dtype, quantize="expert", workers=1, verify=False)
    return path


@pytest.fixture(scope="module", params=ARCHS)
def arch_file(request, tmp_path_factory):
    return make_file(tmp_path_factory, request.param, **WIDE)


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_matches_numpy_engine_on_every_architecture(arch_file, monkeypatch):
    made = install(monkeypatch)
    with Engine(arch_file) as cpu, Engine(arch_file, EngineConfig(device="cuda", max_seq_len=64)) as gpu:
        assert type(gpu).__name__ == "CudaEngine"
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert got.shape == exp.shape and rel(got, exp) < 1e-4
        assert gpu.infer(PROMPTS) == cpu.infer(PROMPTS)
        a = gpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        b = cpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        assert a.output_ids == b.output_ids
        assert gpu.stats()["graphs"] == {"1x64": "captured"}
    assert made.backends[0].launches == 6          # steps 2..7 of the decode replayed the graph


def test_small_heads_use_the_fallback_attention(tmp_path_factory, monkeypatch):
    install(monkeypatch)
    path = make_file(tmp_path_factory, "mixtral")                               # head_dim 8
    with Engine(path) as cpu, Engine(path, EngineConfig(device="cuda", max_seq_len=64)) as gpu:
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < 1e-4
        assert gpu.generate([3, 4], max_new_tokens=5, stop_ids=[]).output_ids == \
            cpu.generate([3, 4], max_new_tokens=5, stop_ids=[]).output_ids
        assert "fallback" in gpu.stats()["graphs"]["1x64"]


def test_bf16_dense_weights(tmp_path_factory, monkeypatch):
    install(monkeypatch)
    path = make_file(tmp_path_factory, "qwen3_moe", dtype="bfloat16", **WIDE)
    with Engine(path) as cpu, Engine(path, EngineConfig(device="cuda")) as gpu:
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < 1e-4


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory):
    return make_file(tmp_path_factory, "mixtral", num_hidden_layers=3, **WIDE)


@pytest.mark.parametrize("policy,scope,capacity", [("lru", "global", 3), ("lrfu", "global", 5),
                                                   ("lru", "per_layer", 2), ("lfu", "per_layer", 1)])
def test_paging_matches_numpy_engine(mixtral_file, monkeypatch, policy, scope, capacity):
    install(monkeypatch)
    cfg = dict(max_cached_experts=capacity, cache_policy=policy, cache_scope=scope)
    with Engine(mixtral_file, EngineConfig(**cfg)) as cpu, \
            Engine(mixtral_file, EngineConfig(device="cuda", **cfg)) as gpu:
        assert not gpu.experts.resident
        for got, exp in zip(gpu.logits(PROMPTS), cpu.logits(PROMPTS)):
            assert rel(got, exp) < 1e-4
        a = gpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        b = cpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        assert a.output_ids == b.output_ids
        assert (a.stats.cache_hits, a.stats.cache_misses) == (b.stats.cache_hits, b.stats.cache_misses)
        assert a.stats.bytes_paged == b.stats.bytes_paged
        assert gpu.cache.stats().evictions == cpu.cache.stats().evictions > 0
        assert "paged" in gpu.stats()["graphs"]["1x64"]
        if capacity < 4:
            assert gpu.stats()["paging"]["passes"] > gpu.stats()["paging"]["tokens"] * 0  # multi-pass ran


def test_prefetch_keeps_outputs_and_reports_recall(mixtral_file, monkeypatch):
    install(monkeypatch)
    cfg = dict(max_cached_experts=8, cache_policy="lrfu")
    with Engine(mixtral_file, EngineConfig(**cfg)) as cpu:
        want = cpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids
    from colibri_format.runtime.cuda.engine_cuda import CudaEngine

    with CudaEngine(mixtral_file, EngineConfig(device="cuda", **cfg), prefetch=True) as gpu:
        assert gpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids == want
        paging = gpu.stats()["paging"]
        assert paging["predicted"] > 0 and 0.0 <= paging["prefetch_recall"] <= 1.0
        assert paging["prefetch_loads"] > 0


def test_staging_ring_when_registration_fails(mixtral_file, monkeypatch):
    install(monkeypatch, register_fails=True)
    cfg = dict(max_cached_experts=3)
    with Engine(mixtral_file, EngineConfig(**cfg)) as cpu, \
            Engine(mixtral_file, EngineConfig(device="cuda", **cfg)) as gpu:
        assert gpu.stats()["host_source"] == "staging"
        assert gpu.infer(PROMPTS) == cpu.infer(PROMPTS)


def test_batch_generation_matches_single_sequences(mixtral_file, monkeypatch):
    install(monkeypatch)
    with Engine(mixtral_file) as cpu, Engine(mixtral_file, EngineConfig(device="cuda")) as gpu:
        outs = gpu.generate_batch(PROMPTS, 5)
        for prompt, got in zip(PROMPTS, outs):
            assert got == cpu.generate(prompt, max_new_tokens=5, stop_ids=[]).output_ids


def test_corrupt_expert_is_caught_on_page_in(tmp_path_factory, monkeypatch):
    install(monkeypatch)
    path = make_file(tmp_path_factory, "mixtral", **WIDE)
    import colibri_format

    with colibri_format.open(path, verify="never") as f:
        offset = f.blob_offset(1, 2)
    with open(path, "r+b") as fh:
        fh.seek(offset + 7)
        b = fh.read(1)
        fh.seek(offset + 7)
        fh.write(bytes([b[0] ^ 0x5A]))
    with pytest.raises(CorruptExpert):          # resident: every blob is checked before its upload
        Engine(path, EngineConfig(device="cuda"))
    with Engine(path, EngineConfig(device="cuda", max_cached_experts=2)) as gpu, pytest.raises(CorruptExpert):
        for start in range(0, 60, 3):           # paged: caught when (and only when) the expert is paged in
            gpu.infer([[start % 128, (start + 1) % 128, (start + 2) % 128]])


def test_over_budget_names_the_largest_that_fits(mixtral_file, monkeypatch):
    from colibri_format.runtime.cuda.pager import MEMORY_RESERVE

    import colibri_format

    with colibri_format.open(mixtral_file) as f:
        blob = len(f.expert_blob(0, 0))
    install(monkeypatch, free_bytes=MEMORY_RESERVE + 5 * blob)
    with pytest.raises(InvalidInput, match="largest max_cached_experts that fits is 3"):
        Engine(mixtral_file, EngineConfig(device="cuda"))
    with Engine(mixtral_file, EngineConfig(device="cuda", max_cached_experts=3)) as gpu:
        gpu.infer([[1, 2, 3]])


def test_closed_engine_refuses(mixtral_file, monkeypatch):
    install(monkeypatch)
    gpu = Engine(mixtral_file, EngineConfig(device="cuda"))
    gpu.close()
    gpu.close()
    with pytest.raises(InvalidInput):
        gpu.infer([[1]])


@pytest.mark.parametrize("capacity", [None, 3])
def test_run_bench_reports_every_section(mixtral_file, monkeypatch, capacity):
    from colibri_format.runtime.cuda.bench import render, run_bench

    install(monkeypatch)
    r = run_bench(mixtral_file, batch_size=2, seq_len=8, num_iters=3, warmup_iters=1, max_cached_experts=capacity,
                  ceiling_bytes=1 << 20)
    assert {"ceilings", "prefill", "decode", "kernels", "roofline"} <= set(r)
    assert r["kernels"]["dense_gemv"]["bytes"] > 0 and r["kernels"]["moe_gate_up"]["calls"] >= 3
    assert ("paging" in r["decode"]) == (capacity is not None)
    assert "decode batch 2" in render(r)


def test_long_prefill_uses_the_grouped_gemm_and_cublas(mixtral_file, monkeypatch):
    install(monkeypatch)
    prompt = [(7 * i + 3) % 128 for i in range(48)]                 # 48 rows: GEMM experts, cuBLAS dense
    with Engine(mixtral_file) as cpu, Engine(mixtral_file, EngineConfig(device="cuda")) as gpu:
        got, exp = gpu.logits([prompt, prompt[:5]]), cpu.logits([prompt, prompt[:5]])
        assert all(rel(a, b) < 1e-4 for a, b in zip(got, exp))
        assert gpu.generate(prompt, max_new_tokens=4, stop_ids=[]).output_ids == \
            cpu.generate(prompt, max_new_tokens=4, stop_ids=[]).output_ids


def test_fused_layer_kernels_match_unfused_path(arch_file, monkeypatch):
    """COLIBRI_CUDA_FUSED=0 keeps the unfused chain; both give the NumPy engine's logits and tokens."""
    made = install(monkeypatch)
    from colibri_format.runtime.cuda.engine_cuda import CudaEngine

    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("COLIBRI_CUDA_FUSED", flag)
        with CudaEngine(arch_file, EngineConfig(device="cuda")) as gpu:
            assert gpu.fwd.fused == (flag == "1")
            outs[flag] = (gpu.logits(PROMPTS), gpu.generate([3, 4], max_new_tokens=4, stop_ids=[]).output_ids)
    ops = made.backends[0].ops
    assert ops.calls.get("qkv_rope_kv", 0) > 0 and ops.calls.get("add_rmsnorm", 0) > 0
    with Engine(arch_file) as cpu:
        want = cpu.logits(PROMPTS)
    for flag, (logits, _) in outs.items():
        for got, exp in zip(logits, want):
            assert rel(got, exp) < 1e-4, flag
    assert outs["1"][1] == outs["0"][1]
