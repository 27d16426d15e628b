"""What the paged engine's publication lag costs in hit rate: the cache simulator on the Zipf trace of
`benchmarks/paging.py` (skew 1.0, locality 0.2; Qwen3-30B-A3B shape: 48 MoE layers x 128 experts, top-8; batch 1),
with the engine's cache (lrfu, decay 0.999 on the token clock, history, frequency admission, global scope) at 50 %
of the experts, under lag 0 (a synchronous engine), 1, 2 (expert_loading="copy"), 3 and the fill-on-read rule
(expert_loading="fill"); see `runtime.cache.cachesim` for the lag model. Two windows: the benchmark's (64 warm-up
passes, then 48 counted) and a steady state (200 warm-up passes, then 1000 counted).

    PYTHONPATH=. python benchmarks/paging_lag.py [--seeds 0,1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.paging import zipf_trace
from colibri_format.runtime.cache.cachesim import run_cache_sim

LAGS = "0,1,2,3,fill"
WINDOWS = (("benchmark (64 warm-up + 48)", 64, 48), ("steady (200 warm-up + 1000)", 200, 1000))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", default="50%")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = []
    for name, warmup, counted in WINDOWS:
        sums: dict[str, list[float]] = {}
        for seed in seeds:
            trace = zipf_trace(48, 128, 8, warmup + counted, seed=seed, batch=args.batch)
            res = run_cache_sim(trace, args.capacity, "lrfu+hist:0.999:token", "global", admission="frequency",
                                lag=LAGS, warmup=warmup)
            for row in res["rows"]:
                s = sums.setdefault(str(row["lag"]), [0.0, 0.0, 0.0])
                s[0] += row["hit_rate"] / len(seeds)
                s[1] += row["misses"] / counted / len(seeds)
                s[2] += row["admissions"] / counted / len(seeds)
        for lag, (hit, miss, adm) in sums.items():
            out.append({"window": name, "lag": lag, "hit_rate": hit, "misses_per_pass": miss,
                        "admissions_per_pass": adm})
    print("| window | lag | hit rate | misses / pass | admissions (copies or fills) / pass |")
    print("|---|---|---|---|---|")
    for r in out:
        print(f"| {r['window']} | {r['lag']} | {r['hit_rate']:.3f} | {r['misses_per_pass']:.1f} | "
              f"{r['admissions_per_pass']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
