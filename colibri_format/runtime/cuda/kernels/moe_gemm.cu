// Prefill-time grouped int8 expert GEMM: tokens grouped per expert by the dispatch kernel, tiled, fp32 SIMT.
//
// Grid (ceil(nout / GEMM_BN), max_tiles), GEMM_THREADS threads. blockIdx.y picks one tile of the dispatch
// tile list (tile_expert, tile_start): up to GEMM_BM consecutive sorted rows that belong to one expert. The
// int8 weight tile is dequantized (with its per-row or per-group scale) into shared memory as fp32; fp32 FMA
// accumulation, each thread owning a 4x4 block of the output tile (two of them for gate and up).
//   moe_gemm_gate_up_*: act[pos, i] = silu(x[perm[pos] / k] . gate[i]) * (x[perm[pos] / k] . up[i])
//   moe_gemm_down_*:    y[perm[pos], h] = w[perm[pos]] * (act[pos] . down[h])
//   *_extras:           the same with gpt-oss's per-expert biases and clamped SwiGLU (common.cuh ExpertExtras)
#include "common.cuh"

#ifndef GEMM_THREADS
#error "GEMM_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef GEMM_BM
#error "GEMM_BM undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef GEMM_BN
#error "GEMM_BN undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef GEMM_BK
#error "GEMM_BK undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef GEMM_PAD
#error "GEMM_PAD undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef TC_THREADS
#error "TC_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(GEMM_THREADS == 256 && GEMM_BM == 64 && GEMM_BN == 64,
              "16 x 16 threads, each owning a 4 x 4 block of the 64 x 64 output tile");
static_assert(GEMM_BK % 16 == 0 && (GEMM_BM * GEMM_BK / 4) % GEMM_THREADS == 0, "A and B tile loads");

