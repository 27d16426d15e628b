// Dense-layer kernels: RMSNorm, RoPE (rotate_half), KV-cache append, attention (decode and causal prefill),
// embedding gather, residual add, SiLU-and-multiply, and a small-batch dense GEMV (usable inside CUDA graphs,
// where cuBLAS cannot be captured through CuPy). All math is fp32.
#include "common.cuh"

#ifndef NORM_VECS
#error "NORM_VECS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif

// ------------------------------------------------------------------------------------------------ RMSNorm
// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * (w + w_offset); one block per row (out may be x: in place).
// Rows that fit NORM_VECS vectors a thread are held in registers (common.cuh: one round of loads, the latency a
// decode step pays once per norm); others take the strided loop.
template <typename TX, typename TO, typename TW>
__device__ __forceinline__ void rmsnorm_impl(const typename TX::storage* x, const typename TW::storage* w,
                                             typename TO::storage* out, int D, float eps, float w_offset) {
    __shared__ float s_red[32];
    const typename TX::storage* xr = x + (size_t)blockIdx.x * D;
    typename TO::storage* orow = out + (size_t)blockIdx.x * D;
    if (row_fits_registers<NORM_VECS>(D) && vec4_aligned<TX>(xr) && vec4_aligned<TO>(orow) && vec4_aligned<TW>(w)) {
        float v[NORM_VECS][4], g[NORM_VECS][4];
        load_row_registers<TX, NORM_VECS>(xr, v, D);
        load_row_registers<TW, NORM_VECS>(w, g, D);
        norm_row_registers<TO, NORM_VECS>(v, g, orow, D, eps, w_offset, s_red);
        return;
    }
    float ss = 0.0f;
#pragma unroll 8
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = TX::to_f32(xr[i]);
        ss = fmaf(v, v, ss);
    }
    const float inv = rsqrtf(block_sum(ss, s_red) / (float)D + eps);
#pragma unroll 8
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        orow[i] = TO::from_f32(TX::to_f32(xr[i]) * inv * (TW::to_f32(w[i]) + w_offset));
}

#define RMSNORM_KERNEL(SUF, TX, TO, TW)                                                                     \
    extern "C" __global__ void rmsnorm_##SUF(const TX::storage* x, const TW::storage* w, TO::storage* out, \
                                             int D, float eps, float w_offset) {                           \
        rmsnorm_impl<TX, TO, TW>(x, w, out, D, eps, w_offset);                                             \
    }
// suffix: <x>_<out>_<weight>
RMSNORM_KERNEL(f32_f32_f32, TF32, TF32, TF32)
RMSNORM_KERNEL(f32_f32_f16, TF32, TF32, TF16)
RMSNORM_KERNEL(f32_f32_bf16, TF32, TF32, TBF16)
RMSNORM_KERNEL(f32_bf16_f32, TF32, TBF16, TF32)
RMSNORM_KERNEL(f32_bf16_f16, TF32, TBF16, TF16)
RMSNORM_KERNEL(f32_bf16_bf16, TF32, TBF16, TBF16)
RMSNORM_KERNEL(bf16_f32_f32, TBF16, TF32, TF32)
RMSNORM_KERNEL(bf16_f32_f16, TBF16, TF32, TF16)
RMSNORM_KERNEL(bf16_f32_bf16, TBF16, TF32, TBF16)
RMSNORM_KERNEL(bf16_bf16_f32, TBF16, TBF16, TF32)
RMSNORM_KERNEL(bf16_bf16_f16, TBF16, TBF16, TF16)
RMSNORM_KERNEL(bf16_bf16_bf16, TBF16, TBF16, TBF16)


// ------------------------------------------------------------------------------------------------ attention
// One query row per (sequence, position): q [NQ, nh, hd] fp32; query row n reads cache sequence q_seq[n] and the
// keys [max(0, q_len[n] - window), q_len[n]) (window <= 0: all). Decode: one row per sequence, q_len = its length.
// Causal prefill: one row per new token, q_len = its position + 1. GQA: head h reads kv head h / (nh / nkv).
#ifndef ATT_THREADS
#error "ATT_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ATT_GMAX
#error "ATT_GMAX undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#define ATT_WARPS (ATT_THREADS / 32)
static_assert(ATT_THREADS % 32 == 0, "whole warps");

// Split-context attention (flash-decoding): the keys of a query row are cut into nsplit contiguous chunks, one
// block of ATT_THREADS threads per (row, kv head, chunk of up to ATT_GMAX query heads, split), so the grid is
// (NQ, nkv, ceil(G / ATT_GMAX) * nsplit). Inside a block each warp takes tiles of 32 keys, one key per lane for the
// scores (q in shared memory), then accumulates p * V with each lane owning HPL dims. The block writes its (max,
// sum, unnormalized output) per head to the workspace; attention_merge combines the splits. With nsplit == 1 the
// block writes the final output directly.
// Attention sinks (gpt-oss): sinks [nh] f32, or NULL for none. Head h's learned logit joins the softmax
// denominator as one more column whose value is dropped: out = num / (den + exp(sinks[h] - M)), with num and den
// rescaled to M = max(max score, sinks[h]) (scores include `scale`). It is added once per row and head: by the
// split kernel when nsplit == 1, else by attention_merge (the split partials never include it).
// A block's warps each hold an online-softmax state (max m, sum l, unnormalized output acc, lanes over the head
// dimension) for the ATT_GMAX heads of its chunk: attention_warps_stash puts them in shared memory,
// attention_merge_warps combines head g's at dim d with the sink logit sk (-inf: none) into (max, numerator,
// denominator); the output is num / den. A warp without keys (m = -inf) weighs 0.
struct WarpMerge {
    float mx, num, den;
};

template <int HPL>
__device__ __forceinline__ void attention_warps_stash(float (&s_m)[ATT_WARPS][ATT_GMAX],
                                                      float (&s_l)[ATT_WARPS][ATT_GMAX],
                                                      float (&s_acc)[ATT_WARPS][ATT_GMAX][HPL * 32],
                                                      const float (&m)[ATT_GMAX], const float (&l)[ATT_GMAX],
                                                      const float (&acc)[ATT_GMAX][HPL]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < ATT_GMAX; ++g) {
        if (lane == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
#pragma unroll
        for (int u = 0; u < HPL; ++u) s_acc[warp][g][lane * HPL + u] = acc[g][u];
    }
}

template <int HD>
__device__ __forceinline__ WarpMerge attention_merge_warps(const float (&s_m)[ATT_WARPS][ATT_GMAX],
                                                           const float (&s_l)[ATT_WARPS][ATT_GMAX],
                                                           const float (&s_acc)[ATT_WARPS][ATT_GMAX][HD], int g,
                                                           int d, float sk) {
    const float NEG_INF = __int_as_float(0xff800000);
    WarpMerge r{sk, 0.0f, 0.0f};
    for (int w = 0; w < ATT_WARPS; ++w) r.mx = fmaxf(r.mx, s_m[w][g]);
    if (r.mx != NEG_INF) {
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float c = expf(s_m[w][g] - r.mx);
            r.num = fmaf(s_acc[w][g][d], c, r.num);
            r.den = fmaf(s_l[w][g], c, r.den);
        }
        if (sk != NEG_INF) r.den += expf(sk - r.mx);
    }
    return r;
}

