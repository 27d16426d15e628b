// The routed experts of a small decode step (T <= MOE_SMALL_MAX_TOKENS tokens) in two launches, with no dispatch
// and no combine kernel: the pairs are few, so work items are indexed straight by the router's ids [T, k].
//
// Weights and fill on read as in moe_gemv.cu: blobs[e] is expert e's blob, off_w / off_s the byte offsets of the
// int8 matrix and its float32 scales (dequantized weight = q[r, c] * scale[r, c / group]; group = the row length
// for per-row scales); fills[e] != 0 is the slot the expert cache admitted e into, and every int8 chunk and scale
// read for e is stored there at the same offset. Only the first pair that routes to e stores (its items cover
// every row), so a slot is written once even when several tokens pick the same expert.
//
//   moe_small_gate_up_*: act[p, i] = silu(x[p / k] . gate_e[i]) * (x[p / k] . up_e[i]), e = ids[p], for every
//                        pair p = t * k + j (pair order); a warp item is (pair, the plan's output rows): it
//                        reads those rows of gate and of up. An id outside [0, E) gives a zero act row.
//   moe_small_down_*:    y[t, h] = residual[t, h] (or 0 when null) + alpha * sum_j w[t, j] * (down_{e_j}[h] .
//                        act[t * k + j]); a warp item is (token, the plan's output rows) and loops over the
//                        token's experts a plan's number at a time, their rows' loads issued together. Each lane
//                        sums its chunks in a fixed order (expert, then chunk) and one butterfly adds the lanes:
//                        the result never depends on scheduling (no atomics). Ids outside [0, E) add nothing. y
//                        may alias residual (each element is read and written by the same lane).
//
// A lane loads the plan's number of 16-byte chunks of each of the item's rows before it uses any (several loads in
// flight, as moe_gemv.cu's wide kernels), then dots them with the fp32 input; accumulation is fp32.
// Suffix: _p<plan> (the plan's constants, limits.py SMALL_*_PLANS) and _r (per-row scales) | _g (group scales).
#include "common.cuh"

#ifndef SMALL_THREADS
#error "SMALL_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG0_ROWS
#error "SG0_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG0_CHUNKS
#error "SG0_CHUNKS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG0_BLOCKS_R
#error "SG0_BLOCKS_R undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG0_BLOCKS_G
#error "SG0_BLOCKS_G undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG1_ROWS
#error "SG1_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG1_CHUNKS
#error "SG1_CHUNKS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG1_BLOCKS_R
#error "SG1_BLOCKS_R undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SG1_BLOCKS_G
#error "SG1_BLOCKS_G undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD0_ROWS
#error "SD0_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD0_EXPERTS
#error "SD0_EXPERTS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD0_CHUNKS
#error "SD0_CHUNKS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD0_BLOCKS_R
#error "SD0_BLOCKS_R undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD0_BLOCKS_G
#error "SD0_BLOCKS_G undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD1_ROWS
#error "SD1_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD1_EXPERTS
#error "SD1_EXPERTS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD1_CHUNKS
#error "SD1_CHUNKS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD1_BLOCKS_R
#error "SD1_BLOCKS_R undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD1_BLOCKS_G
#error "SD1_BLOCKS_G undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD2_ROWS
#error "SD2_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD2_EXPERTS
#error "SD2_EXPERTS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD2_CHUNKS
#error "SD2_CHUNKS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD2_BLOCKS_R
#error "SD2_BLOCKS_R undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef SD2_BLOCKS_G
#error "SD2_BLOCKS_G undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif

// Whether `pair` is the first pair of ids[0..pair] routed to expert e (the one that fills e's slot).
__device__ __forceinline__ bool first_pair_of(const int* __restrict__ ids, int pair, int e) {
    bool seen = false;
    for (int p = threadIdx.x & 31; p < pair; p += 32) seen |= __ldg(ids + p) == e;
    return !__any_sync(COLIBRI_FULL_MASK, seen);
}

