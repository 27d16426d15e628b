"""Expert parallelism on 1, 2 and 4 GPUs (NCCL) beside one GPU paging with the same per-GPU expert budget.

Models: the Mixtral-8x7B shape (2 of 32 layers; hidden 4096, 8 experts top-2, expert FFN 14336) and the
Qwen3-30B-A3B shape (4 of 48 layers; hidden 2048, 128 experts top-8, expert FFN 768), both with a 32,000-token
vocabulary, bf16 dense tensors and int8 experts, written by `colibri_format.synthetic.write_synthetic` (one
random blob repeated) to tmpfs, as benchmarks/paging.py does.

For each world size W the script starts W ranks (this file with --rank; NCCL, NCCL_NVLS_ENABLE=0 kept) running
`ExpertParallelEngine` with every owned expert preloaded, and measures
  * prefill tokens/s: `infer` over a batch of B prompts of P tokens (one batched prefill pass);
  * decode tokens/s: `generate` at batch 1 (the engine's decode loop);
  * the MoE exchange alone: one `ExpertExchange.routed` call (dispatch + owned experts + combine + all_gather)
    for a batch of T rows with random routing, averaged per MoE layer — the part expert parallelism scales.
Beside each W >= 2: the one-GPU engine (`Engine(device="cuda")`) with `max_cached_experts` = the experts one EP
rank holds (the same per-GPU expert memory), paging the rest from the file.

Caveat: the EP engine's dense layers (attention, norms, router, head) are the NumPy reference path on the host,
replicated on every rank; only the expert FFNs and the exchange run on the GPUs. End-to-end tokens/s therefore
compares expert placement strategies under a host-bound dense path; the exchange rows isolate the GPU part.

Run from the repository root (the benchmark imports the library, nothing else; the rank processes inherit
PYTHONPATH):

    PYTHONPATH=. python benchmarks/expert_parallel.py --worlds 1,2,4 --out ep.json     # the multi-GPU machine
    PYTHONPATH=. python benchmarks/expert_parallel.py --dry-run                        # CPU, gloo, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")    # NVLink multicast stays off on the lent machines

SHAPES = {
    "mixtral": dict(vocab=32000, hidden=4096, layers=2, heads=32, kv_heads=8, experts=8, top_k=2,
                    expert_inter=14336, head_dim=128),
    "qwen3": dict(vocab=32000, hidden=2048, layers=4, heads=32, kv_heads=4, experts=128, top_k=8,
                  expert_inter=768, qk_norm="per_head", head_dim=128),
}
TINY = dict(vocab=256, hidden=64, heads=4, kv_heads=2, expert_inter=32, head_dim=16)
RANK_TIMEOUT_S = 580


def log(msg: str) -> None:
    print(f"[expert_parallel {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_model(path: Path, shape: dict, dry: bool) -> Path:
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_model, write_synthetic

    shape = {**shape, **(TINY if dry else {})}
    if dry:
        shape["experts"] = min(shape["experts"], 16)
    head_dim = shape.pop("head_dim")
    model = synthetic_model(**shape)
    model["head_dim"] = head_dim
    model["max_position_embeddings"] = 4096
    write_synthetic(path, model, reuse_expert=True, dense_dtype=S.DType.BF16)
    return path


# --- measurements (the same calls for every engine) -----------------------------------------------------

def measure_engine(eng, vocab: int, opts: dict) -> dict:
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, vocab, (opts["batch"], opts["prompt"])).tolist()
    eng.infer(prompts[:1])                                         # warm-up (kernels, lazily loaded experts)
    t0 = time.perf_counter()
    for _ in range(opts["reps"]):
        eng.infer(prompts)
    prefill_s = (time.perf_counter() - t0) / opts["reps"]
    stats = eng.generate(prompts[0], max_new_tokens=opts["new_tokens"]).stats
    return {"prefill_tokens_per_s": opts["batch"] * opts["prompt"] / prefill_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s}


def measure_exchange(eng, opts: dict) -> dict:
    """Mean seconds of one MoE layer's exchange for `rows` tokens with random routing (same on every rank)."""
    import torch
    import torch.distributed as dist

    m, out = eng.reader.model, {}
    rng = np.random.default_rng(1)
    for rows in opts["exchange_rows"]:
        x = rng.standard_normal((rows, m["hidden_size"])).astype(np.float32)
        idx = np.stack([rng.choice(m["num_experts"], m["top_k"], replace=False) for _ in range(rows)])
        w = np.full(idx.shape, 1.0 / m["top_k"], np.float32)
        layers = eng.placement.moe_layers
        eng.exchange.routed(layers[0], x, w, idx)                  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(opts["reps"]):
            eng.exchange.routed(layers[i % len(layers)], x, w, idx)
        if eng.exchange.device.type == "cuda":
            torch.cuda.synchronize()
        out[str(rows)] = (time.perf_counter() - t0) / opts["reps"]
    return out


