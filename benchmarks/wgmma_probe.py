"""Which operand layouts does Hopper's `wgmma` read? A probe before the mixed-input prefill GEMM (issue 15).

    PYTHONPATH=. python3 benchmarks/wgmma_probe.py --out OUT_DIR          # GPU (sm_90a) and nvcc
    PYTHONPATH=. python3 benchmarks/wgmma_probe.py --compile-only         # nvcc only: builds the cubin

Issue 15 wants the int8 expert weights dequantized to bf16 in registers and multiplied on the tensor cores at bf16
rate. On Hopper that is `wgmma.mma_async` with the weight tile as operand A from registers (each thread's
fragment converted from int8) and the activation tile as operand B from shared memory, read through a 64-bit
matrix descriptor. The PTX manual's descriptor fields (start address, leading and stride byte offsets, swizzle) and
the register layouts are easy to get wrong, so this probe settles them on the device before a GEMM is built on
them. One warpgroup computes D [64, N] = A [64, 16] B [16, N] (A int8 -> bf16 in registers, B bf16 in shared
memory packed as 8 x 8 core matrices, no swizzle; N = 64 and 128) once per hypothesis:

- descriptor: the core matrices adjacent in K 128 bytes apart and adjacent in N 256 bytes apart, with the
  "leading" byte offset taken as the K step and the "stride" offset as the N step ("lbo=K"), or the other way
  round ("lbo=N");
- A fragment: warp w of the warpgroup holds rows 16 w .. 16 w + 15 as mma.sync's m16n8k16 A fragment (a0: row
  lane / 4, columns 2 (lane % 4) + {0, 1}; a1: row + 8; a2, a3: columns + 8);
- accumulators: chunk j of 8 columns in d[4 j .. 4 j + 3] as mma.sync's C fragment (rows lane / 4 and + 8,
  columns 8 j + 2 (lane % 4) + {0, 1}).

Each hypothesis runs on random operands and on B = the identity (D = A's first 16 columns: a wrong A mapping shows
as a permutation of A). The table gives the largest error against NumPy's float64 product; a hypothesis holds when
it is exact (the products of small integers and bf16 values are exact in fp32). Writes wgmma_probe.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

WIDTHS = (64, 128)
HYPOTHESES = {"lbo=K": (128, 256), "lbo=N": (256, 128)}   # (leading, stride) byte offsets of the descriptor

SOURCE = r"""
typedef unsigned short u16;

__device__ __forceinline__ u16 bf16_of_int(int v) { return (u16)(__float_as_uint((float)v) >> 16); }

// the 64-bit shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte units), no
// swizzle
__device__ __forceinline__ unsigned long long smem_desc(const void* p, int lbo, int sbo) {
    const unsigned long long a = (unsigned long long)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFFull) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
}

#define WGMMA_N64_ARGS                                                                                            \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),    \
    "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),         \
    "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),        \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

__device__ __forceinline__ void wgmma_n64(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : WGMMA_N64_ARGS
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// N = 128 as two N = 64 halves of B (the second half's core matrices start 8 N-blocks later)
template <int N>
__device__ __forceinline__ void probe(const signed char* A, const u16* B, float* D, int lbo, int sbo) {
    __shared__ __align__(128) u16 sB[N * 16];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // B [N, 16] (row n: its 16 k values) packed as core matrices (nb, kb): 8 n x 8 k, 128 bytes, the K neighbour
    // 128 bytes on, the N neighbour 256 bytes on
    for (int i = tid; i < N * 16; i += 128) {
        const int n = i >> 4, k = i & 15;
        sB[((n >> 3) * 2 + (k >> 3)) * 64 + (n & 7) * 8 + (k & 7)] = B[i];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3);
    unsigned a[4];
    const int rows[4] = {r, r + 8, r, r + 8}, cols[4] = {c, c, c + 8, c + 8};
#pragma unroll
    for (int q = 0; q < 4; ++q)
        a[q] = (unsigned)bf16_of_int(A[rows[q] * 16 + cols[q]]) |
               ((unsigned)bf16_of_int(A[rows[q] * 16 + cols[q] + 1]) << 16);
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int h = 0; h < N / 64; ++h) wgmma_n64(d + 32 * h, a, smem_desc(sB + h * 8 * 2 * 64, lbo, sbo));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        D[r * N + 8 * j + c] = d[4 * j];
        D[r * N + 8 * j + c + 1] = d[4 * j + 1];
        D[(r + 8) * N + 8 * j + c] = d[4 * j + 2];
        D[(r + 8) * N + 8 * j + c + 1] = d[4 * j + 3];
    }
}

extern "C" __global__ void __launch_bounds__(128) probe_n64(const signed char* A, const u16* B, float* D, int lbo,
                                                            int sbo) {
    probe<64>(A, B, D, lbo, sbo);
}
extern "C" __global__ void __launch_bounds__(128) probe_n128(const signed char* A, const u16* B, float* D, int lbo,
                                                             int sbo) {
    probe<128>(A, B, D, lbo, sbo);
}
"""


def build(workdir: Path) -> Path:
    """The probe's cubin for sm_90a (wgmma needs the arch-specific target), built with nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not on PATH")
    src, cubin = workdir / "wgmma_probe.cu", workdir / "wgmma_probe.cubin"
    src.write_text(SOURCE)
    res = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-O3", "-Xptxas", "-v", "-o", str(cubin), str(src)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"nvcc failed:\n{res.stderr[-4000:]}")
    return cubin


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (the operands below are exact in bf16 anyway)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_case(cp, fn, A: np.ndarray, B: np.ndarray, lbo: int, sbo: int) -> float:
    """Largest |D - A @ B| of one launch (B [N, 16] as bf16 bits, row n holding column n of the math's B)."""
    N = B.shape[0]
    D = cp.full((64, N), np.nan, cp.float32)
    fn((1,), (128,), (cp.asarray(A), cp.asarray(B), D, np.int32(lbo), np.int32(sbo)))
    want = A.astype(np.float64) @ bf16_value(B).astype(np.float64).T
    got = D.get()
    return float("inf") if not np.isfinite(got).all() else float(np.abs(got - want).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-only", action="store_true", help="build the cubin and stop (no GPU needed)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = build(Path(tmp))
        if args.compile_only:
            print(f"built {cubin.stat().st_size} bytes of sm_90a cubin")
            return 0
        import cupy as cp  # noqa: PLC0415 -- GPU machines only

        mod = cp.RawModule(path=str(cubin))
        rng = np.random.default_rng(0)
        A = rng.integers(-128, 128, (64, 16), dtype=np.int8)
        rows, results = [], {}
        for N in WIDTHS:
            fn = mod.get_function(f"probe_n{N}")
            B_rand = bf16_bits(rng.integers(-8, 9, (N, 16)).astype(np.float32) / 4)
            B_eye = bf16_bits(np.eye(N, 16, dtype=np.float32))          # D[:, :16] = A
            for name, (lbo, sbo) in HYPOTHESES.items():
                err = {"random": run_case(cp, fn, A, B_rand, lbo, sbo), "identity": run_case(cp, fn, A, B_eye, lbo, sbo)}
                results[f"N={N} {name}"] = err
                rows.append(f"| {N} | {name} | {err['random']:.3g} | {err['identity']:.3g} | "
                            f"{'holds' if max(err.values()) == 0 else 'no'} |")
    print("| N | descriptor | max err, random | max err, B = I | |\n|---|---|---|---|---|\n" + "\n".join(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wgmma_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