// Dot product of 16 int8 weights (one chunk) with 16 floats at x (16-byte aligned), in two halves of 8 so that
// few input registers are live at once.
__device__ __forceinline__ float dot_chunk(const int4& w, const float* __restrict__ x) {
    float sum = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float4* p = reinterpret_cast<const float4*>(x + (h << 3));
        const float4 a = __ldg(p), b = __ldg(p + 1);
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float wf[8];
        i8x4_to_f32((unsigned int)(h ? w.z : w.x), wf);
        i8x4_to_f32((unsigned int)(h ? w.w : w.y), wf + 4);
#pragma unroll
        for (int u = 0; u < 8; ++u) sum = fmaf(wf[u], xv[u], sum);
    }
    return sum;
}

// One expert's blob and the slot its reads are copied into (null: no copy); the matrix and its scales are at
// byte offsets off_w / off_s of both (two pointers an expert keep the down kernel's registers for its loads).
struct ExpertBlob {
    const char* blob;
    char* slot;
};

__device__ __forceinline__ ExpertBlob expert_blob(const unsigned long long* __restrict__ blobs,
                                                  const unsigned long long* __restrict__ fills, int e, bool fill) {
    return ExpertBlob{reinterpret_cast<const char*>(blobs[e]),
                      fill && fills ? reinterpret_cast<char*>(fills[e]) : nullptr};
}

// Loads chunk cc of `row` of the int8 matrix at off_w (and copies it into the slot when there is one).
__device__ __forceinline__ int4 load_chunk(const ExpertBlob& b, long long off_w, int row, int nchunk, int cc) {
    const size_t at = (size_t)row * nchunk + cc;
    const int4 v = __ldg(reinterpret_cast<const int4*>(b.blob + off_w) + at);
    if (b.slot) reinterpret_cast<int4*>(b.slot + off_w)[at] = v;
    return v;
}

// The scale of chunk cc of `row` (group scales at off_s; copied into the slot when there is one).
__device__ __forceinline__ float group_scale(const ExpertBlob& b, long long off_s, int row, int ngroups, int group,
                                             int cc) {
    const size_t at = (size_t)row * ngroups + (cc << 4) / group;
    const float s = __ldg(reinterpret_cast<const float*>(b.blob + off_s) + at);
    if (b.slot) reinterpret_cast<float*>(b.slot + off_s)[at] = s;
    return s;
}

// The scale of `row` (per-row scales at off_s; lane 0 copies it into the slot when there is one).
__device__ __forceinline__ float row_scale(const ExpertBlob& b, long long off_s, int row) {
    const float s = __ldg(reinterpret_cast<const float*>(b.blob + off_s) + row);
    if (b.slot && (threadIdx.x & 31) == 0) reinterpret_cast<float*>(b.slot + off_s)[row] = s;
    return s;
}

