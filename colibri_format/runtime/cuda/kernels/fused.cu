// Fused decode-layer kernels: fewer dependent launches per layer at small batch (all math fp32).
//
//   add_rmsnorm_<w>:          h = h + alpha * b; x = rmsnorm(h) * w          (residual add + the next norm)
//   qkv_rope_kv_<cache>_<w>:  from the fused q|k|v projection row: q/k norm (full or per head), clip,
//                             rotate_half RoPE of q and k, q to its own buffer, k and v into the KV cache
//
// One block per row; the per-row results equal those of the unfused kernels (rmsnorm, residual_add, rope,
// kv_append) up to fp32 summation order. A MoE layer's decode pass runs add_rmsnorm fused into its router instead
// (router.cu's add_rmsnorm_route, which writes the same h and x).
#include "common.cuh"

#ifndef FUSED_THREADS
#error "FUSED_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef NORM_VECS
#error "NORM_VECS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef QKV_THREADS
#error "QKV_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
// FUSED_THREADS: add_rmsnorm blocks (block_sum: at most 32 warps); QKV_THREADS: qkv_rope_kv, one warp a head
static_assert(FUSED_THREADS % 32 == 0 && FUSED_THREADS <= 1024 && QKV_THREADS % 32 == 0, "whole warps");

// ------------------------------------------------------------------------------------------------ add + RMSNorm
// h [R, D] f32 is updated in place (h += alpha * b); x [R, D] f32 = h * rsqrt(mean(h^2) + eps) * w.
// Each thread re-reads only the elements it wrote itself, so h may be read and written by the same launch.
template <typename TW>
__device__ __forceinline__ void add_rmsnorm_impl(float* h, const float* __restrict__ b,
                                                 const typename TW::storage* __restrict__ w, float* __restrict__ x,
                                                 int D, float alpha, float eps) {
    __shared__ float s_red[32];
    float* hr = h + (size_t)blockIdx.x * D;
    const float* br = b + (size_t)blockIdx.x * D;
    float* xr = x + (size_t)blockIdx.x * D;
    if (row_fits_registers<NORM_VECS>(D) && vec4_aligned<TF32>(hr) && vec4_aligned<TF32>(br) &&
        vec4_aligned<TF32>(xr) && vec4_aligned<TW>(w)) {
        float v[NORM_VECS][4], bv[NORM_VECS][4], g[NORM_VECS][4];
        load_row_registers<TF32, NORM_VECS>(hr, v, D);      // every load before any store: h may alias b
        load_row_registers<TF32, NORM_VECS>(br, bv, D);
        load_row_registers<TW, NORM_VECS>(w, g, D);
#pragma unroll
        for (int u = 0; u < NORM_VECS; ++u)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[u][j] = fmaf(alpha, bv[u][j], v[u][j]);
        store_row_registers<TF32, NORM_VECS>(hr, v, D);
        norm_row_registers<TF32, NORM_VECS>(v, g, xr, D, eps, 0.0f, s_red);
        return;
    }
    float ss = 0.0f;
    constexpr int U = 8;   // elements a thread loads before it stores any (h may alias b: the compiler cannot hoist)
    for (int i0 = threadIdx.x; i0 < D; i0 += U * blockDim.x) {
        float hv[U], bv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * blockDim.x;
            hv[u] = i < D ? hr[i] : 0.0f;
            bv[u] = i < D ? br[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < D) {
                const float v = fmaf(alpha, bv[u], hv[u]);
                hr[i] = v;
                ss = fmaf(v, v, ss);
            }
        }
    }
    const float inv = rsqrtf(block_sum(ss, s_red) / (float)D + eps);
#pragma unroll 8
    for (int i = threadIdx.x; i < D; i += blockDim.x) xr[i] = hr[i] * inv * TW::to_f32(w[i]);
}

#define ADD_RMSNORM_KERNEL(SUF, TW)                                                                         \
    extern "C" __global__ void __launch_bounds__(FUSED_THREADS)                                            \
        add_rmsnorm_##SUF(float* h, const float* b, const TW::storage* w, float* x, int D, float alpha,      \
                          float eps) {                                                                      \
        add_rmsnorm_impl<TW>(h, b, w, x, D, alpha, eps);                                                   \
    }
ADD_RMSNORM_KERNEL(f32, TF32)
ADD_RMSNORM_KERNEL(f16, TF16)
ADD_RMSNORM_KERNEL(bf16, TBF16)

