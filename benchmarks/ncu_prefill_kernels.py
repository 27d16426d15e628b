"""A workload for Nsight Compute: the prefill kernels whose time issue 15 is about, each launched once after a
warm-up, so that `ncu` reports what limits them (memory, tensor pipes, stalls) instead of our guesses.

    ncu --clock-control none --kernel-name regex:'moe_gemm_fast|moe_router|router_widen|gemm' \
        --launch-skip-before-match 0 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --csv --page details \
        python3 benchmarks/ncu_prefill_kernels.py [--cases qwen3-30b-a3b-512,olmoe-512,mixtral-512]

(`STEPS=ncu bash benchmarks/gpu_suite.sh` runs it so.) Per case (prefill_gemm.CASES: random int8 experts of the
real widths, random top-k routing, x ~ N(0, 1)): the pipelined grouped GEMM's W8A8 gate_up and down
(`ops.moe_gemm_*_fast(activations="int8")`, the route 'auto' takes at 512 rows), then both routes of the router
(`ops.router`, the case's expert count, bf16 weights). Each is launched twice, a warm-up (module load, allocations)
then the one to read; ncu profiles both (it serializes and replays each launch it profiles: the durations are the
kernels' own). Prints each second launch's name and case before it, to pair with ncu's rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.prefill_gemm import CASES, random_routing  # noqa: E402
from colibri_format.runtime.cuda.bench import device_experts  # noqa: E402
from colibri_format.runtime.cuda.kernels import ops  # noqa: E402


def workload(cp, name: str) -> None:
    H, I, E, k, T = CASES[name]
    buf, table = device_experts(E, H, I, seed=1)
    ids, w = random_routing(cp, T, E, k, seed=2)
    x = cp.random.RandomState(3).standard_normal((T, H)).astype(cp.float32)
    d = ops.dispatch(ids, E)
    act = cp.empty((T * k, I), cp.float32)
    y = cp.empty((T * k, H), cp.float32)
    router_w = (cp.random.RandomState(4).standard_normal((E, H)).astype(cp.float32).view(cp.uint32) >> 16)
    router_w = router_w.astype(cp.uint16)
    ws = ops.RouterWorkspace(T, E)
    launches = {
        "gate_up int8": lambda: ops.moe_gemm_gate_up_fast(x, table, d, k, activations="int8", out=act),
        "down int8": lambda: ops.moe_gemm_down_fast(act, table, d, w, activations="int8", out=y),
        "router fused": lambda: ops.router(x, router_w, k, workspace=ws, by_gemm=False),
        "router gemm": lambda: ops.router(x, router_w, k, workspace=ws, by_gemm=True),
    }
    for what, launch in launches.items():
        launch()                            # warm-up
        cp.cuda.Device().synchronize()
        print(f"[ncu_prefill_kernels] {name}: {what}", flush=True)
        launch()
        cp.cuda.Device().synchronize()
    del buf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="qwen3-30b-a3b-512,olmoe-512,mixtral-512")
    args = ap.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}; known: {', '.join(CASES)}")
    import cupy as cp  # noqa: PLC0415 -- GPU machines only

    ops.warm_up()
    for name in args.cases.split(","):
        workload(cp, name)
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