template <bool GROUPED, bool GATEUP, bool EXTRAS = false>
__device__ __forceinline__ void moe_gemm(const float* __restrict__ in, const unsigned long long* __restrict__ blobs,
                                         long long off_w, long long off_s, const int* __restrict__ perm,
                                         const int* __restrict__ offsets, const int* __restrict__ tile_expert,
                                         const int* __restrict__ tile_start, const float* __restrict__ pair_w,
                                         float* __restrict__ out, int ncols, int nout, int k, int group,
                                         const ExpertExtras ex = ExpertExtras{}) {
    constexpr int NB = GATEUP ? 2 : 1;
    __shared__ __align__(16) float As[GEMM_BK][GEMM_BM + GEMM_PAD];
    __shared__ __align__(16) float Bs[NB][GEMM_BK][GEMM_BN + GEMM_PAD];
    __shared__ int s_row[GEMM_BM];

    const int e = tile_expert[blockIdx.y];
    if (e < 0) return;
    const int start = tile_start[blockIdx.y];
    const int cnt = min(GEMM_BM, offsets[e + 1] - start);
    const int n0 = blockIdx.x * GEMM_BN;
    const int tid = threadIdx.x;
    const char* blob = reinterpret_cast<const char*>(blobs[e]);
    const signed char* wbase = reinterpret_cast<const signed char*>(blob + off_w);
    const float* sbase = reinterpret_cast<const float*>(blob + off_s);
    const int ngroups = GROUPED ? ncols / group : 1;

    if (tid < GEMM_BM) s_row[tid] = tid < cnt ? (GATEUP ? perm[start + tid] / k : start + tid) : -1;
    __syncthreads();

    const int ty = tid >> 4, tx = tid & 15;
    float acc[NB][4][4];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[b][i][j] = 0.0f;

    for (int k0 = 0; k0 < ncols; k0 += GEMM_BK) {
        // A tile: GEMM_BM rows x GEMM_BK columns, stored transposed
#pragma unroll
        for (int it = 0; it < (GEMM_BM * GEMM_BK / 4) / GEMM_THREADS; ++it) {
            const int i = tid + it * GEMM_THREADS;
            const int m = i / (GEMM_BK / 4), kq = (i % (GEMM_BK / 4)) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            const int r = s_row[m];
            if (r >= 0 && k0 + kq < ncols) v = __ldg(reinterpret_cast<const float4*>(in + (size_t)r * ncols + k0 + kq));
            As[kq][m] = v.x; As[kq + 1][m] = v.y; As[kq + 2][m] = v.z; As[kq + 3][m] = v.w;
        }
        // B tiles: GEMM_BN weight rows x GEMM_BK int8 columns, dequantized, stored transposed
        for (int i = tid; i < NB * GEMM_BN * (GEMM_BK / 16); i += GEMM_THREADS) {
            const int b = i / (GEMM_BN * (GEMM_BK / 16));
            const int rr = (i / (GEMM_BK / 16)) % GEMM_BN, hq = (i % (GEMM_BK / 16)) * 16;
            const int o = n0 + rr;
            float f[16];
            if (o < nout && k0 + hq < ncols) {
                const int wr = (b == 1) ? nout + o : o;
                const int4 q = __ldg(reinterpret_cast<const int4*>(wbase + (size_t)wr * ncols + k0 + hq));
                i8x16_to_f32(q, f);
                const float s = GROUPED ? __ldg(sbase + (size_t)wr * ngroups + (k0 + hq) / group) : __ldg(sbase + wr);
#pragma unroll
                for (int u = 0; u < 16; ++u) f[u] *= s;
            } else {
#pragma unroll
                for (int u = 0; u < 16; ++u) f[u] = 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) Bs[b][hq + u][rr] = f[u];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            const float4 a = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float4 bb = *reinterpret_cast<const float4*>(&Bs[b][kk][tx * 4]);
                const float bv[4] = {bb.x, bb.y, bb.z, bb.w};
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[b][i][j] = fmaf(av[i], bv[j], acc[b][i][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = ty * 4 + i;
        if (m >= cnt) continue;
        const int pos = start + m;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int o = n0 + tx * 4 + j;
            if (o >= nout) continue;
            if (GATEUP) {
                out[(size_t)pos * nout + o] = expert_activation<EXTRAS>(acc[0][i][j], acc[NB - 1][i][j], ex, e, nout, o);
            } else {
                const int pair = perm[pos];
                out[(size_t)pair * nout + o] = __ldg(pair_w + pair) * expert_down_out<EXTRAS>(acc[0][i][j], ex, e, nout, o);
            }
        }
    }
}

#define GEMM_GATE_UP_KERNEL(NAME, GROUPED)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                               \
        NAME(const float* x, const unsigned long long* blobs, long long off_w, long long off_s, const int* perm, \
             const int* offsets, const int* tile_expert, const int* tile_start, float* act, int H, int I,     \
             int k, int group) {                                                                             \
        moe_gemm<GROUPED, true>(x, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, nullptr, act, \
                                H, I, k, group);                                                             \
    }
#define GEMM_DOWN_KERNEL(NAME, GROUPED)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                               \
        NAME(const float* act, const unsigned long long* blobs, long long off_w, long long off_s,            \
             const int* perm, const int* offsets, const int* tile_expert, const int* tile_start,             \
             const float* pair_w, float* y, int H, int I, int group) {                                       \
        moe_gemm<GROUPED, false>(act, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, y, \
                                 I, H, 1, group);                                                            \
    }

GEMM_GATE_UP_KERNEL(moe_gemm_gate_up_r, false)
GEMM_GATE_UP_KERNEL(moe_gemm_gate_up_g, true)
GEMM_DOWN_KERNEL(moe_gemm_down_r, false)
GEMM_DOWN_KERNEL(moe_gemm_down_g, true)

// gpt-oss's experts (suffix _extras): the same tiles with ExpertExtras (common.cuh); bias: gate_up [E, 2I] /
// down [E, H] f32 or null; alpha, limit (+inf: no clamp), up_offset of the clamped SwiGLU.
#define GEMM_GATE_UP_EXTRAS_KERNEL(NAME, GROUPED)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                               \
        NAME(const float* x, const unsigned long long* blobs, long long off_w, long long off_s, const int* perm, \
             const int* offsets, const int* tile_expert, const int* tile_start, float* act, int H, int I,     \
             int k, int group, const float* bias, float alpha, float limit, float up_offset) {               \
        moe_gemm<GROUPED, true, true>(x, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, nullptr, \
                                      act, H, I, k, group, ExpertExtras{bias, alpha, limit, up_offset});     \
    }
#define GEMM_DOWN_EXTRAS_KERNEL(NAME, GROUPED)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                                               \
        NAME(const float* act, const unsigned long long* blobs, long long off_w, long long off_s,            \
             const int* perm, const int* offsets, const int* tile_expert, const int* tile_start,             \
             const float* pair_w, float* y, int H, int I, int group, const float* bias) {                    \
        moe_gemm<GROUPED, false, true>(act, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, \
                                       y, I, H, 1, group, ExpertExtras{bias, 1.0f, 0.0f, 0.0f});             \
    }

GEMM_GATE_UP_EXTRAS_KERNEL(moe_gemm_gate_up_r_extras, false)
GEMM_GATE_UP_EXTRAS_KERNEL(moe_gemm_gate_up_g_extras, true)
GEMM_DOWN_EXTRAS_KERNEL(moe_gemm_down_r_extras, false)
GEMM_DOWN_EXTRAS_KERNEL(moe_gemm_down_g_extras, true)

// ---- tensor-core variant (per-row scales) -----------------------------------------------------------------------
// Same tiles and outputs as above, on the tensor cores: mma.sync m16n8k16 with bf16 operands and fp32
// accumulation. int8 weights are exact in bf16; each activation is split into hi = bf16(x) and lo = bf16(x - hi),
// two products per weight, so inputs keep about 16 significant bits (relative error near 1e-5 instead of bf16's
// 4e-3). The per-row scale is applied in the epilogue. 4 warps, each owning a 32 x 32 block of the 64 x 64 tile.
static_assert(TC_THREADS == 128, "4 warps, each owning a 32 x 32 block of the 64 x 64 tile");
#define TC_LD (GEMM_BK + 8)  // shared row stride in bf16 elements: conflict-free fragment loads

__device__ __forceinline__ unsigned int pack_bf16x2(float lo_col, float hi_col) {
    return (unsigned int)TBF16::from_f32(lo_col) | ((unsigned int)TBF16::from_f32(hi_col) << 16);
}

__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <bool GATEUP, bool EXTRAS = false>
__device__ __forceinline__ void moe_gemm_tc(const float* __restrict__ in, const unsigned long long* __restrict__ blobs,
                                            long long off_w, long long off_s, const int* __restrict__ perm,
                                            const int* __restrict__ offsets, const int* __restrict__ tile_expert,
                                            const int* __restrict__ tile_start, const float* __restrict__ pair_w,
                                            float* __restrict__ out, int ncols, int nout, int k,
                                            const ExpertExtras ex = ExpertExtras{}) {
    constexpr int NB = GATEUP ? 2 : 1;
    __shared__ __align__(16) u16 As_hi[GEMM_BM][TC_LD];
    __shared__ __align__(16) u16 As_lo[GEMM_BM][TC_LD];
    __shared__ __align__(16) u16 Bs[NB][GEMM_BN][TC_LD];
    __shared__ int s_row[GEMM_BM];

    const int e = tile_expert[blockIdx.y];
    if (e < 0) return;
    const int start = tile_start[blockIdx.y];
    const int cnt = min(GEMM_BM, offsets[e + 1] - start);
    const int n0 = blockIdx.x * GEMM_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    const char* blob = reinterpret_cast<const char*>(blobs[e]);
    const signed char* wbase = reinterpret_cast<const signed char*>(blob + off_w);
    const float* sbase = reinterpret_cast<const float*>(blob + off_s);

    if (tid < GEMM_BM) s_row[tid] = tid < cnt ? (GATEUP ? perm[start + tid] / k : start + tid) : -1;
    __syncthreads();

    float acc[NB][2][4][4];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[b][mi][ni][r] = 0.0f;

    for (int k0 = 0; k0 < ncols; k0 += GEMM_BK) {
        // A: 64 rows x 32 fp32 -> hi/lo bf16 pairs
#pragma unroll
        for (int it = 0; it < (GEMM_BM * GEMM_BK / 4) / TC_THREADS; ++it) {
            const int i = tid + it * TC_THREADS;
            const int m = i / (GEMM_BK / 4), kq = (i % (GEMM_BK / 4)) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            const int r = s_row[m];
            if (r >= 0 && k0 + kq < ncols) v = __ldg(reinterpret_cast<const float4*>(in + (size_t)r * ncols + k0 + kq));
            const float xs[4] = {v.x, v.y, v.z, v.w};
            float hi[4], lo[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                hi[u] = TBF16::to_f32(TBF16::from_f32(xs[u]));
                lo[u] = xs[u] - hi[u];
            }
            unsigned int* ph = reinterpret_cast<unsigned int*>(&As_hi[m][kq]);
            unsigned int* pl = reinterpret_cast<unsigned int*>(&As_lo[m][kq]);
            ph[0] = pack_bf16x2(hi[0], hi[1]); ph[1] = pack_bf16x2(hi[2], hi[3]);
            pl[0] = pack_bf16x2(lo[0], lo[1]); pl[1] = pack_bf16x2(lo[2], lo[3]);
        }
        // B: NB x 64 weight rows x 32 int8 -> bf16 (exact)
#pragma unroll
        for (int it = 0; it < (NB * GEMM_BN * (GEMM_BK / 16) + TC_THREADS - 1) / TC_THREADS; ++it) {
            const int i = tid + it * TC_THREADS;
            if (i < NB * GEMM_BN * (GEMM_BK / 16)) {
                const int b = i / (GEMM_BN * (GEMM_BK / 16));
                const int rr = (i / (GEMM_BK / 16)) % GEMM_BN, hq = (i % (GEMM_BK / 16)) * 16;
                const int o = n0 + rr;
                float f[16];
                if (o < nout && k0 + hq < ncols) {
                    const int wr = (b == 1) ? nout + o : o;
                    i8x16_to_f32(__ldg(reinterpret_cast<const int4*>(wbase + (size_t)wr * ncols + k0 + hq)), f);
                } else {
#pragma unroll
                    for (int u = 0; u < 16; ++u) f[u] = 0.0f;
                }
                uint4 w0, w1;
                w0.x = pack_bf16x2(f[0], f[1]); w0.y = pack_bf16x2(f[2], f[3]);
                w0.z = pack_bf16x2(f[4], f[5]); w0.w = pack_bf16x2(f[6], f[7]);
                w1.x = pack_bf16x2(f[8], f[9]); w1.y = pack_bf16x2(f[10], f[11]);
                w1.z = pack_bf16x2(f[12], f[13]); w1.w = pack_bf16x2(f[14], f[15]);
                *reinterpret_cast<uint4*>(&Bs[b][rr][hq]) = w0;
                *reinterpret_cast<uint4*>(&Bs[b][rr][hq + 8]) = w1;
            }
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < GEMM_BK; ks += 16) {
            unsigned int ah[2][4], al[2][4], bf[NB][4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r0 = wm + mi * 16 + g;
                ah[mi][0] = *reinterpret_cast<const unsigned int*>(&As_hi[r0][ks + 2 * t]);
                ah[mi][1] = *reinterpret_cast<const unsigned int*>(&As_hi[r0 + 8][ks + 2 * t]);
                ah[mi][2] = *reinterpret_cast<const unsigned int*>(&As_hi[r0][ks + 2 * t + 8]);
                ah[mi][3] = *reinterpret_cast<const unsigned int*>(&As_hi[r0 + 8][ks + 2 * t + 8]);
                al[mi][0] = *reinterpret_cast<const unsigned int*>(&As_lo[r0][ks + 2 * t]);
                al[mi][1] = *reinterpret_cast<const unsigned int*>(&As_lo[r0 + 8][ks + 2 * t]);
                al[mi][2] = *reinterpret_cast<const unsigned int*>(&As_lo[r0][ks + 2 * t + 8]);
                al[mi][3] = *reinterpret_cast<const unsigned int*>(&As_lo[r0 + 8][ks + 2 * t + 8]);
            }
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) {
                    const int c0 = wn + ni * 8 + g;
                    bf[b][ni][0] = *reinterpret_cast<const unsigned int*>(&Bs[b][c0][ks + 2 * t]);
                    bf[b][ni][1] = *reinterpret_cast<const unsigned int*>(&Bs[b][c0][ks + 2 * t + 8]);
                }
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni) {
                        mma_bf16_16816(acc[b][mi][ni], ah[mi], bf[b][ni]);
                        mma_bf16_16816(acc[b][mi][ni], al[mi], bf[b][ni]);
                    }
        }
        __syncthreads();
    }
    // epilogue: c0,c1 -> (row g, cols 2t, 2t+1); c2,c3 -> (row g + 8, same cols)
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = wm + mi * 16 + g + half * 8;
            if (m >= cnt) continue;
            const int pos = start + m;
            const int pair = GATEUP ? 0 : perm[pos];
            const float pw = GATEUP ? 1.0f : __ldg(pair_w + pair);
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int o = n0 + wn + ni * 8 + 2 * t + c;
                    if (o >= nout) continue;
                    const int r = half * 2 + c;
                    if (GATEUP) {
                        const float gv = acc[0][mi][ni][r] * __ldg(sbase + o);
                        const float uv = acc[NB - 1][mi][ni][r] * __ldg(sbase + nout + o);
                        out[(size_t)pos * nout + o] = expert_activation<EXTRAS>(gv, uv, ex, e, nout, o);
                    } else {
                        out[(size_t)pair * nout + o] =
                            EXTRAS ? pw * expert_down_out<EXTRAS>(acc[0][mi][ni][r] * __ldg(sbase + o), ex, e, nout, o)
                                   : pw * acc[0][mi][ni][r] * __ldg(sbase + o);   // the plain kernel's rounding
                    }
                }
        }
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    moe_gemm_tc_gate_up_r(const float* x, const unsigned long long* blobs, long long off_w, long long off_s,
                          const int* perm, const int* offsets, const int* tile_expert, const int* tile_start,
                          float* act, int H, int I, int k) {
    moe_gemm_tc<true>(x, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, nullptr, act, H, I, k);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    moe_gemm_tc_down_r(const float* act, const unsigned long long* blobs, long long off_w, long long off_s,
                       const int* perm, const int* offsets, const int* tile_expert, const int* tile_start,
                       const float* pair_w, float* y, int H, int I) {
    moe_gemm_tc<false>(act, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, y, I, H, 1);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    moe_gemm_tc_gate_up_r_extras(const float* x, const unsigned long long* blobs, long long off_w, long long off_s,
                                 const int* perm, const int* offsets, const int* tile_expert, const int* tile_start,
                                 float* act, int H, int I, int k, const float* bias, float alpha, float limit,
                                 float up_offset) {
    moe_gemm_tc<true, true>(x, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, nullptr, act, H, I, k,
                            ExpertExtras{bias, alpha, limit, up_offset});
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    moe_gemm_tc_down_r_extras(const float* act, const unsigned long long* blobs, long long off_w, long long off_s,
                              const int* perm, const int* offsets, const int* tile_expert, const int* tile_start,
                              const float* pair_w, float* y, int H, int I, const float* bias) {
    moe_gemm_tc<false, true>(act, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, y, I, H, 1,
                             ExpertExtras{bias, 1.0f, 0.0f, 0.0f});
}
