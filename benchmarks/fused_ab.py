"""A/B in one process: the fused layer kernels and the bf16 tensor-core dense products on vs off (H200 run).

For each shape of gpu_vs_hf.py (same reduced random bf16 model, converted the same way), the CUDA engine is
opened once per variant, interleaved over `--reps` rounds, and timed by `run_bench` (batch-1 decode in a captured
graph, 512-token prefill; the engine config of gpu_vs_hf.py). Variants set COLIBRI_CUDA_FUSED and
COLIBRI_CUDA_BF16_GEMM before the engine is built.

    python3 benchmarks/fused_ab.py --shapes qwen3,olmoe --out $OUT/fused_ab.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = (("fused+bf16gemm", "1", "1"), ("unfused+f32gemm", "0", "0"), ("fused+f32gemm", "1", "0"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,olmoe")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--iters", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU stand-in backend and a tiny model (logic check)")
    args = ap.parse_args()
    if args.dry_run:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))
        from fake_cuda import FakeBackend

        from colibri_format.runtime import cuda_backend

        cuda_backend.set_backend_factory(FakeBackend)
        args.iters = 3

    import torch
    from gpu_vs_hf import build_hf

    from colibri_format.runtime.cuda.bench import run_bench
    from colibri_format.convert.pipeline import convert
    from colibri_format.runtime.cuda.engine_cuda import CudaEngine
    from colibri_format.runtime.engine import EngineConfig

    rows = []
    work = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        for shape in args.shapes.split(","):
            model, _ = build_hf(shape, args.dry_run)
            model.save_pretrained(work / "hf")
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            path = work / f"{shape}.colibri"
            convert(work / "hf", path, dtype="bfloat16", quantize="expert", workers=8, verify=False)
            shutil.rmtree(work / "hf")
            for rep in range(args.reps):
                for name, fused, bf16 in VARIANTS:
                    os.environ["COLIBRI_CUDA_FUSED"], os.environ["COLIBRI_CUDA_BF16_GEMM"] = fused, bf16
                    cfg = EngineConfig(device="cuda", max_batch_size=32, max_seq_len=512)
                    with CudaEngine(path, cfg) as eng:
                        r = run_bench(path, batch_size=1, seq_len=512, num_iters=args.iters, warmup_iters=4,
                                      engine=eng, profile=False, ceiling_bytes=1 << 28)
                    row = {"shape": shape, "variant": name, "rep": rep, "b1_tok_s": r["decode"]["tokens_per_s"],
                           "b1_ms_step": r["decode"]["ms_per_step"], "host_ms": r["decode"]["host_ms_per_step"],
                           "graph": r["decode"]["graph"], "prefill_ms": r["prefill"]["ms"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                                                              "rows": rows}, indent=1))
            path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| shape | variant | b1 tok/s (reps) | ms/step | prefill 512 ms (reps) |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for name, _, _ in VARIANTS:
            rs = [r for r in rows if r["shape"] == shape and r["variant"] == name]
            if rs:
                tps = " / ".join(f"{r['b1_tok_s']:.0f}" for r in rs)
                pre = " / ".join(f"{r['prefill_ms']:.1f}" for r in rs)
                print(f"| {shape} | {name} | {tps} | {min(r['b1_ms_step'] for r in rs):.3f} | {pre} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