template <typename TC, int HPL>
__device__ __forceinline__ void attention_split_impl(const float* __restrict__ q,
                                                     const typename TC::storage* __restrict__ kc,
                                                     const typename TC::storage* __restrict__ vc,
                                                     const int* __restrict__ q_seq, const int* __restrict__ q_len,
                                                     const float* __restrict__ sinks, float* __restrict__ part_ml,
                                                     float* __restrict__ part_acc, float* __restrict__ out, int nh,
                                                     int nkv, int capacity, int window, float scale, int nsplit) {
    constexpr int HD = HPL * 32;
    __shared__ __align__(16) float s_q[ATT_GMAX][HD];
    __shared__ float s_m[ATT_WARPS][ATT_GMAX], s_l[ATT_WARPS][ATT_GMAX];
    __shared__ float s_acc[ATT_WARPS][ATT_GMAX][HD];
    const float NEG_INF = __int_as_float(0xff800000);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x, kvh = blockIdx.y;
    const int split = blockIdx.z % nsplit, gchunk = blockIdx.z / nsplit;
    const int G = nh / nkv;
    const int g0 = gchunk * ATT_GMAX;
    const int ng = min(ATT_GMAX, G - g0);
    const int len = q_len[n];
    const int first = window > 0 ? max(0, len - window) : 0;
    const int chunk = (len - first + nsplit - 1) / nsplit;
    const int lo = first + split * chunk, hi = min(len, lo + chunk);
    const int sq = q_seq[n];

    for (int i = threadIdx.x; i < ATT_GMAX * HD; i += ATT_THREADS) {
        const int g = i / HD, d = i - g * HD;
        const int head = kvh * G + g0 + min(g, ng - 1);
        s_q[g][d] = q[((size_t)n * nh + head) * HD + d] * scale;
    }
    __syncthreads();

    float acc[ATT_GMAX][HPL], m[ATT_GMAX], l[ATT_GMAX];
#pragma unroll
    for (int g = 0; g < ATT_GMAX; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int u = 0; u < HPL; ++u) acc[g][u] = 0.0f;
    }
    const size_t row = (size_t)nkv * HD;
    const typename TC::storage* kb = kc + (size_t)sq * capacity * row + (size_t)kvh * HD;
    const typename TC::storage* vb = vc + (size_t)sq * capacity * row + (size_t)kvh * HD + lane * HPL;
    constexpr int KV = Vec16<TC>::N;  // elements per 16-byte load

    for (int base = lo + warp * 32; base < hi; base += ATT_WARPS * 32) {
        const int p = base + lane;
        float s[ATT_GMAX];
#pragma unroll
        for (int g = 0; g < ATT_GMAX; ++g) s[g] = 0.0f;
        if (p < hi) {
            const typename TC::storage* kr = kb + (size_t)p * row;
#pragma unroll 4
            for (int d0 = 0; d0 < HD; d0 += KV) {
                float kf[KV];
                load16_f32<TC>(kr + d0, kf);
#pragma unroll
                for (int g = 0; g < ATT_GMAX; ++g) {
                    if (g < ng) {
#pragma unroll
                        for (int u = 0; u < KV; ++u) s[g] = fmaf(s_q[g][d0 + u], kf[u], s[g]);
                    }
                }
            }
        }
        float pr[ATT_GMAX];
#pragma unroll
        for (int g = 0; g < ATT_GMAX; ++g) {
            const float sv = p < hi ? s[g] : NEG_INF;
            const float mn = fmaxf(m[g], warp_max(sv));  // finite: lane 0 of the tile is always valid
            const float c = expf(m[g] - mn);              // 0 while m is -inf
            pr[g] = p < hi ? expf(sv - mn) : 0.0f;
            l[g] = l[g] * c + warp_sum(pr[g]);
            m[g] = mn;
#pragma unroll
            for (int u = 0; u < HPL; ++u) acc[g][u] *= c;
        }
        const int nvalid = min(32, hi - base);
#pragma unroll 4
        for (int j = 0; j < nvalid; ++j) {
            float vf[HPL];
#pragma unroll
            for (int u = 0; u < HPL; ++u) vf[u] = TC::to_f32(vb[(size_t)(base + j) * row + u]);
#pragma unroll
            for (int g = 0; g < ATT_GMAX; ++g) {
                const float pj = __shfl_sync(COLIBRI_FULL_MASK, pr[g], j);
#pragma unroll
                for (int u = 0; u < HPL; ++u) acc[g][u] = fmaf(pj, vf[u], acc[g][u]);
            }
        }
    }
    attention_warps_stash<HPL>(s_m, s_l, s_acc, m, l, acc);
    __syncthreads();
    for (int i = threadIdx.x; i < ng * HD; i += ATT_THREADS) {
        const int g = i / HD, d = i - g * HD;
        const int head = kvh * G + g0 + g;
        // with splits, attention_merge adds the sink; -inf: none (fmaxf and + exp(-inf) leave mx and den as they are)
        const WarpMerge r = attention_merge_warps<HD>(s_m, s_l, s_acc, g, d,
                                                      (sinks != nullptr && nsplit == 1) ? sinks[head] : NEG_INF);
        const size_t nhd = (size_t)n * nh + head;
        if (nsplit == 1) {
            out[nhd * HD + d] = r.den > 0.0f ? r.num / r.den : 0.0f;
        } else {
            part_acc[(nhd * nsplit + split) * HD + d] = r.num;
            if (d == 0) {
                part_ml[(nhd * nsplit + split) * 2] = r.mx;
                part_ml[(nhd * nsplit + split) * 2 + 1] = r.den;
            }
        }
    }
}

#define ATTENTION_SPLIT_KERNEL(SUF, TC, HPL)                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                                 \
        attention_split_##SUF(const float* q, const TC::storage* kc, const TC::storage* vc, const int* q_seq,   \
                              const int* q_len, const float* sinks, float* part_ml, float* part_acc,           \
                              float* out, int nh, int nkv, int capacity, int window, float scale, int nsplit) { \
        attention_split_impl<TC, HPL>(q, kc, vc, q_seq, q_len, sinks, part_ml, part_acc, out, nh, nkv,         \
                                      capacity, window, scale, nsplit);                                        \
    }
ATTENTION_SPLIT_KERNEL(f32_hd64, TF32, 2)
ATTENTION_SPLIT_KERNEL(f32_hd128, TF32, 4)
ATTENTION_SPLIT_KERNEL(f32_hd256, TF32, 8)
ATTENTION_SPLIT_KERNEL(f16_hd64, TF16, 2)
ATTENTION_SPLIT_KERNEL(f16_hd128, TF16, 4)
ATTENTION_SPLIT_KERNEL(f16_hd256, TF16, 8)
ATTENTION_SPLIT_KERNEL(bf16_hd64, TBF16, 2)
ATTENTION_SPLIT_KERNEL(bf16_hd128, TBF16, 4)
ATTENTION_SPLIT_KERNEL(bf16_hd256, TBF16, 8)

