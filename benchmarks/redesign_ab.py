"""Before/after one change to the engine, same device call: decode tokens/s at batch 1 and 8 and a 512-token
prefill on the full-depth Qwen3-30B-A3B shape (48 layers, vocabulary 151,936, hidden 2048, 128 experts top-8,
expert FFN 768, 32/4 heads of 128, per-head q/k norm; bf16 dense, int8 experts; one random blob repeated,
written by `colibri_format.synthetic.write_synthetic` to tmpfs; every expert resident on the GPU).

Each tree is a folder holding a `colibri_format` package; it is measured in a subprocess of its own through the
public API only (`Engine`, `generate`, `generate_batch`, `infer`), trees alternating, `--rounds` times:
    mkdir .before && git archive 7c14c88 colibri_format | tar -x -C .before     # the tree before the redesign
    PYTHONPATH=. python benchmarks/redesign_ab.py --tree before=.before --tree after=. --out ab.json
(`.before` is listed in .git/info/exclude and travels to the GPU machine with `carry`.)
Decode b1: `generate` (16-token prompt, 128 new tokens), the engine's own decode tokens/s. Decode b8:
(generate_batch with 65 new tokens - with 1) over 8 x 64 tokens. Prefill: median `infer` time of one 512-token
prompt. Each figure is the median of 3 repetitions inside the subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

QWEN3_FULL = dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, experts=128, top_k=8,
                  expert_inter=768, qk_norm="per_head")


def write_model(path: Path) -> None:
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_model, write_synthetic

    model = synthetic_model(**QWEN3_FULL)
    model["head_dim"] = 128
    model["max_position_embeddings"] = 4096
    write_synthetic(path, model, reuse_expert=True, dense_dtype=S.DType.BF16)


def measure(path: str) -> dict:
    """Runs inside the tree's subprocess."""
    import numpy as np

    from colibri_format.runtime import Engine, EngineConfig

    rng = np.random.default_rng(0)
    cfg = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=1024, verify="never")
    t0 = time.perf_counter()
    with Engine(path, cfg) as eng:
        opened = time.perf_counter() - t0
        prompt = rng.integers(0, eng.vocab_size, 16).tolist()
        b1 = [eng.generate(prompt, max_new_tokens=128, stop_ids=[]).stats.decode_tokens_per_s for _ in range(4)][1:]
        prompts = [rng.integers(0, eng.vocab_size, 16).tolist() for _ in range(8)]
        b8 = []
        for _ in range(4):
            t = time.perf_counter()
            eng.generate_batch(prompts, 1)
            short = time.perf_counter() - t
            t = time.perf_counter()
            eng.generate_batch(prompts, 65)
            b8.append(8 * 64 / (time.perf_counter() - t - short))
        long_prompt = [rng.integers(0, eng.vocab_size, 512).tolist()]
        prefill = []
        for _ in range(6):
            t = time.perf_counter()
            eng.infer(long_prompt)
            prefill.append(1e3 * (time.perf_counter() - t))
    return {"open_s": opened, "decode_b1_tok_s": statistics.median(b1), "decode_b8_tok_s": statistics.median(b8[1:]),
            "prefill_512_ms": statistics.median(prefill[1:]), "raw": {"b1": b1, "b8": b8, "prefill": prefill}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="name=folder holding colibri_format")
    ap.add_argument("--model", default="/dev/shm/qwen3_30b_a3b_full.colibri")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="redesign_ab.json")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    model = Path(args.model)
    if not model.exists():
        t = time.perf_counter()
        write_model(model)
        print(f"wrote {model} ({model.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    trees = dict(t.split("=", 1) for t in args.tree)
    results: dict = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, folder in trees.items():
            env = {**os.environ, "PYTHONPATH": str(Path(folder).resolve())}
            proc = subprocess.run([sys.executable, __file__, "--tree", "x=.", "--measure", str(model)], env=env,
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{name} failed")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(res)
            print(f"round {r} {name:>8}: b1 {res['decode_b1_tok_s']:.1f} tok/s, b8 {res['decode_b8_tok_s']:.1f} tok/s,"
                  f" prefill 512 {res['prefill_512_ms']:.1f} ms, open {res['open_s']:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
