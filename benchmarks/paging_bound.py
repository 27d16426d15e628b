"""The PCIe bound of paged decode on the paging benchmark's trace, per cache policy (issue 13; CPU only).

    PYTHONPATH=. python benchmarks/paging_bound.py [--batches 1,8] [--gbps 55] [--json OUT.json]

`benchmarks/paging.py` replays a synthetic Zipf trace (Qwen3-30B-A3B shape: 48 layers x 128 experts, top-8; skew 1.0,
locality 0.2) into a cache of 50 % of the experts. Whatever the kernels do, every expert a pass misses crosses PCIe
once (a miss is read once a pass however many of the batch's tokens route to it), so tokens/s cannot exceed
PCIe rate / (misses a token x blob bytes). This replays the same trace in the simulator (`run_cache_sim`, lag 0, the
benchmark's 64 warm-up passes) under the engine's default policy (lrfu with history on the token clock, frequency
admission), `static` (the most used experts of the trace itself pinned: popularity known in advance) and `belady`
(the offline optimum: it knows every future access), and prints that bound for each.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.paging import zipf_trace
from colibri_format.runtime.cache.cachesim import run_cache_sim

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 48, 128, 8, 2048, 768          # Qwen3-30B-A3B
BLOB_BYTES = 3 * HIDDEN * INTER + 4 * (2 * INTER + HIDDEN)              # int8 gate_up + down, f32 row scales
POLICIES = "lrfu+hist:0.999:token,static,belady"
WARMUP, COUNTED = 64, 48                                                # paging.py's window


def bounds(batch: int, gbps: float, seed: int) -> list[dict]:
    trace = zipf_trace(LAYERS, EXPERTS, TOP_K, WARMUP + COUNTED, seed=seed, batch=batch)
    result = run_cache_sim(trace, "50%", POLICIES, admission="frequency", warmup=WARMUP)
    rows = []
    for row in result["rows"]:
        per_token = row["misses"] / COUNTED / batch
        mb = per_token * BLOB_BYTES / 1e6
        rows.append({"batch": batch, "policy": row["label"], "hit_rate": round(row["hit_rate"], 3),
                     "misses_per_token": round(per_token, 1), "pcie_mb_per_token": round(mb, 1),
                     "pcie_bound_tok_s": round(gbps * 1e3 / mb, 1)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--gbps", type=float, default=55.0, help="host-to-device rate (the H200's pinned copies: ~55)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [r for b in a.batches.split(",") for r in bounds(int(b), a.gbps, a.seed)]
    print(f"| batch | policy | hit rate | misses / token | PCIe MB / token | bound at {a.gbps:g} GB/s, tok/s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['policy']} | {r['hit_rate']} | {r['misses_per_token']} | {r['pcie_mb_per_token']} "
              f"| {r['pcie_bound_tok_s']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"blob_bytes": BLOB_BYTES, "gbps": a.gbps, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
