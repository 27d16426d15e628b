"""The prefill grouped expert GEMM (issue 15): today's tensor-core kernel against the pipelined one, in one process.

    PYTHONPATH=. python3 benchmarks/prefill_gemm.py --out OUT_DIR [--cases mixtral-512 ...] [--sweep [CASE ...]]

Per case (random experts generated on the GPU, random top-k routing, x ~ N(0, 1)):
- `tc`: moe_gemm.cu's moe_gemm_tc_{gate_up,down}_r (64 x 64 tiles, hi + lo activations, today's prefill);
- `fast-split` / `fast-bf16`: moe_gemm_fast.cu through ops.moe_gemm_{gate_up,down}_fast, timed with the bf16 split
  of their input (ops.split_bf16, also timed alone as `split_bf16`);
- `cublas-dense-split`: for scale, one dense cuBLAS GEMM of the same FLOPs (all P rows against one [N, K] bf16
  matrix, hi + lo: CupyBackend.gemm_bf16_split), i.e. what cuBLAS's tensor cores give on an ungrouped product;
- `cublas-dense-int8`: the same for W8A8 (int8 weights and activations, int32 accumulation, cublasGemmEx with
  CUBLAS_COMPUTE_32I on the int8 tensor cores): the ceiling of a W8A8 route that reads the blobs' int8 in place;
- stage `block`: the whole routed-expert block (ops.moe_experts: dispatch, both products, combine) on the pipelined
  kernel (`fast-*`) and on cuBLAS (`cublas-*`: ops.moe_experts_cublas, each routed expert widened to bf16, its
  per-expert counts read on the host), to place limits.CUBLAS_MIN_EXPERT_MACS; `cublas-int8`: the W8A8 route
  (activations rounded to int8 a row, the blobs' int8 multiplied in place), `fast-int8` the same products on the
  pipelined kernel's s8 MMAs (moe_gemm_fast.cu's _int8 kernels);
- stage `block-device`: the same blocks' device time alone, from CUPTI (bench.device_timeline: the union of their
  kernels' intervals, so the host's work between launches, which the cuBLAS routes' count read and their call an
  expert expose in `block`, is left out); `products`: of that, the expert products' kernels alone (the s8 / split
  kernels or cuBLAS's GEMMs: no dispatch, rounding, epilogue or combine).
Times: CUDA graphs of many launches, median over replays (gpu_kernels.time_graph); cuBLAS: plain launches.
TFLOP/s are useful FLOPs (2 P H 2I for gate_up, 2 P I H for down) over time; the split's extra MMAs count as nothing.
Agreement: the pipelined kernels' outputs against the tc kernel's (relative norm of the difference).
Stages `gate_up-kernel` / `down-kernel`: a pipelined product kernel's own device time from CUPTI (no rounding or
split of its input). GB/s: the routed experts' weight bytes, each matrix counted once, over the time: at 512 rows
Qwen3's and OLMoE's ~32-64 rows an expert make the products memory-bound, and that rate against the HBM copy rate
is what says how far they are from their floor.
--sweep [CASE ...]: afterwards, the pipelined kernels alone on those cases (none named: mixtral-512; the small
experts of qwen3-30b-a3b-512, 32 rows an expert and 12 K steps in down, are where the pipeline's fill and drain
weigh most) rebuilt with other FAST_STAGES, FAST_MIN_BLOCKS, FAST_SKIP_EMPTY_M, FAST_STAGE_STEPS, FAST_L2_PREFETCH
or FAST_PERSISTENT than limits.py's (SWEEP; a row's `variant` names what differs, e.g. "s4 skip", "k2 persistent";
limits.py's own build first, "own", rebuilt like the others), to pick those constants. The results are written after
every case and build. `--cases` with no name leaves the whole-case rows out (the sweep alone).
Writes prefill_gemm.json and prefill_gemm.md to OUT_DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu_kernels import rebuild_module, time_graph
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.bench import device_experts, device_timeline
from colibri_format.runtime.cuda.kernels import ops

CASES = {  # name: (H, I, E, k, T)
    "mixtral-512": (4096, 14336, 8, 2, 512),
    "mixtral-4096": (4096, 14336, 8, 2, 4096),
    "qwen3-30b-a3b-512": (2048, 768, 128, 8, 512),
    "qwen3-30b-a3b-4096": (2048, 768, 128, 8, 4096),
    "mixtral-128": (4096, 14336, 8, 2, 128),
    "mixtral-1024": (4096, 14336, 8, 2, 1024),
    "olmoe-512": (2048, 1024, 64, 8, 512),
    "olmoe-4096": (2048, 1024, 64, 8, 4096),
}
DEFAULT_CASES = ("mixtral-512", "mixtral-4096", "qwen3-30b-a3b-512")
TARGET_TFLOPS = 400.0   # issue 15: Mixtral shapes at 512 rows
LAUNCHES, REPLAYS = 10, 5   # Mixtral at 4096 rows: today's gate_up takes ~40 ms a call
# the builds --sweep times after limits.py's own: each a change of its moe_gemm_fast constants
SWEEP = ({"FAST_STAGES": 2}, {"FAST_STAGES": 4}, {"FAST_MIN_BLOCKS": 1}, {"FAST_SKIP_EMPTY_M": 1},
         {"FAST_STAGES": 4, "FAST_SKIP_EMPTY_M": 1}, {"FAST_STAGE_STEPS": 2, "FAST_STAGES": 2},
         {"FAST_STAGE_STEPS": 2}, {"FAST_STAGE_STEPS": 2, "FAST_SKIP_EMPTY_M": 1}, {"FAST_L2_PREFETCH": 0},
         {"FAST_L2_PREFETCH": 256}, {"FAST_PERSISTENT": 1}, {"FAST_PERSISTENT": 1, "FAST_SKIP_EMPTY_M": 1},
         {"FAST_PERSISTENT": 1, "FAST_STAGE_STEPS": 2, "FAST_SKIP_EMPTY_M": 1})
SWEPT = ("FAST_STAGES", "FAST_MIN_BLOCKS", "FAST_SKIP_EMPTY_M", "FAST_STAGE_STEPS", "FAST_L2_PREFETCH",
         "FAST_PERSISTENT")


def log(*a):
    print(*a, flush=True)


def rel(a, b) -> float:
    a, b = a.get().astype(np.float64), b.get().astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_routing(cp, T: int, E: int, k: int, seed: int):
    """ids [T, k] int32 (k distinct experts a token, uniform) and weights [T, k] f32."""
    rs = cp.random.RandomState(seed)
    ids = cp.argsort(rs.random_sample((T, E)), axis=1)[:, :k].astype(cp.int32)
    return cp.ascontiguousarray(ids), rs.uniform(0.1, 1.0, (T, k)).astype(cp.float32)


def timed(cp, fn) -> float:
    """Median µs of one call of fn: graphs of LAUNCHES calls, REPLAYS replays."""
    return time_graph(cp, [fn], reps=REPLAYS, per_graph=LAUNCHES)


def timed_plain(cp, fn) -> float:
    """Median µs of one call of fn over REPLAYS rounds of LAUNCHES plain launches (cuBLAS cannot be captured)."""
    fn()
    start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(REPLAYS):
        start.record()
        for _ in range(LAUNCHES):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / LAUNCHES)
    return float(np.median(times))


# What names an expert product's kernel: ours (moe_gemm_*) and cuBLAS's (sm90_xmma_gemm_..., cutlass ... gemm, and
# the nvjet_sm90_* kernels CUDA 13's cuBLAS runs its bf16 products on); none of the glue kernels (dispatch, rounding,
# widening, epilogues, combine) has these in its name.
PRODUCT_KERNEL_WORDS = ("gemm", "xmma", "cutlass", "nvjet")


def device_us(cp, fn) -> tuple[float, float] | None:
    """(busy µs, the expert products' µs) of one call of fn on the device, from CUPTI over LAUNCHES calls; None
    without PyTorch's profiler."""
    t = device_timeline(fn, cp.cuda.get_current_stream().synchronize, LAUNCHES)
    if t is None:
        return None
    products = sum(k["us"] for name, k in t["kinds"].items()
                   if any(w in name.lower() for w in PRODUCT_KERNEL_WORDS))
    return t["busy_us"], products


def rebuild_fast_kernel(build: dict[str, int]) -> None:
    """moe_gemm_fast.cu compiled anew with these constants (this process only); limits.py's copies set too, which
    the launches read (shared memory, the persistent grid)."""
    for name, value in build.items():
        setattr(limits, name, value)
    rebuild_module("moe_gemm_fast", **build)


def build_label(build: dict[str, int], own: dict[str, int]) -> str:
    """A sweep row's variant suffix: its constants that differ from limits.py's own ("own" for none)."""
    short = {"FAST_STAGES": "s", "FAST_MIN_BLOCKS": "b", "FAST_SKIP_EMPTY_M": "skip", "FAST_STAGE_STEPS": "k",
             "FAST_L2_PREFETCH": "L2:", "FAST_PERSISTENT": "persistent"}
    words = [short[n] + ("" if n in ("FAST_SKIP_EMPTY_M", "FAST_PERSISTENT") else str(v))
             for n, v in build.items() if v != own[n]]
    return " " + (" ".join(words) or "own")


def bench_case(cp, be, name: str, H: int, I: int, E: int, k: int, T: int, fast_only: str = "",
               modes: tuple[str, ...] = ops.FAST_ACTIVATIONS) -> list[dict]:
    P = T * k
    buf, table = device_experts(E, H, I, seed=1)
    ids, w = random_routing(cp, T, E, k, seed=2)
    x = cp.random.RandomState(3).standard_normal((T, H)).astype(cp.float32)
    d = ops.dispatch(ids, E)
    st = ops.fast_gemm_staging(T, P, H, I)
    act_ref = ops.moe_gemm_gate_up(x, table, d, k, tensor_cores=True)
    y_ref = ops.moe_gemm_down(act_ref, table, d, w, tensor_cores=True)
    act, y = cp.empty_like(act_ref), cp.empty_like(y_ref)
    flops = {"gate_up": 2.0 * P * H * 2 * I, "down": 2.0 * P * I * H}
    routed = int(cp.unique(ids).size)       # experts with rows: each of their matrices read at least once
    weight_bytes = {"gate_up": routed * 2 * I * H, "down": routed * H * I}
    for table_ in (flops, weight_bytes):
        table_["gate_up-kernel"], table_["down-kernel"] = table_["gate_up"], table_["down"]
        table_["block"] = table_["block-device"] = table_["products"] = table_["gate_up"] + table_["down"]
    rows = []

    def add(variant, stage, us, agreement=None, product=True, routed_weights=True):
        tflops = flops[stage] / (us * 1e-6) / 1e12 if product else None
        gbs = weight_bytes[stage] / (us * 1e-6) / 1e9 if product and routed_weights else None
        rows.append({"case": name, "H": H, "I": I, "E": E, "k": k, "T": T, "variant": variant, "stage": stage,
                     "us": us, "tflops": tflops, "weight_gbs": gbs, "rel_vs_tc": agreement})
        log(f"  {variant:18s} {stage:14s} {us:10.1f} us"
            + (f" {tflops:7.1f} TFLOP/s" if product else "") + ("" if gbs is None else f" {gbs:7.0f} GB/s")
            + ("" if agreement is None else f"  rel vs tc {agreement:.2e}"))

    if not fast_only:
        add("tc", "gate_up", timed(cp, lambda: ops.moe_gemm_gate_up(x, table, d, k, tensor_cores=True, out=act)))
        add("tc", "down", timed(cp, lambda: ops.moe_gemm_down(act_ref, table, d, w, tensor_cores=True, out=y)))
    for mode in modes:
        def gate_up():
            ops.moe_gemm_gate_up_fast(x, table, d, k, activations=mode, hi=st.x_hi, lo=st.x_lo, out=act)

        def down():
            ops.moe_gemm_down_fast(act_ref, table, d, w, activations=mode, hi=st.act_hi, lo=st.act_lo, out=y)

        timer = timed_plain if mode == "int8" else timed     # int8 rounds its inputs into fresh arrays: no capture
        add(f"fast-{mode}{fast_only}", "gate_up", timer(cp, gate_up), rel(act, act_ref))
        add(f"fast-{mode}{fast_only}", "down", timer(cp, down), rel(y, y_ref))
        for stage, fn in (("gate_up", gate_up), ("down", down)):    # the product kernel alone, from CUPTI
            device = device_us(cp, fn)
            if device is not None:
                add(f"fast-{mode}{fast_only}", f"{stage}-kernel", device[1])
    if fast_only:
        return rows
    y_block = ops.moe_experts(x, ids, w, table, gemm=True, tensor_cores=True)
    for mode in ops.FAST_ACTIVATIONS:
        for route, cublas in (("fast", False), ("cublas", True)):
            out = ops.moe_experts(x, ids, w, table, gemm=True, fast_gemm=mode, cublas=cublas)
            def block():
                ops.moe_experts(x, ids, w, table, gemm=True, fast_gemm=mode, cublas=cublas, out=out)

            add(f"{route}-{mode}", "block", timed_plain(cp, block), rel(out, y_block))
            device = device_us(cp, block)
            if device is not None:
                add(f"{route}-{mode}", "block-device", device[0])
                if device[1] > 0:
                    add(f"{route}-{mode}", "products", device[1])
                else:
                    log(f"  {route}-{mode}: no product kernel named by {PRODUCT_KERNEL_WORDS} in the timeline")
    add("split_bf16", "gate_up", timed(cp, lambda: ops.split_bf16(x, hi=st.x_hi, lo=st.x_lo)), product=False)
    add("split_bf16", "down", timed(cp, lambda: ops.split_bf16(act_ref, hi=st.act_hi, lo=st.act_lo)),
        product=False)
    dense_rows = cp.random.RandomState(4).standard_normal((P, H)).astype(cp.float32)
    for stage, (n, kk, rows_in) in {"gate_up": (2 * I, H, dense_rows), "down": (H, I, act_ref)}.items():
        wd = cp.random.RandomState(5).randint(-127, 128, (n, kk)).astype(cp.float32).view(cp.uint32)
        wd = (wd >> 16).astype(cp.uint16)          # int8 values, exact in bf16 (their float32 high halves)
        out = cp.empty((P, n), cp.float32)
        add("cublas-dense-split", stage, timed_plain(cp, lambda: be.gemm_bf16_split(rows_in, wd, out)),
            routed_weights=False)
        w8 = cp.random.RandomState(6).randint(-127, 128, (n, kk)).astype(cp.int8)
        a8 = cp.random.RandomState(7).randint(-127, 128, (P, kk)).astype(cp.int8)
        out8 = cp.empty((P, n), cp.int32)
        ops.gemm_int8(a8[:4], w8, out8[:4])
        exact = bool((out8[:4] == a8[:4].astype(cp.int32) @ w8.astype(cp.int32).T).all())
        add("cublas-dense-int8" + ("" if exact else " (WRONG)"), stage,
            timed_plain(cp, lambda: ops.gemm_int8(a8, w8, out8)), routed_weights=False)
        del wd, out, w8, a8, out8
    del buf
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [f"# Prefill grouped expert GEMM, {meta['device']} ({meta['date']})", "",
           f"`{meta['command']}`; target {TARGET_TFLOPS:.0f} TFLOP/s at Mixtral 512 rows.", "",
           "GB/s: the routed experts' weight bytes (each matrix once) over the time.", "",
           "| case | variant | stage | µs | TFLOP/s | GB/s | vs tc | rel vs tc |", "|---|---|---|---|---|---|---|---|"]
    tc = {(r["case"], r["stage"]): r["us"] for r in rows if r["variant"] == "tc"}
    for r in rows:
        tf = "" if r["tflops"] is None else f"{r['tflops']:.1f}"
        gbs = "" if r.get("weight_gbs") is None else f"{r['weight_gbs']:.0f}"
        base = tc.get((r["case"], r["stage"]))
        speed = "" if r["tflops"] is None or base is None else f"{base / r['us']:.2f}x"
        agree = "" if r["rel_vs_tc"] is None else f"{r['rel_vs_tc']:.1e}"
        out.append(f"| {r['case']} | {r['variant']} | {r['stage']} | {r['us']:.1f} | {tf} | {gbs} | {speed} | "
                   f"{agree} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=list(CASES))
    ap.add_argument("--sweep", nargs="*", choices=list(CASES), default=None,
                    help="also other FAST_STAGES / FAST_MIN_BLOCKS on these cases (none named: mixtral-512)")
    ap.add_argument("--sweep-modes", nargs="+", choices=list(ops.FAST_ACTIVATIONS), default=["int8"],
                    help="the pipelined kernel's activations the sweep times (default int8: the W8A8 kernels 'auto' "
                         "runs from limits.W8A8_MIN_EXPERT_MACS, i.e. every pass but the smallest)")
    args = ap.parse_args(argv)
    import cupy as cp

    from colibri_format.runtime.cuda.backend import make_backend

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    be = make_backend()     # compiles and loads every kernel module
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "cupy": cp.__version__, "command": "PYTHONPATH=. python3 benchmarks/prefill_gemm.py --out $OUT"
            + ("" if args.cases == list(DEFAULT_CASES) else " --cases " + " ".join(args.cases))
            + ("" if args.sweep is None else " --sweep " + " ".join(args.sweep)
               + " --sweep-modes " + " ".join(args.sweep_modes)), "fast_stages": limits.FAST_STAGES,
            "fast_min_blocks": limits.FAST_MIN_BLOCKS, "fast_stage_steps": limits.FAST_STAGE_STEPS}
    log(f"modules compiled in {time.time() - t0:.1f} s")
    rows = []

    def save() -> str:      # after every case and build: a run cut off by its time limit keeps what it measured
        meta["seconds"] = time.time() - t0
        (args.out / "prefill_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        md = markdown(meta, rows)
        (args.out / "prefill_gemm.md").write_text(md)
        return md

    for name in args.cases:
        log(f"== {name} (H, I, E, k, T) = {CASES[name]}")
        rows += bench_case(cp, be, name, *CASES[name])
        cp.get_default_memory_pool().free_all_blocks()
        save()
    sweep_cases = [] if args.sweep is None else args.sweep or ["mixtral-512"]
    own = {name: getattr(limits, name) for name in SWEPT}
    for change in ({},) + SWEEP if sweep_cases else ():
        build = {**own, **change}
        rebuild_fast_kernel(build)
        for name in sweep_cases:
            log(f"== {name}, " + ", ".join(f"{n} {v}" for n, v in build.items()))
            rows += bench_case(cp, be, name, *CASES[name], fast_only=build_label(build, own),
                               modes=tuple(args.sweep_modes))
            cp.get_default_memory_pool().free_all_blocks()
        save()
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
