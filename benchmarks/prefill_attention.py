"""Prefill attention on the GPU: today's kernels (attention_split + attention_merge, fp32 SIMT) against the flash
attention kernel (attention_prefill.cu: tensor cores, operands split into bf16 hi + lo), one process, the same inputs.

    PYTHONPATH=. python benchmarks/prefill_attention.py --out OUT_DIR [--tokens 512,4096] [--iters 20]

Shapes: one prompt of --tokens rows prefilled from position 0 (causal: row n attends to keys 0..n), q fp32, at the
attention shapes of Qwen3-30B-A3B (32 query heads, 4 kv heads of 128) and Mixtral-8x7B (32 / 8 of 128), with f32
caches (what the engine keeps) and bf16 caches. Timed on the GPU with events (median of --iters launches after 3
warm-up ones):
- old: `ops.attention` as the backend calls it today (splits planned from the row count and the longest q_len, its
  workspace made once);
- new kernel: `ops.attention_prefill` with its tile plan already on the device;
- new + plan: the same, planning its tiles on the host from q_seq and q_len (a device-to-host copy), as the backend's
  opt-in path runs it per layer.
TFLOP/s counts the causal work only: 4 * heads * head_dim * (sum of the rows' key counts), whatever the split
costs (3 tensor-core products per product with f32 caches, 2 with bf16). `rel_vs_old` is ||new - old|| / ||old||
(both near fp32: expect about 1e-5).
Writes OUT_DIR/prefill_attention.json and OUT_DIR/prefill_attention.txt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "mixtral-8x7b": (32, 8, 128)}   # query heads, kv heads, head_dim


def gpu_ms(cp, fn, iters: int) -> float:
    """Median GPU time of fn() in ms (events around each launch, after warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def inputs(cp, tokens: int, nh: int, nkv: int, hd: int, cache: str):
    from colibri_format.dtypes import float32_to_bf16_bits

    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((tokens, nh, hd), np.float32))
    kv = []
    for _ in range(2):
        c = rng.standard_normal((1, tokens, nkv, hd), np.float32)
        kv.append(cp.asarray(c if cache == "f32" else float32_to_bf16_bits(c)))
    q_seq = cp.zeros(tokens, cp.int32)
    q_len = cp.arange(1, tokens + 1, dtype=cp.int32)
    return q, kv[0], kv[1], q_seq, q_len


def measure(cp, ops, name: str, tokens: int, cache: str, iters: int) -> dict:
    nh, nkv, hd = SHAPES[name]
    q, kc, vc, q_seq, q_len = inputs(cp, tokens, nh, nkv, hd, cache)
    scale = hd ** -0.5
    ns = ops.attention_splits(tokens, nkv, nh // nkv, tokens)
    ws = ops.AttentionWorkspace(tokens, nh, hd, ns) if ns > 1 else None
    old_out, new_out = cp.empty_like(q), cp.empty_like(q)
    plan = cp.asarray(ops.prefill_attention_plan(q_seq.get(), q_len.get(), nh // nkv))

    def old():
        ops.attention(q, kc, vc, q_seq, q_len, scale, out=old_out, nsplit=ns, workspace=ws)

    def new():
        ops.attention_prefill(q, kc, vc, q_seq, q_len, scale, out=new_out, plan=plan)

    def new_planned():
        ops.attention_prefill(q, kc, vc, q_seq, q_len, scale, out=new_out)

    ms = {"old": gpu_ms(cp, old, iters), "new": gpu_ms(cp, new, iters), "new_plus_plan": gpu_ms(cp, new_planned, iters)}
    flops = 4.0 * nh * hd * float(tokens) * (tokens + 1) / 2
    rel = float(cp.linalg.norm(new_out - old_out) / cp.linalg.norm(old_out))
    return {"shape": name, "tokens": tokens, "cache": cache, "heads": nh, "kv_heads": nkv, "head_dim": hd,
            "splits_old": ns, "tiles_new": int(plan.shape[0]), "ms": ms,
            "tflops": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()},
            "speedup": ms["old"] / ms["new"], "rel_vs_old": rel}


def table(rows: list[dict]) -> str:
    head = (f"{'shape':<15}{'tokens':>7}{'cache':>6}{'old ms':>9}{'new ms':>9}{'+plan ms':>9}{'old TF/s':>10}"
            f"{'new TF/s':>10}{'speed-up':>10}{'rel diff':>10}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['shape']:<15}{r['tokens']:>7}{r['cache']:>6}{r['ms']['old']:>9.3f}{r['ms']['new']:>9.3f}"
                     f"{r['ms']['new_plus_plan']:>9.3f}{r['tflops']['old']:>10.1f}{r['tflops']['new']:>10.1f}"
                     f"{r['speedup']:>9.1f}x{r['rel_vs_old']:>10.1e}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    import cupy as cp

    from colibri_format.runtime.cuda.kernels import ops

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "runs": []}
    for name in SHAPES:
        for tokens in (int(t) for t in args.tokens.split(",")):
            for cache in ("f32", "bf16"):
                result["runs"].append(measure(cp, ops, name, tokens, cache, args.iters))
                (out / "prefill_attention.json").write_text(json.dumps(result, indent=1))
    text = f"{result['date']}, {result['device']}\n" + table(result["runs"])
    (out / "prefill_attention.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
