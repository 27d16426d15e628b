"""Decode attention alone (issue 14, item 2): `ops.attention` at batch 1 and 8 on the attention shapes of Qwen3-30B-A3B,
Mixtral-8x7B and OLMoE-1B-7B, with the split count a captured decode graph plans (from the cache capacity), at
real lengths from short to the capacity: µs a call and GB/s of the K/V bytes the lengths need.

    PYTHONPATH=. python benchmarks/attention_decode.py --out OUT_DIR [--caches f32,bf16] [--capacity 4096] \
        [--lengths 64,512,4096] [--splits 64,128,256 --define ATT_MAX_SPLITS=256] [--define ATT_LANE_FLOATS=64 ...]

Each case is a CUDA graph of 20 launches on one workspace (benchmarks/gpu_kernels.time_graph, median of 25
replays), checked once against the NumPy float64 attention. The engine's KV cache is float32 (the default
precision), so f32 is the engine's case; bf16 is there for comparison. Writes attention_decode.json and .md.
`--define NAME=VALUE` (repeatable) overrides one of the attention kernels' compile-time constants
(limits.KERNEL_DEFINES["layers"]) for this process, and ops.py's copy of it where the launch plan reads one
(ATT_DECODE_MIN_KEYS) and limits' (ATT_MAX_SPLITS, which ops checks nsplit against): a candidate timed without editing
limits.py. `--splits` runs each case at the given split counts instead of the planned one.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu_kernels import copy_bandwidth, override_defines, time_graph

SHAPES = {"qwen3": (32, 4, 128), "mixtral": (32, 8, 128), "olmoe": (16, 16, 128)}   # query heads, kv heads, head dim
LENGTHS = (64, 512, 4096)


def case(cp, ops, nb, rng, shape, cache: str, capacity: int, batch: int, length: int,
         splits: int | None = None) -> dict:
    nh, nkv, hd = shape
    dtype = cp.float32 if cache == "f32" else cp.uint16
    host = rng.standard_normal((batch, capacity, nkv, hd)).astype(np.float32)
    if cache == "bf16":
        from colibri_format.dtypes import float32_to_bf16_bits
        host = float32_to_bf16_bits(host)
    kc, vc = cp.asarray(host, dtype=dtype), cp.asarray(host[:, ::-1].copy(), dtype=dtype)
    q = cp.asarray(rng.standard_normal((batch, nh, hd)).astype(np.float32))
    q_seq, q_len = cp.arange(batch, dtype=cp.int32), cp.full(batch, length, cp.int32)
    ns = splits or ops.attention_splits(batch, nkv, nh // nkv, capacity)
    ws = ops.AttentionWorkspace(batch, nh, hd, ns)
    out = cp.empty((batch, nh, hd), cp.float32)
    scale = 1 / math.sqrt(hd)

    def call():
        ops.attention(q, kc, vc, q_seq, q_len, scale, out=out, nsplit=ns, workspace=ws)

    call()
    exp = nb.attention(q.get().astype(np.float64), nb.widen(kc.get(), np.float64), nb.widen(vc.get(), np.float64),
                       q_seq.get(), q_len.get(), scale)
    err = float(np.abs(out.get() - exp).max() / max(np.abs(exp).max(), 1e-30))
    us = time_graph(cp, [call])
    kv_bytes = 2 * batch * length * nkv * hd * kc.dtype.itemsize
    return {"cache": cache, "capacity": capacity, "batch": batch, "length": length, "splits": ns, "us": us,
            "gbps": kv_bytes / us / 1e3, "rel_err": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--caches", default="f32,bf16")
    ap.add_argument("--capacity", type=int, default=4096, help="KV capacity the graph's split count follows")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="real lengths (keys) timed")
    ap.add_argument("--splits", default="", help="comma list of split counts each case runs with instead of the "
                    "planned one (at most ATT_MAX_SPLITS, which --define may raise)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="override an attention kernel constant for this run (repeatable)")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    split_counts = [int(n) for n in args.splits.split(",") if n] or [None]
    from colibri_format.runtime import numpy_backend as nb
    from colibri_format.runtime.cuda.kernels import ops

    overrides = override_defines("layers", args.define)   # a wrong --define is refused before CuPy is needed
    try:
        import cupy as cp
    except ImportError:
        raise SystemExit("attention_decode.py needs a CUDA GPU and CuPy; CuPy is not installed") from None

    rng = np.random.default_rng(0)
    copy = copy_bandwidth(cp)
    rows = []
    for name in args.shapes.split(","):
        for cache in args.caches.split(","):
            for batch in map(int, args.batches.split(",")):
                for length in (n for n in lengths if n <= args.capacity):
                    for ns in split_counts:
                        r = {"shape": name, **case(cp, ops, nb, rng, SHAPES[name], cache, args.capacity, batch,
                                                   length, ns)}
                        rows.append(r)
                        print(f"{name:8s} {cache:4s} b{batch} len {length:5d}: {r['us']:7.2f} us "
                              f"{r['gbps']:7.1f} GB/s ({r['splits']} splits, rel err {r['rel_err']:.1e})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "device_copy_gbps": copy, "capacity": args.capacity,
            "defines": overrides}
    (out / "attention_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| shape | cache | batch | length | splits | µs | GB/s of K/V | share of copy rate |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['cache']} | {r['batch']} | {r['length']} | {r['splits']} | {r['us']:.2f} | "
              f"{r['gbps']:.0f} | {r['gbps'] / copy:.0%} |" for r in rows]
    (out / "attention_decode.md").write_text("\n".join(lines) + "\n")
    print(f"device copy {copy:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