// ------------------------------------------------------------------------------------------------ q/k/v epilogue
// This thread's shares of the sums of squares of a row's q (nq values) and k (the nk after them) for the full q/k
// norm. Rows that fit NORM_VECS float4s a thread (aligned) are loaded whole before the first add: one memory latency
// (a strided loop of dependent adds paid one a step: OLMoE's 2048 + 2048 values took ~9 µs a call on the H200).
__device__ __forceinline__ void full_norm_sums(const float* __restrict__ row, int nq, int nk, float& sq, float& sk) {
    if (row_fits_registers<NORM_VECS>(nq) && row_fits_registers<NORM_VECS>(nk) && vec4_aligned<TF32>(row) &&
        vec4_aligned<TF32>(row + nq)) {
        float q[NORM_VECS][4], k[NORM_VECS][4];
        load_row_registers<TF32, NORM_VECS>(row, q, nq);
        load_row_registers<TF32, NORM_VECS>(row + nq, k, nk);
        sq = sum_squares_registers<NORM_VECS>(q);
        sk = sum_squares_registers<NORM_VECS>(k);
        return;
    }
    sq = sk = 0.0f;
    for (int i = threadIdx.x; i < nq; i += blockDim.x) sq = fmaf(row[i], row[i], sq);
    for (int i = threadIdx.x; i < nk; i += blockDim.x) sk = fmaf(row[nq + i], row[nq + i], sk);
}

// qkv [N, (nh + 2 nkv) hd] f32 (row n: q heads, then k heads, then v heads, as the fused projection writes them).
// norm_mode: 0 none; 1 "full" (q over its nh*hd values with wq [nh*hd], k over nkv*hd with wk [nkv*hd]);
// 2 "per_head" (each head over hd values, wq / wk [hd]). clip > 0: q, k, v clamped to [-clip, clip] after a full
// norm and before a per-head norm (the NumPy engine's order). Then RoPE (rotate_half, first 2*half dims, cos/sin
// row rpos[n]) on q and k. Writes q_out [N, nh, hd] f32, and k, v to the caches [S, capacity, nkv, hd] at
// (seq[n], pos[n]). Grid (N, ceil((nh + nkv) / QKV_HEADS_PER_BLOCK)): one warp per head, so that a single row
// still spreads over several multiprocessors; with a full norm each block first reduces the row's q and k sums.
template <typename TC, typename TW>
__device__ __forceinline__ void qkv_rope_kv_impl(const float* __restrict__ qkv, float* __restrict__ q_out,
                                                 typename TC::storage* __restrict__ kc,
                                                 typename TC::storage* __restrict__ vc,
                                                 const typename TW::storage* __restrict__ wq,
                                                 const typename TW::storage* __restrict__ wk,
                                                 const int* __restrict__ seq, const int* __restrict__ pos,
                                                 const int* __restrict__ rpos, const float* __restrict__ cos_t,
                                                 const float* __restrict__ sin_t, int nh, int nkv, int hd, int half,
                                                 int capacity, int norm_mode, float eps, float clip) {
    __shared__ float s_red[32];
    const int n = blockIdx.x;
    const int nq = nh * hd, nk = nkv * hd;
    const float* row = qkv + (size_t)n * (nq + 2 * nk);
    const size_t dst = ((size_t)seq[n] * capacity + pos[n]) * (size_t)nk;   // this row's slot in the caches

    // v: clip and store (no norm, no rotation), spread over the row's blocks
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < nk; i += gridDim.y * blockDim.x) {
        float v = row[nq + nk + i];
        if (clip > 0.0f) v = fminf(fmaxf(v, -clip), clip);
        vc[dst + i] = TC::from_f32(v);
    }

    float inv_q = 1.0f, inv_k = 1.0f;
    if (norm_mode == 1) {
        float sq, sk;
        full_norm_sums(row, nq, nk, sq, sk);
        inv_q = rsqrtf(block_sum(sq, s_red) / (float)nq + eps);
        inv_k = rsqrtf(block_sum(sk, s_red) / (float)nk + eps);
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const float* cr = cos_t + (size_t)(half > 0 ? rpos[n] : 0) * half;
    const float* sr = sin_t + (size_t)(half > 0 ? rpos[n] : 0) * half;
    for (int head = blockIdx.y * nwarps + warp; head < nh + nkv; head += gridDim.y * nwarps) {
        const bool is_q = head < nh;
        const float* src = row + (size_t)head * hd;              // k heads follow the q heads in the row
        const typename TW::storage* w = is_q ? wq : wk;
        const int woff = norm_mode == 1 ? (is_q ? head : head - nh) * hd : 0;
        const float inv_full = is_q ? inv_q : inv_k;
        // value d of this head after the full norm and the clip
        auto pre = [&](int d) -> float {
            float v = src[d];
            if (norm_mode == 1) v = v * inv_full * TW::to_f32(w[woff + d]);
            if (clip > 0.0f) v = fminf(fmaxf(v, -clip), clip);
            return v;
        };
        float inv_head = 1.0f;
        if (norm_mode == 2) {
            float ss = 0.0f;
            for (int d = lane; d < hd; d += 32) {
                const float v = pre(d);
                ss = fmaf(v, v, ss);
            }
            inv_head = rsqrtf(warp_sum(ss) / (float)hd + eps);
        }
        auto val = [&](int d) -> float {
            const float v = pre(d);
            return norm_mode == 2 ? v * inv_head * TW::to_f32(w[d]) : v;
        };
        float* qdst = q_out + ((size_t)n * nh + head) * hd;
        typename TC::storage* kdst = kc + dst + (size_t)(head - nh) * hd;
        for (int i = lane; i < half; i += 32) {
            const float x1 = val(i), x2 = val(i + half), c = cr[i], s = sr[i];
            const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
            if (is_q) { qdst[i] = y1; qdst[i + half] = y2; }
            else { kdst[i] = TC::from_f32(y1); kdst[i + half] = TC::from_f32(y2); }
        }
        for (int d = 2 * half + lane; d < hd; d += 32) {
            const float y = val(d);
            if (is_q) qdst[d] = y;
            else kdst[d] = TC::from_f32(y);
        }
    }
}

