"""A small CUDA-engine workload for `compute-sanitizer --tool memcheck` (benchmarks/gpu_suite.sh runs it).

A tiny Qwen3-MoE-like file (hidden 128, 2 heads of 64 with per-head q/k norms, 2 layers of 4 experts top-2, vocab
128; bf16 dense, int8 experts) written by `colibri_format.synthetic.write_synthetic`; exercises prefill, graph
capture and replay, batched decode, the paged path with multi-pass layers and prefetch, the staging-free copy
path, and a prefill on the opt-in pipelined expert GEMM (`fast_expert_gemm`).

Run from the repository root (the workload imports the library, nothing else):

    PYTHONPATH=. compute-sanitizer --tool memcheck python benchmarks/sanitize_tiny.py
    PYTHONPATH=. python benchmarks/sanitize_tiny.py --dry-run      # the same calls on device="cpu" (NumPy)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from colibri_format import spec as S
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.synthetic import synthetic_model, write_synthetic


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help='run the workload on device="cpu" (no GPU needed)')
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.colibri"
        model = synthetic_model(vocab=128, hidden=128, layers=2, heads=2, kv_heads=1, experts=4, top_k=2,
                                expert_inter=16, qk_norm="per_head")
        write_synthetic(path, model, dense_dtype=S.DType.BF16, expert_format=S.ExpertFormat.INT8_ROW)
        with Engine(path, EngineConfig(device=device, max_seq_len=64)) as eng:
            print("logits", [x.shape for x in eng.logits([[1, 2, 3, 4], [5, 6]])])
            print("generate", eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids)
            print("batch", eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3), eng.stats()["graphs"])
        for fast in ("split", "bf16"):     # a 40-row prefill on the pipelined grouped GEMM (moe_gemm_fast.cu)
            with Engine(path, EngineConfig(device=device, max_seq_len=64, fast_expert_gemm=fast)) as eng:
                print("fast gemm", fast, [x.shape for x in eng.logits([list(range(1, 41))])])
        with Engine(path, EngineConfig(device=device, max_seq_len=64, max_cached_experts=2, prefetch=True)) as eng:
            print("paged", eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids,
                  {k: eng.stats()["paging"][k] for k in ("hits", "misses", "loads")})
    print("sanitize workload done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
