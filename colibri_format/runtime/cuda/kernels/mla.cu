// Multi-head latent attention (DeepSeek-V3 family) in its absorbed form, over a latent cache that holds, per token,
// the normed compressed kv c (r = kv_lora_rank values) and the roped key shared by all heads (dr values):
//
//   mla_rope_append:      c and the roped shared key into the cache at (seq[n], pos[n]); each head's rope part of q
//                         turned into qr
//   mla_absorb_q_<w>:     ql[n, h] = q_nope[n, h] k_b[h]             (k_b [nh dn, r]: q into the latent space)
//   mla_attend:           lat[n, h] = sum_l p_l c_l, p = softmax_l(scale (ql . c_l + qr . k_l)) over l < q_len[n]
//   mla_absorb_v_<w>:     out[n, h dv + v] = lat[n, h] . v_b[h dv + v]   (v_b [nh dv, r]: the heads' values)
//
// numpy_backend.mla_attention (form "absorbed") is the reference; all math is fp32. No key or value per head is
// ever formed, so one pass serves decode steps and prefills alike, and every launch shape depends only on the row
// count: the kernels can be captured in a CUDA graph.
#include "common.cuh"

#ifndef MLA_THREADS
#error "MLA_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef MLA_MAX_RANK
#error "MLA_MAX_RANK undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef MLA_ROWS
#error "MLA_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#define MLA_WARPS (MLA_THREADS / 32)
#define MLA_RANK_PER_LANE (MLA_MAX_RANK / 32)
static_assert(MLA_THREADS % 32 == 0 && MLA_THREADS <= 1024, "whole warps");
static_assert(MLA_MAX_RANK % 32 == 0, "the latent accumulator is split evenly over a warp's lanes");
#define MLA_NEG_INF __int_as_float(0xff800000)

// Element i of the rotate-half RoPE of v (cos/sin rows c, s of `half` values; dims past 2 half are kept).
__device__ __forceinline__ float rope_at(const float* v, int i, int half, const float* c, const float* s) {
    if (i < half) return v[i] * c[i] - v[i + half] * s[i];
    if (i < 2 * half) return v[i] * c[i - half] + v[i - half] * s[i - half];
    return v[i];
}

// ------------------------------------------------------------------------------------------------ RoPE + append
// q [N, nh, dn + dr], c [N, r], k_rope [N, dr] with rows `k_stride` floats apart (a column slice of kv_a_proj's
// output), cos/sin [*, half] (row rpos[n]); cache [S, capacity, r + dr]; qr [N, nh, dr]. Grid (N), any block size.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_rope_append(const float* __restrict__ q, const float* __restrict__ c, const float* __restrict__ k_rope,
                    int k_stride, const int* __restrict__ seq, const int* __restrict__ pos,
                    const int* __restrict__ rpos, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                    float* __restrict__ cache, float* __restrict__ qr, int nh, int dn, int dr, int r, int half,
                    int capacity) {
    const int n = blockIdx.x;
    float* dst = cache + ((size_t)seq[n] * capacity + pos[n]) * (size_t)(r + dr);
    const float* cr = cos_t + (size_t)rpos[n] * half;
    const float* sr = sin_t + (size_t)rpos[n] * half;
    for (int i = threadIdx.x; i < r; i += blockDim.x) dst[i] = c[(size_t)n * r + i];
    const float* kr = k_rope + (size_t)n * k_stride;
    for (int i = threadIdx.x; i < dr; i += blockDim.x) dst[r + i] = rope_at(kr, i, half, cr, sr);
    for (int j = threadIdx.x; j < nh * dr; j += blockDim.x) {
        const int h = j / dr, i = j % dr;
        const float* qh = q + ((size_t)n * nh + h) * (dn + dr) + dn;
        qr[((size_t)n * nh + h) * dr + i] = rope_at(qh, i, half, cr, sr);
    }
}

