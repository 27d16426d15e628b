"""`colibri cache-sim`: a trace written by `colibri infer --trace`, replayed under every policy."""

import json

from rich.console import Console

from colibri_format.cli import main
from colibri_format.cli.render import cache_sim_table
from colibri_format.runtime.cache.cachesim import run_cache_sim, synthetic_trace


def test_cache_sim_replays_an_infer_trace(model_file, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    assert main(["infer", model_file, "--ids", "1,2,3", "--max-new-tokens", "6", "--trace", str(trace),
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["cache-sim", str(trace), "--capacity", "25%,50%", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    policies = {row["policy"] for row in sim["rows"]}
    assert {"lru", "lfu", "lrfu", "static", "belady"} <= policies
    for cap in (6, 12):   # Belady is a lower bound for every online policy at the same capacity
        rows = [r for r in sim["rows"] if r["capacity"] == cap]
        best = min(r["misses"] for r in rows if r["policy"] == "belady")
        assert all(r["misses"] >= best for r in rows if r["policy"] not in ("static",))
    assert main(["cache-sim", str(trace), "--capacity", "25%", "--policy", "lru,belady"]) == 0
    text = capsys.readouterr().out
    assert "expert-cache miss rate" in text and "lru" in text and "belady" in text


def test_cache_sim_missing_trace_exit_1(tmp_path, capsys):
    assert main(["cache-sim", str(tmp_path / "none.jsonl")]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_render_table():
    res = run_cache_sim(synthetic_trace(2, 8, 2, 20, seed=0), "25%,50%", "lru,belady", "global",
                        blob_bytes=1 << 20)
    console = Console(record=True, width=120)
    console.print(cache_sim_table(res))
    text = console.export_text()
    assert "lru" in text and "belady" in text and "25% (4 total)" in text and "%" in text


def test_render_table_escapes_the_model_name():
    res = run_cache_sim(synthetic_trace(2, 8, 2, 20, seed=0, model="[bold]x[/bold]"), "25%", "lru", "global")
    console = Console(record=True, width=120)
    console.print(cache_sim_table(res))
    assert "[bold]x[/bold]" in console.export_text()
