"""A workload for Nsight Compute: one full-depth decode step of the CUDA engine inside an NVTX range, so that `ncu`
reports what limits each of its kernels (issue 14: the step's ~8 kernels a layer run at 35-58 % of the HBM rate or
are latency-bound, by the CUPTI timelines; the counters say why).

    ncu --clock-control none --nvtx --nvtx-include "ncu_step/" --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --csv --page details \
        python3 benchmarks/ncu_decode_step.py [--shape qwen3] [--batch 1] [--context 512]

(`STEPS=ncu_decode bash benchmarks/gpu_suite.sh` runs it so.) The shape is decode_profile.SHAPES' (full depth, the
real vocabulary, bf16 dense, int8 experts, one blob repeated: `synthetic.write_synthetic(reuse_expert=True)`), written
to --dir and deleted after. An engine without graphs (the kernels a replayed step runs, launched one by one) prefills
a --context-token prompt into each of --batch sequences, runs 4 decode steps as a warm-up, then one step inside the
NVTX range "ncu_step": the kernels ncu profiles. --tiny runs toy widths on the CPU engine (a check of the script).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import SHAPES  # noqa: E402
from prefill_engine import TINY, model_of  # noqa: E402
from synthetic_decode import write_timed  # noqa: E402

WARMUP_STEPS = 4


def log(msg: str) -> None:
    print(f"[ncu_decode_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def nvtx_range(device: str):
    """(push, pop) of the NVTX range ncu filters on; no-ops on the CPU (--tiny, a check of the script)."""
    if device != "cuda":
        return (lambda name: None), (lambda: None)
    import cupy as cp  # noqa: PLC0415 -- GPU machines only

    return cp.cuda.nvtx.RangePush, cp.cuda.nvtx.RangePop


def profiled_step(path: Path, batch: int, context: int, device: str) -> None:
    from colibri_format.runtime import Engine, EngineConfig  # noqa: PLC0415

    push, pop = nvtx_range(device)
    capacity = context + WARMUP_STEPS + 8
    with Engine(path, EngineConfig(device=device, use_graphs=False, verify="never", max_seq_len=capacity)) as eng:
        runner = eng.decode_runner(batch, capacity)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, eng.vocab_size, context) for _ in range(batch)]
        eng.prefill_into(runner, prompts)
        ids = np.array([p[-1] for p in prompts], np.int32)
        for step in range(WARMUP_STEPS + 1):
            pos = np.full(batch, context + step, np.int32)
            eng.be.synchronize()
            if step == WARMUP_STEPS:
                push("ncu_step")
            runner.step(ids, pos)
            eng.be.synchronize()
            if step == WARMUP_STEPS:
                pop()
        log(f"profiled one step: batch {batch}, position {context + WARMUP_STEPS}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the profiled step")
    ap.add_argument("--dir", default="/dev/shm", help="where the file is written (and deleted)")
    ap.add_argument("--tiny", action="store_true", help="toy widths on the CPU engine: a check of the script")
    args = ap.parse_args(argv)
    path = Path(args.dir) / f"ncu_decode_{'tiny' if args.tiny else args.shape}.colibri"
    try:
        write_timed(path, model_of(TINY if args.tiny else SHAPES[args.shape]), log)
        profiled_step(path, args.batch, args.context, "cpu" if args.tiny else "cuda")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
