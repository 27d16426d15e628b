"""Where a full-depth decode step's time goes, and dense GEMV candidates at the shapes decode multiplies.

    PYTHONPATH=. python benchmarks/decode_profile.py --out OUT_DIR [--shapes qwen3,olmoe,mixtral] [--peer PEER.py]

(a) `runtime.cuda.bench.run_bench` on full-depth files (`--shapes`: Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B; bf16
    dense, int8 experts, or int4_group g32 with `--experts int4_g32`; written by
    `synthetic.write_synthetic(reuse_expert=True)` if missing) at batch 1 and 8:
    tokens/s, roofline share, and the device timeline of replayed decode steps from CUPTI (every kernel's time per
    step, busy + idle = span); `--peer ../shared/tools/peer_torch_compile_moe.py` then runs the torch.compile int8
    peer on the same shapes in the same call.
(b) dense GEMV candidates (rows per warp x 16-byte loads in flight per row, T = 1 and 8 tokens) against the
    engine's `dense_gemv`, each captured in a CUDA graph of many launches over rotated weight copies (so the
    weights come from HBM, not L2), GB/s of weight bytes beside the device-to-device copy rate; each candidate is
    checked against float64 NumPy first.
Writes decode_profile.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import copy_bandwidth, override_defines, rebuild_module, time_graph  # noqa: E402
from synthetic_decode import EXPERT_FORMATS, expert_options, shaped_model, write_timed  # noqa: E402

SHAPES = {  # full depth: every layer, the real vocabulary (head_dim 128 for all three)
    "qwen3": dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, experts=128, top_k=8,
                  expert_inter=768, qk_norm="per_head"),                                 # Qwen3-30B-A3B
    "olmoe": dict(vocab=50304, hidden=2048, layers=16, heads=16, kv_heads=16, experts=64, top_k=8,
                  expert_inter=1024, qk_norm="full"),                                    # OLMoE-1B-7B
    "mixtral": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, experts=8, top_k=2,
                    expert_inter=14336),                                                 # Mixtral-8x7B
}
PEER_NAMES = {"qwen3": "qwen3_30b_a3b", "olmoe": "olmoe_1b7b", "mixtral": "mixtral_8x7b"}
GEMV_SHAPES = {  # name: (N, K) of the dense products a decode step runs
    "qwen3 qkv": (5120, 2048), "qwen3 o_proj": (2048, 4096), "qwen3 lm_head": (151936, 2048),
    "olmoe qkv": (6144, 2048), "olmoe o_proj": (2048, 2048), "mixtral qkv": (6144, 4096),
    "mixtral o_proj": (4096, 4096)}
VARIANTS = ((4, 1), (4, 2), (4, 4), (2, 4), (2, 8), (1, 8), (8, 2))      # (rows per warp, loads in flight per row)
ROTATE_BYTES = 512 << 20
ENGINE_SPLITS = (None, 1, 2, 4, 8)      # the engine's dense_gemv: the split it picks, then each split forced

SOURCE = r"""
__device__ __forceinline__ float wsum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ float dot8(uint4 v, float4 a, float4 b) {
    float s = __uint_as_float(v.x << 16) * a.x;
    s = fmaf(__uint_as_float(v.x & 0xffff0000u), a.y, s);
    s = fmaf(__uint_as_float(v.y << 16), a.z, s);
    s = fmaf(__uint_as_float(v.y & 0xffff0000u), a.w, s);
    s = fmaf(__uint_as_float(v.z << 16), b.x, s);
    s = fmaf(__uint_as_float(v.z & 0xffff0000u), b.y, s);
    s = fmaf(__uint_as_float(v.w << 16), b.z, s);
    return fmaf(__uint_as_float(v.w & 0xffff0000u), b.w, s);
}
template <int ROWS, int UNR, int TOK>
__device__ __forceinline__ void gemv(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                     float* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int items = (N + ROWS - 1) / ROWS, warps = (gridDim.x * blockDim.x) >> 5;
    for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < items; item += warps) {
        const int r0 = min(item * ROWS, N - ROWS);
        float acc[ROWS][TOK];
#pragma unroll
        for (int q = 0; q < ROWS; ++q)
#pragma unroll
            for (int j = 0; j < TOK; ++j) acc[q][j] = 0.0f;
        for (int c0 = lane * 8; c0 < K; c0 += 256 * UNR) {
            uint4 wv[UNR][ROWS];
#pragma unroll
            for (int u = 0; u < UNR; ++u)
#pragma unroll
                for (int q = 0; q < ROWS; ++q)
                    wv[u][q] = c0 + u * 256 < K ? ld_stream(w + (size_t)(r0 + q) * K + c0 + u * 256)
                                                : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                const int c = c0 + u * 256;
                if (c < K) {
#pragma unroll
                    for (int j = 0; j < TOK; ++j) {
                        const float4 a = __ldg(reinterpret_cast<const float4*>(x + (size_t)j * K + c));
                        const float4 b = __ldg(reinterpret_cast<const float4*>(x + (size_t)j * K + c + 4));
#pragma unroll
                        for (int q = 0; q < ROWS; ++q) acc[q][j] += dot8(wv[u][q], a, b);
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < ROWS; ++q)
#pragma unroll
            for (int j = 0; j < TOK; ++j) {
                const float s = wsum(acc[q][j]);
                if (lane == 0 && r0 + q >= item * ROWS) y[(size_t)j * N + r0 + q] = s;
            }
    }
}
#define V(R, U, T) extern "C" __global__ void __launch_bounds__(256) \
    g_R##R##_U##U##_T##T(const float* x, const unsigned short* w, float* y, int N, int K) { gemv<R, U, T>(x, w, y, N, K); }
#define VT(R, U) V(R, U, 1) V(R, U, 8)
VT(4, 1) VT(4, 2) VT(4, 4) VT(2, 4) VT(2, 8) VT(1, 8) VT(8, 2)
"""


def log(msg: str) -> None:
    print(f"[decode_profile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_model(path: Path, shape: str, experts: str = "int8") -> Path:
    if path.exists():
        return path
    write_timed(path, shaped_model(SHAPES[shape], head_dim=128, max_position_embeddings=4096), log,
                **expert_options(experts))
    return path


def use_dense_plan(text: str, result: dict) -> None:
    """`--dg-plan TOKENS=RxU`: limits.DG_PLANS (which the wrapper's grid reads) and layers.cu's -D constants set."""
    from colibri_format.runtime.cuda import limits

    tokens, plan = text.split("=")
    rows, unroll = (int(v) for v in plan.lower().split("x"))
    limits.DG_PLANS[int(tokens)] = (rows, unroll)
    rebuild_module("layers", **{f"DG_T{tokens}_ROWS": rows, f"DG_T{tokens}_UNROLL": unroll})
    result.setdefault("dg_plans", {})[tokens] = [rows, unroll]


def engine_profile(path: Path, batches: list[int], kv_cache_dtype: str = "auto", context: int = 16) -> list[dict]:
    from colibri_format.runtime.cuda.bench import render, run_bench

    out = []
    for b in batches:
        r = run_bench(path, batch_size=b, num_iters=64, warmup_iters=8, prefill=False, verify="never",
                      kv_cache_dtype=kv_cache_dtype, context=context)
        log("\n" + render(r))
        out.append(r)
    return out


def gemv_candidates(cp, copy_gbps: float) -> list[dict]:
    from colibri_format.runtime.cuda.kernels import ops

    mod = cp.RawModule(code=SOURCE, options=("--std=c++17",))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = []
    for name, (N, K) in GEMV_SHAPES.items():
        nbytes = N * K * 2
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / nbytes)))
        ws = [cp.random.randint(0, 1 << 16, (N, K), dtype=cp.int32).astype(cp.uint16) for _ in range(copies)]
        for w in ws:     # finite bf16: clear the exponent's top bit
            w &= 0xBFFF
        for T in (1, 8):
            x = cp.random.standard_normal((T, K), dtype=cp.float32)
            y = cp.empty((T, N), cp.float32)
            w64 = (ws[0].get().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            ref = x.get().astype(np.float64) @ w64.T
            for splits in ENGINE_SPLITS:
                ops.dense_gemv(x, ws[0], out=y, splits=splits)
                err = float(np.abs(y.get() - ref).max() / np.abs(ref).max())
                us = time_graph(cp, [lambda w=w: ops.dense_gemv(x, w, out=y, splits=splits) for w in ws],
                                per_graph=max(40, copies))
                label = "engine dense_gemv" + ("" if splits is None else f" splits {splits}")
                rows.append({"shape": name, "N": N, "K": K, "T": T, "kernel": label, "us": us,
                             "gbps": nbytes / us / 1e3, "share_of_copy": nbytes / us / 1e3 / copy_gbps,
                             "splits": splits or ops.dense_gemv_splits(N, K, 1 if T == 1 else 8, 2, sms),
                             "max_rel_err": err})
            for R, U in VARIANTS:
                f = mod.get_function(f"g_R{R}_U{U}_T{1 if T == 1 else 8}")
                items = -(-N // R)
                for grid_name, blocks in (("all", -(-items // 8)), ("8/SM", min(-(-items // 8), 8 * sms))):
                    def launch(w, f=f, blocks=blocks):
                        f((blocks,), (256,), (x, w, y, np.int32(N), np.int32(K)))
                    launch(ws[0])
                    err = float(np.abs(y.get() - ref).max() / np.abs(ref).max())
                    us = time_graph(cp, [lambda w=w: launch(w) for w in ws], per_graph=max(40, copies))
                    rows.append({"shape": name, "N": N, "K": K, "T": T, "kernel": f"R{R} U{U} grid {grid_name}",
                                 "us": us, "gbps": nbytes / us / 1e3, "share_of_copy": nbytes / us / 1e3 / copy_gbps,
                                 "max_rel_err": err})
            best = max((r for r in rows if r["shape"] == name and r["T"] == T), key=lambda r: r["gbps"])
            eng = next(r for r in rows if r["shape"] == name and r["T"] == T and r["kernel"] == "engine dense_gemv")
            log(f"{name} T={T}: engine {eng['us']:.1f} us {eng['gbps']:.0f} GB/s; best {best['kernel']} "
                f"{best['us']:.1f} us {best['gbps']:.0f} GB/s ({best['share_of_copy']:.0%} of copy)")
        del ws
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--qwen3-file", default="/dev/shm/qwen3_30b_a3b_full.colibri", help="kept (other shapes: "
                    "/dev/shm/<shape>_full.colibri, deleted after their run)")
    ap.add_argument("--shapes", default="qwen3", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--peer", help="the peer script (peer_torch_compile_moe.py): run on the same shapes after ours")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-gemv", action="store_true")
    ap.add_argument("--pairs-ab", action="store_true", help="each shape's engine runs twice on one file: one-token "
                    "passes by pair (the default), then with the dispatch (as --no-pairs)")
    ap.add_argument("--dense-tc-ab", action="store_true", help="each shape's engine runs again with its bf16 dense "
                    "products of 2-32 rows on dense_gemv_tc (limits.DG_TC_MIN_ROWS = 2; off by default)")
    ap.add_argument("--kv-bf16-ab", action="store_true", help="each shape's engine runs again with a bf16 KV cache "
                    "(EngineConfig.kv_cache_dtype='bfloat16')")
    ap.add_argument("--context", type=int, default=16, help="prompt tokens a sequence before the timed steps "
                    "(attention's work follows it; the bf16 KV cache's decode A/B wants a long one, e.g. 4096)")
    ap.add_argument("--no-pairs", action="store_true", help="one-token passes keep the dispatch (ops.pairs_path "
                    "off: the four-kernel MoE layer before session 16)")
    ap.add_argument("--dg-max-splits", type=int, help="limits.DG_MAX_SPLITS for the engine runs (1: dense_gemv "
                    "unsplit, the kernel before session 16)")
    ap.add_argument("--dg-plan", action="append", default=[], metavar="TOKENS=RxU",
                    help="limits.DG_PLANS[TOKENS] = (R, U) for the engine runs, layers.cu rebuilt to match (repeatable; "
                    "1=2x4: one token's plan before session 17)")
    ap.add_argument("--layers-define", action="append", default=[], metavar="NAME=VALUE",
                    help="layers.cu rebuilt with this -D constant for the engine runs (repeatable; e.g. "
                    "ATT_DECODE_MIN_KEYS=32)")
    ap.add_argument("--experts", default="int8", choices=sorted(EXPERT_FORMATS),
                    help="expert format of the files (int4_g32: int8 activations, the engine's default)")
    args = ap.parse_args()
    import cupy as cp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    result["copy_gbps"] = copy_bandwidth(cp)
    log(f"device-to-device copy {result['copy_gbps']:.0f} GB/s")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    if args.dg_max_splits is not None:
        from colibri_format.runtime.cuda import limits

        limits.DG_MAX_SPLITS = args.dg_max_splits
        result["dg_max_splits"] = args.dg_max_splits
    for plan in args.dg_plan:
        use_dense_plan(plan, result)
    if args.layers_define:
        result["layers_defines"] = override_defines("layers", args.layers_define, "--layers-define")
    if args.no_pairs:
        from colibri_format.runtime.cuda.kernels import ops

        ops.pairs_path = lambda num_tokens: False
        result["pairs"] = False
    if not args.skip_engine:
        result["engine"] = {}
        for shape in shapes:
            keep = shape == "qwen3" and args.experts == "int8"
            path = Path(args.qwen3_file) if keep else Path(f"/dev/shm/{shape}_{args.experts}_full.colibri")
            ensure_model(path, shape, args.experts)
            batches = [int(b) for b in args.batches.split(",")]
            result["engine"][shape] = engine_profile(path, batches, context=args.context)
            if args.pairs_ab:
                from colibri_format.runtime.cuda.kernels import ops

                by_pair = ops.pairs_path
                ops.pairs_path = lambda num_tokens: False
                log(f"{shape} again with the dispatch (--pairs-ab)")
                result["engine"][f"{shape} dispatch"] = engine_profile(path, batches, context=args.context)
                ops.pairs_path = by_pair
            if args.kv_bf16_ab:
                log(f"{shape} again with a bf16 KV cache (--kv-bf16-ab)")
                result["engine"][f"{shape} bf16 KV"] = engine_profile(path, batches, "bfloat16", args.context)
            if args.dense_tc_ab:
                from colibri_format.runtime.cuda import limits

                saved, limits.DG_TC_MIN_ROWS = limits.DG_TC_MIN_ROWS, 2
                log(f"{shape} again with dense_gemv_tc from 2 rows (--dense-tc-ab)")
                result["engine"][f"{shape} dense_tc"] = engine_profile(path, batches, context=args.context)
                limits.DG_TC_MIN_ROWS = saved
            if not keep:
                path.unlink()
            (out / "decode_profile.json").write_text(json.dumps(result, indent=1, default=str))
    if args.peer:
        import os
        import subprocess

        cp.get_default_memory_pool().free_all_blocks()      # the engines are closed: leave the peer the GPU
        cp.get_default_pinned_memory_pool().free_all_blocks()
        env = dict(os.environ, OUT=str(out))
        peer = subprocess.run([sys.executable, args.peer, *(PEER_NAMES[s] for s in shapes)], env=env,
                              capture_output=True, text=True)
        log(f"peer ({args.peer}, rc {peer.returncode}):\n{peer.stdout[-3000:]}{peer.stderr[-2000:]}")
        result["peer"] = {"rc": peer.returncode, "stdout": peer.stdout[-5000:]}
    if not args.skip_gemv:
        result["gemv"] = gemv_candidates(cp, result["copy_gbps"])
    (out / "decode_profile.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