// Attention for few query rows (decode): the same contract and partials as attention_split, another work split.
// Block = (row n, kv head, split); warp w takes the heads g0 + ATT_HPW*w .. + ATT_HPW - 1 of the kv head's chunk
// of ATT_GMAX heads; lanes split the head dimension (HPL = HD / 32 values each). The split's keys go in tiles of
// KB = ATT_LANE_FLOATS / HPL keys whose K and V rows the whole block copies into shared memory (cp.async, 16 bytes a
// copy), ATT_DECODE_STAGES - 1 tiles ahead of the one its warps compute on: the keys' reads stay in flight while the
// scores, the softmax and p * V run, and every K/V byte is read once a block (each warp used to load its tile
// itself and then wait for it, so a split of c keys cost about c / KB memory round trips plus its arithmetic, and
// the block's warps read the same rows four times). With splits the last block merges (no attention_merge launch;
// tickets: one zeroed int per (row, kv head, head chunk)).
#ifndef ATT_LANE_FLOATS
#error "ATT_LANE_FLOATS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#define ATT_HPW (ATT_GMAX / ATT_WARPS)
static_assert(ATT_GMAX % ATT_WARPS == 0, "whole heads per warp");
#ifndef ATT_DECODE_MIN_KEYS
#error "ATT_DECODE_MIN_KEYS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ATT_MAX_SPLITS
#error "ATT_MAX_SPLITS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ATT_MERGE_LOADS
#error "ATT_MERGE_LOADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(ATT_MERGE_LOADS >= 1, "the merge takes at least one split a round");
static_assert(ATT_MAX_SPLITS % 32 == 0, "the merge's lanes take whole rounds of splits");
#ifndef ATT_DECODE_STAGES
#error "ATT_DECODE_STAGES undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(ATT_DECODE_STAGES >= 2, "a tile in flight while another is computed on");
// The online softmax of attention_decode, for NH query heads of one kv head in registers (lanes over the head
// dimension, HPL values each). attention_decode_start: each head's q (times scale) and an empty state; head i is
// head first + i of the chunk of `ng`, clamped to its last. attention_decode_tile: the keys [p0, min(p0 + KB, hi))
// of a tile stage in shared memory (KB K rows, then KB V rows, HD values each): each head's running max m, sum l and
// unnormalized output acc.
template <int HPL, int NH>
__device__ __forceinline__ void attention_decode_start(const float* __restrict__ q, size_t chunk_row, int first,
                                                       int ng, float scale, float (&qv)[NH][HPL],
                                                       float (&acc)[NH][HPL], float (&m)[NH], float (&l)[NH]) {
    constexpr int HD = HPL * 32;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        const size_t head_row = chunk_row + min(first + h, ng - 1);
        m[h] = __int_as_float(0xff800000);
        l[h] = 0.0f;
#pragma unroll
        for (int u = 0; u < HPL; ++u) {
            qv[h][u] = q[head_row * HD + lane * HPL + u] * scale;
            acc[h][u] = 0.0f;
        }
    }
}

// A lane's HPL consecutive values of a row in shared memory, widened: one 4-, 8- or 16-byte load per 16 bytes
// (consecutive lanes read consecutive bytes, so a warp's load has no bank conflicts).
template <typename TC, int HPL>
__device__ __forceinline__ void shared_lane_values(const typename TC::storage* p, float (&out)[HPL]) {
    typedef typename TC::storage S;
    constexpr int BYTES = HPL * (int)sizeof(S);
    static_assert(BYTES == 4 || BYTES == 8 || BYTES % 16 == 0, "a lane's values are 4, 8 or 16k bytes");
    S v[HPL];
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) reinterpret_cast<uint4*>(v)[i] = reinterpret_cast<const uint4*>(p)[i];
    } else if constexpr (BYTES == 8) {
        *reinterpret_cast<uint2*>(v) = *reinterpret_cast<const uint2*>(p);
    } else {
        *reinterpret_cast<unsigned int*>(v) = *reinterpret_cast<const unsigned int*>(p);
    }
#pragma unroll
    for (int u = 0; u < HPL; ++u) out[u] = TC::to_f32(v[u]);
}

template <typename TC, int HPL, int NH>
__device__ __forceinline__ void attention_decode_tile(const typename TC::storage* stage, int p0, int hi,
                                                      const float (&qv)[NH][HPL], float (&acc)[NH][HPL],
                                                      float (&m)[NH], float (&l)[NH]) {
    constexpr int HD = HPL * 32, KB = ATT_LANE_FLOATS / HPL;
    const float NEG_INF = __int_as_float(0xff800000);
    const int lane = threadIdx.x & 31;
    float kf[KB][HPL], vf[KB][HPL];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
        shared_lane_values<TC, HPL>(stage + b * HD + lane * HPL, kf[b]);
        shared_lane_values<TC, HPL>(stage + (KB + b) * HD + lane * HPL, vf[b]);
    }
    float d[NH * KB], dots[NH * KB];                 // lane partials, then the warp's sums, of q_h . k_b
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int b = 0; b < KB; ++b) {
            d[h * KB + b] = 0.0f;
#pragma unroll
            for (int u = 0; u < HPL; ++u) d[h * KB + b] = fmaf(qv[h][u], kf[b][u], d[h * KB + b]);
        }
    warp_sums<NH * KB>(d, dots);
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        float sc[KB];
        float mb = NEG_INF;
#pragma unroll
        for (int b = 0; b < KB; ++b) {
            sc[b] = p0 + b < hi ? dots[h * KB + b] : NEG_INF;
            mb = fmaxf(mb, sc[b]);
        }
        const float mn = fmaxf(m[h], mb);            // finite: key p0 < hi is valid
        const float c = expf(m[h] - mn);             // 0 while m is -inf
        l[h] *= c;
#pragma unroll
        for (int u = 0; u < HPL; ++u) acc[h][u] *= c;
#pragma unroll
        for (int b = 0; b < KB; ++b) {
            const float pb = expf(sc[b] - mn);       // 0 for masked keys (their rows are zeros)
            l[h] += pb;
#pragma unroll
            for (int u = 0; u < HPL; ++u) acc[h][u] = fmaf(pb, vf[b][u], acc[h][u]);
        }
        m[h] = mn;
    }
}

// The block's copies of the tile of keys [p0, p0 + KB) into a stage (KB K rows, then KB V rows, HD values each);
// keys at or past hi are zeros (not read). seq_off: the element offset of the row's sequence and kv head in the
// caches; row: the elements from one key to the next (nkv * HD).
template <typename TC, int HPL>
__device__ __forceinline__ void attention_decode_copy_tile(typename TC::storage* stage,
                                                           const typename TC::storage* __restrict__ kc,
                                                           const typename TC::storage* __restrict__ vc,
                                                           size_t seq_off, size_t row, int p0, int hi) {
    constexpr int HD = HPL * 32, KB = ATT_LANE_FLOATS / HPL;
    constexpr int PER_ROW = HD * (int)sizeof(typename TC::storage) / 16, ELEMS = 16 / (int)sizeof(typename TC::storage);
    constexpr int ROUNDS = (KB * PER_ROW + ATT_THREADS - 1) / ATT_THREADS;   // 16-byte copies of K a thread
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int i = threadIdx.x + r * ATT_THREADS;
        if (i >= KB * PER_ROW) break;
        const int b = i / PER_ROW, c = (i - b * PER_ROW) * ELEMS;
        const bool valid = p0 + b < hi;
        const size_t off = valid ? seq_off + (size_t)(p0 + b) * row + c : 0;
        copy16_async(stage + b * HD + c, kc + off, valid);
        copy16_async(stage + (KB + b) * HD + c, vc + off, valid);
    }
}