#define QKV_ROPE_KV_KERNEL(SUF, TC, TW)                                                                           \
    extern "C" __global__ void __launch_bounds__(QKV_THREADS)                                                    \
        qkv_rope_kv_##SUF(const float* qkv, float* q_out, TC::storage* kc, TC::storage* vc, const TW::storage* wq, \
                          const TW::storage* wk, const int* seq, const int* pos, const int* rpos,                  \
                          const float* cos_t, const float* sin_t, int nh, int nkv, int hd, int half, int capacity, \
                          int norm_mode, float eps, float clip) {                                                 \
        qkv_rope_kv_impl<TC, TW>(qkv, q_out, kc, vc, wq, wk, seq, pos, rpos, cos_t, sin_t, nh, nkv, hd, half,     \
                                 capacity, norm_mode, eps, clip);                                                 \
    }
// suffix: <cache dtype>_<norm weight dtype>
QKV_ROPE_KV_KERNEL(f32_f32, TF32, TF32)
QKV_ROPE_KV_KERNEL(f32_f16, TF32, TF16)
QKV_ROPE_KV_KERNEL(f32_bf16, TF32, TBF16)
QKV_ROPE_KV_KERNEL(f16_f32, TF16, TF32)
QKV_ROPE_KV_KERNEL(f16_f16, TF16, TF16)
QKV_ROPE_KV_KERNEL(f16_bf16, TF16, TBF16)
QKV_ROPE_KV_KERNEL(bf16_f32, TBF16, TF32)
QKV_ROPE_KV_KERNEL(bf16_f16, TBF16, TF16)
QKV_ROPE_KV_KERNEL(bf16_bf16, TBF16, TBF16)

// ------------------------------------------------------------------------------------------------ bf16 split
// x f32 = hi + lo with hi = bf16(x) (round to nearest even) and lo = bf16(x - hi): two bf16 operands whose sum
// carries about 16 mantissa bits, so that two bf16 tensor-core products with fp32 accumulation (hi @ W + lo @ W)
// match an fp32 product with bf16-stored W to ~1e-5 instead of bf16's ~4e-3. lo null: hi alone (ops.round_bf16).
extern "C" __global__ void split_bf16(const float* __restrict__ x, u16* __restrict__ hi, u16* __restrict__ lo,
                                      long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = x[i];
        const u16 h = TBF16::from_f32(v);
        hi[i] = h;
        if (lo != nullptr) lo[i] = TBF16::from_f32(v - TBF16::to_f32(h));
    }
}
