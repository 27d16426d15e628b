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
it is exact (the products of small integers and bf16 values are exact in fp32).

Stage 2, with the layout that held: `gemm_w8_bf16`, a first grouped GEMM of int8 weights (row scales) and bf16
activations on wgmma (one warpgroup a 64-row x 128-token tile, cp.async double buffering, the weights pre-packed so
each thread loads its A fragments as 32 contiguous bytes), with every wgmma group waited for before the next step.
Stage 3, `gemm_w8_bf16_p_{cvt,fast}`: two warpgroups a block (128 weight rows) sharing each X tile, X and weight tiles
through a ring of 4 shared-memory stages filled 2 steps ahead, one wgmma group kept in flight (A fragments
double-buffered in registers); `fast` widens int8 by the fp32 magic number instead of int-to-float conversions.
ptxas still serializes its wgmmas (warning C7513: register-sourced A fragments defined inside the pipeline).
Stage 4, `gemm_w8_bf16_ss{3,4}`: the same with the widened weights stored to shared memory as core matrices and both
operands read through descriptors (no C7513), rings of 3 or 4 stages.
Stage 5, `gemm_w8_bf16_rm3`: stage 4 (3 stages) reading the weights row-major as a .colibri expert blob holds them,
no packing: what an engine kernel could read in place.
Stage 6, `gemm_w8_a8_s{4,6}`: int8 activations with per-token scales (the engine's int8-activation option) on s8 x s8
wgmma (twice the bf16 rate), both operands copied by cp.async straight into core matrices, no widening; rings of 4
or 6 stages of 16 KB.
Every kernel is checked against float64 on a small case with a partial token tile and a wrapping stage ring, then
timed on Mixtral-8x7B's expert products at a 512-token prefill (8 experts x 128 rows; issue 15's target is >= 400
TFLOP/s). `--compile-only` also prints ptxas's register and spill lines. Writes wgmma_probe.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from colibri_format.dtypes import float32_to_bf16_bits, to_float32

WIDTHS = (64, 128)
HYPOTHESES = {"lbo=K": (128, 256), "lbo=N": (256, 128)}   # (leading, stride) byte offsets of the descriptor