// ------------------------------------------------------------------------------------------------ q absorption
// ql [N, nh, r] = q_nope [N, nh, dn] (the first dn values of each head of q [N, nh, dn + dr]) times k_b [nh dn, r].
// Grid (ceil(r / 32), nh, ceil(N / MLA_ROWS)): lane l of warp w sums latent column j = 32 blockIdx.x + l over
// d = w, w + MLA_WARPS, ... for MLA_ROWS rows at once (each k_b load serves them all; the warps split dn so that even
// a few heads fill the device), then the warps' partial sums are added. Dynamic shared memory: MLA_ROWS * dn floats
// (the rows' q_nope of head h), then MLA_WARPS * MLA_ROWS * 32 partial sums.
template <typename TW>
__device__ __forceinline__ void absorb_q_impl(const float* __restrict__ q,
                                              const typename TW::storage* __restrict__ kb, float* __restrict__ ql,
                                              int N, int nh, int dn, int dr, int r) {
    extern __shared__ float s_q[];
    float* s_part = s_q + MLA_ROWS * dn;
    const int h = blockIdx.y, n0 = blockIdx.z * MLA_ROWS;
    const int rows = min(MLA_ROWS, N - n0);
    for (int t = threadIdx.x; t < rows * dn; t += blockDim.x) {
        const int i = t / dn, d = t % dn;
        s_q[t] = q[((size_t)(n0 + i) * nh + h) * (dn + dr) + d];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, j = blockIdx.x * 32 + lane;
    float acc[MLA_ROWS];
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) acc[i] = 0.0f;
    if (j < r) {
        for (int d = warp; d < dn; d += MLA_WARPS) {
            const float w = TW::to_f32(kb[((size_t)h * dn + d) * r + j]);
#pragma unroll
            for (int i = 0; i < MLA_ROWS; ++i)
                if (i < rows) acc[i] = fmaf(s_q[i * dn + d], w, acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) s_part[(warp * MLA_ROWS + i) * 32 + lane] = acc[i];
    __syncthreads();
    for (int t = threadIdx.x; t < rows * 32; t += blockDim.x) {
        const int i = t / 32, col = blockIdx.x * 32 + t % 32;
        if (col >= r) continue;
        float sum = 0.0f;
        for (int w = 0; w < MLA_WARPS; ++w) sum += s_part[(w * MLA_ROWS + i) * 32 + t % 32];
        ql[((size_t)(n0 + i) * nh + h) * r + col] = sum;
    }
}

// ------------------------------------------------------------------------------------------------ attention
// One block per (row n, head h); its warps take positions l = warp, warp + MLA_WARPS, ... of cache sequence seq[n]
// below q_len[n], each with its own online softmax (running max m, denominator d, and the latent accumulator spread
// over its lanes: lane holds columns lane + 32 k). The warps' states are merged at the end. Dynamic shared memory:
// (r + dr) query floats, MLA_WARPS * r accumulator floats, 2 * MLA_WARPS for m and d.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_attend(const float* __restrict__ ql, const float* __restrict__ qr, const float* __restrict__ cache,
               const int* __restrict__ seq, const int* __restrict__ q_len, float* __restrict__ lat, int nh, int r,
               int dr, int capacity, float scale) {
    extern __shared__ float smem[];
    const int n = blockIdx.x, h = blockIdx.y, width = r + dr;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* s_q = smem;                          // [ql | qr] of (n, h)
    float* s_acc = s_q + width;                 // [MLA_WARPS][r]
    float* s_m = s_acc + MLA_WARPS * r;         // [MLA_WARPS]
    float* s_d = s_m + MLA_WARPS;               // [MLA_WARPS]
    for (int i = threadIdx.x; i < r; i += blockDim.x) s_q[i] = ql[((size_t)n * nh + h) * r + i];
    for (int i = threadIdx.x; i < dr; i += blockDim.x) s_q[r + i] = qr[((size_t)n * nh + h) * dr + i];
    __syncthreads();

    const float* base = cache + (size_t)seq[n] * capacity * width;
    float m = MLA_NEG_INF, d = 0.0f, acc[MLA_RANK_PER_LANE];
#pragma unroll
    for (int k = 0; k < MLA_RANK_PER_LANE; ++k) acc[k] = 0.0f;
    for (int l = warp; l < q_len[n]; l += MLA_WARPS) {
        const float* row = base + (size_t)l * width;
        float s = 0.0f;
        for (int i = lane; i < width; i += 32) s = fmaf(s_q[i], row[i], s);
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float keep = expf(m - m_new), p = expf(s - m_new);    // keep = 0 on the first position (m = -inf)
        d = fmaf(d, keep, p);
#pragma unroll
        for (int k = 0; k < MLA_RANK_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < r) acc[k] = fmaf(acc[k], keep, p * row[j]);
        }
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_d[warp] = d;
    }
#pragma unroll
    for (int k = 0; k < MLA_RANK_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        if (j < r) s_acc[warp * r + j] = acc[k];
    }
    __syncthreads();

    float m_all = MLA_NEG_INF;
    for (int w = 0; w < MLA_WARPS; ++w) m_all = fmaxf(m_all, s_m[w]);
    float den = 0.0f;
    for (int w = 0; w < MLA_WARPS; ++w)
        if (s_m[w] > MLA_NEG_INF) den += s_d[w] * expf(s_m[w] - m_all);      // a warp with no position adds nothing
    for (int j = threadIdx.x; j < r; j += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < MLA_WARPS; ++w)
            if (s_m[w] > MLA_NEG_INF) o += s_acc[w * r + j] * expf(s_m[w] - m_all);
        lat[((size_t)n * nh + h) * r + j] = o / den;
    }
}

