"""Real routing traces of the bundled demo model on held-out text, and the expert-cache simulator on them.

Run from the repository root (the benchmark imports the library, nothing else):

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python benchmarks/real_traces.py --out-dir docs/traces
    PYTHONPATH=. python benchmarks/real_traces.py --dry-run     # a few tokens per trace, into a temporary folder

Converts ``models/colibri-demo-moe`` with the default options (float16 dense, int8 per-row experts) into a
temporary folder, then records three traces with the NumPy engine (``EngineConfig(trace_path=...)``), all on
the same four held-out modules of ``eval.txt`` (fractions.py, json/decoder.py, statistics.py, textwrap.py;
each tokenized on its own, so each starts with ``<|bos|>``):

* ``generate.jsonl`` - serving, one request at a time: for each module, ``Engine.generate`` with the module's
  first 64 tokens as the prompt (one prefill pass) and 256 sampled new tokens (temperature 0.8, top-p 0.95,
  seed = module index, no stop token), one forward pass per new token. The four requests run back to back
  on one engine, so the trace is one stream of 4 x 256 = 1,024 forward passes.
* ``teacher_forced.jsonl`` - decode-style teacher forcing: the first 512 tokens of each module fed one token
  per forward pass through a KV cache (the engine's decode step, ``eng.decode_runner(...).step``, as
  ``Engine.generate`` runs it; the routing reaches the trace writer through ``eng.decoder.route_hook``), so the
  routing is that of a decoder that produced exactly the held-out text: 4 x 512 = 2,048 passes.
* ``teacher_forced_batch4.jsonl`` - the same four passages decoded in lock-step as a batch of 4 sequences:
  512 forward passes of 4 tokens each. The cache simulator counts an expert once per pass and layer however
  many of the 4 tokens chose it, as the engines load it once for the whole batch.

Then it runs ``run_cache_sim(trace, "10%,25%,40%,60%", "all", scope)`` for scope ``global`` (capacity = a share
of all 6 x 8 = 48 experts) and ``per_layer`` (a share of each layer's 8 experts), prints markdown tables and
the matching ``colibri cache-sim`` commands, and writes ``cache_sim.json`` next to the traces.
``--dry-run`` records 8 + 8 generated and 16 teacher-forced tokens per module into a temporary folder: it
checks the script, not the traces.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "colibri-demo-moe"
MODULES = ("fractions.py", "json/decoder.py", "statistics.py", "textwrap.py")
CAPACITIES = "10%,25%,40%,60%"
PROMPT_TOKENS, NEW_TOKENS, TF_TOKENS = 64, 256, 512


def module_ids(names=MODULES, model_dir: Path = MODEL_DIR) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (model_dir / "eval.txt").read_text(encoding="utf-8")
    parts = re.split(r"^# ===== Lib/(\S+) =====\n", text, flags=re.M)
    modules = dict(zip(parts[1::2], parts[2::2]))
    return [tok.encode(modules[n]).ids for n in names]


def trace_generate(model: Path, out: Path, passages: list[list[int]], prompt_tokens: int = PROMPT_TOKENS,
                   new_tokens: int = NEW_TOKENS) -> dict:
    from colibri_format.runtime.engine import Engine, EngineConfig

    t0, gen = time.perf_counter(), 0
    with Engine(model, EngineConfig(trace_path=str(out))) as eng:
        for i, ids in enumerate(passages):
            res = eng.generate(ids[:prompt_tokens], max_new_tokens=new_tokens, temperature=0.8, top_p=0.95,
                               seed=i, stop_ids=[])
            gen += len(res.output_ids)
    return {"passes": len(passages) * new_tokens, "generated": gen, "seconds": time.perf_counter() - t0}


def trace_teacher_forced(model: Path, out: Path, passages: list[list[int]], batch: bool,
                         tokens: int = TF_TOKENS) -> dict:
    """Feed the passages one token per sequence per pass through a decode runner's KV cache; every pass's
    routing goes to a TraceWriter through the decoder's route hook (pass t, sequence = row of the batch)."""
    from colibri_format.runtime.cache.trace import TraceWriter
    from colibri_format.runtime.engine import Engine, EngineConfig

    seqs = [np.asarray(p[:tokens]) for p in passages]
    t0, passes = time.perf_counter(), 0
    with Engine(model, EngineConfig()) as eng:
        m = eng.reader.model
        with TraceWriter(out, num_layers=m["num_layers"], moe_layers=m["moe_layers"], num_experts=m["num_experts"],
                         top_k=m["top_k"], model=str(eng.metadata.get("architecture", "unknown"))) as writer:
            groups = [seqs] if batch else [[s] for s in seqs]
            try:
                for group in groups:
                    n = min(len(s) for s in group)
                    runner = eng.decode_runner(len(group), n)
                    for pos in range(n):
                        def record(layer, ids, t=passes, pos=pos):
                            for row, chosen in enumerate(eng.be.to_host(ids).astype(np.int64)):
                                writer.record(t, row, layer, chosen, pos=pos)
                        eng.decoder.route_hook = record
                        runner.step(np.array([s[pos] for s in group]), np.full(len(group), pos))
                        passes += 1
            finally:
                eng.decoder.route_hook = None
    return {"passes": passes, "seconds": time.perf_counter() - t0}