GEMM_SOURCE = r"""
// ---- stage 2: a grouped int8-weight x bf16-activation GEMM on wgmma (a first cut; the layouts of stage 1) -------
// Y[e, t, o] = scale[e, o] * sum_k W[e, o, k] X[e, t, k]: a block of one warpgroup computes 64 weight rows (wgmma
// M) x GN = 128 tokens (wgmma N) of one expert; K in steps of GK = 64 (four k16 wgmmas). X's tile of a step is
// staged by cp.async in shared memory as stage 1's core matrices (double buffered); the weights are pre-packed on
// the host so that each thread's A fragments of a step are 32 contiguous bytes (two 16-byte loads, one step ahead)
// and widened int8 -> bf16 in registers; the row scales are applied in the epilogue.
#define GK 64
#define GN 128

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}

#define WGMMA_N128_ARGS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

__device__ __forceinline__ void wgmma_n128(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : WGMMA_N128_ARGS
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ unsigned bf16x2_of_bytes(unsigned w, int first) {
    return (unsigned)bf16_of_int((signed char)(w >> (8 * first))) |
           ((unsigned)bf16_of_int((signed char)(w >> (8 * first + 8))) << 16);
}

// a[j][0..3] of k16 step j from the step's 32 packed bytes (per j: row r cols c, c+1, c+8, c+9, then row r+8 alike)
__device__ __forceinline__ void a_fragments(const uint4* w, unsigned (&a)[4][4]) {
    const unsigned words[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned lo = words[2 * j], hi = words[2 * j + 1];
        a[j][0] = bf16x2_of_bytes(lo, 0);
        a[j][1] = bf16x2_of_bytes(hi, 0);
        a[j][2] = bf16x2_of_bytes(lo, 2);
        a[j][3] = bf16x2_of_bytes(hi, 2);
    }
}

// The epilogue: this thread's accumulators (rows o and o + 8, tokens t0 + 8 j + c and + 1) times the rows' scales.
__device__ __forceinline__ void store_tile(const float* d, const float* __restrict__ scale, float* __restrict__ Y,
                                           int e, int M, int NO, int t0, int o, int c,
                                           const float* __restrict__ token_scale = nullptr) {
    const float s0 = scale[(size_t)e * NO + o], s8 = scale[(size_t)e * NO + o + 8];
    float* Ye = Y + (size_t)e * M * NO;
#pragma unroll
    for (int j = 0; j < GN / 8; ++j) {
        const int t = t0 + 8 * j + c;
        const float x0 = token_scale != nullptr && t < M ? token_scale[(size_t)e * M + t] : 1.0f;
        const float x1 = token_scale != nullptr && t + 1 < M ? token_scale[(size_t)e * M + t + 1] : 1.0f;
        if (t < M) {
            Ye[(size_t)t * NO + o] = d[4 * j] * s0 * x0;
            Ye[(size_t)t * NO + o + 8] = d[4 * j + 2] * s8 * x0;
        }
        if (t + 1 < M) {
            Ye[(size_t)(t + 1) * NO + o] = d[4 * j + 1] * s0 * x1;
            Ye[(size_t)(t + 1) * NO + o + 8] = d[4 * j + 3] * s8 * x1;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
    gemm_w8_bf16(const uint4* __restrict__ Wp, const float* __restrict__ scale, const u16* __restrict__ X,
                 float* __restrict__ Y, int M, int NO, int K, int lbo, int sbo) {
    __shared__ __align__(128) u16 sX[2][GN * GK];
    const int e = blockIdx.z, rb = blockIdx.x, t0 = blockIdx.y * GN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int steps = K / GK;
    const u16* Xe = X + (size_t)e * M * K;
    const uint4* Wt = Wp + ((size_t)e * (NO / 64) + rb) * steps * 256 + tid * 2;
    auto load_x = [&](int buf, int step) {
        for (int i = tid; i < GN * (GK / 8); i += 128) {
            const int n = i >> 3, q = i & 7, tok = min(t0 + n, M - 1);
            u16* dst = sX[buf] + (((q >> 1) * (GN / 8) + (n >> 3)) * 2 + (q & 1)) * 64 + (n & 7) * 8;
            cp_async16(dst, Xe + (size_t)tok * K + step * GK + q * 8);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    uint4 w[2] = {__ldg(Wt), __ldg(Wt + 1)};
    load_x(0, 0);
    for (int s = 0; s < steps; ++s) {
        uint4 wn[2] = {w[0], w[1]};
        if (s + 1 < steps) {
            load_x((s + 1) & 1, s + 1);
            wn[0] = __ldg(Wt + (size_t)(s + 1) * 256);
            wn[1] = __ldg(Wt + (size_t)(s + 1) * 256 + 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        unsigned a[4][4];
        a_fragments(w, a);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_n128(d, a[j], smem_desc(sX[s & 1] + j * (GN / 8) * 2 * 64, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        __syncthreads();   // the buffer this step read is refilled by the next step's copies
        w[0] = wn[0];
        w[1] = wn[1];
    }
    const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3), o = rb * 64 + r;
    store_tile(d, scale, Y, e, M, NO, t0, o, c);
}
// ---- stage 3: the same product pipelined (a candidate for the prefill GEMM) ------------------------------------
// A block of two warpgroups computes 128 weight rows (warpgroup g: the 64-row tile 2 blockIdx.x + g, packed as
// stage 2) x GN tokens of one expert. Each K step's X tile (16 KB) and both weight tiles (2 x 4 KB) go through a
// ring of P3_STAGES shared-memory stages filled by cp.async P3_STAGES - 2 steps ahead; a warpgroup keeps one
// group of wgmmas in flight while it widens the next step's weights (A fragments double-buffered in registers, so a
// fragment is rewritten only after the wgmmas that read it completed). FAST_CVT widens int8 -> bf16 by the fp32
// magic number 2^23 (byte permutes and one subtraction, exact for |v| <= 128) instead of int-to-float conversions.
#define P3_STAGES 4
#define P3_X_BYTES (GN * GK * 2)
#define P3_W_BYTES (2 * 128 * 32)
#define P3_STAGE_BYTES (P3_X_BYTES + P3_W_BYTES)

__device__ __forceinline__ unsigned bf16x2_fast(unsigned biased, int first) {
    const float lo = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440 | first)) - 8388736.0f;
    const float hi = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7440 | (first + 1))) - 8388736.0f;
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

template <bool FAST_CVT>
__device__ __forceinline__ void a_fragments_from(const uint4* w, unsigned (&a)[4][4]) {
    const unsigned words[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned lo = words[2 * j], hi = words[2 * j + 1];
        if (FAST_CVT) {
            a[j][0] = bf16x2_fast(lo ^ 0x80808080u, 0);
            a[j][1] = bf16x2_fast(hi ^ 0x80808080u, 0);
            a[j][2] = bf16x2_fast(lo ^ 0x80808080u, 2);
            a[j][3] = bf16x2_fast(hi ^ 0x80808080u, 2);
        } else {
            a[j][0] = bf16x2_of_bytes(lo, 0);
            a[j][1] = bf16x2_of_bytes(hi, 0);
            a[j][2] = bf16x2_of_bytes(lo, 2);
            a[j][3] = bf16x2_of_bytes(hi, 2);
        }
    }
}

// One K step's X tile into shared memory as B's core matrices (cp.async from all 256 threads of a block).
__device__ __forceinline__ void load_x_tile(u16* sx, const u16* __restrict__ Xe, int t0, int M, int K, int step) {
    for (int i = threadIdx.x; i < GN * (GK / 8); i += 256) {
        const int n = i >> 3, q = i & 7, tok = min(t0 + n, M - 1);
        cp_async16(sx + (((q >> 1) * (GN / 8) + (n >> 3)) * 2 + (q & 1)) * 64 + (n & 7) * 8,
                   Xe + (size_t)tok * K + step * GK + q * 8);
    }
}

// Ring stage step % STAGES <- one K step's X tile and the block's two packed weight tiles, by cp.async; one commit
// group a call, empty past the last step (the group count stays uniform).
template <int STAGES>
__device__ __forceinline__ void load_step(unsigned char* smem, const u16* __restrict__ Xe, const uint4* __restrict__ Wb,
                                          int t0, int M, int K, int steps, int step) {
    if (step < steps) {
        unsigned char* stage = smem + (step % STAGES) * P3_STAGE_BYTES;
        load_x_tile(reinterpret_cast<u16*>(stage), Xe, t0, M, K, step);
        uint4* sw = reinterpret_cast<uint4*>(stage + P3_X_BYTES);
        for (int i = threadIdx.x; i < 512; i += 256) {      // 2 row tiles x 256 16-byte chunks
            const int tile = i >> 8, c = i & 255;
            cp_async16(sw + i, Wb + ((size_t)tile * steps + step) * 256 + c);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <bool FAST_CVT>
__device__ __forceinline__ void gemm_w8_bf16_p(const uint4* __restrict__ Wp, const float* __restrict__ scale,
                                               const u16* __restrict__ X, float* __restrict__ Y, int M, int NO, int K,
                                               int lbo, int sbo) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int e = blockIdx.z, t0 = blockIdx.y * GN;
    const int tid = threadIdx.x, g = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
    const int steps = K / GK;
    const u16* Xe = X + (size_t)e * M * K;
    const uint4* Wb = Wp + ((size_t)e * (NO / 64) + 2 * blockIdx.x) * steps * 256;   // the block's first row tile
    auto stage_x = [&](int buf) { return reinterpret_cast<u16*>(smem + buf * P3_STAGE_BYTES); };
    auto stage_w = [&](int buf) { return reinterpret_cast<uint4*>(smem + buf * P3_STAGE_BYTES + P3_X_BYTES); };
    auto load = [&](int step) { load_step<P3_STAGES>(smem, Xe, Wb, t0, M, K, steps, step); };
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    unsigned a[2][4][4];
#pragma unroll
    for (int s = 0; s < P3_STAGES - 2; ++s) load(s);
    // Register fences (empty asm that reads and writes): a fragment stays live, in its registers, until the wait that
    // retires the wgmmas reading it; without them the compiler reuses the registers of a fragment it believes
    // consumed at issue, and ptxas serializes every wgmma (its warning C7513).
    auto fence_frag = [](unsigned (&frag)[4][4]) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(frag[j][q])::"memory");
    };
    auto fence_acc = [&]() {
#pragma unroll
        for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
    };
    auto step = [&](int s, unsigned (&frag)[4][4], unsigned (&prev)[4][4]) {
        asm volatile("cp.async.wait_group %0;" ::"n"(P3_STAGES - 3) : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();            // step s landed for every thread; every warpgroup finished step s - 2's wgmmas
        load(s + P3_STAGES - 2);    // into step s - 2's stage
        const int buf = s % P3_STAGES;
        a_fragments_from<FAST_CVT>(stage_w(buf) + g * 256 + wt * 2, frag);
        fence_frag(frag);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_n128(d, frag[j], smem_desc(stage_x(buf) + j * (GN / 8) * 2 * 64, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        fence_frag(prev);     // the previous step's wgmmas, which read `prev`, have retired
    };
    for (int s = 0; s < steps; s += 2) {
        step(s, a[0], a[1]);
        if (s + 1 < steps) step(s + 1, a[1], a[0]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    fence_acc();
    const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3), o = (2 * blockIdx.x + g) * 64 + r;
    store_tile(d, scale, Y, e, M, NO, t0, o, c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_bf16_p_cvt(const uint4* Wp, const float* scale, const u16* X, float* Y, int M, int NO, int K, int lbo,
                       int sbo) {
    gemm_w8_bf16_p<false>(Wp, scale, X, Y, M, NO, K, lbo, sbo);
}
extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_bf16_p_fast(const uint4* Wp, const float* scale, const u16* X, float* Y, int M, int NO, int K, int lbo,
                        int sbo) {
    gemm_w8_bf16_p<true>(Wp, scale, X, Y, M, NO, K, lbo, sbo);
}
// ---- stage 4: both operands from shared memory (SS) -----------------------------------------------------------
// Stage 3's register fragments keep ptxas from overlapping wgmmas (C7513: a non-wgmma instruction defines wgmma
// input registers inside the pipeline). Here each warpgroup widens its 64 x 64 int8 weight tile of a step into a
// bf16 tile in shared memory, laid out as B's core matrices (8 rows x 16 bytes; K neighbours 128 bytes apart, row
// neighbours 256 bytes apart, one 64 x 16 block per k16 wgmma), and both operands are read through descriptors, so
// the only registers a wgmma touches are its accumulators and a group can stay in flight across steps. Two bf16
// tiles alternate (a step's tile is rewritten two steps later, after the wait that retires its wgmmas).
#define SS_A_BYTES (2 * 64 * GK * 2)   // both warpgroups' bf16 tiles of one step

__device__ __forceinline__ void wgmma_ss_n128(float* d, unsigned long long desc_a, unsigned long long desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_N128_ARGS
        : "l"(desc_a), "l"(desc_b));
}

template <int STAGES>
__device__ __forceinline__ void gemm_w8_bf16_ss(const uint4* __restrict__ Wp, const float* __restrict__ scale,
                                                const u16* __restrict__ X, float* __restrict__ Y, int M, int NO,
                                                int K, int lbo, int sbo) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int e = blockIdx.z, t0 = blockIdx.y * GN;
    const int tid = threadIdx.x, g = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
    const int steps = K / GK;
    const u16* Xe = X + (size_t)e * M * K;
    const uint4* Wb = Wp + ((size_t)e * (NO / 64) + 2 * blockIdx.x) * steps * 256;
    auto stage_x = [&](int buf) { return reinterpret_cast<u16*>(smem + buf * P3_STAGE_BYTES); };
    auto stage_w = [&](int buf) { return reinterpret_cast<uint4*>(smem + buf * P3_STAGE_BYTES + P3_X_BYTES); };
    // warpgroup g's bf16 tile of ring slot b: 4 k16 blocks of 64 rows x 16, each 8 x 2 core matrices
    auto tile_a = [&](int b) {
        return reinterpret_cast<u16*>(smem + STAGES * P3_STAGE_BYTES + b * SS_A_BYTES) + g * 64 * GK;
    };
    auto load = [&](int step) { load_step<STAGES>(smem, Xe, Wb, t0, M, K, steps, step); };
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) load(s);
    // this thread's bf16 pairs: rows r, r + 8 of its warpgroup's tile, columns c, c + 8 of each k16 block
    const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3);
    for (int s = 0; s < steps; ++s) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 3) : "memory");
        __syncthreads();            // step s landed everywhere; step s - 2's wgmmas retired in every warpgroup
        load(s + STAGES - 2);
        const int buf = s % STAGES;
        unsigned a[4][4];
        a_fragments_from<true>(stage_w(buf) + g * 256 + wt * 2, a);
        u16* ta = tile_a(s & 1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned* blk = reinterpret_cast<unsigned*>(ta + j * 64 * 16);
            // core matrix (row / 8, col / 8) at ((row / 8) * 2 + col / 8) * 64 elements; row % 8 at 8 elements
            blk[(((r >> 3) * 2 + 0) * 64 + (r & 7) * 8 + c) >> 1] = a[j][0];
            blk[((((r + 8) >> 3) * 2 + 0) * 64 + (r & 7) * 8 + c) >> 1] = a[j][1];
            blk[(((r >> 3) * 2 + 1) * 64 + (r & 7) * 8 + c) >> 1] = a[j][2];
            blk[((((r + 8) >> 3) * 2 + 1) * 64 + (r & 7) * 8 + c) >> 1] = a[j][3];
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> the wgmma's reads
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; ++j)
            wgmma_ss_n128(d, smem_desc(ta + j * 64 * 16, lbo, sbo),
                          smem_desc(stage_x(buf) + j * (GN / 8) * 2 * 64, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    const int o = (2 * blockIdx.x + g) * 64 + r;
    store_tile(d, scale, Y, e, M, NO, t0, o, c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_bf16_ss3(const uint4* Wp, const float* scale, const u16* X, float* Y, int M, int NO, int K, int lbo,
                     int sbo) {
    gemm_w8_bf16_ss<3>(Wp, scale, X, Y, M, NO, K, lbo, sbo);
}
extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_bf16_ss4(const uint4* Wp, const float* scale, const u16* X, float* Y, int M, int NO, int K, int lbo,
                     int sbo) {
    gemm_w8_bf16_ss<4>(Wp, scale, X, Y, M, NO, K, lbo, sbo);
}
// ---- stage 5: stage 4 on the file's own weight layout ----------------------------------------------------------
// The experts' int8 matrices as a .colibri blob holds them (row-major [NO, K], no packing): a step's 128 x 64 weight
// tile is copied row-major into shared memory (rows RM_ROW_BYTES apart: 64 bytes plus 16 of padding, so the widening
// reads of eight consecutive rows hit distinct banks), then each thread widens two 16-byte pieces (one row, one k16
// block) into the bf16 core-matrix tile with two 16-byte stores, and the wgmmas run as in stage 4.
#define RM_ROW_BYTES 80
#define RM_X_BYTES (GN * GK * 2)
#define RM_STAGE_BYTES (RM_X_BYTES + 128 * RM_ROW_BYTES)

template <int STAGES>
__device__ __forceinline__ void load_step_rm(unsigned char* smem, const u16* __restrict__ Xe,
                                             const signed char* __restrict__ We, int row0, int t0, int M, int K,
                                             int steps, int step) {
    if (step < steps) {
        unsigned char* stage = smem + (step % STAGES) * RM_STAGE_BYTES;
        load_x_tile(reinterpret_cast<u16*>(stage), Xe, t0, M, K, step);
        for (int i = threadIdx.x; i < 512; i += 256) {      // 128 rows x 4 16-byte pieces, 4 lanes a row's 64 bytes
            const int row = i >> 2, kq = i & 3;
            cp_async16(stage + RM_X_BYTES + row * RM_ROW_BYTES + kq * 16,
                       We + (size_t)(row0 + row) * K + step * GK + kq * 16);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// 16 int8 -> 16 bf16 (exact), as two 16-byte halves: k 0..7 and k 8..15
__device__ __forceinline__ void widen16(uint4 v, uint4& lo, uint4& hi) {
    const unsigned w[4] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u, v.z ^ 0x80808080u, v.w ^ 0x80808080u};
    lo = make_uint4(bf16x2_fast(w[0], 0), bf16x2_fast(w[0], 2), bf16x2_fast(w[1], 0), bf16x2_fast(w[1], 2));
    hi = make_uint4(bf16x2_fast(w[2], 0), bf16x2_fast(w[2], 2), bf16x2_fast(w[3], 0), bf16x2_fast(w[3], 2));
}

template <int STAGES>
__device__ __forceinline__ void gemm_w8_bf16_rm(const signed char* __restrict__ W, const float* __restrict__ scale,
                                                const u16* __restrict__ X, float* __restrict__ Y, int M, int NO,
                                                int K, int lbo, int sbo) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int e = blockIdx.z, t0 = blockIdx.y * GN, row0 = blockIdx.x * 128;
    const int tid = threadIdx.x, g = tid >> 7, warp = (tid & 127) >> 5, lane = tid & 31;
    const int steps = K / GK;
    const u16* Xe = X + (size_t)e * M * K;
    const signed char* We = W + (size_t)e * NO * K;
    auto stage = [&](int buf) { return smem + buf * RM_STAGE_BYTES; };
    auto tile_a = [&](int b) { return reinterpret_cast<u16*>(smem + STAGES * RM_STAGE_BYTES + b * SS_A_BYTES); };
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) load_step_rm<STAGES>(smem, Xe, We, row0, t0, M, K, steps, s);
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");   // the zeros stay put (ptxas C7515)
    for (int s = 0; s < steps; ++s) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 3) : "memory");
        __syncthreads();            // step s landed everywhere; step s - 2's wgmmas retired in every warpgroup
        load_step_rm<STAGES>(smem, Xe, We, row0, t0, M, K, steps, s + STAGES - 2);
        const int buf = s % STAGES;
        u16* ta = tile_a(s & 1);
#pragma unroll
        for (int rep = 0; rep < 2; ++rep) {          // piece i: row i % 128 of the block, k16 block i / 128
            const int i = tid + 256 * rep, row = i & 127, j = i >> 7;
            const uint4 v = *reinterpret_cast<const uint4*>(stage(buf) + RM_X_BYTES + row * RM_ROW_BYTES + j * 16);
            uint4 lo, hi;
            widen16(v, lo, hi);
            // warpgroup row / 64's tile, k16 block j, core matrices (row % 64 / 8, 0 | 1), row % 8
            u16* core = ta + (row >> 6) * 64 * GK + j * 64 * 16 + ((row & 63) >> 3) * 2 * 64 + (row & 7) * 8;
            *reinterpret_cast<uint4*>(core) = lo;
            *reinterpret_cast<uint4*>(core + 64) = hi;
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic stores -> the wgmma's reads
        __syncthreads();
        const u16* mine = ta + g * 64 * GK;
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; ++j)
            wgmma_ss_n128(d, smem_desc(mine + j * 64 * 16, lbo, sbo),
                          smem_desc(reinterpret_cast<const u16*>(stage(buf)) + j * (GN / 8) * 2 * 64, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
    const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3);
    store_tile(d, scale, Y, e, M, NO, t0, row0 + g * 64 + r, c);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_bf16_rm3(const signed char* W, const float* scale, const u16* X, float* Y, int M, int NO, int K, int lbo,
                     int sbo) {
    gemm_w8_bf16_rm<3>(W, scale, X, Y, M, NO, K, lbo, sbo);
}
// ---- stage 6: int8 activations (per-token scales): s8 x s8 wgmma on the file's row-major weights --------------
// No widening: each 16-byte piece of a weight row or an activation row is copied by cp.async straight to its place
// in a core matrix (8 rows x 16 bytes; K neighbours 128 bytes apart, row neighbours 256, one block of rows x 32
// bytes a k32 wgmma), and both operands are read through descriptors. A stage is 8 KB of activations + 8 KB of
// weights; copies run STAGES - 2 steps ahead and one wgmma group stays in flight. Y = (W X) * row scale * token
// scale; the int32 products are exact.
#define A8_X_BYTES (GN * GK)
#define A8_STAGE_BYTES (A8_X_BYTES + 128 * GK)
#define WGMMA_N128_IARGS \
    "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), \
    "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), \
    "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), \
    "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), \
    "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), \
    "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), \
    "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), \
    "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])

__device__ __forceinline__ void wgmma_s8_n128(int* d, unsigned long long desc_a, unsigned long long desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : WGMMA_N128_IARGS
        : "l"(desc_a), "l"(desc_b));
}

// byte offset of the 16-byte piece (row, kq) of a 64-byte K step in a tile of `rows` rows laid out as core matrices
__device__ __forceinline__ int a8_piece(int rows, int row, int kq) {
    return (kq >> 1) * rows * 32 + ((row >> 3) * 2 + (kq & 1)) * 128 + (row & 7) * 16;
}

template <int STAGES>
__device__ __forceinline__ void load_step_a8(unsigned char* smem, const signed char* __restrict__ Xe,
                                             const signed char* __restrict__ We, int row0, int t0, int M, int K,
                                             int steps, int step) {
    if (step < steps) {
        unsigned char* stage = smem + (step % STAGES) * A8_STAGE_BYTES;
        for (int i = threadIdx.x; i < 512; i += 256) {      // 128 rows x 4 pieces, 4 lanes a row's 64 bytes
            const int row = i >> 2, kq = i & 3, tok = min(t0 + row, M - 1);
            cp_async16(stage + a8_piece(GN, row, kq), Xe + (size_t)tok * K + step * GK + kq * 16);
            // weight rows: warpgroup row / 64's tile of 64 rows
            cp_async16(stage + A8_X_BYTES + (row >> 6) * 64 * GK + a8_piece(64, row & 63, kq),
                       We + (size_t)(row0 + row) * K + step * GK + kq * 16);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int STAGES>
__device__ __forceinline__ void gemm_w8_a8(const signed char* __restrict__ W, const float* __restrict__ scale,
                                           const signed char* __restrict__ X, float* __restrict__ Y, int M, int NO,
                                           int K, int lbo, int sbo, const float* __restrict__ token_scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int e = blockIdx.z, t0 = blockIdx.y * GN, row0 = blockIdx.x * 128;
    const int tid = threadIdx.x, g = tid >> 7, warp = (tid & 127) >> 5, lane = tid & 31;
    const int steps = K / GK;
    const signed char* Xe = X + (size_t)e * M * K;
    const signed char* We = W + (size_t)e * NO * K;
    int d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0;
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) load_step_a8<STAGES>(smem, Xe, We, row0, t0, M, K, steps, s);
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+r"(d[i])::"memory");   // the zeros stay put (ptxas C7515)
    for (int s = 0; s < steps; ++s) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 3) : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();            // step s landed everywhere; step s - 2's wgmmas retired in every warpgroup
        load_step_a8<STAGES>(smem, Xe, We, row0, t0, M, K, steps, s + STAGES - 2);
        const unsigned char* st = smem + (s % STAGES) * A8_STAGE_BYTES;
        const unsigned char* mine = st + A8_X_BYTES + g * 64 * GK;
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wgmma_s8_n128(d, smem_desc(mine + j * 64 * 32, lbo, sbo), smem_desc(st + j * GN * 32, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+r"(d[i])::"memory");
    float df[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) df[i] = (float)d[i];
    const int r = 16 * warp + (lane >> 2), c = 2 * (lane & 3);
    store_tile(df, scale, Y, e, M, NO, t0, row0 + g * 64 + r, c, token_scale);
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_a8_s4(const signed char* W, const float* scale, const signed char* X, float* Y, int M, int NO, int K,
                  int lbo, int sbo, const float* token_scale) {
    gemm_w8_a8<4>(W, scale, X, Y, M, NO, K, lbo, sbo, token_scale);
}
extern "C" __global__ void __launch_bounds__(256)
    gemm_w8_a8_s6(const signed char* W, const float* scale, const signed char* X, float* Y, int M, int NO, int K,
                  int lbo, int sbo, const float* token_scale) {
    gemm_w8_a8<6>(W, scale, X, Y, M, NO, K, lbo, sbo, token_scale);
}
"""

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
""" + GEMM_SOURCE


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
    for line in res.stderr.splitlines():      # ptxas -v: registers and spills of each kernel
        if "registers" in line or "spill" in line:
            print(line.strip())
    return cubin


def run_case(cp, fn, A: np.ndarray, B: np.ndarray, lbo: int, sbo: int) -> float:
    """Largest |D - A @ B| of one launch (B [N, 16] as bf16 bits, row n holding column n of the math's B)."""
    N = B.shape[0]
    D = cp.full((64, N), np.nan, cp.float32)
    fn((1,), (128,), (cp.asarray(A), cp.asarray(B), D, np.int32(lbo), np.int32(sbo)))
    want = A.astype(np.float64) @ to_float32(B).astype(np.float64).T
    got = D.get()
    return float("inf") if not np.isfinite(got).all() else float(np.abs(got - want).max())


def pack_weights(W: np.ndarray) -> np.ndarray:
    """W int8 [E, NO, K] -> gemm_w8_bf16's order [E, NO / 64, K / 64, 128 threads, 32 bytes]: thread t (warp w, lane
    l; r = 16 w + l / 4, c = 2 (l % 4)) holds for k16 step j of a 64-column step the bytes of row r at columns c,
    c + 1, c + 8, c + 9, then row r + 8 alike."""
    E, NO, K = W.shape
    t = np.arange(128)
    r, c = 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4)
    rows = np.broadcast_to(r[:, None, None] + np.array([0, 0, 0, 0, 8, 8, 8, 8]), (128, 4, 8))
    cols = 16 * np.arange(4)[None, :, None] + c[:, None, None] + np.array([0, 1, 8, 9, 0, 1, 8, 9])
    blocks = W.reshape(E, NO // 64, 64, K // 64, 64)
    packed = blocks[:, :, rows, :, cols]                       # [128, 4, 8, E, NO / 64, K / 64]
    return np.ascontiguousarray(packed.transpose(3, 4, 5, 0, 1, 2)).reshape(E, NO // 64, K // 64, 128, 32)


# stage 2's kernel and stage 3's two: (threads, weight rows a block, dynamic shared bytes)
GEMM_KERNELS = {"gemm_w8_bf16": (128, 64, 0), "gemm_w8_bf16_p_cvt": (256, 128, 4 * (128 * 64 * 2 + 2 * 128 * 32)),
                "gemm_w8_bf16_p_fast": (256, 128, 4 * (128 * 64 * 2 + 2 * 128 * 32)),
                "gemm_w8_bf16_ss3": (256, 128, 3 * (128 * 64 * 2 + 2 * 128 * 32) + 2 * 2 * 64 * 64 * 2),
                "gemm_w8_bf16_ss4": (256, 128, 4 * (128 * 64 * 2 + 2 * 128 * 32) + 2 * 2 * 64 * 64 * 2),
                "gemm_w8_bf16_rm3": (256, 128, 3 * (128 * 64 * 2 + 128 * 80) + 2 * 2 * 64 * 64 * 2),
                "gemm_w8_a8_s4": (256, 128, 4 * (128 * 64 + 128 * 64)),
                "gemm_w8_a8_s6": (256, 128, 6 * (128 * 64 + 128 * 64))}
INT8_ACTIVATIONS = ("gemm_w8_a8_s4", "gemm_w8_a8_s6")   # int8 X with per-token scales (an extra last argument)
ROW_MAJOR = ("gemm_w8_bf16_rm3",) + INT8_ACTIVATIONS   # weights as the file holds them (no pack_weights)


def launch_gemm(cp, fn, Wp, scale, X, Y, lbo: int, sbo: int, kernel: str = "gemm_w8_bf16",
                token_scale=None) -> None:
    E, M, K = X.shape
    NO = scale.shape[1]
    threads, rows, smem = GEMM_KERNELS[kernel]
    if smem and fn.max_dynamic_shared_size_bytes < smem:     # above 48 KB a kernel must opt in
        fn.max_dynamic_shared_size_bytes = smem
    args = (Wp, scale, X, Y, np.int32(M), np.int32(NO), np.int32(K), np.int32(lbo), np.int32(sbo))
    fn((NO // rows, -(-M // 128), E), (threads,), args + ((token_scale,) if kernel in INT8_ACTIVATIONS else ()),
       shared_mem=smem)


def check_gemm(cp, fn, lbo: int, sbo: int, kernel: str = "gemm_w8_bf16") -> float:
    """Relative error of a GEMM kernel against float64 on 2 experts of 100 tokens (a partial tile), 256 x 640 (10 K
    steps: the stage ring wraps), weights over the whole int8 range."""
    rng = np.random.default_rng(1)
    E, M, NO, K = 2, 100, 256, 640
    W = rng.integers(-128, 128, (E, NO, K), dtype=np.int8)
    scale = rng.uniform(1e-3, 2e-3, (E, NO)).astype(np.float32)
    Y = cp.full((E, M, NO), np.nan, cp.float32)
    weights = W if kernel in ROW_MAJOR else pack_weights(W)
    if kernel in INT8_ACTIVATIONS:
        X = rng.integers(-127, 128, (E, M, K), dtype=np.int8)
        xs = rng.uniform(0.5, 2.0, (E, M)).astype(np.float32)
        launch_gemm(cp, fn, cp.asarray(weights), cp.asarray(scale), cp.asarray(X), Y, lbo, sbo, kernel, cp.asarray(xs))
        x64 = X.astype(np.float64) * xs[:, :, None]
    else:
        X = float32_to_bf16_bits(rng.standard_normal((E, M, K)).astype(np.float32))
        launch_gemm(cp, fn, cp.asarray(weights), cp.asarray(scale), cp.asarray(X), Y, lbo, sbo, kernel)
        x64 = to_float32(X).astype(np.float64)
    want = np.einsum("emk,eok->emo", x64, W.astype(np.float64)) * scale[:, None, :]
    got = Y.get()
    return float("inf") if not np.isfinite(got).all() else float(np.abs(got - want).max() / np.abs(want).max())


def time_gemm(cp, fn, E: int, M: int, NO: int, K: int, lbo: int, sbo: int, kernel: str = "gemm_w8_bf16",
              reps: int = 10) -> float:
    """Median µs of a GEMM kernel on random device operands (the weight bytes taken as already packed)."""
    Wp = cp.random.randint(-127, 128, (E, NO, K), dtype=cp.int8)
    scale = cp.full((E, NO), 1e-3, cp.float32)
    if kernel in INT8_ACTIVATIONS:
        X = cp.random.randint(-127, 128, (E, M, K), dtype=cp.int8)
    else:
        X = cp.random.standard_normal((E, M, K), dtype=cp.float32).astype(cp.float16).view(cp.uint16)  # any 16-bit
    xs = cp.ones((E, M), cp.float32)
    Y = cp.empty((E, M, NO), cp.float32)
    for _ in range(3):
        launch_gemm(cp, fn, Wp, scale, X, Y, lbo, sbo, kernel, xs)
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch_gemm(cp, fn, Wp, scale, X, Y, lbo, sbo, kernel, xs)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    del Wp, X, Y
    cp.get_default_memory_pool().free_all_blocks()
    return float(np.median(times))


# stage 2's timed cases: Mixtral-8x7B's expert products at a 512-token prefill (top-2 of 8: 128 rows an expert)
GEMM_CASES = {"mixtral gate_up": (8, 128, 28672, 4096), "mixtral down": (8, 128, 4096, 14336)}


def gemm_stage(cp, mod, hypothesis: str, kernels: list[str]) -> dict:
    """Check, then time, each of `kernels`; every row is printed as it comes (a kernel that faults ends the process
    with the rows before it on record)."""
    lbo, sbo = HYPOTHESES[hypothesis]
    results = {}
    for kernel in kernels:
        fn = mod.get_function(kernel)
        err = check_gemm(cp, fn, lbo, sbo, kernel)
        print(f"{kernel} ({hypothesis}) against float64: relative error {err:.3g}", flush=True)
        results[kernel] = {"check": err}
        if err > 1e-5:
            continue
        for name, (E, M, NO, K) in GEMM_CASES.items():
            us = time_gemm(cp, fn, E, M, NO, K, lbo, sbo, kernel)
            tflops = 2 * E * M * NO * K / us / 1e6
            results[kernel][name] = {"us": us, "tflops": tflops}
            print(f"{kernel} {name}: E {E} x {M} rows, {NO} x {K}: {us:.1f} µs, {tflops:.1f} TFLOP/s", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-only", action="store_true", help="build the cubin and stop (no GPU needed)")
    ap.add_argument("--kernels", default=",".join(GEMM_KERNELS), help="GEMM kernels to check and time (comma list)")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    if unknown := [k for k in kernels if k not in GEMM_KERNELS]:
        raise SystemExit(f"--kernels: {unknown[0]} is not one of {', '.join(GEMM_KERNELS)}")
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
            B_rand = float32_to_bf16_bits(rng.integers(-8, 9, (N, 16)).astype(np.float32) / 4)
            B_eye = float32_to_bf16_bits(np.eye(N, 16, dtype=np.float32))          # D[:, :16] = A
            for name, (lbo, sbo) in HYPOTHESES.items():
                err = {"random": run_case(cp, fn, A, B_rand, lbo, sbo),
                       "identity": run_case(cp, fn, A, B_eye, lbo, sbo)}
                results[f"N={N} {name}"] = err
                rows.append(f"| {N} | {name} | {err['random']:.3g} | {err['identity']:.3g} | "
                            f"{'holds' if max(err.values()) == 0 else 'no'} |")
        held = [h for h in HYPOTHESES if all(max(results[f"N={N} {h}"].values()) == 0 for N in WIDTHS)]
        print("| N | descriptor | max err, random | max err, B = I | |\n|---|---|---|---|---|\n" + "\n".join(rows),
              flush=True)
        if held:
            results["gemm"] = gemm_stage(cp, mod, held[0], kernels)
        else:
            print("no hypothesis held: no GEMM")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wgmma_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
