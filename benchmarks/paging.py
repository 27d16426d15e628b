"""Expert paging on one GPU at full depth: the cases of the paging issue, with the PCIe bound beside each.

Models (full depth: every layer, the real vocabulary; bf16 dense, int8 experts or, with `--experts int4_g32` etc.,
4-bit ones; one random blob repeated, written by `colibri_format.synthetic.write_synthetic(reuse_expert=True)` to
tmpfs):
  Qwen3-30B-A3B: 48 layers, vocab 151,936, hidden 2048, 128 experts top-8 of FFN 768, 32/4 heads of 128;
  Mixtral-8x7B: 32 layers, vocab 32,000, hidden 4096, 8 experts top-2 of FFN 14,336, 32/8 heads of 128.
Cases: all resident; the cache at 50% / 25% of the experts (global scope; Mixtral: 4 of 8 per layer), lrfu;
batch 1 and 8; routing random (random router weights: near-uniform, little reuse) or replayed from a synthetic
Zipf trace (`runtime.cache.cachesim.synthetic_trace`, skew 1.0, locality 0.2; the replayed routes are copied on
the device from static buffers, so the step stays one CUDA graph); a budget so small that nothing is resident
(one slot: every expert streams from the host mapping) for the streaming rate (the whole step's, and, from a CUPTI
timeline of a few more steps, the expert kernels' own: the step's expert bytes over their device time); lrfu +
prefetch on random routing.

Expert loading (`EngineConfig.expert_loading`, issue 13's A/B): the paged Zipf-trace cases at 50 % run once per mode
of `--loading` (default fill,copy,copy-async): "fill" (the GEMV kernels fill admitted slots as they read them),
"copy" (copied at admission on the copy stream, published at the next table write), "copy-async" (published once an
event query says the copies are done). `--ab-only` runs just those cases (and the resident baseline).

Each run opens one `Engine(path, EngineConfig(device="cuda", max_cached_experts=..., ...))` and goes through
`runtime.cuda.bench.decode_bench` (warm-up steps fill the cache, then timed steps). Beside each run: the PCIe
bound of its measured misses, tokens/s <= pinned host-to-device GB/s / (misses per token x blob bytes), and the
bound of all its PCIe bytes (zero-copy reads + admission copies). The pinned rate is
`runtime.cuda.bench.copy_ceilings`.

Run from the repository root:

    PYTHONPATH=. python benchmarks/paging.py --out paging.json [--dry-run]

`--dry-run` runs the same flow on the CPU (the NumPy backend) with tiny dimensions and a few steps: it checks the
script, not speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.synthetic_decode import EXPERT_FORMATS, expert_options
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.runtime.expert_pool import EXPERT_LOADING

PROMPT = 16      # prompt tokens per sequence before the decode steps
ZIPF_SKEW, ZIPF_LOCALITY = 1.0, 0.2   # the replayed routing trace (paging_lag.py and paging_bound.py simulate it)

QWEN3 = dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, experts=128, top_k=8, expert_inter=768,
             qk_norm="per_head", head_dim=128)
MIXTRAL = dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, experts=8, top_k=2, expert_inter=14336,
               head_dim=128)
TINY = dict(vocab=256, hidden=128, layers=3, heads=2, kv_heads=1, expert_inter=32, head_dim=64)


def log(msg: str) -> None:
    print(f"[paging {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def zipf_trace(layers: int, experts: int, k: int, steps: int, seed: int = 0, batch: int = 1):
    """The benchmark's synthetic routing trace (`cachesim.synthetic_trace` at ZIPF_SKEW, ZIPF_LOCALITY)."""
    from colibri_format.runtime.cache.cachesim import synthetic_trace

    return synthetic_trace(layers, experts, k, steps, skew=ZIPF_SKEW, locality=ZIPF_LOCALITY, seed=seed, batch=batch)


def write_model(path: Path, shape: dict, dry: bool, experts: str = "int8") -> Path:
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_model, write_synthetic

    shape = {**shape, **({k: v for k, v in TINY.items() if k in shape} if dry else {})}
    if dry and shape["experts"] > 16:
        shape["experts"] = 16
    head_dim = shape.pop("head_dim")
    model = synthetic_model(**shape)
    model["head_dim"] = head_dim
    model["max_position_embeddings"] = 4096
    write_synthetic(path, model, reuse_expert=True, dense_dtype=S.DType.BF16, **expert_options(experts))
    return path


