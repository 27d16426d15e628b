"""Plans of the dense decode GEMV (`ops.dense_gemv`) against K splits, at the products a decode step runs (issue 14).

    PYTHONPATH=. python benchmarks/dense_gemv_sweep.py --out OUT_DIR [--tokens 1,8] [--shapes "qwen3 qkv,..."]
    PYTHONPATH=. python benchmarks/dense_gemv_sweep.py --list          # the candidate plans, no GPU

A plan is (output rows a warp item, 16-byte loads a lane issues per row before it uses them): limits.DG_PLANS per
tokens a pass, compiled in as -D constants. Each candidate is built once (`gpu_kernels.rebuild_module`, with
DG_PLANS patched so the wrapper's grid follows it) and run through `ops.dense_gemv` at every split (1, 2, 4, 8)
and at the split the engine picks (`ops.dense_gemv_splits`), on bf16 weights rotated over copies larger than L2
(from HBM), timed in CUDA graphs of many launches (`gpu_kernels.time_graph`): µs a launch, GB/s of weight bytes,
share of the device copy rate, registers and spills. A plan changes which warp computes a row and how many loads a
lane has in flight, not the order in which a lane sums its chunks, so at one split every plan's output equals the
default plan's bit for bit; the script checks that, and each default-plan split against float64. Writes
dense_gemv_sweep.json, prints the table, exits 1 when an output is wrong.

    PYTHONPATH=. python benchmarks/dense_gemv_sweep.py --out OUT_DIR --tc [--tc-tokens 1,2,4,8,16,32]

--tc instead times the tensor-core product (`ops.dense_gemv_tc`, limits.DG_TC_*) beside what the engine runs by
default for the same rows (`dense_gemv` passes of 8 rows, DeviceDense.linear's loop), at the split it picks and
each split forced, for each DG_TC_UNROLL of TC_UNROLLS (layers.cu rebuilt): the figures that set
limits.DG_TC_MIN_ROWS. The default unroll's outputs are checked against the kernel's NumPy twin
(`ops.dense_gemv_tc_reference`), the other unrolls' against the default's, bit for bit (the same sums in the same
order, on the same seeded inputs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import GEMV_SHAPES, ROTATE_BYTES  # noqa: E402
from gpu_kernels import copy_bandwidth, log, rebuild_module, time_graph  # noqa: E402

from colibri_format.runtime.cuda import limits  # noqa: E402

CANDIDATES = {1: ((1, 4), (1, 8), (2, 2), (2, 4), (4, 1), (4, 2)),      # tokens a pass -> (rows, loads) plans
              8: ((1, 4), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1))}
SPLITS = (1, 2, 4, 8)
F32_TOL = 2e-6
TC_TOL = 1e-6           # dense_gemv_tc against its twin (the same split inputs, float64 sums)
TC_UNROLLS = (4, 2, 8)  # limits.DG_TC_UNROLL first


def plan_defines(tokens: int, plan: tuple[int, int]) -> dict[str, int]:
    return {f"DG_T{tokens}_ROWS": plan[0], f"DG_T{tokens}_UNROLL": plan[1]}


def use_plan(tokens: int, plan: tuple[int, int]) -> None:
    """The layers module rebuilt with `plan` for `tokens`, and DG_PLANS (which the wrapper's grid reads) to match."""
    limits.DG_PLANS[tokens] = plan
    rebuild_module("layers", **plan_defines(tokens, plan))


def make_cases(cp, tokens: int, shapes: list[str]) -> list[dict]:
    cases = []
    for name in shapes:
        N, K = GEMV_SHAPES[name]
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / (N * K * 2))))
        ws = [cp.random.randint(0, 1 << 16, (N, K), dtype=cp.int32).astype(cp.uint16) for _ in range(copies)]
        for w in ws:     # finite bf16: clear the exponent's top bit
            w &= 0xBFFF
        x = cp.random.standard_normal((tokens, K), dtype=cp.float32)
        w64 = (ws[0].get().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        cases.append({"name": name, "N": N, "K": K, "ws": ws, "x": x, "y": cp.empty((tokens, N), cp.float32),
                      "ref": x.get().astype(np.float64) @ w64.T, "default": {}})
    return cases


def sweep(cp, tokens: int, shapes: list[str], copy_gbps: float, wrong: list) -> list[dict]:
    from colibri_format.runtime.cuda.kernels import ops

    default_plan = limits.DG_PLANS[tokens]
    plans = [default_plan] + [p for p in CANDIDATES[tokens] if p != default_plan]
    cases = make_cases(cp, tokens, shapes)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = []
    for plan in plans:
        use_plan(tokens, plan)
        fn = ops.kernel("layers", f"dense_gemv_bf16_t{tokens}")
        for c in cases:
            picked = ops.dense_gemv_splits(c["N"], c["K"], tokens, 2, sms)
            for splits in SPLITS:
                y = ops.dense_gemv(c["x"], c["ws"][0], out=c["y"], splits=splits).get()
                if plan == default_plan:
                    c["default"][splits] = y
                    err = float(np.abs(y - c["ref"]).max() / np.abs(c["ref"]).max())
                    if err > F32_TOL:
                        wrong.append(f"{c['name']} T={tokens} splits {splits}: {err:.2e} from float64")
                elif not np.array_equal(y, c["default"][splits]):
                    wrong.append(f"{c['name']} T={tokens} plan {plan} splits {splits}: differs from the default plan")
                us = time_graph(cp, [lambda w=w: ops.dense_gemv(c["x"], w, out=c["y"], splits=splits)
                                     for w in c["ws"]], per_graph=max(40, len(c["ws"])))
                gbps = c["N"] * c["K"] * 2 / us / 1e3
                rows.append({"shape": c["name"], "N": c["N"], "K": c["K"], "T": tokens, "rows": plan[0],
                             "loads": plan[1], "default_plan": plan == default_plan, "splits": splits,
                             "picked": splits == picked, "us": us, "gbps": gbps, "share_of_copy": gbps / copy_gbps,
                             "registers": int(fn.attributes["num_regs"]),
                             "spill_bytes": int(fn.attributes["local_size_bytes"])})
            best = min((r for r in rows if r["shape"] == c["name"] and r["rows"] == plan[0]
                        and r["loads"] == plan[1]), key=lambda r: r["us"])
            log(f"T={tokens} R{plan[0]} U{plan[1]} {c['name']:15s} best split {best['splits']} {best['us']:7.2f} µs "
                f"(picked {picked})")
    use_plan(tokens, default_plan)
    return rows


def default_passes(ops, c: dict, w) -> None:
    """The engine's product of c's rows without the tensor cores: dense_gemv passes of 8 rows (DeviceDense.linear)."""
    T = c["x"].shape[0]
    for t0 in range(0, T, 8):
        ops.dense_gemv(c["x"][t0:t0 + 8], w, out=c["y"][t0:t0 + 8])


def tc_sweep(cp, token_counts: list[int], shapes: list[str], copy_gbps: float, wrong: list) -> list[dict]:
    from colibri_format.runtime.cuda.kernels import ops

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    default_unroll, rows = limits.DG_TC_UNROLL, []
    first: dict[tuple, np.ndarray] = {}    # the default unroll's outputs: another unroll sums in the same order
    for unroll in TC_UNROLLS:
        rebuild_module("layers", DG_TC_UNROLL=unroll)
        for T in token_counts:
            cp.random.seed(T)              # the same weights and rows for every unroll
            for c in make_cases(cp, T, shapes):
                nbytes = c["N"] * c["K"] * 2

                def add(kernel: str, splits, fn, c=c, T=T, unroll=unroll, nbytes=nbytes):
                    us = time_graph(cp, [lambda w=w: fn(w) for w in c["ws"]], per_graph=max(40, len(c["ws"])))
                    rows.append({"shape": c["name"], "N": c["N"], "K": c["K"], "T": T, "kernel": kernel,
                                 "unroll": unroll, "splits": splits, "us": us, "gbps": nbytes / us / 1e3,
                                 "share_of_copy": nbytes / us / 1e3 / copy_gbps})

                if unroll == default_unroll:
                    add("dense_gemv passes", None, lambda w, c=c: default_passes(ops, c, w))
                    twin = ops.dense_gemv_tc_reference(c["x"].get(), c["ws"][0].get())
                picked = ops.dense_gemv_tc_splits(c["N"], c["K"], sms)
                for splits in (None, *SPLITS):
                    y = ops.dense_gemv_tc(c["x"], c["ws"][0], out=c["y"], splits=splits).get()
                    key = (c["name"], T, splits)
                    if unroll == default_unroll:
                        first[key] = y
                        err = float(np.abs(y - twin).max() / np.abs(twin).max())
                        if err > TC_TOL:
                            wrong.append(f"dense_gemv_tc {c['name']} T={T} splits {splits}: {err:.2e} from the twin")
                    elif not np.array_equal(y, first[key]):
                        wrong.append(f"dense_gemv_tc {c['name']} T={T} unroll {unroll} splits {splits}: differs "
                                     f"from unroll {default_unroll}")
                    add("dense_gemv_tc", splits or picked,
                        lambda w, c=c, splits=splits: ops.dense_gemv_tc(c["x"], w, out=c["y"], splits=splits))
                log(f"T={T} unroll {unroll} {c['name']:15s} " + " ".join(
                    f"{r['kernel']} {r['splits']}: {r['us']:.2f}" for r in rows[-6:] if r["shape"] == c["name"]))
            cp.get_default_memory_pool().free_all_blocks()
    rebuild_module("layers", DG_TC_UNROLL=default_unroll)
    return rows


def tc_table_md(rows: list[dict]) -> str:
    lines = ["| shape | T | dense_gemv passes µs | dense_gemv_tc µs, unroll: best split (picked split) | best x | "
             "best GB/s |", "|---|---|---|---|---|---|"]
    for shape, T in sorted({(r["shape"], r["T"]) for r in rows}, key=lambda k: (k[1], k[0])):
        case = [r for r in rows if (r["shape"], r["T"]) == (shape, T)]
        base = next(r["us"] for r in case if r["kernel"] == "dense_gemv passes")
        tc = [r for r in case if r["kernel"] == "dense_gemv_tc"]
        cells = []
        for unroll in TC_UNROLLS:
            mine = [r for r in tc if r["unroll"] == unroll]
            if mine:
                best = min(mine, key=lambda r: r["us"])
                cells.append(f"{unroll}: {best['us']:.2f} ({mine[0]['us']:.2f})")
        best = min(tc, key=lambda r: r["us"])
        lines.append(f"| {shape} | {T} | {base:.2f} | {'; '.join(cells)} | {base / best['us']:.2f}x | "
                     f"{best['gbps']:.0f} |")
    return "\n".join(lines)


def table_md(rows: list[dict]) -> str:
    lines = ["| shape | T | rows x loads | splits 1 / 2 / 4 / 8 (µs; * picked) | best GB/s | registers | spill B |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["shape"], r["T"], r["rows"], r["loads"]) for r in rows},
                  key=lambda k: (k[1], k[0], k[2], k[3]))
    for shape, T, R, U in keys:
        rs = sorted((r for r in rows if (r["shape"], r["T"], r["rows"], r["loads"]) == (shape, T, R, U)),
                    key=lambda r: r["splits"])
        cells = " / ".join(f"{r['us']:.2f}{'*' if r['picked'] else ''}" for r in rs)
        lines.append(f"| {shape} | {T} | {R} x {U}{' (default)' if rs[0]['default_plan'] else ''} | {cells} | "
                     f"{max(r['gbps'] for r in rs):.0f} | {rs[0]['registers']} | {rs[0]['spill_bytes']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", default="1,8", help="comma list of tokens a pass (keys of CANDIDATES)")
    ap.add_argument("--shapes", default=",".join(GEMV_SHAPES), help=f"comma list of {', '.join(GEMV_SHAPES)}")
    ap.add_argument("--list", action="store_true", help="print the candidate plans' -D constants and stop (no GPU)")
    ap.add_argument("--tc", action="store_true", help="time dense_gemv_tc against the default passes instead")
    ap.add_argument("--tc-tokens", default="1,2,4,8,16,32", help="with --tc: comma list of rows a pass (1-32)")
    args = ap.parse_args()
    if args.tc:
        return run_tc(args)
    tokens = [int(t) for t in args.tokens.split(",")]
    unknown = [t for t in tokens if t not in CANDIDATES] + [s for s in args.shapes.split(",") if s not in GEMV_SHAPES]
    if unknown:
        ap.error(f"unknown tokens or shapes: {unknown}")
    if args.list:
        for t in tokens:
            for plan in CANDIDATES[t]:
                print(t, plan, plan_defines(t, plan))
        return 0
    import cupy as cp

    copy_gbps = copy_bandwidth(cp)
    log(f"device copy {copy_gbps:.0f} GB/s")
    rows, wrong = [], []
    for t in tokens:
        rows += sweep(cp, t, args.shapes.split(","), copy_gbps, wrong)
        cp.get_default_memory_pool().free_all_blocks()
    return report(Path(args.out) / "dense_gemv_sweep.json", copy_gbps, rows, wrong, table_md(rows))


def report(path: Path, copy_gbps: float, rows: list[dict], wrong: list[str], table: str) -> int:
    """The JSON written, the table and any wrong output printed; the exit status (1: an output was wrong)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows, "wrong": wrong}, indent=1))
    print(table + "".join(f"\nWRONG: {w}" for w in wrong))
    return 1 if wrong else 0


def run_tc(args) -> int:
    tokens = [int(t) for t in args.tc_tokens.split(",")]
    shapes = args.shapes.split(",")
    bad = [t for t in tokens if not 1 <= t <= 32] + [s for s in shapes if s not in GEMV_SHAPES]
    if bad:
        raise SystemExit(f"dense_gemv_sweep.py: unknown rows or shapes: {bad}")
    import cupy as cp

    copy_gbps = copy_bandwidth(cp)
    log(f"device copy {copy_gbps:.0f} GB/s")
    wrong: list[str] = []
    rows = tc_sweep(cp, tokens, shapes, copy_gbps, wrong)
    return report(Path(args.out) / "dense_gemv_tc_sweep.json", copy_gbps, rows, wrong, tc_table_md(rows))


if __name__ == "__main__":
    raise SystemExit(main())
