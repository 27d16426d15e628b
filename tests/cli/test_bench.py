"""`colibri bench`: the options reach `run_bench` (the GPU library, stood in for here), both views print."""

import json

import pytest

from colibri_format.cli import main

RESULT = {"file": "m.colibri", "config": {}, "ceilings": {"d2d_copy_gbps": 4000.0, "h2d_pinned_gbps": 50.0},
          "decode": {"batch": 2, "steps": 3, "tokens_per_s": 100.0, "ms_per_step": 20.0, "host_ms_per_step": 1.0,
                     "graph": "captured"}}


@pytest.fixture()
def bench_lib(monkeypatch):
    from colibri_format.cli import bench as bench_command
    from colibri_format.runtime.cuda import bench

    calls = []
    monkeypatch.setattr(bench_command, "need_cupy", lambda what: None)     # the GPU library is stood in for

    def fake_run_bench(path, **kw):
        calls.append((path, kw))
        return json.loads(json.dumps(RESULT))

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    return calls


def test_options_reach_run_bench_and_json(bench_lib, small_file, capsys):
    assert main(["bench", small_file, "--batch-size", "2", "--seq-len", "8", "--num-iters", "3",
                 "--warmup-iters", "0", "--context", "100", "--max-cached-experts", "4", "--cache-policy", "lru",
                 "--prefetch", "--json"]) == 0
    (path, kw), = bench_lib
    assert str(path) == small_file
    assert kw == {"batch_size": 2, "seq_len": 8, "num_iters": 3, "warmup_iters": 0, "context": 100,
                  "max_cached_experts": 4,
                  "gpu_memory": None, "cache_policy": "lru", "prefetch": True, "int8_activations": True,
                  "kv_cache_dtype": "auto"}
    assert json.loads(capsys.readouterr().out) == RESULT
    assert main(["bench", small_file, "--gpu-memory", "20GiB", "--json"]) == 0
    assert bench_lib[-1][1]["gpu_memory"] == "20GiB"
    assert main(["bench", small_file, "--float-activations", "--json"]) == 0
    assert bench_lib[-1][1]["int8_activations"] is False


def test_text_view(bench_lib, small_file, capsys):
    assert main(["bench", small_file]) == 0
    assert bench_lib[0][1]["batch_size"] == 1 and bench_lib[0][1]["max_cached_experts"] is None
    assert bench_lib[0][1]["context"] == 16
    out = capsys.readouterr().out
    assert "decode batch 2: 100.0 tokens/s" in out and "copy ceiling 4000 GB/s" in out


@pytest.mark.parametrize("flag", ["--batch-size", "--num-iters", "--seq-len", "--context"])
def test_non_positive_sizes_are_usage_errors(bench_lib, small_file, capsys, flag):
    assert main(["bench", small_file, flag, "0"]) == 2
    assert bench_lib == []
