"""Small CUDA-engine workloads for `compute-sanitizer --tool memcheck` (benchmarks/gpu_suite.sh runs it), one per
family of kernels, so every kernel module the engine launches runs under the sanitizer.

Each workload is a tiny file written by `colibri_format.synthetic.write_synthetic` (bf16 dense, 2-4 layers, head
dim 64 so the attention kernels run): qwen3_moe (per-head q/k norms, int8 experts), gpt_oss (sinks, windows on some
layers, a router bias on the logits, expert biases and the clamped SwiGLU), minimax_m2 (sigmoid router with a
selection bias, full q/k norm, partial RoPE), qwen3_next (Gated DeltaNet and gated attention layers, a shared
expert), deepseek_v3 (multi-head latent attention, grouped top-k, a leading dense layer), int4_group and mxfp4
(4-bit experts). The models come from the full-depth benchmarks' tiny shapes (new_arch_decode.py, hybrid_decode.py,
mla_decode.py, int4_decode.py), so the sanitizer sees what those benchmarks measure. Each runs a ragged prefill,
greedy generation (graph capture and replay), batched decode, the paged path with prefetch in each
`expert_loading` mode, and a 40-row prefill with greedy steps under each opt-in path of `OPT_INS` (off by default
until measured on an H200, or, like cuBLAS's grouped expert GEMM, chosen by size: forced on here); int4_group also
with the tensor-core decode GEMVs on every pass (their crossover, limits.TC4_MIN_*, lowered: a tiny model is far
below it), qwen3_moe also with its bf16 dense products of 2-32 rows on dense_gemv_tc and with a bf16 KV cache
(the bf16 attention kernels, flash prefill included) and `dense_gemm="bf16"` (ops.round_bf16).

Run from the repository root:

    PYTHONPATH=. compute-sanitizer --tool memcheck python benchmarks/sanitize_tiny.py [--only gpt_oss,mxfp4]
    PYTHONPATH=. python benchmarks/sanitize_tiny.py --dry-run      # the same calls on device="cpu" (NumPy)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from colibri_format import spec as S
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.runtime.expert_pool import EXPERT_LOADING
from colibri_format.synthetic import synthetic_model, write_synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent))


OPT_INS = ({"fast_expert_gemm": "split"}, {"fast_expert_gemm": "bf16"}, {"flash_prefill": True},
           {"cublas_expert_gemm": True}, {"fast_expert_gemm": "bf16", "cublas_expert_gemm": True},
           {"fast_expert_gemm": "int8"}, {"fast_expert_gemm": "int8", "cublas_expert_gemm": True})


def workloads() -> dict[str, tuple[dict, S.ExpertFormat, int]]:
    """name -> (model, expert format, group size) of each tiny file."""
    import hybrid_decode
    import int4_decode
    import mla_decode
    import new_arch_decode

    int8 = (S.ExpertFormat.INT8_ROW, 0)
    qwen3 = synthetic_model(vocab=128, hidden=128, layers=2, heads=2, kv_heads=1, experts=4, top_k=2,
                            expert_inter=16, qk_norm="per_head")
    four_bit = int4_decode.model_of(int4_decode.TINY)
    return {"qwen3_moe": (qwen3, *int8),
            "gpt_oss": (new_arch_decode.model_of(*new_arch_decode.SHAPES["gpt_oss_tiny"]), *int8),
            "minimax_m2": (new_arch_decode.model_of(*new_arch_decode.SHAPES["minimax_m2_tiny"]), *int8),
            "qwen3_next": (hybrid_decode.model_of(hybrid_decode.SHAPES["tiny"]), *int8),
            "deepseek_v3": (mla_decode.mla_model("tiny"), *int8),
            "int4_group": (four_bit, S.ExpertFormat.INT4_GROUP, 32),
            "mxfp4": (four_bit, S.ExpertFormat.MXFP4, 32)}


def run(name: str, path: Path, model: dict, device: str) -> None:
    """Prefill, generation, batched decode and paging on one tiny file."""
    with Engine(path, EngineConfig(device=device, max_seq_len=64)) as eng:
        print(name, "logits", [x.shape for x in eng.logits([[1, 2, 3, 4], [5, 6]])])
        print(name, "generate", eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids)
        print(name, "batch", eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3), eng.stats()["graphs"])
    for opt_in in OPT_INS:       # a model a path does not take runs today's kernels there
        with Engine(path, EngineConfig(device=device, max_seq_len=64, **opt_in)) as eng:
            print(name, opt_in, [x.shape for x in eng.logits([list(range(1, 41))])],
                  eng.generate([1, 2, 3], max_new_tokens=3, stop_ids=[]).output_ids)
    if name == "int4_group":
        tc4_everywhere(name, path, device)
    if name == "qwen3_moe":
        dense_tc_everywhere(name, path, device)
        spread_dispatch(name, path, device)
        with Engine(path, EngineConfig(device=device, max_seq_len=64, kv_cache_dtype="bfloat16",
                                       dense_gemm="bf16")) as eng:
            print(name, "bf16 KV cache, bf16 dense products", [x.shape for x in eng.logits([list(range(1, 41))])],
                  eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids,
                  eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3))
    cached = max(2, len(model["moe_layers"]) * model["num_experts"] // 2)
    for loading in EXPERT_LOADING:
        with Engine(path, EngineConfig(device=device, max_seq_len=64, max_cached_experts=cached, prefetch=True,
                                       expert_loading=loading)) as eng:
            print(name, "paged", loading, eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids,
                  {k: eng.stats()["paging"][k] for k in ("hits", "misses", "loads")})


def tc4_everywhere(name: str, path: Path, device: str) -> None:
    """Generation and batched decode with moe_gemv4_tc.cu on every int4_group decode pass."""
    saved = limits.TC4_MIN_TOKENS, limits.TC4_MIN_INTERMEDIATE
    limits.TC4_MIN_TOKENS = limits.TC4_MIN_INTERMEDIATE = 1
    try:
        with Engine(path, EngineConfig(device=device, max_seq_len=64)) as eng:
            print(name, "tc4", eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids,
                  eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3))
    finally:
        limits.TC4_MIN_TOKENS, limits.TC4_MIN_INTERMEDIATE = saved


def spread_dispatch(name: str, path: Path, device: str) -> None:
    """Prefills and batched decode with every dispatch spread over blocks (moe_dispatch_ranks / _groups / _scatter:
    limits.DISPATCH_SPREAD_MIN_PAIRS: by default only from 4,096 pairs, more than these passes have)."""
    saved = limits.DISPATCH_SPREAD_MIN_PAIRS
    limits.DISPATCH_SPREAD_MIN_PAIRS = 1
    try:
        with Engine(path, EngineConfig(device=device, max_seq_len=64)) as eng:
            print(name, "spread dispatch", [x.shape for x in eng.logits([list(range(1, 41)), [5, 6]])],
                  eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3))
    finally:
        limits.DISPATCH_SPREAD_MIN_PAIRS = saved


def dense_tc_everywhere(name: str, path: Path, device: str) -> None:
    """Batched decode and a 12-row prompt with layers.cu's dense_gemv_tc on every bf16 pass of 2-32 rows (the
    backend's dense_tc_min_rows, off by default until timed)."""
    with Engine(path, EngineConfig(device=device, max_seq_len=64)) as eng:
        eng.be.dense_tc_min_rows = 2
        print(name, "dense tc", eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3),
              [x.shape for x in eng.logits([list(range(1, 13))])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help='run the workloads on device="cpu" (no GPU needed)')
    ap.add_argument("--only", help="comma list of workloads (default: all)")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    chosen = workloads()
    names = args.only.split(",") if args.only else list(chosen)
    if set(names) - set(chosen):
        ap.error(f"unknown workloads {sorted(set(names) - set(chosen))}; known: {sorted(chosen)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model, fmt, group = chosen[name]
            path = Path(tmp) / f"{name}.colibri"
            write_synthetic(path, model, dense_dtype=S.DType.BF16, expert_format=fmt, group_size=group)
            run(name, path, model, device)
    print("sanitize workload done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