class TraceRoutes:
    """Replayed routes for eng.decoder.forced_routes: one static device buffer [batch, k] per MoE layer, refilled
    from the trace before each decode step (`advance`: a device-to-device copy on the compute stream from the whole
    trace, uploaded once, so queuing a step never waits for the device), so a captured step replays them; prefill
    rows cycle through the trace (eager)."""

    def __init__(self, eng, layers: list[int], experts: int, k: int, batch: int, steps: int, seed: int = 0) -> None:
        trace = zipf_trace(len(layers), experts, k, steps, seed=seed, batch=batch)
        self.choices = np.zeros((steps, len(layers), batch, k), np.int32)
        for rec in trace.records:
            for li, (_, chosen) in enumerate(rec.experts):
                self.choices[rec.t, li, rec.seq] = chosen
        self.be, self.stream, self.layers, self.batch, self.step = eng.be, eng.stream, list(layers), batch, 0
        self.buffers = eng.be.zeros((len(layers), batch, k), np.int32)
        self.on_device = eng.be.zeros(self.choices.shape, np.int32)
        eng.be.set_from_host(self.on_device, self.choices, eng.stream)

    def advance(self) -> None:
        with self.stream:
            self.buffers[...] = self.on_device[self.step % len(self.choices)]
        self.step += 1

    def __call__(self, layer: int, rows: int):
        li = self.layers.index(layer)
        if rows == self.batch:
            return self.buffers[li]
        flat = self.choices[:, li].reshape(-1, self.choices.shape[-1])
        return self.be.to_device(flat[np.arange(rows) % len(flat)])


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


def one_run(path, *, batch, capacity, routing, n, warmup, ceilings, scope="global", policy="lrfu",
            prefetch=False, admission="frequency", device="cuda", loading="fill", int8_activations=True) -> dict:
    import colibri_format
    from colibri_format.runtime.cuda.bench import decode_bench

    with colibri_format.open(path, verify="never") as f:
        layers, E, k = sorted(f.model["moe_layers"]), f.model["num_experts"], f.model["top_k"]
    cfg = EngineConfig(device=device, max_batch_size=batch, max_seq_len=max(64, PROMPT + warmup + n + 1),
                       verify="never", max_cached_experts=capacity, cache_policy=policy, cache_scope=scope,
                       prefetch=prefetch, cache_admission=admission, expert_loading=loading,
                       int8_activations=int8_activations)
    t0 = time.perf_counter()
    with Engine(path, cfg) as eng:
        opened = time.perf_counter() - t0
        advance = None
        if routing == "trace":
            routes = TraceRoutes(eng, layers, E, k, batch, n + warmup + 64)
            eng.decoder.forced_routes, advance = routes, routes.advance
        res, runner = decode_bench(eng, batch, n, warmup, np.random.default_rng(0), context=PROMPT,
                                   before_step=advance)
        blob = eng.experts.blob_size
        source = eng.stats()["host_source"]
        streaming = expert_kernels_us(eng, runner, batch) if capacity == 1 and device == "cuda" else None
    name = policy + ("+prefetch" if prefetch else "") + ("" if admission == "frequency" else f" ({admission})")
    name += "" if capacity is None else f" [{loading}]"
    row = {"batch": batch, "capacity": capacity, "scope": scope, "policy": name, "loading": loading,
           "routing": routing, "open_s": opened, "host_source": source, "blob_bytes": blob,
           **{k: res[k] for k in ("tokens_per_s", "ms_per_step", "host_ms_per_step", "graph",
                                  "chained_tokens_per_s", "chained_ms_per_step")},
           **res.get("paging", {})}
    if "chained_paging" in res:
        row.update({f"chained_{k}": res["chained_paging"][k] for k in ("hit_rate", "misses_per_token")})
    if "misses_per_token" in row:
        rate = ceilings["h2d_pinned_gbps"] * 1e9

        def share_of_bound(tokens_per_s: float, misses_per_token: float) -> float | None:
            """tokens/s over the PCIe bound (pinned copy rate / the bytes of a token's misses)."""
            miss_bytes = misses_per_token * blob
            return tokens_per_s * miss_bytes / rate if miss_bytes else None
        miss_bytes = row["misses_per_token"] * blob
        row["pcie_bound_tokens_per_s"] = rate / miss_bytes if miss_bytes else None
        row["share_of_bound"] = share_of_bound(row["tokens_per_s"], row["misses_per_token"])
        pcie = row["pcie_mb_per_token"] * 1e6
        row["all_pcie_bound_tokens_per_s"] = rate / pcie if pcie else None
        row["zero_copy_gbps"] = row["gb_zero_copy"] * 1e9 / (n * batch / row["tokens_per_s"]) / 1e9
        row["chained_share_of_bound"] = share_of_bound(row["chained_tokens_per_s"], row["chained_misses_per_token"])
    if streaming is not None:       # nothing resident: every routed expert of a step is read over PCIe
        row["expert_kernels_us_per_step"] = streaming
        row["expert_kernels_gbps"] = row["misses_per_token"] * batch * blob / streaming / 1e3
        row["expert_kernels_share_of_pinned"] = row["expert_kernels_gbps"] / ceilings["h2d_pinned_gbps"]
    return row