// The warp's heads after the keys: partials of split `split` (or, `direct`, the output, the sink joined).
template <int HPL>
__device__ __forceinline__ void attention_decode_store(const float* __restrict__ sinks, float* part_ml,
                                                       float* part_acc, float* __restrict__ out, int nh, int nsplit,
                                                       bool direct, int n, int kvh, int split, int G, int g0, int ng,
                                                       const float (&acc)[ATT_HPW][HPL], const float (&m)[ATT_HPW],
                                                       const float (&l)[ATT_HPW]) {
    constexpr int HD = HPL * 32;
    const float NEG_INF = __int_as_float(0xff800000);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < ATT_HPW; ++h) {
        const int g = warp * ATT_HPW + h;
        if (g >= ng) break;
        const int head = kvh * G + g0 + g;
        const size_t nhd = (size_t)n * nh + head;
        if (direct) {      // the sink joins here; with splits the last block's merge adds it
            const float sk = sinks != nullptr ? sinks[head] : NEG_INF;
            const float mx = fmaxf(m[h], sk);
            float num_c = 0.0f, den = 0.0f;
            if (mx != NEG_INF) {
                num_c = expf(m[h] - mx);
                den = l[h] * num_c + (sk != NEG_INF ? expf(sk - mx) : 0.0f);
            }
#pragma unroll
            for (int u = 0; u < HPL; ++u)
                out[nhd * HD + lane * HPL + u] = den > 0.0f ? acc[h][u] * num_c / den : 0.0f;
        } else {
#pragma unroll
            for (int u = 0; u < HPL; ++u) part_acc[(nhd * nsplit + split) * HD + lane * HPL + u] = acc[h][u];
            if (lane == 0) {
                part_ml[(nhd * nsplit + split) * 2] = m[h];
                part_ml[(nhd * nsplit + split) * 2 + 1] = l[h];
            }
        }
    }
}

// When more than one split holds keys, the last of those `used` blocks of a (row, kv head, head chunk) to finish
// merges the chunk's heads (as attention_merge does, sinks included) and resets the ticket to 0 for the next launch
// (graph replays): one launch less per layer. Partials are read past L1 (written by other blocks); the fence orders
// them before the ticket.
// Only the `used` splits that hold keys are read. A warp per head first turns the splits' (max, sum) into weights
// exp(m_s - max) / denominator in shared memory, with lanes across splits (independent loads, one round trip);
// then each thread sums its output values' partials with those weights, so no thread runs a serial chain of
// dependent loads and exponentials per split (the merge was most of a short-context decode call before). A thread
// takes 4 consecutive values (float4 loads) and issues ATT_MERGE_LOADS splits' loads before it adds any: a chunk of
// 8 heads x 128 values is 2 rounds of loads a thread, where a value a thread and the compiler's 4-way unroll of the
// split loop (its remainder one split at a time) made 8-24 round trips of L2 latency in the last block alone. The
// sum still runs over the splits in order, masked splits adding fmaf(0, 0, num) = num: the same bits.
template <int HD>
__device__ __forceinline__ void attention_merge_last(const float* part_ml, const float* part_acc,
                                                     const float* __restrict__ sinks, int* __restrict__ tickets,
                                                     float* __restrict__ out, int nh, int nsplit, int used, int n,
                                                     int kvh, int G, int g0, int ng) {
    __shared__ int s_last;
    __shared__ float s_w[ATT_GMAX][ATT_MAX_SPLITS];
    const float NEG_INF = __int_as_float(0xff800000);
    const int ticket_id = (n * gridDim.y + kvh) * (gridDim.z / nsplit) + g0 / ATT_GMAX;
    __syncthreads();                                  // every warp's partials are written
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(tickets + ticket_id, 1) == used - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < ng; g += ATT_WARPS) {
        const int head = kvh * G + g0 + g;
        const size_t r = (size_t)n * nh + head;
        const float sink = sinks != nullptr ? __ldg(sinks + head) : NEG_INF;
        float ms[ATT_MAX_SPLITS / 32], ls[ATT_MAX_SPLITS / 32];
        float mx = sink;
#pragma unroll
        for (int i = 0; i < ATT_MAX_SPLITS / 32; ++i) {
            const int sp = lane + 32 * i;
            ms[i] = sp < used ? __ldcg(part_ml + (r * nsplit + sp) * 2) : NEG_INF;
            ls[i] = sp < used ? __ldcg(part_ml + (r * nsplit + sp) * 2 + 1) : 0.0f;
            mx = fmaxf(mx, ms[i]);
        }
        mx = warp_max(mx);
        float den = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAX_SPLITS / 32; ++i) {
            ms[i] = ms[i] == NEG_INF ? 0.0f : expf(ms[i] - mx);     // mx finite where any m_s is
            den = fmaf(ls[i], ms[i], den);
        }
        den = warp_sum(den);
        if (sink != NEG_INF) den += expf(sink - mx);
        const float inv = den > 0.0f ? 1.0f / den : 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAX_SPLITS / 32; ++i) s_w[g][lane + 32 * i] = ms[i] * inv;
    }
    __syncthreads();
    constexpr int Q = HD / 4;    // float4 quads a head
    for (int i = threadIdx.x; i < ng * Q; i += blockDim.x) {
        const int g = i / Q, d = (i - g * Q) * 4;
        const size_t r = (size_t)n * nh + kvh * G + g0 + g;
        const float4* acc = reinterpret_cast<const float4*>(part_acc + r * nsplit * HD + d);
        float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = 0; s0 < used; s0 += ATT_MERGE_LOADS) {
            float4 a[ATT_MERGE_LOADS];
#pragma unroll
            for (int b = 0; b < ATT_MERGE_LOADS; ++b)
                a[b] = s0 + b < used ? __ldcg(acc + (size_t)(s0 + b) * Q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int b = 0; b < ATT_MERGE_LOADS; ++b) {
                const float wt = s0 + b < used ? s_w[g][s0 + b] : 0.0f;
                num.x = fmaf(a[b].x, wt, num.x);
                num.y = fmaf(a[b].y, wt, num.y);
                num.z = fmaf(a[b].z, wt, num.z);
                num.w = fmaf(a[b].w, wt, num.w);
            }
        }
        *reinterpret_cast<float4*>(out + r * HD + d) = num;
    }
    if (threadIdx.x == 0) tickets[ticket_id] = 0;
}

