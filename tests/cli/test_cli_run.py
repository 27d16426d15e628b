"""`colibri infer` and `colibri cache-sim` end to end on a synthetic file (ids in, ids out)."""

import json

import pytest

from colibri_format.cli import main
from colibri_format.runtime.cache.cachesim import pins_from_trace
from colibri_format.synthetic import synthetic_model, write_synthetic


@pytest.fixture()
def model_file(tmp_path):
    return str(write_synthetic(tmp_path / "m.colibri", synthetic_model(layers=3, experts=8, top_k=2)))


def _infer_json(capsys, *args):
    assert main(["infer", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_infer_json_trace_and_cache_sim(model_file, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    result = _infer_json(capsys, model_file, "--ids", "1,2,3", "--max-new-tokens", "6", "--trace", str(trace))
    assert len(result["output_ids"]) == 6 and result["prompt_ids"] == [1, 2, 3]
    stats = result["stats"]
    assert stats["experts_touched"] > 0 and stats["cache_misses"] > 0
    assert stats["hit_rate"] == stats["cache_hits"] / (stats["cache_hits"] + stats["cache_misses"])
    assert stats["misses_per_token"] == stats["cache_misses"] / 9          # 3 prompt + 6 generated tokens
    assert stats["paged_gb_per_s"] > 0 and stats["bytes_paged"] == stats["expert_loads"] * 8192
    assert main(["cache-sim", str(trace), "--capacity", "25%,50%", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    policies = {row["policy"] for row in sim["rows"]}
    assert {"lru", "lfu", "lrfu", "static", "belady"} <= policies
    for cap in (6, 12):   # Belady is a lower bound for every online policy at the same capacity
        rows = [r for r in sim["rows"] if r["capacity"] == cap]
        best = min(r["misses"] for r in rows if r["policy"] == "belady")
        assert all(r["misses"] >= best for r in rows if r["policy"] not in ("static",))


def test_static_policy_pins_from_trace(model_file, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    greedy = _infer_json(capsys, model_file, "--ids", "5,6,7", "--max-new-tokens", "5", "--trace", str(trace))
    pins = pins_from_trace(trace, 4)
    assert len(pins) == 4 and len(set(pins)) == 4
    static = _infer_json(capsys, model_file, "--ids", "5,6,7", "--max-new-tokens", "5", "--cache-policy", "static",
                         "--pin-from-trace", str(trace), "--max-cached-experts", "4")
    assert static["output_ids"] == greedy["output_ids"]   # the cache policy never changes the answer


def test_static_without_pins_is_a_clear_error(model_file, capsys):
    assert main(["infer", model_file, "--ids", "1", "--cache-policy", "static"]) == 1
    assert "--pin-from-trace" in capsys.readouterr().err


@pytest.mark.parametrize("ids, needle", [("1,2,x", "comma-separated"), ("1,2,100000", "outside")])
def test_bad_ids_exit_1(model_file, capsys, ids, needle):
    assert main(["infer", model_file, "--ids", ids]) == 1
    assert needle in capsys.readouterr().err
