"""Today's routed-expert block of a small decode step (dispatch + gate_up + down + combine) against the two
moe_small.cu kernels (gate_up by pair, down with the combine folded in), in one process.

    PYTHONPATH=. python benchmarks/decode_moe_small.py --out OUT_DIR [--shapes qwen3,olmoe,mixtral] [--tokens 1,4]

Shapes (int8 experts, per-row scales; `--group 128` for group scales): Qwen3-30B-A3B (H 2048, I 768, 128 experts,
top-8), OLMoE-1B-7B (2048, 1024, 64, top-8), Mixtral-8x7B (4096, 14336, 8, top-2); T = 1 and 4 tokens.
Each variant is captured in a CUDA graph of many launches over rotated routings (each launch picks other experts of
a set far larger than L2, so the weights come from HBM) and timed by `gpu_kernels.time_graph` (median of replays):
µs per MoE layer and GB/s of the expert bytes the launch reads (matrices and scales of its distinct experts),
beside a device-to-device copy measured in the same run. Every plan of the new kernels (limits.SMALL_*_PLANS) is
timed, and each is first checked against today's path on the device (today's is tested against float64 NumPy).
Stage rows time each kernel alone (today's dispatch precomputed per routing). Writes decode_moe_small.json and
decode_moe_small.md to OUT_DIR and prints the table. About 2-3 minutes on an H200.

`--engine FILE` (e.g. decode_profile.py's /dev/shm/qwen3_30b_a3b_full.colibri, which that script writes) adds
full-depth decode tokens/s of the engine at batch 1 and 4 with `EngineConfig(small_moe=...)` off and on, both in
this process (about 1 more minute once the file exists).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import copy_bandwidth, log, time_graph  # noqa: E402

from colibri_format.runtime.cuda import limits  # noqa: E402
from colibri_format.runtime.cuda.bench import device_experts, layout_for  # noqa: E402
from colibri_format.runtime.cuda.kernels import ops  # noqa: E402

SHAPES = {  # name: (H, I, E, k)
    "qwen3": (2048, 768, 128, 8),       # Qwen3-30B-A3B
    "olmoe": (2048, 1024, 64, 8),       # OLMoE-1B-7B
    "mixtral": (4096, 14336, 8, 2),     # Mixtral-8x7B
}
ROUTINGS = 16           # routings a graph rotates over
LAUNCHES = 64           # launches a graph holds
AGREE = 1e-4            # relative difference allowed between the new kernels and today's path (both fp32, other
#                         summation orders over up to 14336 terms; an indexing bug is off by O(1))


def routings(cp, rng, T: int, E: int, k: int) -> list:
    return [cp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
            for _ in range(ROUTINGS)]


def expert_bytes(layout, ids_list, stage: str) -> float:
    """Mean bytes a launch reads of its distinct experts: 'gate_up', 'down' or 'all' (matrices and scales)."""
    names = {"gate_up": ("gate_up", "gate_up_scale"), "down": ("down", "down_scale")}
    names["all"] = names["gate_up"] + names["down"]
    per_expert = sum(layout.array(n).nbytes for n in names[stage])
    return float(np.mean([len(np.unique(ids.get())) for ids in ids_list])) * per_expert


def bench_shape(cp, name: str, T: int, group: int, copy_gbps: float, wrong: list) -> list[dict]:
    H, I, E, k = SHAPES[name]
    buf, table = device_experts(E, H, I, group)
    layout = layout_for(H, I, group)
    rng = np.random.default_rng(T)
    ids_list = routings(cp, rng, T, E, k)
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    w = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    resid = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    h, act, ypair = cp.empty((T, H), cp.float32), cp.empty((T * k, I), cp.float32), cp.empty((T * k, H), cp.float32)
    disps = [ops.dispatch(ids, E) for ids in ids_list]
    want = ops.moe_experts(x, ids_list[0], w, table, residual=resid).get()

    def row(variant: str, stage: str, launches: list) -> dict:
        us = time_graph(cp, launches, per_graph=LAUNCHES)
        nbytes = expert_bytes(layout, ids_list, stage)
        r = {"shape": name, "H": H, "I": I, "E": E, "k": k, "T": T, "group": group, "variant": variant,
             "stage": stage, "us": us, "expert_bytes": nbytes, "gbps": nbytes / us / 1e3,
             "share_of_copy": nbytes / us / 1e3 / copy_gbps}
        log(f"  {name} T={T} {variant:<22} {stage:<8} {us:8.1f} us {r['gbps']:7.0f} GB/s ({r['share_of_copy']:.0%})")
        return r

    rows = [row("today", "all", [lambda i=i, d=d: ops.moe_experts(x, i, w, table, residual=resid, disp=d, act=act,
                                                            ypair=ypair, out=h) for i, d in zip(ids_list, disps)]),
            row("today", "gate_up", [lambda d=d: ops.moe_gate_up(x, table, d, k, out=act) for d in disps]),
            row("today", "down", [lambda d=d: ops.moe_down(act, table, d, w, out=ypair) for d in disps])]
    for g in range(len(limits.SMALL_GATE_UP_PLANS)):
        for dn in range(len(limits.SMALL_DOWN_PLANS)):
            got = ops.moe_experts_small(x, ids_list[0], w, table, residual=resid, plans=(g, dn)).get()
            diff = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if diff > AGREE:    # wrong: reported, not timed, and the other plans still run
                log(f"  {name} T={T} plans ({g}, {dn}): WRONG, relative difference {diff:.2e} from today's path")
                wrong.append({"shape": name, "T": T, "plans": (g, dn), "relative_difference": diff})
                continue
            rows.append(row(f"small g{g} d{dn}", "all", [
                lambda i=i, g=g, dn=dn: ops.moe_experts_small(x, i, w, table, residual=resid, act=act, out=h,
                                                              plans=(g, dn)) for i in ids_list]))
    for g in range(len(limits.SMALL_GATE_UP_PLANS)):
        rows.append(row(f"small g{g}", "gate_up", [lambda i=i, g=g: ops.moe_small_gate_up(x, i, table, plan=g,
                                                                                           out=act)
                                                    for i in ids_list]))
    for dn in range(len(limits.SMALL_DOWN_PLANS)):
        rows.append(row(f"small d{dn}", "down", [lambda i=i, dn=dn: ops.moe_small_down(act, i, w, table,
                                                                                        residual=resid, plan=dn,
                                                                                        out=h)
                                                  for i in ids_list]))
    del buf
    return rows


def engine_ab(path: str, batches=(1, 4)) -> list[dict]:
    """Decode tokens/s (graphs, no profile) of the engine on `path` with small_moe off, then on."""
    from colibri_format.runtime.cuda.bench import run_bench
    from colibri_format.runtime.engine import Engine, EngineConfig

    rows = []
    for small in (False, True):
        cfg = EngineConfig(device="cuda", max_batch_size=max(batches), max_seq_len=512, verify="never",
                           small_moe=small)
        with Engine(path, cfg) as eng:
            for b in batches:
                d = run_bench(path, batch_size=b, num_iters=64, warmup_iters=8, prefill=False, profile=False,
                              engine=eng)["decode"]
                rows.append({"file": path, "small_moe": small, "batch": b, "tokens_per_s": d["tokens_per_s"],
                             "ms_per_step": d["ms_per_step"], "graph": d["graph"]})
                log(f"  engine small_moe={small} batch {b}: {d['tokens_per_s']:.1f} tokens/s "
                    f"({d['ms_per_step']:.3f} ms/step, graph {d['graph']})")
    return rows


def summary_md(rows: list[dict]) -> str:
    """Per shape and token count: today's whole block against the fastest pair of plans."""
    lines = ["| shape | T | today µs | best small µs (plans) | speed-up |", "|---|---|---|---|---|"]
    for key in dict.fromkeys((r["shape"], r["T"]) for r in rows):
        mine = [r for r in rows if (r["shape"], r["T"]) == key and r["stage"] == "all"]
        today = next(r for r in mine if r["variant"] == "today")
        best = min((r for r in mine if r["variant"] != "today"), key=lambda r: r["us"], default=None)
        if best is None:
            continue
        lines.append(f"| {key[0]} | {key[1]} | {today['us']:.1f} | {best['us']:.1f} ({best['variant']}) | "
                     f"{today['us'] / best['us']:.2f}x |")
    return "\n".join(lines) + "\n"


