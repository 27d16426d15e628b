"""The expert dispatch of a prefill pass: one block (dispatch.cu's moe_dispatch) against the three launches over
several blocks (moe_dispatch_ranks / _groups / _scatter, limits.DISPATCH_SPREAD_MIN_PAIRS), to place that threshold.

    PYTHONPATH=. python3 benchmarks/dispatch_spread.py --out OUT_DIR

Per (experts, top-k, tokens): random routes (k distinct experts a token), both forms timed in CUDA graphs of many
calls (gpu_kernels.time_graph, median µs a call) and checked equal, output for output. Session 25's timelines put the
one-block kernel at 17 µs a layer at Qwen3-30B-A3B's 512 tokens and 122 at 4,096. Writes dispatch_spread.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.gpu_kernels import time_graph
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

SHAPES = {"qwen3-30b-a3b": (128, 8), "olmoe-1b-7b": (64, 8), "mixtral-8x7b": (8, 2)}
TOKENS = (128, 512, 2048, 4096)


def case(cp, E: int, k: int, T: int) -> dict:
    rs = np.random.default_rng(T + E)
    ids = cp.asarray(np.argsort(rs.random((T, E)), axis=1)[:, :k].astype(np.int32))
    out = {}
    for form, least in (("one block", 0), ("spread", 1)):
        limits.DISPATCH_SPREAD_MIN_PAIRS = least
        bufs = ops.dispatch_buffers(T * k, E)
        us = time_graph(cp, [lambda bufs=bufs: ops.dispatch(ids, E, out=bufs)])
        ops.dispatch(ids, E, out=bufs)
        out[form] = (us, [a.get() for a in bufs[:8]], bufs.spread)
    same = all(np.array_equal(a, b) for a, b in zip(out["one block"][1], out["spread"][1]))
    spread = out["spread"][2]
    return {"experts": E, "k": k, "tokens": T, "pairs": T * k, "one_block_us": out["one block"][0],
            "spread_us": out["spread"][0], "blocks": spread.blocks, "chunk": spread.chunk, "same": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import cupy as cp

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print("| shape | tokens | pairs | one block µs | spread µs (blocks x chunk) | same |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (E, k) in SHAPES.items():
        for T in TOKENS:
            r = dict(case(cp, E, k, T), shape=name)
            rows.append(r)
            print(f"| {name} | {T} | {r['pairs']} | {r['one_block_us']:.1f} | {r['spread_us']:.1f} "
                  f"({r['blocks']} x {r['chunk']}) | {r['same']} |", flush=True)
    (args.out / "dispatch_spread.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
