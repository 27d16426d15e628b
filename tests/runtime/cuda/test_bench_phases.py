"""The benchmark library's phases on the CPU engine (they time through the public step API on any backend), and
`run_bench` on a GPU: every section, the MoE block in the kernel profile, paging figures only when paged."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.cuda.bench import decode_bench, prefill_bench, render, run_bench, summarize_timeline
from colibri_format.synthetic import synthetic_model, write_synthetic


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    model = synthetic_model(layers=3, experts=8, top_k=2, hidden=128, heads=2, kv_heads=1)
    model["head_dim"] = 64
    return write_synthetic(tmp_path_factory.mktemp("bench") / "m.colibri", model)


@pytest.mark.parametrize("capacity", [None, 3])
def test_phases_on_the_cpu_engine(path, capacity):
    with Engine(path, EngineConfig(max_cached_experts=capacity)) as eng:
        rng = np.random.default_rng(0)
        pre = prefill_bench(eng, 24, rng)
        dec, runner = decode_bench(eng, 2, 5, 1, rng)
    assert pre["tokens"] == 24 and pre["ms"] > 0 and pre["tokens_per_s"] > 0
    assert dec["batch"] == 2 and dec["steps"] == 5 and dec["tokens_per_s"] > 0
    assert dec["graph"] == "the numpy backend has no graphs" and runner.batch == 2
    assert dec["chained_tokens_per_s"] > 0 and dec["chained_ms_per_step"] > 0     # the same steps as one chain
    assert ("paging" in dec) == ("chained_paging" in dec) == (capacity is not None)
    if capacity is not None:
        p = dec["paging"]
        assert p["misses_per_token"] > 0 and 0.0 <= p["hit_rate"] <= 1.0
        assert p["pcie_mb_per_token"] > 0 and p["loads_per_token"] > 0
        if p["gb_copied"]:      # decode passes fill admitted slots as they read: a rate only where copies ran
            assert p["copy_gbps"] > 0                                   # the copies' host time stands in
        else:
            assert p["copy_gbps"] is None
    text = render({"file": str(path), "ceilings": {"d2d_copy_gbps": 1.0, "h2d_pinned_gbps": 1.0},
                   "prefill": pre, "decode": dec})
    assert "decode batch 2 after 16 tokens" in text and ("MB/token over PCIe" in text) == (capacity is not None)
    assert "tokens fed back on the device" in text


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [None, 3])
def test_run_bench_reports_every_section(path, capacity):
    from tests.runtime.cuda.conftest import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU / CuPy available")
    r = run_bench(path, batch_size=2, seq_len=8, num_iters=3, warmup_iters=1, max_cached_experts=capacity,
                  ceiling_bytes=1 << 20)
    assert {"ceilings", "prefill", "decode", "kernels", "roofline"} <= set(r)
    assert r["kernels"]["dense_gemv"]["bytes"] > 0 and r["kernels"]["moe_experts"]["calls"] >= 3
    assert r["kernels"]["moe_experts"]["bytes"] > 0          # the roofline counts the experts read
    assert ("paging" in r["decode"]) == (capacity is not None)
    assert r["decode"]["chained_tokens_per_s"] > 0
    assert "decode batch 2" in render(r) and "tokens fed back on the device" in render(r)
    assert r["config"]["context"] == r["decode"]["context"] == 16


def test_timeline_totals_add_up_per_step():
    # two steps; kernels a (twice a step), b overlapping a, then a gap; CPU-side ops are not device time
    ev = [{"cat": "kernel", "name": "a", "ts": 0, "dur": 10}, {"cat": "kernel", "name": "b", "ts": 5, "dur": 10},
          {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 20, "dur": 4}, {"cat": "kernel", "name": "a", "ts": 30, "dur": 10},
          {"cat": "cpu_op", "name": "x", "ts": 0, "dur": 100}, {"cat": "kernel", "name": "a", "ts": 40, "dur": 0}]
    t = summarize_timeline(ev, steps=2)
    assert t["kinds"]["a"] == {"calls": 1.5, "us": 10.0} and t["kinds"]["gpu_memcpy"]["calls"] == 0.5
    assert t["span_us"] == 20.0 and t["busy_us"] == 14.5 and t["idle_us"] == 5.5


def test_decode_steps_follow_a_prompt_of_the_context_asked_for(path):
    """decode_bench's context (run_bench's and `colibri bench`'s): the timed steps attend to that many
    prompt tokens, and the runner holds them with the steps."""
    with Engine(path, EngineConfig(max_seq_len=128)) as eng:
        dec, runner = decode_bench(eng, 1, 2, 1, np.random.default_rng(0), context=60)
    assert dec["context"] == 60 and runner.capacity >= 60 + 1 + 2 + 1
