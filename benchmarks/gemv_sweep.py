"""Plans of the decode expert GEMVs: rows a warp item and 16-byte chunks a lane loads at once (issues 14, 16).

    PYTHONPATH=. python benchmarks/gemv_sweep.py --out OUT_DIR [--kernels dp4a,int8] [--shapes mixtral,qwen3]
                                                 [--tokens 1,8] [--group 32]
    PYTHONPATH=. python benchmarks/gemv_sweep.py --out OUT_DIR --pairs      # the one-token by-pair kernels
    PYTHONPATH=. python benchmarks/gemv_sweep.py --list          # the candidate plans, no GPU

Two families, each with its plans in limits.py as -D constants:
- dp4a: moe_gemv4_dp4a.cu's int4_group GEMVs on int8 activations, a plan per tokens a pass (A8_PLANS); for T tokens
  a step the kernel the engine picks (`ops.tokens_per_pass`) is swept;
- int8: moe_gemv.cu's one-token w4 kernels on int8_row experts (GEMV_W4_PLAN), the engine's default at one token a
  pass (T = 1 only).
Each candidate plan is compiled in once, at every tokens a pass (`gpu_kernels.rebuild_module`: 16 builds a family),
and run on every case through the engine's own wrapper
(`ops.moe_gate_up_4bit_a8` / `moe_down_4bit_a8`, `ops.moe_gate_up` / `moe_down` with variant w4), its output
compared with the default plan's bit for bit (a plan changes which warp computes a row and how many loads a lane
issues before it uses them, not the order in which a row's chunks are summed), and timed as gemv4_tc.py times its
kernels: CUDA graphs of many launches over rotated routings on random experts larger than L2; µs a launch, GB/s of
the expert bytes read, and the kernel's registers and spilled bytes. --pairs sweeps the kernels one-token passes run
in the engine since session 16 instead (`ops.pairs_path`: by pair from the router's ids, no dispatch;
`moe_gate_up_pairs` / `moe_down_pairs`, `moe_gate_up_4bit_a8_pairs` / `moe_down_4bit_a8_pairs`), which compile from
the same plan constants as the one-token dispatch kernels (T = 1 only). Writes gemv_sweep.json and prints the table;
exits 1 when a plan's output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv4_tc import LAUNCHES, ROUTINGS, SHAPES, device_experts, expert_bytes, gpu_or_none  # noqa: E402
from gpu_kernels import copy_bandwidth, log, rebuild_module, time_graph  # noqa: E402

from colibri_format import spec as S  # noqa: E402
from colibri_format.runtime.cuda import limits  # noqa: E402
from colibri_format.runtime.cuda.kernels import ops  # noqa: E402

# (rows a warp item, chunks a lane loads per row at once) tried per stage; gate_up rows are half gate, half up (even)
CANDIDATES = {"gate_up": ((2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2)),
              "down": ((1, 4), (1, 8), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2))}
STAGE = {"gate_up": 0, "down": 1}
MODULE = {"dp4a": "moe_gemv4_dp4a", "int8": "moe_gemv"}


def defines(family: str, stage: str, plan: tuple[int, int] | None) -> dict[str, int]:
    """The family's plan constants with `stage`'s plan replaced by `plan` at every tokens a pass (None: the
    defaults), so one build serves every case of the sweep."""
    if family == "dp4a":
        plans = {t: list(v) for t, v in limits.A8_PLANS.items()}
        for v in plans.values():
            v[STAGE[stage]] = plan or v[STAGE[stage]]
        return limits.a8_plan_defines(plans)
    w4 = list(limits.GEMV_W4_PLAN)
    w4[STAGE[stage]] = plan or w4[STAGE[stage]]
    return limits.w4_plan_defines(tuple(w4))


def kernel_name(family: str, stage: str, tokc: int, pairs: bool) -> str:
    if family == "dp4a":
        return f"moe4a8_{stage}_pairs_int4" if pairs else f"moe4a8_{stage}_int4_t{tokc}"
    return f"moe_{stage}_pairs_w4_r" if pairs else f"moe_{stage}_w4_r"


def stage_runners(cp, family: str, table, k: int, x, act, w, pairs: bool):
    """{stage: run(routing) -> output} through the engine's wrappers; routing: a dispatch, or with `pairs` the
    router's ids [T, k]."""
    out = {"gate_up": cp.empty(act.shape, cp.float32), "down": cp.empty((act.shape[0], x.shape[1]), cp.float32)}
    if family == "dp4a":
        (xq, xs), (aq, as_) = ops.quantize_activations_a8(x), ops.quantize_activations_a8(act)
        if pairs:
            return {"gate_up": lambda ids: ops.moe_gate_up_4bit_a8_pairs(xq, xs, ids, table, out=out["gate_up"]),
                    "down": lambda ids: ops.moe_down_4bit_a8_pairs(aq, as_, ids, w, table, out=out["down"])}
        return {"gate_up": lambda d: ops.moe_gate_up_4bit_a8(xq, xs, table, d, k, out=out["gate_up"]),
                "down": lambda d: ops.moe_down_4bit_a8(aq, as_, table, d, w, out=out["down"])}
    if pairs:
        return {"gate_up": lambda ids: ops.moe_gate_up_pairs(x, ids, table, out=out["gate_up"]),
                "down": lambda ids: ops.moe_down_pairs(act, ids, w, table, out=out["down"])}
    return {"gate_up": lambda d: ops.moe_gate_up(x, table, d, k, variant="w4", out=out["gate_up"]),
            "down": lambda d: ops.moe_down(act, table, d, w, variant="w4", out=out["down"])}