template <typename TC, int HPL>
__device__ __forceinline__ void attention_decode_impl(const float* __restrict__ q,
                                                      const typename TC::storage* __restrict__ kc,
                                                      const typename TC::storage* __restrict__ vc,
                                                      const int* __restrict__ q_seq, const int* __restrict__ q_len,
                                                      const float* __restrict__ sinks, float* part_ml,
                                                      float* part_acc, int* __restrict__ tickets,
                                                      float* __restrict__ out, int nh, int nkv, int capacity,
                                                      int window, float scale, int nsplit) {
    constexpr int HD = HPL * 32;
    static_assert(ATT_LANE_FLOATS / HPL >= 1, "a key a tile at least");
    const int warp = threadIdx.x >> 5;
    const int n = blockIdx.x, kvh = blockIdx.y;
    const int split = blockIdx.z % nsplit, gchunk = blockIdx.z / nsplit;
    const int G = nh / nkv, g0 = gchunk * ATT_GMAX, ng = min(ATT_GMAX, G - g0);
    // Each split takes the span over nsplit keys, but at least ATT_DECODE_MIN_KEYS, so a short context (decode at
    // position 60 in a graph captured for a 32k cache) runs on the first few splits and the merge reads only those
    // `used` ones: the grid, fixed at capture, follows the capacity; the work follows the length.
    const int len = q_len[n], first = window > 0 ? max(0, len - window) : 0, span = len - first;
    const int chunk = max((span + nsplit - 1) / nsplit, ATT_DECODE_MIN_KEYS);
    // Blocks past the `used` splits have no keys and leave at once (no ticket: the merge counts `used` arrivals).
    // When one split holds every key (a span up to ATT_DECODE_MIN_KEYS, or an empty one), its block writes the
    // output as an unsplit launch does (the same bits): no partials, no ticket, no merge, whatever the grid.
    const int used = (span + chunk - 1) / chunk;     // <= nsplit, as chunk >= span / nsplit; 0 for an empty span
    if (split >= max(used, 1)) return;
    const bool direct = used <= 1;
    const int lo = first + split * chunk, hi = min(len, lo + chunk);

    // ATT_DECODE_STAGES stages of 2 * KB rows (a tile's K rows, then its V rows) in dynamic shared memory
    // (limits.attention_decode_shared_bytes); a copy group is committed every step, empty or not, so that
    // wait_copies' count names tile t's group.
    typedef typename TC::storage S;
    constexpr int KB = ATT_LANE_FLOATS / HPL, STAGE = 2 * KB * HD;
    extern __shared__ __align__(16) unsigned char att_tiles[];
    S* tiles = reinterpret_cast<S*>(att_tiles);
    const size_t row = (size_t)nkv * HD, seq_off = (size_t)q_seq[n] * capacity * row + (size_t)kvh * HD;
    const int ntiles = (hi - lo + KB - 1) / KB;
#pragma unroll
    for (int t = 0; t < ATT_DECODE_STAGES - 1; ++t) {
        if (t < ntiles)
            attention_decode_copy_tile<TC, HPL>(tiles + t * STAGE, kc, vc, seq_off, row, lo + t * KB, hi);
        commit_copies();
    }
    const bool has_heads = warp * ATT_HPW < ng;      // else no head of this chunk for this warp: it only copies
    float qv[ATT_HPW][HPL], acc[ATT_HPW][HPL], m[ATT_HPW], l[ATT_HPW];
    attention_decode_start<HPL, ATT_HPW>(q, (size_t)n * nh + kvh * G + g0, warp * ATT_HPW, ng, scale, qv, acc, m, l);
    for (int t = 0; t < ntiles; ++t) {
        wait_copies<ATT_DECODE_STAGES - 2>();         // this thread's copies of tile t have landed
        __syncthreads();                              // everyone's have; tile t - 1's stage is free again
        const int ahead = t + ATT_DECODE_STAGES - 1;
        if (ahead < ntiles)
            attention_decode_copy_tile<TC, HPL>(tiles + ahead % ATT_DECODE_STAGES * STAGE, kc, vc, seq_off, row,
                                                lo + ahead * KB, hi);
        commit_copies();
        if (has_heads)
            attention_decode_tile<TC, HPL, ATT_HPW>(tiles + t % ATT_DECODE_STAGES * STAGE, lo + t * KB, hi, qv, acc,
                                                    m, l);
    }
    wait_copies<0>();                                 // only empty groups remain: none outlives the block
    if (has_heads)
        attention_decode_store<HPL>(sinks, part_ml, part_acc, out, nh, nsplit, direct, n, kvh, split, G, g0, ng, acc,
                                    m, l);
    if (!direct)
        attention_merge_last<HD>(part_ml, part_acc, sinks, tickets, out, nh, nsplit, used, n, kvh, G, g0, ng);
}

#define ATTENTION_DECODE_KERNEL(SUF, TC, HPL)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                                 \
        attention_decode_##SUF(const float* q, const TC::storage* kc, const TC::storage* vc, const int* q_seq,  \
                               const int* q_len, const float* sinks, float* part_ml, float* part_acc,          \
                               int* tickets, float* out, int nh, int nkv, int capacity, int window,            \
                               float scale, int nsplit) {                                                      \
        attention_decode_impl<TC, HPL>(q, kc, vc, q_seq, q_len, sinks, part_ml, part_acc, tickets, out, nh,    \
                                       nkv, capacity, window, scale, nsplit);                                  \
    }
ATTENTION_DECODE_KERNEL(f32_hd64, TF32, 2)
ATTENTION_DECODE_KERNEL(f32_hd128, TF32, 4)
ATTENTION_DECODE_KERNEL(f32_hd256, TF32, 8)
ATTENTION_DECODE_KERNEL(f16_hd64, TF16, 2)
ATTENTION_DECODE_KERNEL(f16_hd128, TF16, 4)
ATTENTION_DECODE_KERNEL(f16_hd256, TF16, 8)
ATTENTION_DECODE_KERNEL(bf16_hd64, TBF16, 2)
ATTENTION_DECODE_KERNEL(bf16_hd128, TBF16, 4)
ATTENTION_DECODE_KERNEL(bf16_hd256, TBF16, 8)

// out[r, :] for r = (row, head) = merge of the nsplit partials (max, sum, unnormalized output); one block per r,
// one thread per dim. sinks [nh] f32 or NULL: head r % nh's sink logit joins the denominator (see above).
extern "C" __global__ void attention_merge(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                           const float* __restrict__ sinks, float* __restrict__ out, int hd,
                                           int nsplit, int nh) {
    const size_t r = blockIdx.x;
    const float NEG_INF = __int_as_float(0xff800000);
    float mx = NEG_INF;
    for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, part_ml[(r * nsplit + s) * 2]);
    const float sink = sinks != nullptr ? __ldg(sinks + r % nh) : NEG_INF;
    if (sinks != nullptr) mx = fmaxf(mx, sink);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        if (mx != NEG_INF) {
            for (int s = 0; s < nsplit; ++s) {
                const float ms = part_ml[(r * nsplit + s) * 2];
                if (ms == NEG_INF) continue;
                const float c = expf(ms - mx);
                num = fmaf(part_acc[(r * nsplit + s) * hd + d], c, num);
                den = fmaf(part_ml[(r * nsplit + s) * 2 + 1], c, den);
            }
            if (sinks != nullptr) den += expf(sink - mx);
        }
        out[r * hd + d] = den > 0.0f ? num / den : 0.0f;
    }
}