EXPERT_KERNELS = ("moe_gate_up", "moe_down", "moe4_gate_up", "moe4_down", "moe4a8_gate_up", "moe4a8_down",
                  "moe4tc_gate_up", "moe4tc_down")     # the routed experts' GEMV kernels (int8 and 4-bit)


def expert_kernels_us(eng, runner, batch: int) -> float | None:
    """Device µs a decode step spends in the routed experts' kernels, from CUPTI (bench.timeline_profile) over a
    few more steps: with nothing resident those kernels read every expert over PCIe, so the step's expert bytes
    over this time is the rate they stream at (issue 13: >= 0.85 of the pinned copy rate), without the step's
    attention, dense products and norms, which read no expert."""
    from colibri_format.runtime.cuda.bench import timeline_profile

    ids, pos = np.zeros(batch, np.int64), np.full(batch, PROMPT)
    t = timeline_profile(eng, lambda: runner.step(ids, pos), steps=4)
    if t is None:
        return None
    return sum(k["us"] for name, k in t["kinds"].items() if name.startswith(EXPERT_KERNELS))


def qwen3_cases(path: Path, args, ceilings: dict) -> list[dict]:
    import colibri_format

    with colibri_format.open(path, verify="never") as f:
        total = len(f.model["moe_layers"]) * f.model["num_experts"]
    half, quarter = total // 2, total // 4
    ab = [dict(batch=b, capacity=half, routing="trace", loading=mode) for b in (1, 8) for mode in args.loading]
    if args.ab_only:
        cases = [dict(batch=1, capacity=None, routing="trace")] + ab
        return [run_case(path, case, args, ceilings, "qwen3", total) for case in cases]
    cases = [dict(batch=1, capacity=None, routing="trace"), *ab[:len(args.loading)],
             dict(batch=1, capacity=half, routing="random"), dict(batch=1, capacity=quarter, routing="random"),
             dict(batch=8, capacity=None, routing="trace"), *ab[len(args.loading):],
             dict(batch=1, capacity=1, routing="random"),
             dict(batch=1, capacity=half, routing="random", prefetch=True),
             dict(batch=1, capacity=half, routing="trace", admission="always")]
    return [run_case(path, case, args, ceilings, "qwen3", total) for case in cases]


def mixtral_cases(path: Path, args, ceilings: dict) -> list[dict]:
    cases = [dict(batch=1, capacity=None, routing="random", scope="per_layer"),
             dict(batch=1, capacity=4, routing="random", scope="per_layer")]
    return [run_case(path, case, args, ceilings, "mixtral", 8) for case in cases]