def make_case(cp, family: str, name: str, T: int, group: int, pairs: bool) -> dict:
    """A sweep case: random experts, rotated routings (dispatches, or with `pairs` the ids themselves), inputs, the
    engine's runners and the default plan's outputs (the module must hold the default plans when this runs)."""
    H, I, E, k = SHAPES[name]
    fmt = S.ExpertFormat.INT4_GROUP if family == "dp4a" else S.ExpertFormat.INT8_ROW
    buf, table, layout = device_experts(cp, E, H, I, T, fmt, group if family == "dp4a" else 0)
    rng = np.random.default_rng(T)
    ids_list = [cp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
                for _ in range(ROUTINGS)]
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    act = cp.asarray(rng.standard_normal((T * k, I)).astype(np.float32))
    w = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    case = {"name": name, "T": T, "tokc": ops.tokens_per_pass(T, k, E), "buf": buf, "layout": layout,
            "ids_list": ids_list, "routings": ids_list if pairs else [ops.dispatch(ids, E) for ids in ids_list],
            "runs": stage_runners(cp, family, table, k, x, act, w, pairs)}
    case["default"] = {stage: run(case["routings"][0]).get() for stage, run in case["runs"].items()}
    return case


def sweep_family(cp, family: str, shapes: list[str], tokens: list[int], group: int, copy_gbps: float,
                 wrong: list, pairs: bool = False) -> list[dict]:
    """Every candidate plan of `family`, one build each, over every (shape, tokens) case."""
    module = MODULE[family]
    rebuild_module(module, **defines(family, "gate_up", None))
    cases = [make_case(cp, family, name, T, group, pairs) for name in shapes for T in tokens]
    rows = []
    for stage, plans in CANDIDATES.items():
        for plan in plans:
            if stage == "gate_up" and plan[0] % 2:
                continue
            rebuild_module(module, **defines(family, stage, plan))
            for c in cases:
                run = c["runs"][stage]
                same = bool(np.array_equal(run(c["routings"][0]).get(), c["default"][stage]))
                if not same:
                    wrong.append(f"{family} {c['name']} T={c['T']} {stage} plan {plan}: output differs from the "
                                 "default plan's")
                us = time_graph(cp, [lambda d=d: run(d) for d in c["routings"]], per_graph=LAUNCHES)
                nbytes = expert_bytes(c["layout"], c["ids_list"], stage)
                fn = ops.kernel(module, kernel_name(family, stage, c["tokc"], pairs))
                row = {"family": family + (" pairs" if pairs else ""), "shape": c["name"], "T": c["T"], "tokens_a_pass": c["tokc"], "stage": stage,
                       "rows": plan[0], "chunks": plan[1],
                       "default": defines(family, stage, plan) == defines(family, stage, None),
                       "us": us, "gbps": nbytes / us / 1e3, "share_of_copy": nbytes / us / 1e3 / copy_gbps,
                       "same_output": same, "registers": int(fn.attributes["num_regs"]),
                       "spill_bytes": int(fn.attributes["local_size_bytes"])}
                rows.append(row)
                log(f"  {family} {c['name']} T={c['T']} {stage:7s} R{plan[0]} C{plan[1]} {us:8.1f} µs "
                    f"{row['gbps']:6.0f} GB/s regs {row['registers']} spill {row['spill_bytes']}"
                    f"{'' if same else ' WRONG'}")
    rebuild_module(module, **defines(family, "gate_up", None))
    del cases
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def table_md(rows: list[dict]) -> str:
    lines = ["| kernels | shape | T (a pass) | stage | rows x chunks | µs | GB/s | share of copy | registers | spill B "
             "| |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['shape']} | {r['T']} ({r['tokens_a_pass']}) | {r['stage']} | "
                     f"{r['rows']} x {r['chunks']} | {r['us']:.1f} | {r['gbps']:.0f} | {r['share_of_copy']:.0%} | "
                     f"{r['registers']} | {r['spill_bytes']} | {'default' if r['default'] else ''}"
                     f"{'' if r['same_output'] else ' WRONG'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--kernels", default="dp4a,int8", help="comma list of dp4a, int8")
    ap.add_argument("--shapes", default="mixtral,qwen3", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,8", help="comma list of tokens a step (int8: 1 only)")
    ap.add_argument("--group", type=int, default=32, help="int4_group scale group (32, 64 or 128)")
    ap.add_argument("--pairs", action="store_true", help="the one-token by-pair kernels (ops.pairs_path; T = 1)")
    ap.add_argument("--list", action="store_true", help="print the candidate plans' -D constants and stop (no GPU)")
    args = ap.parse_args()
    families = args.kernels.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.list:
        for family in families:
            for stage, plans in CANDIDATES.items():
                for plan in plans:
                    print(family, stage, plan, defines(family, stage, plan))
        return 0
    cp = gpu_or_none()
    if cp is None:
        print("gemv_sweep.py needs a CUDA GPU and CuPy; none found", file=sys.stderr)
        return 2
    copy_gbps = copy_bandwidth(cp)
    log(f"device copy {copy_gbps:.0f} GB/s")
    rows, wrong = [], []
    for family in families:
        rows += sweep_family(cp, family, args.shapes.split(","), tokens if family == "dp4a" and not args.pairs
                             else [1], args.group, copy_gbps, wrong, args.pairs)
    md = table_md(rows) + "".join(f"\nWRONG: {w}" for w in wrong)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_sweep.json").write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows, "wrong": wrong},
                                                    indent=1))
    print(md)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
