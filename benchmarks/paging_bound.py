"""The bounds of paged decode on the paging benchmark's trace, per cache policy and expert format (issue 13; CPU only).

    PYTHONPATH=. python benchmarks/paging_bound.py [--batches 1,8] [--experts int8,int4_g32] [--gbps 55] \
        [--resident-ms int8:1=3.262] [--json OUT.json]

`benchmarks/paging.py` replays a synthetic Zipf trace (Qwen3-30B-A3B shape: 48 layers x 128 experts, top-8; skew 1.0,
locality 0.2) into a cache of 50 % of the experts. Whatever the kernels do, every expert a pass misses crosses PCIe
once (a miss is read once a pass however many of the batch's tokens route to it), so tokens/s cannot exceed
PCIe rate / (misses a token x blob bytes). This replays the same trace in the simulator (`run_cache_sim`, lag 0, the
benchmark's 64 warm-up passes) under the engine's default policy (lrfu with history on the token clock, frequency
admission), `static` (the most used experts of the trace itself pinned: popularity known in advance) and `belady`
(the offline optimum: it knows every future access), and prints that bound for each, with the blob bytes of each
--experts format (spec.blob_layout, as paging.py's files store them).

--resident-ms FORMAT:BATCH=MS (repeatable; the measured all-resident step of that format and batch) adds the bound
of an engine that cannot predict its misses: the trace's routes are drawn at random, so a layer's misses are known
only once its router has run, and every later kernel of the step waits for that layer's experts; the step is then
at least the resident step plus the misses' reads: batch / (MS + misses a pass x blob bytes / rate).
"""

from __future__ import annotations

import argparse
import json

from benchmarks.paging import zipf_trace
from benchmarks.synthetic_decode import EXPERT_FORMATS, expert_options
from colibri_format.runtime.cache.cachesim import run_cache_sim
from colibri_format.spec.layout import blob_layout

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 48, 128, 8, 2048, 768          # Qwen3-30B-A3B
POLICIES = "lrfu+hist:0.999:token,static,belady"
WARMUP, COUNTED = 64, 48                                                # paging.py's window


def blob_bytes(experts: str) -> int:
    options = expert_options(experts)
    return blob_layout(HIDDEN, INTER, options["expert_format"], options["group_size"]).size


def bounds(batch: int, formats: list[str], gbps: float, seed: int, resident_ms: dict) -> list[dict]:
    trace = zipf_trace(LAYERS, EXPERTS, TOP_K, WARMUP + COUNTED, seed=seed, batch=batch)
    result = run_cache_sim(trace, "50%", POLICIES, admission="frequency", warmup=WARMUP)
    rows = []
    for experts in formats:
        blob = blob_bytes(experts)
        step_ms = resident_ms.get((experts, batch))
        for row in result["rows"]:
            per_token = row["misses"] / COUNTED / batch
            mb = per_token * blob / 1e6
            r = {"batch": batch, "experts": experts, "blob_bytes": blob, "policy": row["label"],
                 "hit_rate": round(row["hit_rate"], 3), "misses_per_token": round(per_token, 1),
                 "pcie_mb_per_token": round(mb, 1), "pcie_bound_tok_s": round(gbps * 1e3 / mb, 1)}
            if step_ms is not None:
                r["resident_step_ms"] = step_ms
                r["serial_bound_tok_s"] = round(batch / (step_ms / 1e3 + batch * mb / 1e3 / gbps), 1)
            rows.append(r)
    return rows


def parse_resident(values: list[str]) -> dict:
    """{(format, batch): ms} from FORMAT:BATCH=MS strings; a malformed one is one usage line."""
    out = {}
    for v in values:
        try:
            key, ms = v.split("=")
            experts, batch = key.split(":")
            if experts not in EXPERT_FORMATS or int(batch) < 1 or float(ms) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--resident-ms takes FORMAT:BATCH=MS with FORMAT one of {sorted(EXPERT_FORMATS)}, "
                             f"BATCH >= 1 and MS > 0, not {v!r}") from None
        out[(experts, int(batch))] = float(ms)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--experts", default="int8", help=f"comma list of {sorted(EXPERT_FORMATS)}")
    ap.add_argument("--gbps", type=float, default=55.0, help="host-to-device rate (the H200's pinned copies: ~55)")
    ap.add_argument("--resident-ms", action="append", default=[], metavar="FORMAT:BATCH=MS",
                    help="the measured all-resident step of FORMAT at BATCH (repeatable): adds the serial bound")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    formats = a.experts.split(",")
    if any(f not in EXPERT_FORMATS for f in formats):
        raise SystemExit(f"--experts takes a comma list of {sorted(EXPERT_FORMATS)}, not {a.experts!r}")
    resident = parse_resident(a.resident_ms)
    rows = [r for b in a.batches.split(",") for r in bounds(int(b), formats, a.gbps, a.seed, resident)]
    print(f"| batch | experts | policy | hit rate | misses / token | PCIe MB / token | PCIe bound at {a.gbps:g} GB/s, "
          f"tok/s | resident step ms | serial bound, tok/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['experts']} | {r['policy']} | {r['hit_rate']} | {r['misses_per_token']} "
              f"| {r['pcie_mb_per_token']} | {r['pcie_bound_tok_s']} | {r.get('resident_step_ms', '-')} "
              f"| {r.get('serial_bound_tok_s', '-')} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gbps": a.gbps, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
