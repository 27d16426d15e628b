"""Plans of the dp4a 4-bit decode GEMVs (moe_gemv4_dp4a.cu): rows a warp item and chunks a lane loads at once.

    PYTHONPATH=. python benchmarks/gemv4_sweep.py --out OUT_DIR [--shapes mixtral,qwen3] [--tokens 1,8] [--group 32]
    PYTHONPATH=. python benchmarks/gemv4_sweep.py --list          # the plans and their -D constants, no GPU

The kernels take their plan per tokens-a-pass from limits.py's A8_PLANS (-D A8_{GU,DN}_T<tokens>_{ROWS,CPL}). Each
plan below is compiled into its own module (the other token counts keep their plans), launched exactly as
`ops.moe_gate_up_4bit_a8` / `ops.moe_down_4bit_a8` launch theirs (the kernel of the tokens a pass the engine picks
for T tokens a step; as many blocks as fit the device at once), and
timed as benchmarks/gemv4_tc.py times its kernels: CUDA graphs of many launches over rotated routings on random
int4_group experts larger than L2; µs a launch and GB/s of the expert bytes read. A plan's output must equal the
engine's (A8_PLANS) bit for bit: the plan changes which warp computes a row and how many loads a lane issues
before it uses them, not the order in which a row's chunks are summed. Registers and spilled bytes come from the
compiled kernel. Writes gemv4_sweep.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv4_tc import LAUNCHES, ROUTINGS, SHAPES, device_int4_experts, expert_bytes, gpu_or_none  # noqa: E402
from gpu_kernels import copy_bandwidth, log, time_graph  # noqa: E402

from colibri_format.runtime.cuda import limits  # noqa: E402
from colibri_format.runtime.cuda.kernels import ops  # noqa: E402

# (rows a warp item, chunks a lane loads per row at once) tried per stage; gate_up rows are half gate, half up
CANDIDATES = {"gate_up": ((2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2)),
              "down": ((1, 4), (1, 8), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2))}
STAGE_KEY = {"gate_up": 0, "down": 1}


def plans_with(tokens: int, stage: str, plan: tuple[int, int]) -> dict:
    """limits.A8_PLANS with `stage`'s plan at `tokens` tokens a pass replaced."""
    plans = {t: list(v) for t, v in limits.A8_PLANS.items()}
    plans[tokens][STAGE_KEY[stage]] = plan
    return {t: tuple(v) for t, v in plans.items()}


def define_options(plans: dict) -> tuple[str, ...]:
    defines = {**limits.KERNEL_DEFINES["moe_gemv4_dp4a"], **limits.a8_plan_defines(plans)}
    return tuple(f"-D{k}={v}" for k, v in defines.items())


def plan_function(cp, tokens: int, stage: str, plan: tuple[int, int]):
    mod = cp.RawModule(code=ops.kernel_source("moe_gemv4_dp4a"),
                       options=ops.NVRTC_OPTIONS + define_options(plans_with(tokens, stage, plan)))
    return mod.get_function(f"moe4a8_{stage}_int4_t{tokens}")


def launcher(cp, fn, stage: str, table, k: int, inputs: tuple, w, out):
    """fn launched as ops launches the engine's kernel of `stage` (grid: the blocks that fit at once)."""
    grid = (ops._sm_count() * ops.resident_blocks(fn, limits.A8_THREADS),)
    q, s = inputs
    H, I = table.hidden_size, table.intermediate_size
    if stage == "gate_up":
        def run(d):
            fn(grid, (limits.A8_THREADS,),
               (q, s, table.blob_ptrs, np.uint64(0), np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale),
                d.perm, d.offsets, d.active, d.meta, out, np.int32(H), np.int32(I), np.int32(k),
                np.int32(table.group_size)))
            return out
    else:
        def run(d):
            fn(grid, (limits.A8_THREADS,),
               (q, s, table.blob_ptrs, np.uint64(0), np.int64(table.off_down), np.int64(table.off_down_scale),
                d.perm, d.offsets, d.active, d.meta, w, out, np.int32(H), np.int32(I), np.int32(table.group_size)))
            return out
    return run