// ------------------------------------------------------------------------------------------------ elementwise
// out[n, :] = table[ids[n], :] * mult (fp32); an id outside [0, V) yields a row of NaN.
template <typename TW>
__device__ __forceinline__ void embedding_impl(const int* __restrict__ ids, const typename TW::storage* __restrict__ table,
                                               float* __restrict__ out, int N, int V, int H, float mult) {
    const long long total = (long long)N * H;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int n = (int)(idx / H), h = (int)(idx - (long long)n * H);
        const int id = ids[n];
        out[idx] = (id >= 0 && id < V) ? TW::to_f32(table[(size_t)id * H + h]) * mult : __int_as_float(0x7fc00000);
    }
}
#define EMBEDDING_KERNEL(SUF, TW)                                                                             \
    extern "C" __global__ void embedding_##SUF(const int* ids, const TW::storage* table, float* out, int N,    \
                                               int V, int H, float mult) {                                   \
        embedding_impl<TW>(ids, table, out, N, V, H, mult);                                                  \
    }
EMBEDDING_KERNEL(f32, TF32)
EMBEDDING_KERNEL(f16, TF16)
EMBEDDING_KERNEL(bf16, TBF16)

// out = a + alpha * b (fp32, n elements; out may alias a or b)
extern "C" __global__ void residual_add_f32(const float* a, const float* b, float* out, long long n, float alpha) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = fmaf(alpha, b[i], a[i]);
}

// out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I] (fp32)
extern "C" __global__ void silu_mul_f32(const float* __restrict__ gu, float* __restrict__ out, int T, int I) {
    const long long total = (long long)T * I;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(idx / I), i = (int)(idx - (long long)t * I);
        out[idx] = silu_f32(gu[(size_t)t * 2 * I + i]) * gu[(size_t)t * 2 * I + I + i];
    }
}

// ------------------------------------------------------------------------------------------------ dense GEMV
// y[t, n] = x[t, :] . W[n, :] (+ bias[n]) for small T: x [T, K] fp32, W [N, K] (f32/f16/bf16), y [T, N] fp32.
// A kernel per token count TOK (1, 2, 4, 8; T <= TOK tokens): one warp per ROWS output rows, each
// lane issuing UNROLL 16-byte weight loads per row before it multiplies (the loads in flight are what bandwidth
// needs at one token); weights are streamed past L1. (ROWS, UNROLL) per TOK come from runtime/cuda/limits.py
// (DG_PLANS, measured on the H200). N >= ROWS; K % 8 == 0 for 16-bit weights, K % 4 == 0 for fp32.
#ifndef DG_THREADS
#error "DG_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T1_ROWS
#error "DG_T1_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T1_UNROLL
#error "DG_T1_UNROLL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T2_ROWS
#error "DG_T2_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T2_UNROLL
#error "DG_T2_UNROLL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T4_ROWS
#error "DG_T4_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T4_UNROLL
#error "DG_T4_UNROLL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T8_ROWS
#error "DG_T8_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_T8_UNROLL
#error "DG_T8_UNROLL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(DG_THREADS % 32 == 0, "whole warps");

__device__ __forceinline__ uint4 load16_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// dot product of 16 bytes of TW weights with the Vec16<TW>::N floats xv
template <typename TW>
__device__ __forceinline__ float dot16(uint4 v, const float* xv) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
    float s = 0.0f;
    if constexpr (Vec16<TW>::N == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s = fmaf(__uint_as_float(u[i]), xv[i], s);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s = fmaf(TW::to_f32((u16)(u[i] & 0xffffu)), xv[2 * i], s);
            s = fmaf(TW::to_f32((u16)(u[i] >> 16)), xv[2 * i + 1], s);
        }
    }
    return s;
}

// n floats (n % 4 == 0) from a 16-byte aligned address, read-only path (common.cuh's ldg4_f32, n / 4 times)
template <int N>
__device__ __forceinline__ void load_floats(const float* __restrict__ p, float* v) {
#pragma unroll
    for (int e = 0; e < N; e += 4) ldg4_f32<TF32>(p + e, v + e);
}

// rsqrt(mean + eps) of a row from its slices' sums of squares (squares[p * stride], p < splits: added in slice order)
__device__ __forceinline__ float inverse_norm(const float* squares, int stride, int splits, int K, float eps) {
    float ss = 0.0f;
    for (int p = 0; p < splits; ++p) ss += squares[p * stride];
    return rsqrtf(ss / (float)K + eps);
}

// The input norm a normed dense_gemv applies to x's rows first (dense_gemv_normed_*): gamma [K] f32 (the norm
// weight, any offset added), eps, and x_out [T, K] f32, where the normed rows are stored once.
struct RowNorm {
    const float* gamma;
    float eps;
    float* x_out;
};

// The normed rows of a normed GEMV (x_out = rmsnorm(x), rmsnorm's expression), a float4 a lane over the items'
// first warps (one round of loads; one warp storing them all took ~16 dependent rounds at the tail): lane `first` of
// `stride`, token j's squares at squares[j] (+ p TOK for its slices p < splits).
__device__ __forceinline__ void store_normed_rows(const float* __restrict__ x, const RowNorm& norm,
                                                  const float* squares, int TOK, int splits, int T, int K, int first,
                                                  int stride) {
    const int quads = K / 4;
    for (int i = first; i < T * quads; i += stride) {
        const int j = i / quads, c = (i - j * quads) * 4;
        const float inv = inverse_norm(squares + j, TOK, splits, K, norm.eps);
        float xv[4], gv[4];
        load_floats<4>(x + (size_t)j * K + c, xv);
        load_floats<4>(norm.gamma + c, gv);
#pragma unroll
        for (int e = 0; e < 4; ++e) xv[e] = rms_scaled(xv[e], inv, gv[e], 0.0f);
        store4_f32<TF32>(norm.x_out + (size_t)j * K + c, xv);
    }
}