// ---- gate/up ----------------------------------------------------------------------------------------------------
template <int ROWS, int CHUNKS, bool GROUPED>
__device__ __forceinline__ void small_gate_up(const float* __restrict__ x, const int* __restrict__ ids,
                                              const unsigned long long* __restrict__ blobs,
                                              const unsigned long long* __restrict__ fills, long long off_w,
                                              long long off_s, float* __restrict__ act, int T, int k, int E, int H,
                                              int I, int group) {
    constexpr int R = 2 * ROWS;  // weight rows an item reads: ROWS of gate, then the same ROWS of up
    const int lane = threadIdx.x & 31;
    const int n_rg = (I + ROWS - 1) / ROWS;
    const int P = T * k;
    const int total = P * n_rg;
    const int nchunk = H >> 4;
    const int ngroups = H / group;
    const int warps_total = (gridDim.x * blockDim.x) >> 5;

    for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total; item += warps_total) {
        // row-group-major: the pairs' items for the same rows run side by side, so an expert that several tokens
        // picked is read from memory once and from L2 by the others
        const int pair = item % P;
        const int o0 = (item / P) * ROWS;
        const int ob = min(o0, I - ROWS);  // the last item is shifted down to stay inside; it writes from o0 on
        const int e = __ldg(ids + pair);
        float* out = act + (size_t)pair * I + ob;
        if (e < 0 || e >= E) {
            if (lane < ROWS && ob + lane >= o0) out[lane] = 0.0f;
            continue;
        }
        const ExpertBlob m = expert_blob(blobs, fills, e, fills && first_pair_of(ids, pair, e));
        const float* xrow = x + (size_t)(pair / k) * H;
        int rows[R];
#pragma unroll
        for (int q = 0; q < R; ++q) rows[q] = ob + (q % ROWS) + (q >= ROWS ? I : 0);
        float acc[R];
#pragma unroll
        for (int q = 0; q < R; ++q) acc[q] = 0.0f;

#pragma unroll 1
        for (int cb = 0; cb < nchunk; cb += 32 * CHUNKS) {
            int4 wv[CHUNKS][R];
#pragma unroll
            for (int f = 0; f < CHUNKS; ++f) {
                const int cc = cb + 32 * f + lane;
                if (cc < nchunk) {
#pragma unroll
                    for (int q = 0; q < R; ++q) wv[f][q] = load_chunk(m, off_w, rows[q], nchunk, cc);
                }
            }
#pragma unroll
            for (int f = 0; f < CHUNKS; ++f) {
                const int cc = cb + 32 * f + lane;
                if (cc < nchunk) {
#pragma unroll
                    for (int q = 0; q < R; ++q) {
                        const float part = dot_chunk(wv[f][q], xrow + (cc << 4));
                        acc[q] = GROUPED ? fmaf(part, group_scale(m, off_s, rows[q], ngroups, group, cc), acc[q])
                                         : acc[q] + part;
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < ROWS; ++q) {
            const float gate = warp_sum(acc[q]) * (GROUPED ? 1.0f : row_scale(m, off_s, rows[q]));
            const float up = warp_sum(acc[q + ROWS]) * (GROUPED ? 1.0f : row_scale(m, off_s, rows[q + ROWS]));
            if (lane == 0 && ob + q >= o0) out[q] = silu_f32(gate) * up;
        }
    }
}

// ---- down + combine ----------------------------------------------------------------------------------------------
template <int ROWS, int EXPERTS, int CHUNKS, bool GROUPED>
__device__ __forceinline__ void small_down(const float* __restrict__ act, const int* __restrict__ ids,
                                           const float* __restrict__ weights,
                                           const unsigned long long* __restrict__ blobs,
                                           const unsigned long long* __restrict__ fills, long long off_w,
                                           long long off_s, const float* residual, float* y, int T, int k, int E,
                                           int H, int I, int group, float alpha) {
    const int lane = threadIdx.x & 31;
    const int n_rg = (H + ROWS - 1) / ROWS;
    const int total = T * n_rg;
    const int nchunk = I >> 4;
    const int ngroups = I / group;
    const int warps_total = (gridDim.x * blockDim.x) >> 5;

    for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total; item += warps_total) {
        const int t = item % T;  // row-group-major, as in small_gate_up (tokens sharing an expert meet in L2)
        const int o0 = (item / T) * ROWS;
        const int ob = min(o0, H - ROWS);
        float acc[ROWS];
#pragma unroll
        for (int q = 0; q < ROWS; ++q) acc[q] = 0.0f;

#pragma unroll 1
        for (int j0 = 0; j0 < k; j0 += EXPERTS) {
            // the batch's experts: u is live when slot j0 + u exists and routes to an expert of this layer
            ExpertBlob m[EXPERTS];
            bool live[EXPERTS];
            float coef[EXPERTS][ROWS];  // routing weight, times the row scale for per-row scales
#pragma unroll
            for (int u = 0; u < EXPERTS; ++u) {
                const int pair = t * k + j0 + u;
                const int e = j0 + u < k ? __ldg(ids + pair) : -1;
                live[u] = e >= 0 && e < E;
                m[u] = expert_blob(blobs, fills, live[u] ? e : 0, live[u] && fills && first_pair_of(ids, pair, e));
                const float w = live[u] ? __ldg(weights + pair) : 0.0f;
#pragma unroll
                for (int q = 0; q < ROWS; ++q)
                    coef[u][q] = live[u] && !GROUPED ? w * row_scale(m[u], off_s, ob + q) : w;
            }
#pragma unroll 1
            for (int cb = 0; cb < nchunk; cb += 32 * CHUNKS) {
                int4 wv[EXPERTS][CHUNKS][ROWS];
#pragma unroll
                for (int u = 0; u < EXPERTS; ++u)
#pragma unroll
                    for (int f = 0; f < CHUNKS; ++f) {
                        const int cc = cb + 32 * f + lane;
                        if (live[u] && cc < nchunk) {
#pragma unroll
                            for (int q = 0; q < ROWS; ++q) wv[u][f][q] = load_chunk(m[u], off_w, ob + q, nchunk, cc);
                        }
                    }
#pragma unroll
                for (int u = 0; u < EXPERTS; ++u)
#pragma unroll
                    for (int f = 0; f < CHUNKS; ++f) {
                        const int cc = cb + 32 * f + lane;
                        if (live[u] && cc < nchunk) {
                            const float* arow = act + (size_t)(t * k + j0 + u) * I + (cc << 4);
#pragma unroll
                            for (int q = 0; q < ROWS; ++q) {
                                const float c =
                                    GROUPED ? coef[u][q] * group_scale(m[u], off_s, ob + q, ngroups, group, cc)
                                            : coef[u][q];
                                acc[q] = fmaf(dot_chunk(wv[u][f][q], arow), c, acc[q]);
                            }
                        }
                    }
            }
        }
#pragma unroll
        for (int q = 0; q < ROWS; ++q) {
            const float sum = warp_sum(acc[q]);
            if (lane == 0 && ob + q >= o0) {
                const size_t at = (size_t)t * H + ob + q;
                y[at] = residual ? fmaf(alpha, sum, residual[at]) : alpha * sum;
            }
        }
    }
}

#define SMALL_GATE_UP_KERNEL(NAME, ROWS, CHUNKS, GROUPED, MIN_BLOCKS)                                                  \
    extern "C" __global__ void __launch_bounds__(SMALL_THREADS, MIN_BLOCKS)                                            \
        NAME(const float* x, const int* ids, const unsigned long long* blobs, const unsigned long long* fills,         \
             long long off_w, long long off_s, float* act, int T, int k, int E, int H, int I, int group) {             \
        small_gate_up<ROWS, CHUNKS, GROUPED>(x, ids, blobs, fills, off_w, off_s, act, T, k, E, H, I, group);           \
    }
#define SMALL_DOWN_KERNEL(NAME, ROWS, EXPERTS, CHUNKS, GROUPED, MIN_BLOCKS)                                            \
    extern "C" __global__ void __launch_bounds__(SMALL_THREADS, MIN_BLOCKS)                                            \
        NAME(const float* act, const int* ids, const float* weights, const unsigned long long* blobs,                  \
             const unsigned long long* fills, long long off_w, long long off_s, const float* residual, float* y,       \
             int T, int k, int E, int H, int I, int group, float alpha) {                                              \
        small_down<ROWS, EXPERTS, CHUNKS, GROUPED>(act, ids, weights, blobs, fills, off_w, off_s, residual, y, T,      \
                                                   k, E, H, I, group, alpha);                                          \
    }

SMALL_GATE_UP_KERNEL(moe_small_gate_up_p0_r, SG0_ROWS, SG0_CHUNKS, false, SG0_BLOCKS_R)
SMALL_GATE_UP_KERNEL(moe_small_gate_up_p0_g, SG0_ROWS, SG0_CHUNKS, true, SG0_BLOCKS_G)
SMALL_GATE_UP_KERNEL(moe_small_gate_up_p1_r, SG1_ROWS, SG1_CHUNKS, false, SG1_BLOCKS_R)
SMALL_GATE_UP_KERNEL(moe_small_gate_up_p1_g, SG1_ROWS, SG1_CHUNKS, true, SG1_BLOCKS_G)
SMALL_DOWN_KERNEL(moe_small_down_p0_r, SD0_ROWS, SD0_EXPERTS, SD0_CHUNKS, false, SD0_BLOCKS_R)
SMALL_DOWN_KERNEL(moe_small_down_p0_g, SD0_ROWS, SD0_EXPERTS, SD0_CHUNKS, true, SD0_BLOCKS_G)
SMALL_DOWN_KERNEL(moe_small_down_p1_r, SD1_ROWS, SD1_EXPERTS, SD1_CHUNKS, false, SD1_BLOCKS_R)
SMALL_DOWN_KERNEL(moe_small_down_p1_g, SD1_ROWS, SD1_EXPERTS, SD1_CHUNKS, true, SD1_BLOCKS_G)
SMALL_DOWN_KERNEL(moe_small_down_p2_r, SD2_ROWS, SD2_EXPERTS, SD2_CHUNKS, false, SD2_BLOCKS_R)
SMALL_DOWN_KERNEL(moe_small_down_p2_g, SD2_ROWS, SD2_EXPERTS, SD2_CHUNKS, true, SD2_BLOCKS_G)