# --- one rank of a group ---------------------------------------------------------------------------------

def rank_main(args) -> None:
    from colibri_format.runtime.engine import EngineConfig
    from colibri_format.runtime.parallel.dist import init_from_env, shutdown
    from colibri_format.runtime.parallel.engine import ExpertParallelEngine

    opts = json.loads(args.opts)
    me = init_from_env(timeout_s=300)
    try:
        with ExpertParallelEngine(args.file, EngineConfig(verify="never", max_seq_len=4096),
                                  device=me.device) as eng:
            t0 = time.perf_counter()
            held = eng.preload()
            row = {"world": me.world_size, "experts_per_rank": held, "preload_s": time.perf_counter() - t0}
            row.update(measure_engine(eng, eng.vocab_size, opts))
            row["exchange_s_per_layer"] = measure_exchange(eng, opts)
    finally:
        shutdown()
    if me.rank == 0:
        Path(args.result).write_text(json.dumps(row))


def run_group(path: Path, world: int, device: str, opts: dict, tmp: Path) -> dict:
    from colibri_format.runtime.parallel.dist import free_port, worker_env

    result = tmp / f"world{world}.json"
    devices, port = list(range(world)), free_port()
    cmd = [sys.executable, __file__, "--rank-of", str(path), "--result", str(result), "--opts", json.dumps(opts)]
    procs = [subprocess.Popen(cmd, env=worker_env(r, devices, device, port)) for r in range(world)]
    codes = [p.wait(timeout=RANK_TIMEOUT_S) for p in procs]
    if any(codes):
        raise RuntimeError(f"world {world}: rank exit codes {codes}")
    return json.loads(result.read_text())


def paging_baseline(path: Path, budget: int, device: str, opts: dict) -> dict:
    from colibri_format.runtime.engine import Engine, EngineConfig

    config = EngineConfig(device=device, verify="never", max_seq_len=4096, max_cached_experts=budget,
                          cache_policy="lrfu")
    with Engine(path, config) as eng:
        row = {"engine": f"one {device} paging", "max_cached_experts": budget}
        row.update(measure_engine(eng, eng.vocab_size, opts))
    return row


# --- driver ----------------------------------------------------------------------------------------------

def bench_shape(name: str, shape: dict, args, opts: dict, tmp: Path) -> list[dict]:
    path = write_model(tmp / f"{name}.colibri", dict(shape), args.dry_run)
    experts = (SHAPES[name]["experts"] if not args.dry_run else min(shape["experts"], 16)) * shape["layers"]
    device = "cpu" if args.dry_run else "cuda"
    rows = []
    try:
        for world in args.worlds:
            row = {"shape": name, "engine": f"expert-parallel x{world}", **run_group(path, world, device, opts, tmp)}
            log(json.dumps(row))
            rows.append(row)
            if world >= 2:
                base = {"shape": name, "world_budget": world,
                        **paging_baseline(path, experts // world, device, opts)}
                log(json.dumps(base))
                rows.append(base)
    finally:
        path.unlink()
    return rows


def print_table(rows: list[dict]) -> None:
    print("| shape | engine | experts/GPU | prefill tok/s | decode tok/s | exchange ms/layer (rows) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        per_gpu = r.get("experts_per_rank", r.get("max_cached_experts"))
        ex = ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in r.get("exchange_s_per_layer", {}).items()) or "-"
        print(f"| {r['shape']} | {r['engine']} | {per_gpu} | {r['prefill_tokens_per_s']:.1f} | "
              f"{r['decode_tokens_per_s']:.1f} | {ex} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4", help="GPU counts to run")
    ap.add_argument("--shapes", default="mixtral,qwen3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes")
    ap.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--opts", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        args.file = args.rank_of
        rank_main(args)
        return 0
    args.worlds = [int(w) for w in args.worlds.split(",")]
    opts = (dict(batch=2, prompt=8, new_tokens=4, reps=2, exchange_rows=[1, 16]) if args.dry_run else
            dict(batch=8, prompt=128, new_tokens=32, reps=3, exchange_rows=[1, 8, 512]))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for name in args.shapes.split(","):
            rows += bench_shape(name, SHAPES[name], args, opts, Path(tmp))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "dry_run": args.dry_run, "opts": opts, "rows": rows,
              "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