def table_md(rows: list[dict], copy_gbps: float) -> str:
    lines = [f"device-to-device copy: {copy_gbps:.0f} GB/s", "",
             "| shape | T | variant | stage | µs | GB/s of expert bytes | share of copy |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['T']} | {r['variant']} | {r['stage']} | {r['us']:.1f} | {r['gbps']:.0f} | "
              f"{r['share_of_copy']:.0%} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,4", help=f"comma list of token counts (<= {limits.MOE_SMALL_MAX_TOKENS})")
    ap.add_argument("--group", type=int, default=0, help="scale group size (0: per-row scales)")
    ap.add_argument("--engine", help="a full-depth .colibri file: also decode tokens/s with small_moe off and on")
    args = ap.parse_args()
    import cupy as cp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copy_gbps = copy_bandwidth(cp)
    log(f"device-to-device copy {copy_gbps:.0f} GB/s")
    rows, wrong = [], []
    for name in args.shapes.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            rows += bench_shape(cp, name, T, args.group, copy_gbps, wrong)
    engine = engine_ab(args.engine) if args.engine else []
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "copy_gbps": copy_gbps,
              "plans": {"gate_up": limits.SMALL_GATE_UP_PLANS, "down": limits.SMALL_DOWN_PLANS},
              "command": " ".join(sys.argv), "rows": rows, "wrong": wrong, "engine": engine}
    (out / "decode_moe_small.json").write_text(json.dumps(result, indent=1))
    md = summary_md(rows) + "\n" + table_md(rows, copy_gbps)
    if engine:
        md += "\n| file | small_moe | batch | tokens/s | ms/step |\n|---|---|---|---|---|\n" + "".join(
            f"| {r['file']} | {r['small_moe']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
            f"{r['ms_per_step']:.3f} |\n" for r in engine)
    (out / "decode_moe_small.md").write_text(md)
    print(md)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
