"""Expert paging on one GPU: decode tokens/s with the expert cache at 10/25/50/100% of the experts.

Model: a Qwen3-30B-A3B-shaped int8 file with FEWER LAYERS (4 of 48; hidden 2048, 128 experts top-8, expert FFN
768, 32/4 heads of 128, bf16 dense) and a 32,000-token vocabulary instead of 151,936 (so the output head does
not hide the experts), written by `colibri_format.synthetic.write_synthetic` (one random blob repeated: content
does not matter for paging) to tmpfs. Cache: global scope, lru, lrfu and lrfu + next-layer-router prefetch;
batch 1 and 8; routing either random (random router weights: near-uniform, little reuse) or replayed from a
synthetic Zipf trace (`runtime.cache.cachesim.synthetic_trace`, skew 1.0, locality 0.2: the assumption
benchmarks/cache_policies.py makes for fine-grained shapes). Prefetch is measured with random routing only:
with a replayed trace the router's prediction is unrelated to the replayed choices.

Beside each run: the PCIe bound implied by its measured misses, tokens/s <= 1 / (misses per token x blob bytes /
measured pinned host-to-device bandwidth). Also: the Mixtral-8x7B shape (2 of 32 layers, vocab 32,000) with
max_cached_experts=5 of 8 per layer.

Each run opens one `Engine(path, EngineConfig(device="cuda", max_cached_experts=..., cache_policy=...,
prefetch=...))` and drives it through the public step API: `eng.decode_runner`, `eng.prefill_into`,
`runner.step`, `eng.argmax`; replayed routes go to `eng.decoder.forced_routes`; paging figures are the
difference of `eng.experts.counters` over the timed steps, copy-stream time from `eng.experts.copy_bandwidth()`.
The pinned host-to-device ceiling is `runtime.cuda.bench.copy_ceilings`.

Run from the repository root (the benchmark imports the library, nothing else):

    PYTHONPATH=. python benchmarks/paging.py --out paging.json [--dry-run]

`--dry-run` runs the same flow on the CPU (`EngineConfig(device="cpu")`, the NumPy backend) with tiny
dimensions and a few steps: it checks the script, not speed (the copy ceiling is then a host memcpy, and the
copy time is the host time of the copies, which are synchronous there).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_format.runtime.engine import Engine, EngineConfig

PROMPT = 16      # prompt tokens per sequence before the decode steps

QWEN3 = dict(vocab=32000, hidden=2048, layers=4, heads=32, kv_heads=4, experts=128, top_k=8, expert_inter=768,
             qk_norm="per_head", head_dim=128)
MIXTRAL = dict(vocab=32000, hidden=4096, layers=2, heads=32, kv_heads=8, experts=8, top_k=2, expert_inter=14336,
               head_dim=128)
TINY = dict(vocab=256, hidden=128, heads=2, kv_heads=1, expert_inter=32, head_dim=64)


def log(msg: str) -> None:
    print(f"[paging {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_model(path: Path, shape: dict, dry: bool) -> Path:
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_model, write_synthetic

    shape = {**shape, **({k: v for k, v in TINY.items() if k in shape} if dry else {})}
    if dry and shape["experts"] > 16:
        shape["experts"] = 16
    head_dim = shape.pop("head_dim")
    model = synthetic_model(**shape)
    model["head_dim"] = head_dim
    model["max_position_embeddings"] = 4096
    write_synthetic(path, model, reuse_expert=True, dense_dtype=S.DType.BF16)
    return path


class TraceRoutes:
    """Replayed routes for eng.decoder.forced_routes: decode rows replay the trace step by step; prefill rows
    cycle through it."""

    def __init__(self, layers: list[int], experts: int, k: int, batch: int, steps: int, seed: int = 0) -> None:
        from colibri_format.runtime.cache.cachesim import synthetic_trace

        trace = synthetic_trace(len(layers), experts, k, steps, skew=1.0, locality=0.2, seed=seed, batch=batch)
        self.choices = np.zeros((steps, batch, len(layers), k), np.int32)
        for rec in trace.records:
            for li, (_, chosen) in enumerate(rec.experts):
                self.choices[rec.t, rec.seq, li] = chosen
        self.layers, self.batch, self.step = list(layers), batch, 0

    def __call__(self, layer: int, rows: int) -> np.ndarray:
        li = self.layers.index(layer)
        if rows == self.batch:
            out = self.choices[self.step % len(self.choices), :, li]
            if li == len(self.layers) - 1:
                self.step += 1
            return out
        flat = self.choices[:, :, li].reshape(-1, self.choices.shape[-1])
        return flat[np.arange(rows) % len(flat)]


def copy_ceiling(device: str, nbytes: int) -> dict:
    """Pinned host-to-device copy GB/s (and device-to-device), the bound paging works against."""
    from colibri_format.runtime.engine import make_backend

    be = make_backend(EngineConfig(device=device))
    if be.name != "numpy":
        from colibri_format.runtime.cuda.bench import copy_ceilings

        return copy_ceilings(be, be.new_stream(), nbytes)
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)   # NumPy backend: device memory is host
    t0 = time.perf_counter()
    np.copyto(dst, src)
    gbps = nbytes / (time.perf_counter() - t0) / 1e9
    return {"d2d_copy_gbps": 2 * gbps, "h2d_pinned_gbps": gbps, "note": "host memcpy (NumPy backend)"}


def decode_steps(eng: Engine, batch: int, n: int, warmup: int, seed: int = 0) -> dict:
    """Prefill `batch` random prompts, `warmup` steps, then `n` timed greedy steps: tokens/s and paging."""
    from colibri_format.runtime.cuda.bench import decode_bench

    res, _ = decode_bench(eng, batch, n, warmup, np.random.default_rng(seed), prompt_len=PROMPT)
    return {"tokens_per_s": res["tokens_per_s"], "ms_per_step": res["ms_per_step"], "graph": res["graph"],
            **res.get("paging", {})}


def one_run(path, layers, E, k, *, batch, capacity, policy, prefetch, routing, n, warmup, ceilings, scope, device):
    cfg = EngineConfig(device=device, max_batch_size=batch, max_seq_len=max(64, PROMPT + warmup + n + 1),
                       verify="never", max_cached_experts=capacity, cache_policy=policy, cache_scope=scope,
                       prefetch=prefetch)
    with Engine(path, cfg) as eng:
        if routing == "trace":
            eng.decoder.forced_routes = TraceRoutes(layers, E, k, batch, n + warmup + 64)
        d = decode_steps(eng, batch, n, warmup)
        blob = eng.experts.blob_size
    row = {"batch": batch, "capacity": capacity, "policy": policy + ("+prefetch" if prefetch else ""),
           "routing": routing, **d}
    if "misses_per_token" in d:
        bw = ceilings["h2d_pinned_gbps"] * 1e9
        row["pcie_bound_tokens_per_s"] = bw / (d["misses_per_token"] * blob) if d["misses_per_token"] else None
    return row


def verify_cost(path: Path) -> dict:
    """Host time to hash one blob before its first copy (what verify='first-use' adds to a first miss)."""
    import colibri_format

    with colibri_format.open(path, verify="never") as f:
        t0 = time.perf_counter()
        for e in range(8):
            f.verify_expert(f.model["moe_layers"][0], e)
        ms = 1e3 * (time.perf_counter() - t0) / 8
        blob = len(f.expert_blob(f.model["moe_layers"][0], 0))
    return {"ms_per_blob": ms, "blob_bytes": blob, "gbps": blob / (ms / 1e3) / 1e9}


def qwen3_sweep(path: Path, args, ceilings: dict) -> list[dict]:
    import colibri_format

    with colibri_format.open(path) as f:
        layers, E, k = sorted(f.model["moe_layers"]), f.model["num_experts"], f.model["top_k"]
    total = len(layers) * E
    rows = []
    for routing in ("random", "trace"):
        for batch in (1, 8):
            base = one_run(path, layers, E, k, batch=batch, capacity=None, policy="lrfu", prefetch=False,
                              routing=routing, n=args.steps, warmup=args.warmup, ceilings=ceilings,
                              scope="global", device=args.device)
            base["fraction"] = 1.0
            rows.append(base)
            log(f"resident {routing} b{batch}: {base['tokens_per_s']:.1f} tok/s")
            for frac in (0.10, 0.25, 0.50):
                cap = max(1, round(frac * total))
                for policy, prefetch in (("lru", False), ("lrfu", False), ("lrfu", True)):
                    if prefetch and routing == "trace":
                        continue
                    row = one_run(path, layers, E, k, batch=batch, capacity=cap, policy=policy,
                                     prefetch=prefetch, routing=routing, n=args.steps, warmup=args.warmup,
                                     ceilings=ceilings, scope="global", device=args.device)
                    row["fraction"] = frac
                    row["vs_resident"] = row["tokens_per_s"] / base["tokens_per_s"]
                    rows.append(row)
                    log(f"{routing} b{batch} {frac:.0%} {row['policy']}: {row['tokens_per_s']:.1f} tok/s, hit "
                        f"{row['hit_rate']:.1%}, {row['paging_gbps'] or 0:.1f} GB/s, stall "
                        f"{row['stall_ms_per_token']:.2f} ms/tok")
    return rows


def mixtral_runs(path: Path, args, ceilings: dict) -> list[dict]:
    import colibri_format

    with colibri_format.open(path) as f:
        layers, E, k = sorted(f.model["moe_layers"]), f.model["num_experts"], f.model["top_k"]
    rows = []
    for capacity, policy, prefetch in ((None, "lrfu", False), (5, "lru", False), (5, "lrfu", False),
                                       (5, "lrfu", True)):
        row = one_run(path, layers, E, k, batch=1, capacity=capacity, policy=policy, prefetch=prefetch,
                         routing="random", n=max(4, args.steps // 2), warmup=2, ceilings=ceilings,
                         scope="per_layer", device=args.device)
        row["fraction"] = 1.0 if capacity is None else capacity / E
        rows.append(row)
        log(f"mixtral cap {capacity} {row['policy']}: {row['tokens_per_s']:.2f} tok/s")
    return rows


def print_table(rows: list[dict]) -> None:
    print("| routing | batch | cache | policy | tok/s | vs resident | hit rate | misses/tok | GB/s | stall ms/tok "
          "| prefetch recall | PCIe bound tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cache = "100%" if r.get("capacity") is None else f"{r.get('fraction', 0):.1%} ({r['capacity']})"
        def f(key, fmt):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        print(f"| {r['routing']} | {r['batch']} | {cache} | {r['policy']} | {r['tokens_per_s']:.1f} | "
              f"{f('vs_resident', '.2f')} | {f('hit_rate', '.1%')} | {f('misses_per_token', '.2f')} | "
              f"{f('paging_gbps', '.1f')} | {f('stall_ms_per_token', '.2f')} | {f('prefetch_recall', '.2f')} | "
              f"{f('pcie_bound_tokens_per_s', '.0f')} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--skip-mixtral", action="store_true")
    ap.add_argument("--work-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.steps, args.warmup = 3, 1
    ceilings = copy_ceiling(args.device, 1 << 20 if args.dry_run else 1 << 30)
    log(f"ceilings {ceilings}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "ceilings": ceilings, "qwen3": [],
              "mixtral": []}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        path = write_model(Path(tmp) / "qwen3.colibri", dict(QWEN3), args.dry_run)
        log(f"qwen3-shaped file {path.stat().st_size / 1e9:.2f} GB")
        try:
            result["verify_cost"] = verify_cost(path)
            log(f"verification on first use: {result['verify_cost']}")
            result["qwen3"] = qwen3_sweep(path, args, ceilings)
        finally:
            path.unlink()
            save()
        if not args.skip_mixtral:
            path = write_model(Path(tmp) / "mixtral.colibri", dict(MIXTRAL), args.dry_run)
            try:
                result["mixtral"] = mixtral_runs(path, args, ceilings)
            finally:
                path.unlink()
                save()
    print_table(result["qwen3"] + result["mixtral"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