// A block's DG_THREADS / 32 warps take DG_THREADS / 32 / splits items of ROWS rows, `splits` warps an item, each
// over one slice of K (whole 32 * V-element chunks); the slices' partial sums meet in shared memory and the item's
// first warp adds them in slice order (deterministic). Splitting K puts every weight load of a short GEMV in flight
// at once: one warp walking a 4096-wide row alone waits for four memory round trips in turn.
// NORM: y = rmsnorm(x) @ W.T = rsqrt(mean(x^2) + eps) * ((x * gamma) @ W.T): the inverse norm is a factor of each
// output, so every warp dots x * gamma while it sums x^2 over its slice (the x it loads anyway), and the item's first
// warp scales the sum once the slices' squares have met. The rmsnorm launch before the product goes (a dependent
// kernel of ~2 us a layer in a decode step's graph); the items' first warps also store the normed rows to x_out (a
// float4 a lane, spread over the items: one warp storing them all took ~16 dependent rounds of loads at the tail),
// as `rmsnorm` would, for the products that read them later (a gated attention output).
template <typename TW, int TOK, int ROWS, int UNROLL, bool NORM = false>
__device__ __forceinline__ void dense_gemv_impl(const float* __restrict__ x, const typename TW::storage* __restrict__ w,
                                                const float* __restrict__ bias, float* __restrict__ y, int T, int N,
                                                int K, int splits, const RowNorm norm = RowNorm{}) {
    constexpr int V = Vec16<TW>::N, STEP = 32 * V, WARPS = DG_THREADS / 32;
    __shared__ float s_part[WARPS][ROWS][TOK];
    __shared__ float s_squares[NORM ? WARPS : 1][TOK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = warp % splits;                            // splits divides WARPS (ops.dense_gemv)
    const int item = blockIdx.x * (WARPS / splits) + warp / splits;
    const bool live = item < (N + ROWS - 1) / ROWS;
    const int r0 = min(item * ROWS, N - ROWS);                  // shifted in range (N >= ROWS)
    const int per_slice = ((K + STEP - 1) / STEP + splits - 1) / splits * STEP;
    const int k_lo = slice * per_slice, k_hi = min(K, k_lo + per_slice);
    float acc[ROWS][TOK], squares[TOK];
#pragma unroll
    for (int j = 0; j < TOK; ++j) {
        squares[j] = 0.0f;
#pragma unroll
        for (int q = 0; q < ROWS; ++q) acc[q][j] = 0.0f;
    }
    for (int c0 = k_lo + lane * V; live && c0 < k_hi; c0 += STEP * UNROLL) {
        uint4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int q = 0; q < ROWS; ++q)
                wv[u][q] = c0 + u * STEP < k_hi ? load16_stream(w + (size_t)(r0 + q) * K + c0 + u * STEP)
                                                : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * STEP;
            if (c < k_hi) {
                float gv[V];
                if constexpr (NORM) load_floats<V>(norm.gamma + c, gv);
#pragma unroll
                for (int j = 0; j < TOK; ++j) {
                    if (j < T) {
                        float xv[V];      // loaded once, used by every row
                        load_floats<V>(x + (size_t)j * K + c, xv);
                        if constexpr (NORM) {
#pragma unroll
                            for (int e = 0; e < V; ++e) {
                                squares[j] = fmaf(xv[e], xv[e], squares[j]);
                                xv[e] *= gv[e];
                            }
                        }
#pragma unroll
                        for (int q = 0; q < ROWS; ++q) acc[q][j] += dot16<TW>(wv[u][q], xv);
                    }
                }
            }
        }
    }
    warp_sums_store<ROWS * TOK>(reinterpret_cast<float (&)[ROWS * TOK]>(acc), &s_part[warp][0][0]);
    if constexpr (NORM) {
#pragma unroll
        for (int j = 0; j < TOK; ++j) {        // warp_sum, as the norms sum their squares
            const float s = warp_sum(squares[j]);
            if (lane == 0) s_squares[warp][j] = s;
        }
    }
    if (splits > 1) __syncthreads();                            // splits is the same in every thread
    else __syncwarp();
    if (slice != 0 || !live) return;
    for (int i = lane; i < ROWS * TOK; i += 32) {
        const int q = i / TOK, j = i - q * TOK;
        float s = 0.0f;
        for (int p = 0; p < splits; ++p) s += s_part[warp + p][q][j];
        if constexpr (NORM) s *= inverse_norm(&s_squares[warp][j], TOK, splits, K, norm.eps);
        if (j < T && r0 + q >= item * ROWS) y[(size_t)j * N + r0 + q] = s + (bias ? bias[r0 + q] : 0.0f);
    }
    if constexpr (NORM)     // K % 8 == 0 (ops.dense_gemv_normed)
        store_normed_rows(x, norm, &s_squares[warp][0], TOK, splits, T, K, item * 32 + lane,
                          (N + ROWS - 1) / ROWS * 32);
}
#define DENSE_GEMV_KERNEL(SUF, TW, TOK, ROWS, UNROLL)                                                          \
    extern "C" __global__ void __launch_bounds__(DG_THREADS)                                                  \
        dense_gemv_##SUF##_t##TOK(const float* x, const TW::storage* w, const float* bias, float* y, int T,     \
                                  int N, int K, int splits) {                                                 \
        dense_gemv_impl<TW, TOK, ROWS, UNROLL>(x, w, bias, y, T, N, K, splits);                               \
    }
#define DENSE_GEMV_NORMED_KERNEL(SUF, TW, TOK, ROWS, UNROLL)                                                   \
    extern "C" __global__ void __launch_bounds__(DG_THREADS)                                                  \
        dense_gemv_normed_##SUF##_t##TOK(const float* x, const TW::storage* w, const float* bias, float* y,      \
                                         int T, int N, int K, int splits, const float* gamma, float eps,       \
                                         float* x_out) {                                                       \
        dense_gemv_impl<TW, TOK, ROWS, UNROLL, true>(x, w, bias, y, T, N, K, splits, RowNorm{gamma, eps, x_out}); \
    }
#define DENSE_GEMV_KERNELS(SUF, TW)                                 \
    DENSE_GEMV_KERNEL(SUF, TW, 1, DG_T1_ROWS, DG_T1_UNROLL)         \
    DENSE_GEMV_KERNEL(SUF, TW, 2, DG_T2_ROWS, DG_T2_UNROLL)         \
    DENSE_GEMV_KERNEL(SUF, TW, 4, DG_T4_ROWS, DG_T4_UNROLL)         \
    DENSE_GEMV_KERNEL(SUF, TW, 8, DG_T8_ROWS, DG_T8_UNROLL)         \
    DENSE_GEMV_NORMED_KERNEL(SUF, TW, 1, DG_T1_ROWS, DG_T1_UNROLL)  \
    DENSE_GEMV_NORMED_KERNEL(SUF, TW, 2, DG_T2_ROWS, DG_T2_UNROLL)  \
    DENSE_GEMV_NORMED_KERNEL(SUF, TW, 4, DG_T4_ROWS, DG_T4_UNROLL)  \
    DENSE_GEMV_NORMED_KERNEL(SUF, TW, 8, DG_T8_ROWS, DG_T8_UNROLL)
DENSE_GEMV_KERNELS(f32, TF32)
DENSE_GEMV_KERNELS(f16, TF16)
DENSE_GEMV_KERNELS(bf16, TBF16)

// ---------------------------------------------------------------------------------- dense GEMV on the tensor cores
// dense_gemv_tc_bf16_n<NT>: y = x @ W.T (+ bias) for bf16 W [N, K] and up to 8 NT tokens (NT = 1, 2, 4: T <= 8, 16,
// 32), on mma.sync m16n8k16 with W as A (16 output rows a warp item) and the tokens as B (NT tiles of 8). Each warp
// reads its rows once whatever the tokens, where dense_gemv re-reads them every 8 tokens and, at 8, spends its time
// on 256 FMAs a 16-byte chunk (a third of the copy rate at Qwen3's decode shapes, session 17). x is split in
// registers into bf16 hi + lo (two MMAs a weight, ~16 mantissa bits: ~1e-5 relative, as the prefill's bf16
// products, ops.gemm_bf16 on split_bf16's halves). The k order inside each 32-column slice is permuted identically
// for A and B, as in moe_gemm_fast.cu: lane (g, t) loads columns 8t .. 8t + 7 of rows g and g + 8 (16 bytes each)
// and of token g, and feeds columns 8t .. 8t + 3 to the first MMA of the slice, 8t + 4 .. 8t + 7 to the second.
// An item's K may be split over `splits` warps of the block (their partial sums meet in shared memory and the
// item's first warp adds them in slice order, as dense_gemv does); N >= 16, K % 32 == 0 (ops.dense_gemv_tc).
#ifndef DG_TC_UNROLL
#error "DG_TC_UNROLL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DG_TC_ROWS
#error "DG_TC_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(DG_TC_ROWS == 16, "a warp item is the 16 rows of one m16n8k16 A tile");