def locality(trace_path: Path) -> dict:
    """Share of (layer, expert) accesses of pass t that pass t-1 also made, and experts per pass and layer."""
    from colibri_format.runtime.cache.trace import access_sequence, read_trace

    acc = access_sequence(read_trace(trace_path))
    steps: dict[int, set] = {}
    for layer, e, t in zip(acc.layer.tolist(), acc.expert.tolist(), acc.step.tolist()):
        steps.setdefault(t, set()).add((layer, e))
    order = sorted(steps)
    reused = sum(len(steps[b] & steps[a]) for a, b in zip(order, order[1:]))
    later = sum(len(steps[b]) for b in order[1:])
    layers = len(set(acc.layer.tolist()))
    return {"repeat_prev_pass": reused / later if later else 0.0,
            "experts_per_pass_per_layer": len(acc) / len(order) / layers}


def md_table(result: dict) -> str:
    caps: list[tuple[str, int]] = []
    for r in result["rows"]:
        if (r["capacity_spec"], r["capacity"]) not in caps:
            caps.append((r["capacity_spec"], r["capacity"]))
    unit = "per layer" if result["scope"] == "per_layer" else "of 48"
    head = "| policy | " + " | ".join(f"{s} ({c} {unit})" for s, c in caps) + " |"
    lines = [head, "| --- " * (len(caps) + 1) + "|"]
    labels: list[str] = []
    cells: dict = {}
    for r in result["rows"]:
        if r["label"] not in labels:
            labels.append(r["label"])
        cells[(r["label"], r["capacity"])] = r["miss_rate"]
    best = {c: min(cells[(lab, c)] for lab in labels if lab != "belady") for _, c in caps}
    for lab in labels:
        vals = []
        for _, c in caps:
            v = cells[(lab, c)]
            txt = f"{100 * v:.2f}%"
            vals.append(f"**{txt}**" if lab != "belady" and v == best[c] else txt)
        lines.append(f"| {lab} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


SWEEP_POLICIES = "lru,lrfu:0.999:token,lrfu+hist:0.9:token,static,belady"
TARGETS = (0.187, 0.023)   # the design article's LRU and hybrid miss rates


def capacity_sweep(out_dir: Path, names: list[str]) -> dict:
    """Global scope, every capacity 1..48: the smallest capacity at which each policy's miss rate is at or
    below each target."""
    from colibri_format.runtime.cache.cachesim import run_cache_sim

    out: dict = {}
    print(f"\n#### Capacity needed for a miss rate <= {', '.join(f'{100 * t:.1f}%' for t in TARGETS)} "
          f"(scope global, capacities 1..48)\n")
    print("| trace | policy | " + " | ".join(f"<= {100 * t:.1f}%" for t in TARGETS) + " |")
    print("| --- " * (2 + len(TARGETS)) + "|")
    for n in names:
        res = run_cache_sim(out_dir / f"{n}.jsonl", ",".join(str(c) for c in range(1, 49)), SWEEP_POLICIES,
                            "global")
        rates: dict[str, dict[int, float]] = {}
        for r in res["rows"]:
            rates.setdefault(r["label"], {})[r["capacity"]] = r["miss_rate"]
        out[n] = rates
        for label, by_cap in rates.items():
            cells = []
            for target in TARGETS:
                cap = next((c for c in sorted(by_cap) if by_cap[c] <= target), None)
                cells.append("never" if cap is None else f"{cap} of 48 ({100 * cap / 48:.0f}%)")
            print(f"| {n} | {label} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default="docs/traces")
    p.add_argument("--skip-record", action="store_true", help="reuse the traces already in --out-dir")
    p.add_argument("--dry-run", action="store_true", help="a few tokens per trace, into a temporary folder")
    args = p.parse_args(argv)
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="colibri-traces-dry-") as tmp:
            return record_and_replay(Path(tmp), False, dict(prompt_tokens=8, new_tokens=8, tf_tokens=16))
    return record_and_replay(Path(args.out_dir), args.skip_record,
                             dict(prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS, tf_tokens=TF_TOKENS))


def record_and_replay(out_dir: Path, skip_record: bool, sizes: dict) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ["generate", "teacher_forced", "teacher_forced_batch4"]
    runs: dict[str, dict] = {}
    if not skip_record:
        from colibri_format.convert.pipeline import convert

        passages = module_ids()
        with tempfile.TemporaryDirectory(prefix="colibri-traces-") as tmp:
            model = Path(tmp) / "demo-int8-row.colibri"
            convert(MODEL_DIR, model, dtype="float16", quantize="expert", resume=False)
            runs["generate"] = trace_generate(model, out_dir / "generate.jsonl", passages, sizes["prompt_tokens"],
                                              sizes["new_tokens"])
            runs["teacher_forced"] = trace_teacher_forced(model, out_dir / "teacher_forced.jsonl", passages, False,
                                                          sizes["tf_tokens"])
            runs["teacher_forced_batch4"] = trace_teacher_forced(model, out_dir / "teacher_forced_batch4.jsonl",
                                                                 passages, True, sizes["tf_tokens"])
        for n, r in runs.items():
            print(f"{n}: {r}", file=sys.stderr)

    from colibri_format.runtime.cache.cachesim import run_cache_sim

    results = {}
    for n in names:
        path = out_dir / f"{n}.jsonl"
        loc = locality(path)
        for scope in ("global", "per_layer"):
            res = run_cache_sim(path, CAPACITIES, "all", scope)
            res["locality"] = loc
            res["bytes"] = path.stat().st_size
            results[f"{n}/{scope}"] = res
            t = res["trace"]
            print(f"\n#### `{n}.jsonl`, scope {scope}\n")
            print(f"`colibri cache-sim {out_dir}/{n}.jsonl --capacity {CAPACITIES} --policy all --scope {scope}`\n")
            print(f"{t['tokens']} routed tokens, {t['steps']} forward passes, {t['accesses']} accesses, "
                  f"{t['distinct_experts']} distinct experts, cold-miss floor {100 * t['cold_miss_rate']:.2f}%, "
                  f"{loc['experts_per_pass_per_layer']:.2f} experts per pass and layer, "
                  f"{100 * loc['repeat_prev_pass']:.1f}% of a pass's experts also used by the previous pass\n")
            print(md_table(res))
    sweep = capacity_sweep(out_dir, names)
    meta = {"runs": runs, "modules": MODULES, "capacities": CAPACITIES, "results": results, "sweep": sweep}
    (out_dir / "cache_sim.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