def run_case(path: Path, case: dict, args, ceilings: dict, model: str, total: int) -> dict:
    row = one_run(path, n=args.steps, warmup=args.warmup, ceilings=ceilings, device=args.device, **case)
    row["model"] = model
    row["fraction"] = 1.0 if case["capacity"] is None else case["capacity"] / total
    log(f"{model} b{row['batch']} {row['routing']} cache {row['fraction']:.1%} {row['policy']}: "
        f"{row['tokens_per_s']:.1f} tok/s, hit {row.get('hit_rate', 1):.1%}, misses/tok "
        f"{row.get('misses_per_token', 0):.1f}, share of bound {row.get('share_of_bound') or 0:.2f}, "
        f"graph {row['graph']}; chained {row['chained_tokens_per_s']:.1f} tok/s, hit "
        f"{row.get('chained_hit_rate', 1):.1%}, share of bound {row.get('chained_share_of_bound') or 0:.2f}")
    return row


def print_table(rows: list[dict]) -> None:
    print("| model | routing | batch | cache | tok/s | hit rate | misses/tok | loads/tok | PCIe MB/tok | "
          "zero-copy GB/s | bound from misses | share | chained tok/s | chained hit rate | chained share | graph |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cache = "100%" if r.get("capacity") is None else f"{r['fraction']:.1%} ({r['capacity']})"

        def f(key, fmt):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        print(f"| {r['model']} | {r['routing']} | {r['batch']} | {cache} {r['policy']} | {r['tokens_per_s']:.1f} | "
              f"{f('hit_rate', '.3f')} | {f('misses_per_token', '.1f')} | {f('loads_per_token', '.2f')} | "
              f"{f('pcie_mb_per_token', '.0f')} | {f('zero_copy_gbps', '.1f')} | "
              f"{f('pcie_bound_tokens_per_s', '.0f')} | {f('share_of_bound', '.2f')} | "
              f"{f('chained_tokens_per_s', '.1f')} | {f('chained_hit_rate', '.3f')} | "
              f"{f('chained_share_of_bound', '.2f')} | {r['graph']} |")
    for r in rows:
        if r.get("expert_kernels_gbps") is not None:
            print(f"{r['model']} b{r['batch']}, nothing resident: the expert kernels take "
                  f"{r['expert_kernels_us_per_step']:.0f} us a step and stream {r['expert_kernels_gbps']:.1f} GB/s "
                  f"over PCIe, {r['expert_kernels_share_of_pinned']:.2f} of the pinned copy rate")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=64, help="steps that fill the cache before the timed ones")
    ap.add_argument("--skip-mixtral", action="store_true")
    ap.add_argument("--work-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--qwen3-file", help="an existing full-depth Qwen3-30B-A3B-shaped file to use (kept)")
    ap.add_argument("--loading", default="fill,copy,copy-async",
                    help="expert_loading modes the 50%% Zipf-trace cases run in (comma list)")
    ap.add_argument("--ab-only", action="store_true",
                    help="only the resident baseline and the expert_loading A/B cases (Qwen3; implies --skip-mixtral)")
    ap.add_argument("--experts", default="int8", choices=sorted(EXPERT_FORMATS),
                    help="expert format of the written files (int4 formats run on int8 activations, the default)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    args.loading = [m.strip() for m in args.loading.split(",") if m.strip()]
    bad = [m for m in args.loading if m not in EXPERT_LOADING]
    if bad or not args.loading:
        ap.error(f"--loading takes a comma list of {', '.join(EXPERT_LOADING)}")
    args.skip_mixtral = args.skip_mixtral or args.ab_only
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.steps, args.warmup = 3, 2
    ceilings = copy_ceiling(args.device, 1 << 20 if args.dry_run else 1 << 30)
    log(f"ceilings {ceilings}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "ceilings": ceilings,
              "experts": args.experts, "rows": []}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for name, shape, cases in (("qwen3", QWEN3, qwen3_cases), ("mixtral", MIXTRAL, mixtral_cases)):
            if name == "mixtral" and args.skip_mixtral:
                continue
            t0 = time.perf_counter()
            given = Path(args.qwen3_file) if name == "qwen3" and args.qwen3_file else None
            path = given or write_model(Path(tmp) / f"{name}.colibri", dict(shape), args.dry_run, args.experts)
            log(f"{name} file {path.stat().st_size / 1e9:.2f} GB ready in {time.perf_counter() - t0:.1f} s")
            try:
                result["rows"] += cases(path, args, ceilings)
            finally:
                if given is None:
                    path.unlink()
                save()
    print_table(result["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