// 8 floats of token j of x at column c (zeros for a token past T: a padded column of the n8 tile)
__device__ __forceinline__ void load_x8(const float* __restrict__ x, int j, int T, int K, int c, float (&v)[8]) {
    if (j < T) {
        load_floats<8>(x + (size_t)j * K + c, v);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.0f;
    }
}

// v as bf16 pairs hi (round to nearest even) and lo = bf16(v - hi), the lower column in each pair's low half
__device__ __forceinline__ void split_x8(const float (&v)[8], unsigned int (&hi)[4], unsigned int (&lo)[4]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const u16 h0 = TBF16::from_f32(v[2 * p]), h1 = TBF16::from_f32(v[2 * p + 1]);
        const u16 l0 = TBF16::from_f32(v[2 * p] - TBF16::to_f32(h0));
        const u16 l1 = TBF16::from_f32(v[2 * p + 1] - TBF16::to_f32(h1));
        hi[p] = (unsigned int)h0 | ((unsigned int)h1 << 16);
        lo[p] = (unsigned int)l0 | ((unsigned int)l1 << 16);
    }
}

// NORM (dense_gemv_tc_normed_*): y = rmsnorm(x) @ W.T = rsqrt(mean(x^2) + eps) * ((x * gamma) @ W.T), as
// dense_gemv_impl's NORM: each lane sums the squares of the x it loads for its token (8 NT + g) while the MMAs take
// x * gamma, the item's warps' sums meet in shared memory, and the item's first warp scales its outputs and stores
// the normed rows to x_out (spread over the items' first warps).
template <int NT, bool NORM = false>
__device__ __forceinline__ void dense_gemv_tc_impl(const float* __restrict__ x, const u16* __restrict__ w,
                                                   const float* __restrict__ bias, float* __restrict__ y, int T, int N,
                                                   int K, int splits, const RowNorm norm = RowNorm{}) {
    constexpr int WARPS = DG_THREADS / 32, TOK = 8 * NT, SLICE = 32;
    __shared__ float s_part[WARPS][TOK][DG_TC_ROWS];           // token-major: the stores below take rows in order
    __shared__ float s_squares[NORM ? WARPS : 1][TOK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int slice = warp % splits;                            // splits divides WARPS (ops.dense_gemv_tc)
    const int item = blockIdx.x * (WARPS / splits) + warp / splits;
    const bool live = item < (N + DG_TC_ROWS - 1) / DG_TC_ROWS;
    const int r0 = min(item * DG_TC_ROWS, N - DG_TC_ROWS);      // shifted in range (N >= 16)
    const int slices = K / SLICE, per_split = (slices + splits - 1) / splits;
    const int s_lo = slice * per_split, s_hi = min(slices, s_lo + per_split);
    const u16* row_g = w + (size_t)(r0 + g) * K + 8 * t;
    const u16* row_g8 = row_g + (size_t)8 * K;
    float acc[NT][4], squares[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        squares[nt] = 0.0f;
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    }
    for (int s0 = s_lo; live && s0 < s_hi; s0 += DG_TC_UNROLL) {
        uint4 wa[DG_TC_UNROLL], wb[DG_TC_UNROLL];
#pragma unroll
        for (int u = 0; u < DG_TC_UNROLL; ++u) {
            const bool in = s0 + u < s_hi;
            wa[u] = in ? load16_stream(row_g + (size_t)(s0 + u) * SLICE) : make_uint4(0u, 0u, 0u, 0u);
            wb[u] = in ? load16_stream(row_g8 + (size_t)(s0 + u) * SLICE) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < DG_TC_UNROLL; ++u) {
            if (s0 + u < s_hi) {
                const int c = (s0 + u) * SLICE + 8 * t;
                float gv[8];
                if constexpr (NORM) load_floats<8>(norm.gamma + c, gv);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float v[8];
                    unsigned int hi[4], lo[4];
                    load_x8(x, nt * 8 + g, T, K, c, v);
                    if constexpr (NORM) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            squares[nt] = fmaf(v[e], v[e], squares[nt]);
                            v[e] *= gv[e];
                        }
                    }
                    split_x8(v, hi, lo);
                    mma_16816(acc[nt], wa[u].x, wb[u].x, wa[u].y, wb[u].y, hi[0], hi[1]);
                    mma_16816(acc[nt], wa[u].z, wb[u].z, wa[u].w, wb[u].w, hi[2], hi[3]);
                    mma_16816(acc[nt], wa[u].x, wb[u].x, wa[u].y, wb[u].y, lo[0], lo[1]);
                    mma_16816(acc[nt], wa[u].z, wb[u].z, wa[u].w, wb[u].w, lo[2], lo[3]);
                }
            }
        }
    }
    // accumulator r of tile nt: row g (+ 8 for r >= 2), token 8 nt + 2t + (r & 1)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s_part[warp][8 * nt + 2 * t + (r & 1)][g + 8 * (r >> 1)] = acc[nt][r];
    if constexpr (NORM) {       // a token's squares: its 4 lanes (t) of the warp, then the item's warps
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float sq = squares[nt];
            sq += __shfl_xor_sync(0xffffffffu, sq, 1);
            sq += __shfl_xor_sync(0xffffffffu, sq, 2);
            if (t == 0) s_squares[warp][8 * nt + g] = sq;
        }
    }
    if (splits > 1) __syncthreads();                            // splits is the same in every thread
    else __syncwarp();
    if (slice != 0 || !live) return;
    for (int i = lane; i < DG_TC_ROWS * TOK; i += 32) {       // 16 consecutive rows of a token a half-warp
        const int j = i / DG_TC_ROWS, q = i - j * DG_TC_ROWS;
        float sum = 0.0f;
        for (int p = 0; p < splits; ++p) sum += s_part[warp + p][j][q];
        if constexpr (NORM) sum *= inverse_norm(&s_squares[warp][j], TOK, splits, K, norm.eps);
        if (j < T && r0 + q >= item * DG_TC_ROWS) y[(size_t)j * N + r0 + q] = sum + (bias ? bias[r0 + q] : 0.0f);
    }
    if constexpr (NORM)
        store_normed_rows(x, norm, &s_squares[warp][0], TOK, splits, T, K, item * 32 + lane,
                          (N + DG_TC_ROWS - 1) / DG_TC_ROWS * 32);
}
#define DENSE_GEMV_TC_KERNEL(NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(DG_THREADS)                                                     \
        dense_gemv_tc_bf16_n##NT(const float* x, const u16* w, const float* bias, float* y, int T, int N, int K,  \
                                 int splits) {                                                                   \
        dense_gemv_tc_impl<NT>(x, w, bias, y, T, N, K, splits);                                                  \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(DG_THREADS)                                                     \
        dense_gemv_tc_normed_bf16_n##NT(const float* x, const u16* w, const float* bias, float* y, int T, int N,  \
                                        int K, int splits, const float* gamma, float eps, float* x_out) {         \
        dense_gemv_tc_impl<NT, true>(x, w, bias, y, T, N, K, splits, RowNorm{gamma, eps, x_out});                \
    }
DENSE_GEMV_TC_KERNEL(1)
DENSE_GEMV_TC_KERNEL(2)
DENSE_GEMV_TC_KERNEL(4)