def sweep_shape(cp, name: str, T: int, group: int, copy_gbps: float, wrong: list) -> list[dict]:
    H, I, E, k = SHAPES[name]
    buf, table, layout = device_int4_experts(cp, E, H, I, group, seed=T)
    rng = np.random.default_rng(T)
    ids_list = [cp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
                for _ in range(ROUTINGS)]
    disps = [ops.dispatch(ids, E) for ids in ids_list]
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    act = cp.asarray(rng.standard_normal((T * k, I)).astype(np.float32))
    w = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    inputs = {"gate_up": ops.quantize_activations_a8(x), "down": ops.quantize_activations_a8(act)}
    engine = {"gate_up": ops.moe_gate_up_4bit_a8(*inputs["gate_up"], table, disps[0], k).get(),
              "down": ops.moe_down_4bit_a8(*inputs["down"], table, disps[0], w).get()}
    tokc = ops._tokens4(None, T, k, E)     # the kernel (tokens a pass) the engine runs for T tokens
    rows = []
    for stage, plans in CANDIDATES.items():
        out = cp.empty(engine[stage].shape, cp.float32)
        nbytes = expert_bytes(layout, ids_list, stage)
        for plan in plans:
            if stage == "gate_up" and plan[0] % 2:
                continue
            fn = plan_function(cp, tokc, stage, plan)
            run = launcher(cp, fn, stage, table, k, inputs[stage], w, out)
            same = bool(np.array_equal(run(disps[0]).get(), engine[stage]))
            if not same:
                wrong.append(f"{name} T={T} {stage} plan {plan}: output differs from the engine's")
            us = time_graph(cp, [lambda d=d: run(d) for d in disps], per_graph=LAUNCHES)
            row = {"shape": name, "T": T, "tokens_a_pass": tokc, "group": group, "stage": stage, "rows": plan[0],
                   "chunks": plan[1], "engine_plan": tuple(limits.A8_PLANS[tokc][STAGE_KEY[stage]]) == plan, "us": us,
                   "gbps": nbytes / us / 1e3, "share_of_copy": nbytes / us / 1e3 / copy_gbps, "same_output": same,
                   "registers": int(fn.attributes["num_regs"]),
                   "spill_bytes": int(fn.attributes["local_size_bytes"])}
            rows.append(row)
            log(f"  {name} T={T} {stage:7s} R{plan[0]} C{plan[1]} {us:8.1f} µs {row['gbps']:6.0f} GB/s "
                f"regs {row['registers']} spill {row['spill_bytes']}{'' if same else ' WRONG'}")
    del buf
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def table_md(rows: list[dict]) -> str:
    lines = ["| shape | T (a pass) | stage | rows x chunks | µs | GB/s | share of copy | registers | spill B | |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['T']} ({r['tokens_a_pass']}) | {r['stage']} | {r['rows']} x {r['chunks']} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {r['share_of_copy']:.0%} | {r['registers']} | {r['spill_bytes']} | "
                     f"{'engine' if r['engine_plan'] else ''}{'' if r['same_output'] else ' WRONG'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="mixtral,qwen3", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,8", help="comma list of tokens a step (the engine's kernel for each runs)")
    ap.add_argument("--group", type=int, default=32, help="int4_group scale group (32, 64 or 128)")
    ap.add_argument("--list", action="store_true", help="print the plans' -D constants and stop (no GPU)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.list:
        for T in tokens:
            for stage, plans in CANDIDATES.items():
                for plan in plans:
                    print(T, stage, plan, " ".join(o for o in define_options(plans_with(T, stage, plan))
                                                   if f"_T{T}_" in o))
        return 0
    cp = gpu_or_none()
    if cp is None:
        print("gemv4_sweep.py needs a CUDA GPU and CuPy; none found", file=sys.stderr)
        return 2
    copy_gbps = copy_bandwidth(cp)
    log(f"device copy {copy_gbps:.0f} GB/s")
    rows, wrong = [], []
    for name in args.shapes.split(","):
        for T in tokens:
            rows += sweep_shape(cp, name, T, args.group, copy_gbps, wrong)
    md = table_md(rows) + "".join(f"\nWRONG: {w}" for w in wrong)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv4_sweep.json").write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows, "wrong": wrong},
                                                     indent=1))
    print(md)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
