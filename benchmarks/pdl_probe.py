"""Does programmatic dependent launch (PDL, Hopper) shorten a chain of decode-sized kernels? (issue 14)

    PYTHONPATH=. python3 benchmarks/pdl_probe.py --out OUT_DIR [--layers 48]

A batch-1 decode step is ~10 small kernels a layer, each paying its launch, ramp-up and tail while HBM idles. With
PDL (`cuLaunchKernelEx` + the programmatic stream serialization attribute) a kernel may start while the one before
it runs: it issues `griddepcontrol.wait` before touching anything the earlier kernel writes, and may first prefetch
its own weights into L2 (they do not depend on the earlier kernel). This probe measures that on a stand-in for the
attention half of a Qwen3-30B-A3B layer (hidden 2048): a tiny elementwise kernel (a norm's stand-in) -> a bf16 GEMV
5120 x 2048 (q/k/v) -> a tiny kernel -> a bf16 GEMV 2048 x 4096 (o_proj), `--layers` times with distinct weights (so
they stream from HBM), captured in one CUDA graph, in four forms:

- `plain`: CuPy launches (today's engine);
- `ex`: the same kernels through cuLaunchKernelEx without the attribute (the launch path alone);
- `pdl`: with the attribute, every kernel waiting at its start and letting its dependents launch at once;
- `pdl+l2`: as `pdl`, each GEMV warp first prefetching its weight rows into L2 (`prefetch.global.L2::evict_last`);
- `pdl-late`, `pdl-late+l2`: as those, but each kernel lets its dependents launch only after its main loop.

Every form must give the plain form's output bit for bit (checked). Writes pdl_probe.json to OUT_DIR.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np

SOURCE = r"""
#define MODE_WAIT 1
#define MODE_TRIGGER 2
#define MODE_PREFETCH 4
#define MODE_TRIGGER_LATE 8
__device__ __forceinline__ void prologue(int mode) {
    if (mode & MODE_TRIGGER) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (mode & MODE_WAIT) asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void late_trigger(int mode) {
    if (mode & MODE_TRIGGER_LATE) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ float bf(unsigned int bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float dot8(uint4 v, const float* x) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s = fmaf(bf(u[i] & 0xffffu), x[2 * i], s);
        s = fmaf(bf(u[i] >> 16), x[2 * i + 1], s);
    }
    return s;
}
// y[N] = w[N, K] (bf16 bits) . x[K]; a warp per 2 rows, 16-byte loads, 4 in flight a row.
extern "C" __global__ void __launch_bounds__(256) gemv(const float* x, const unsigned short* w, float* y, int N,
                                                       int K, int mode) {
    const int lane = threadIdx.x & 31, r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 2;
    if ((mode & MODE_PREFETCH) && r0 < N) {
        const char* base = reinterpret_cast<const char*>(w + (size_t)r0 * K);
        for (int b = lane * 128; b < 2 * K * 2; b += 32 * 128)
            asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + b));
    }
    prologue(mode);
    if (r0 >= N) return;
    float a0 = 0.0f, a1 = 0.0f;
    for (int c0 = lane * 8; c0 < K; c0 += 32 * 8 * 4) {
        uint4 v0[4], v1[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int c = c0 + u * 256;
            v0[u] = c < K ? ld_stream(w + (size_t)r0 * K + c) : make_uint4(0, 0, 0, 0);
            v1[u] = c < K ? ld_stream(w + (size_t)(r0 + 1) * K + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int c = c0 + u * 256;
            if (c < K) {
                float xv[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) xv[e] = x[c + e];
                a0 += dot8(v0[u], xv);
                a1 += dot8(v1[u], xv);
            }
        }
    }
    late_trigger(mode);
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        a0 += __shfl_xor_sync(0xffffffffu, a0, o);
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
    }
    if (lane == 0) { y[r0] = a0; y[r0 + 1] = a1; }
}
// out[i] = 0.5 * in[i % n_in] + 0.01 for i < n_out (a norm's stand-in: one small dependent kernel)
extern "C" __global__ void tiny(const float* in, float* out, int n_in, int n_out, int mode) {
    prologue(mode);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_out; i += gridDim.x * blockDim.x)
        out[i] = 0.5f * in[i % n_in] + 0.01f;
    late_trigger(mode);
}
"""

ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_int32),
                ("value_pad", ctypes.c_byte * 60)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("shared", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


class ExLauncher:
    """cuLaunchKernelEx through the driver API, with or without the PDL attribute."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuLaunchKernelEx.restype = ctypes.c_int
        self.attr = LaunchAttribute(ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, 0, 1)

    def __call__(self, fn, grid: int, block: int, args: list, stream_ptr: int, pdl: bool) -> None:
        holders = [ctypes.c_uint64(a.data.ptr) if hasattr(a, "data") else ctypes.c_int32(a) for a in args]
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        cfg = LaunchConfig((grid, 1, 1), (block, 1, 1), 0, ctypes.c_void_p(stream_ptr),
                           ctypes.pointer(self.attr) if pdl else None, 1 if pdl else 0)
        rc = self.cuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(getattr(fn, "ptr", None) or fn.kernel.ptr), params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