// ------------------------------------------------------------------------------------------------ v absorption
// out [N, nh dv] = per head, lat [N, nh, r] times v_b [nh dv, r]^T. Grid (ceil(dv / MLA_WARPS), nh,
// ceil(N / MLA_ROWS)): a warp per output column v of head h (lanes over r: coalesced v_b rows), MLA_ROWS rows at
// once. Dynamic shared memory: MLA_ROWS * r floats (the rows' latent output of head h).
template <typename TW>
__device__ __forceinline__ void absorb_v_impl(const float* __restrict__ lat,
                                              const typename TW::storage* __restrict__ vb, float* __restrict__ out,
                                              int N, int nh, int dv, int r) {
    extern __shared__ float s_lat[];
    const int h = blockIdx.y, n0 = blockIdx.z * MLA_ROWS;
    const int rows = min(MLA_ROWS, N - n0);
    for (int t = threadIdx.x; t < rows * r; t += blockDim.x) {
        const int i = t / r, j = t % r;
        s_lat[t] = lat[((size_t)(n0 + i) * nh + h) * r + j];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, v = blockIdx.x * MLA_WARPS + (threadIdx.x >> 5);
    if (v >= dv) return;
    const typename TW::storage* w = vb + ((size_t)h * dv + v) * r;
    float acc[MLA_ROWS];
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) acc[i] = 0.0f;
    for (int j = lane; j < r; j += 32) {
        const float wj = TW::to_f32(w[j]);
#pragma unroll
        for (int i = 0; i < MLA_ROWS; ++i)
            if (i < rows) acc[i] = fmaf(s_lat[i * r + j], wj, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) {
        const float total = warp_sum(acc[i]);
        if (lane == 0 && i < rows) out[(size_t)(n0 + i) * nh * dv + (size_t)h * dv + v] = total;
    }
}

#define MLA_ABSORB_KERNELS(SUF, TW)                                                                         \
    extern "C" __global__ void __launch_bounds__(MLA_THREADS)                                              \
        mla_absorb_q_##SUF(const float* q, const TW::storage* kb, float* ql, int N, int nh, int dn, int dr,  \
                           int r) {                                                                         \
        absorb_q_impl<TW>(q, kb, ql, N, nh, dn, dr, r);                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(MLA_THREADS)                                              \
        mla_absorb_v_##SUF(const float* lat, const TW::storage* vb, float* out, int N, int nh, int dv, int r) { \
        absorb_v_impl<TW>(lat, vb, out, N, nh, dv, r);                                                     \
    }
MLA_ABSORB_KERNELS(f32, TF32)
MLA_ABSORB_KERNELS(f16, TF16)
MLA_ABSORB_KERNELS(bf16, TBF16)