def main() -> int:
    import cupy as cp  # noqa: PLC0415

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    gemv, tiny = mod.get_function("gemv"), mod.get_function("tiny")
    H, QKV, O_IN = 2048, 5120, 4096
    rng = np.random.default_rng(0)

    def bf16_bits(shape):
        return cp.asarray((rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(
            cp.uint16)

    w_qkv = [bf16_bits((QKV, H)) for _ in range(a.layers)]
    w_o = [bf16_bits((H, O_IN)) for _ in range(a.layers)]
    h0 = cp.asarray(rng.standard_normal(H, dtype=np.float32))
    xa, ya, xb, yb = (cp.zeros(n, cp.float32) for n in (H, QKV, O_IN, H))
    ex = ExLauncher()
    stream = cp.cuda.Stream(non_blocking=True)
    weight_bytes = sum(w.nbytes for w in w_qkv + w_o)

    def step(form: str) -> None:
        mode = {"plain": 0, "ex": 0, "pdl": 3, "pdl+l2": 7, "pdl-late": 9, "pdl-late+l2": 13}[form]
        gmode, mode = mode, mode & ~4

        def launch(fn, grid, block, args, kmode):
            args = list(args[:-1]) + [kmode]
            if form == "plain":
                fn((grid,), (block,), tuple(x if hasattr(x, "data") else np.int32(x) for x in args))
            else:
                ex(fn, grid, block, args, stream.ptr, pdl=form.startswith("pdl"))

        launch(tiny, 16, 256, [h0, xa, H, H, 0], mode)
        for i in range(a.layers):
            launch(gemv, QKV // 16, 256, [xa, w_qkv[i], ya, QKV, H, 0], gmode)
            launch(tiny, 16, 256, [ya, xb, QKV, O_IN, 0], mode)
            launch(gemv, H // 16, 256, [xb, w_o[i], yb, H, O_IN, 0], gmode)
            launch(tiny, 16, 256, [yb, xa, H, H, 0], mode)

    results, reference = [], None
    for form in ("plain", "ex", "pdl", "pdl+l2", "pdl-late", "pdl-late+l2"):
        with stream:
            stream.begin_capture()
            step(form)
            graph = stream.end_capture()
            for _ in range(3):
                graph.launch(stream)
            stream.synchronize()
            out = cp.asnumpy(yb)
            if reference is None:
                reference = out
            same = bool(np.array_equal(out, reference))
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(a.replays):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
        us = cp.cuda.get_elapsed_time(start, end) * 1e3 / a.replays
        row = {"form": form, "step_us": round(us, 1), "kernels": 1 + 4 * a.layers,
               "weight_gb_per_s": round(weight_bytes / us / 1e3, 1), "same_output": same}
        results.append(row)
        print(row, flush=True)
    base = results[0]["step_us"]
    for r in results:
        r["speedup_vs_plain"] = round(base / r["step_us"], 3)
    doc = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "device": cp.cuda.runtime.getDeviceProperties(0)[
        "name"].decode(), "layers": a.layers, "weight_bytes": weight_bytes, "results": results}
    (a.out / "pdl_probe.json").write_text(json.dumps(doc, indent=2))
    print("| form | step µs | GB/s of weights | x plain | same output |\n|---|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['form']} | {r['step_us']} | {r['weight_gb_per_s']} | {r['speedup_vs_plain']} | {r['same_output']} |")
    return 0 if all(r["same_output"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
