// Fused MoE router: logits = x @ Wr.T, scoring (softmax | sigmoid), top-k, optional renormalisation,
// optional selection-only bias, router scale. One launch.
//
// Grid (ceil(T / ROUTER_TPB), ceil(E / ROUTER_EPB)), 256 threads. Each block computes the logits of ROUTER_TPB
// tokens for ROUTER_EPB experts, all its threads splitting the hidden dimension (so the router matrix is spread
// over many multiprocessors and no thread walks a long row alone), and stores them in `logits` [T, E]. The last
// block of a token group to finish (a ticket taken with atomicAdd after a fence) runs the softmax and the
// warp-level top-k for that group, one warp per token (each lane holding E / 32 experts; one packed 64-bit
// max-reduction per selected expert), and resets the group's ticket counter to zero for the next launch. With a
// single block per token group (E <= ROUTER_EPB) the block selects at once, without the global round trip.
//
// Selection order: descending key, ties to the lower expert index (NumPy's stable argsort of -key).
//   order 0 (softmax_topk): score = softmax(logits) or sigmoid(logits); key = score (+ bias: it steers the
//                          selection only); weight = score, divided by the sum of the k selected if normalize;
//                          times scale.
//   order 1 (topk_softmax): key = logits (+ bias: part of the logits, gpt-oss); weight = softmax over the k
//                          selected keys; times scale.
// Grouped top-k (order 0 with topk_group < n_group; DeepSeek-V3, GLM-4.5): the E experts form n_group groups of
// E / n_group consecutive experts; a group scores the sum of its two best keys (its one key for groups of one),
// the topk_group best groups are kept (ties to the lower group index) and the keys of every other group become
// -inf before the top-k; the weights stay the unbiased scores. The selecting warp stages its keys and group scores
// in dynamic shared memory: ROUTER_TPB * (E + 2 * n_group) * 4 bytes a block, given at launch only for grouped
// calls (router_shared_bytes in ops.py; 0 otherwise). n_group 1 (or topk_group >= n_group) is a plain top-k.
//
// add_rmsnorm_route_<w>_e<width>: fused.cu's add_rmsnorm (h += alpha * o in place, x = rmsnorm(h) * w_norm) and
// the router on x in one launch, on the router's grid. Every block recomputes v = h + alpha * o and the row's sum
// of squares for its tokens (router_norm_logits). The last block of a token group, the one that selects, writes
// the group's h and x: not a fixed block, as every other block of the group must have read the old h first. h and x
// equal add_rmsnorm's bit for bit where add_rmsnorm holds the row in registers (H <= 4 NORM_VECS FUSED_THREADS,
// aligned rows) and ROUTER_THREADS == FUSED_THREADS: the same per-thread sums, added in the same order. w_norm has
// the router weight's dtype (a file's dense_dtype). The logits are those of x up to fp32 rounding (inv scales the
// sums, not x: see router_norm_logits).
#include "common.cuh"

#ifndef ROUTER_THREADS
#error "ROUTER_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ROUTER_TPB
#error "ROUTER_TPB undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ROUTER_EPB
#error "ROUTER_EPB undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ROUTER_MAX_E
#error "ROUTER_MAX_E undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef ROUTER_MAX_K
#error "ROUTER_MAX_K undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
// ROUTER_TPB: tokens per block; ROUTER_EPB: experts per block
#define ROUTER_WARPS (ROUTER_THREADS / 32)
static_assert(ROUTER_THREADS % 32 == 0 && ROUTER_TPB <= ROUTER_WARPS && ROUTER_TPB * ROUTER_EPB <= ROUTER_THREADS,
              "one selecting warp per token of a block; one thread per logit of the block in the final sum");
static_assert(ROUTER_MAX_K <= 32, "router_select keeps one selected expert per lane of a warp");
static_assert(ROUTER_MAX_E == 32 * 16, "the widest router kernel below (_e512) holds 16 experts a lane");

// All ROUTER_THREADS threads split the hidden dimension (16-byte weight loads, every load of a thread issued
// before its first use), then the per-thread partial dot products are summed across the block.
template <typename TW>
__device__ __forceinline__ void router_logits(const float* __restrict__ x, const typename TW::storage* __restrict__ w,
                                              float* __restrict__ logits, int T, int H, int E) {
    constexpr int V = Vec16<TW>::N;
    __shared__ float s_part[ROUTER_WARPS][ROUTER_EPB * ROUTER_TPB];
    const int warp = threadIdx.x >> 5;
    const int t0 = blockIdx.x * ROUTER_TPB;
    const int e0 = blockIdx.y * ROUTER_EPB;
    float acc[ROUTER_EPB][ROUTER_TPB];
#pragma unroll
    for (int i = 0; i < ROUTER_EPB; ++i)
#pragma unroll
        for (int j = 0; j < ROUTER_TPB; ++j) acc[i][j] = 0.0f;

#pragma unroll 2
    for (int c = threadIdx.x * V; c < H; c += ROUTER_THREADS * V) {
        float wv[ROUTER_EPB][V];
#pragma unroll
        for (int i = 0; i < ROUTER_EPB; ++i) {
            const int e = min(e0 + i, E - 1);  // clamped: experts past E are computed and discarded
            load16_f32<TW>(w + (size_t)e * H + c, wv[i]);
        }
#pragma unroll
        for (int j = 0; j < ROUTER_TPB; ++j) {
            const int t = min(t0 + j, T - 1);  // clamped likewise
#pragma unroll
            for (int q = 0; q < V; q += 4) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(x + (size_t)t * H + c + q));
#pragma unroll
                for (int i = 0; i < ROUTER_EPB; ++i) {
                    acc[i][j] = fmaf(wv[i][q], v.x, acc[i][j]);
                    acc[i][j] = fmaf(wv[i][q + 1], v.y, acc[i][j]);
                    acc[i][j] = fmaf(wv[i][q + 2], v.z, acc[i][j]);
                    acc[i][j] = fmaf(wv[i][q + 3], v.w, acc[i][j]);
                }
            }
        }
    }
    warp_sums_store<ROUTER_EPB * ROUTER_TPB>(reinterpret_cast<float (&)[ROUTER_EPB * ROUTER_TPB]>(acc), s_part[warp]);
    __syncthreads();
    if (threadIdx.x < ROUTER_EPB * ROUTER_TPB) {
        const int i = threadIdx.x / ROUTER_TPB, j = threadIdx.x % ROUTER_TPB;
        float sum = 0.0f;
#pragma unroll
        for (int q = 0; q < ROUTER_WARPS; ++q) sum += s_part[q][threadIdx.x];
        if (t0 + j < T && e0 + i < E) logits[(size_t)(t0 + j) * E + e0 + i] = sum;
    }
}

// A selection key packed with its expert index into one 64-bit word whose unsigned order is the selection order:
// larger key first, then the lower index. Float keys are mapped to order-preserving unsigned bits.
__device__ __forceinline__ unsigned long long pack_key(float k, int e) {
    unsigned int b = __float_as_uint(k);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (unsigned int)(0x7fffffff - e);
}

// Grouped top-k: keys of experts outside the topk_group best of n_group groups become -inf (see the header).
// `s_key` holds E + 2 * n_group words of this warp's dynamic shared memory.
template <int EPL>
__device__ __forceinline__ void router_group_mask(unsigned long long* key, float* __restrict__ s_key, int E,
                                                  int n_group, int topk_group) {
    const int lane = threadIdx.x & 31;
    const float NEG_INF = __int_as_float(0xff800000);
    float* s_gscore = s_key + E;
    int* s_kept = reinterpret_cast<int*>(s_gscore + n_group);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {  // unpack the keys (the inverse of pack_key)
        const int e = lane + 32 * i;
        if (e < E) {
            const unsigned int b = (unsigned int)(key[i] >> 32);
            s_key[e] = __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
        }
    }
    __syncwarp();
    const int gsize = E / n_group;
    for (int g = lane; g < n_group; g += 32) {  // the sum of the group's two best keys
        float b1 = NEG_INF, b2 = NEG_INF;
        for (int j = 0; j < gsize; ++j) {
            const float v = s_key[g * gsize + j];
            if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
        }
        const float sc = gsize > 1 ? b1 + b2 : b1;
        s_gscore[g] = sc != sc ? NEG_INF : sc;
        s_kept[g] = 0;
    }
    __syncwarp();
    for (int j = 0; j < topk_group; ++j) {  // the best groups, ties to the lower group index
        unsigned long long best = 0ull;
        for (int g = lane; g < n_group; g += 32) {
            const unsigned long long gk = s_kept[g] ? 0ull : pack_key(s_gscore[g], g);
            best = gk > best ? gk : best;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(COLIBRI_FULL_MASK, best, o);
            best = other > best ? other : best;
        }
        const int g = 0x7fffffff - (int)(unsigned int)(best & 0xffffffffull);
        if (lane == (g & 31)) s_kept[g] = 1;  // the lane that owns group g
        __syncwarp();
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        if (e < E && !s_kept[e / gsize]) key[i] = pack_key(NEG_INF, e);
    }
}

template <int EPL>
__device__ void router_select(const float* __restrict__ logits, const float* __restrict__ bias,
                              int* __restrict__ topk_ids, float* __restrict__ topk_w, int t, int E, int K,
                              int scoring, int order, int normalize, float scale, int n_group, int topk_group,
                              float* __restrict__ s_key) {
    const int lane = threadIdx.x & 31;
    const float NEG_INF = __int_as_float(0xff800000);
    float logit[EPL], score[EPL];
    unsigned long long key[EPL];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        float l = NEG_INF;
        if (e < E) {
            l = __ldcg(logits + (size_t)t * E + e);  // written by other blocks: bypass L1
            if (l != l) l = NEG_INF;  // NaN never wins
        }
        logit[i] = l;
        m = fmaxf(m, l);
    }
    m = warp_max(m);
    if (order == 0 && scoring == 0) {
        float z = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            score[i] = (lane + 32 * i < E) ? expf(logit[i] - m) : 0.0f;
            z += score[i];
        }
        const float inv = 1.0f / warp_sum(z);
#pragma unroll
        for (int i = 0; i < EPL; ++i) score[i] *= inv;
    } else if (order == 0) {
#pragma unroll
        for (int i = 0; i < EPL; ++i) score[i] = 1.0f / (1.0f + expf(-logit[i]));
    } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) score[i] = logit[i];
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        float k = (order == 0) ? score[i] : logit[i];
        if (bias != nullptr && e < E) k += __ldg(bias + e);  // order 0: selection only; order 1: the logits
        if (k != k) k = NEG_INF;
        if (order == 1) score[i] = k;  // the weights are the softmax of the selected (biased) logits
        key[i] = e < E ? pack_key(k, e) : 0ull;  // 0: below every real key
    }
    if (order == 0 && topk_group < n_group) router_group_mask<EPL>(key, s_key, E, n_group, topk_group);
    float my_w = 0.0f;  // lane j < K keeps the j-th selection
    int my_id = 0;
    for (int j = 0; j < K; ++j) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int i = 0; i < EPL; ++i) best = key[i] > best ? key[i] : best;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(COLIBRI_FULL_MASK, best, o);
            best = other > best ? other : best;
        }
        const int e = 0x7fffffff - (int)(unsigned int)(best & 0xffffffffull);
        float sc = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            if (key[i] == best) { sc = score[i]; key[i] = 0ull; }  // only the owner lane matches
        }
        sc = __shfl_sync(COLIBRI_FULL_MASK, sc, e & 31);
        if (lane == j) { my_w = sc; my_id = e; }
    }
    // weights of the selection
    const bool mine = lane < K;
    if (order == 1) {  // softmax over the k selected logits; the first selection holds their maximum
        const float top = __shfl_sync(COLIBRI_FULL_MASK, my_w, 0);
        const float ex = mine ? expf(my_w - top) : 0.0f;
        my_w = ex / warp_sum(ex);
    } else if (normalize) {
        my_w = my_w / warp_sum(mine ? my_w : 0.0f);
    }
    if (mine) {
        topk_ids[(size_t)t * K + lane] = my_id;
        topk_w[(size_t)t * K + lane] = my_w * scale;
    }
}

// Whether this block selects for its token group: the only block of the group, or the last to finish (a ticket
// taken with atomicAdd after a fence, the group's counter reset to zero for the next launch; the fence after it lets
// the block see the other blocks' logits). Starts with a barrier: every logit and shared value of the block is
// written.
__device__ __forceinline__ bool router_last_block(unsigned int* tickets) {
    __shared__ int s_last;
    if (gridDim.y == 1) {
        __syncthreads();
        return true;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int ticket = atomicAdd(tickets + blockIdx.x, 1u);
        s_last = (ticket == gridDim.y - 1);
        if (s_last) tickets[blockIdx.x] = 0u;  // ready for the next launch
    }
    __syncthreads();
    if (!s_last) return false;
    __threadfence();
    return true;
}

// The selection of the block's tokens, a warp each (the last block of the group).
template <int EPL>
__device__ __forceinline__ void router_select_tokens(const float* logits, const float* bias, int* topk_ids,
                                                     float* topk_w, int T, int E, int K, int scoring, int order,
                                                     int normalize, float scale, int n_group, int topk_group) {
    extern __shared__ float s_dyn[];  // grouped top-k only: ROUTER_TPB * (E + 2 * n_group) words
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x * ROUTER_TPB + warp;
    if (warp < ROUTER_TPB && t < T)
        router_select<EPL>(logits, bias, topk_ids, topk_w, t, E, K, scoring, order, normalize, scale, n_group,
                           topk_group, s_dyn + (size_t)warp * (E + 2 * n_group));
}

template <typename TW, int EPL>
__device__ __forceinline__ void router_impl(const float* x, const typename TW::storage* w, const float* bias,
                                            float* logits, unsigned int* tickets, int* topk_ids, float* topk_w,
                                            int T, int H, int E, int K, int scoring, int order, int normalize,
                                            float scale, int n_group, int topk_group) {
    router_logits<TW>(x, w, logits, T, H, E);
    if (!router_last_block(tickets)) return;
    router_select_tokens<EPL>(logits, bias, topk_ids, topk_w, T, E, K, scoring, order, normalize, scale, n_group,
                              topk_group);
}

// ------------------------------------------------------------------------- add_rmsnorm_route: the norm fused in
// The logits of add_rmsnorm_route: each block recomputes, for its ROUTER_TPB tokens, v = h + alpha * o over its
// threads' share of the hidden dimension, in add_rmsnorm's layout (4-element vectors, thread t holding vectors t,
// t + ROUTER_THREADS, ...: norm_row_registers' order) and sums v^2 as add_rmsnorm does. The logits are linear in
// x = v * inv * w_norm, inv = rsqrt(mean(v^2) + eps) a scalar a token, so the block accumulates W (v w_norm) and
// scales the sums by inv at the end: every router weight load and multiply-add is issued before the norm's
// reduction completes (none depends on it), and the tokens' sums of squares ride in the block reduction of the
// partial logits instead of barriers of their own. Stores this block's logits [T, E] and each token's inv in s_inv.
template <typename TW>
__device__ __forceinline__ void router_norm_logits(const float* h, const float* __restrict__ o,
                                                   const typename TW::storage* __restrict__ wn,
                                                   const typename TW::storage* __restrict__ w,
                                                   float* __restrict__ logits, float* s_inv, int T, int H, int E,
                                                   float alpha, float eps) {
    constexpr int SQUARES = ROUTER_EPB * ROUTER_TPB;  // s_part: the partial logits, then the sums of squares
    __shared__ float s_part[ROUTER_WARPS][SQUARES + ROUTER_TPB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t0 = blockIdx.x * ROUTER_TPB;
    const int e0 = blockIdx.y * ROUTER_EPB;
    float acc[ROUTER_EPB][ROUTER_TPB], ss[ROUTER_TPB];
#pragma unroll
    for (int j = 0; j < ROUTER_TPB; ++j) {
        ss[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTER_EPB; ++i) acc[i][j] = 0.0f;
    }

#pragma unroll 2
    for (int c = 4 * threadIdx.x; c < H; c += 4 * ROUTER_THREADS) {
        float wv[ROUTER_EPB][4], g[4];
#pragma unroll
        for (int i = 0; i < ROUTER_EPB; ++i) {
            const int e = min(e0 + i, E - 1);  // clamped: experts past E are computed and discarded
            ldg4_f32<TW>(w + (size_t)e * H + c, wv[i]);
        }
        ldg4_f32<TW>(wn + c, g);
#pragma unroll
        for (int j = 0; j < ROUTER_TPB; ++j) {
            const size_t row = (size_t)min(t0 + j, T - 1) * H;  // clamped likewise
            float hv[4], ov[4];
            load4_f32<TF32>(h + row + c, hv);  // coherent: the group's last block rewrites h in this launch
            load4_f32<TF32>(o + row + c, ov);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float v = fmaf(alpha, ov[q], hv[q]);
                ss[j] = fmaf(v, v, ss[j]);
                const float vg = v * g[q];
#pragma unroll
                for (int i = 0; i < ROUTER_EPB; ++i) acc[i][j] = fmaf(wv[i][q], vg, acc[i][j]);
            }
        }
    }
    warp_sums_store<SQUARES>(reinterpret_cast<float (&)[SQUARES]>(acc), s_part[warp]);
#pragma unroll
    for (int j = 0; j < ROUTER_TPB; ++j) {       // warp_sum, as add_rmsnorm sums its squares: the same inv bits
        const float sum = warp_sum(ss[j]);
        if (lane == 0) s_part[warp][SQUARES + j] = sum;
    }
    __syncthreads();
    if (warp * 32 < SQUARES) {  // whole warps: the sums of squares are reduced warp-collectively
        const int i = threadIdx.x / ROUTER_TPB, j = threadIdx.x % ROUTER_TPB;
        float inv_j = 0.0f;
#pragma unroll
        for (int jj = 0; jj < ROUTER_TPB; ++jj) {  // block_sum's second stage: add_rmsnorm's inv, bit for bit
            const float total = warp_sum(lane < ROUTER_WARPS ? s_part[lane][SQUARES + jj] : 0.0f);
            const float inv = rsqrtf(total / (float)H + eps);
            if (jj == j) inv_j = inv;
            if (threadIdx.x == jj) s_inv[jj] = inv;
        }
        if (threadIdx.x < SQUARES) {
            float sum = 0.0f;
#pragma unroll
            for (int q = 0; q < ROUTER_WARPS; ++q) sum += s_part[q][threadIdx.x];
            if (t0 + j < T && e0 + i < E) logits[(size_t)(t0 + j) * E + e0 + i] = sum * inv_j;
        }
    }
}

// The last block of a token group writes its tokens' h (in place) and x as add_rmsnorm does (the same v, inv and
// expression: the same bits). Only it writes h: the group's other blocks have read theirs before taking a ticket.
// Each thread reads every element before it writes it (o may be h).
template <typename TW>
__device__ __forceinline__ void router_norm_store(float* h, const float* o, const typename TW::storage* wn,
                                                  float* __restrict__ x, const float* s_inv, int T, int H,
                                                  float alpha) {
    const int t0 = blockIdx.x * ROUTER_TPB;
    for (int c = 4 * threadIdx.x; c < H; c += 4 * ROUTER_THREADS) {
        float g[4];
        ldg4_f32<TW>(wn + c, g);
#pragma unroll
        for (int j = 0; j < ROUTER_TPB; ++j) {
            if (t0 + j >= T) break;
            const size_t at = (size_t)(t0 + j) * H + c;
            float v[4], ov[4];
            load4_f32<TF32>(h + at, v);
            load4_f32<TF32>(o + at, ov);
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = fmaf(alpha, ov[q], v[q]);
            store4_f32<TF32>(h + at, v);
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = rms_scaled(v[q], s_inv[j], g[q], 0.0f);  // add_rmsnorm's w_offset
            store4_f32<TF32>(x + at, v);
        }
    }
}

template <typename TW, int EPL>
__device__ __forceinline__ void add_rmsnorm_route_impl(float* h, const float* o, const typename TW::storage* wn,
                                                       float* x, const typename TW::storage* w, const float* bias,
                                                       float* logits, unsigned int* tickets, int* topk_ids,
                                                       float* topk_w, int T, int H, int E, int K, int scoring,
                                                       int order, int normalize, float scale, int n_group,
                                                       int topk_group, float alpha, float eps) {
    __shared__ float s_inv[ROUTER_TPB];
    router_norm_logits<TW>(h, o, wn, w, logits, s_inv, T, H, E, alpha, eps);
    if (!router_last_block(tickets)) return;
    router_norm_store<TW>(h, o, wn, x, s_inv, T, H, alpha);
    router_select_tokens<EPL>(logits, bias, topk_ids, topk_w, T, E, K, scoring, order, normalize, scale, n_group,
                              topk_group);
}

// suffix: <router (and norm) weight dtype>_e<32 * EPL: largest expert count>
#define ROUTER_KERNEL(SUFFIX, TW, EPL)                                                                         \
    extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)                                              \
        moe_router_##SUFFIX(const float* x, const TW::storage* w, const float* bias, float* logits,           \
                            unsigned int* tickets, int* topk_ids, float* topk_w, int T, int H, int E, int K,  \
                            int scoring, int order, int normalize, float scale, int n_group, int topk_group) {\
        router_impl<TW, EPL>(x, w, bias, logits, tickets, topk_ids, topk_w, T, H, E, K, scoring, order,       \
                             normalize, scale, n_group, topk_group);                                          \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)                                              \
        add_rmsnorm_route_##SUFFIX(float* h, const float* o, const TW::storage* wn, float* x,                 \
                                   const TW::storage* w, const float* bias, float* logits,                    \
                                   unsigned int* tickets, int* topk_ids, float* topk_w, int T, int H, int E,  \
                                   int K, int scoring, int order, int normalize, float scale, int n_group,    \
                                   int topk_group, float alpha, float eps) {                                  \
        add_rmsnorm_route_impl<TW, EPL>(h, o, wn, x, w, bias, logits, tickets, topk_ids, topk_w, T, H, E, K,  \
                                        scoring, order, normalize, scale, n_group, topk_group, alpha, eps);   \
    }
#define ROUTER_KERNELS(SUF, TW)          \
    ROUTER_KERNEL(SUF##_e32, TW, 1)      \
    ROUTER_KERNEL(SUF##_e64, TW, 2)      \
    ROUTER_KERNEL(SUF##_e128, TW, 4)     \
    ROUTER_KERNEL(SUF##_e256, TW, 8)     \
    ROUTER_KERNEL(SUF##_e512, TW, 16)

ROUTER_KERNELS(f32, TF32)
ROUTER_KERNELS(f16, TF16)
ROUTER_KERNELS(bf16, TBF16)

// ---------------------------------------------------------------- passes of many rows: the logits from cuBLAS
// For passes of limits.ROUTER_GEMM_MIN_ROWS rows or more, ops.router takes the logits from cuBLAS's fp32 product
// (ops.gemm_f32: fp32 products of the same values as router_logits, summed in another order) and launches the
// selection alone: router_logits re-reads each row of x once per block of ROUTER_EPB experts and each expert row
// once per block of ROUTER_TPB tokens, which costs ~51 us at 512 rows of Qwen3-30B-A3B (docs/benchmarks.md,
// session 14) where the product is a few microseconds.

// router_widen_<dtype>: the router weight [E, H] (n = E * H values, a multiple of 8) as float32, for that product.
#define ROUTER_WIDEN(SUF, TW)                                                                                   \
    extern "C" __global__ void router_widen_##SUF(const TW::storage* __restrict__ w, float* __restrict__ out,  \
                                                  long long n) {                                               \
        constexpr int V = Vec16<TW>::N;                                                                        \
        const long long stride = (long long)gridDim.x * blockDim.x * V;                                        \
        for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += stride) {       \
            float v[V];                                                                                        \
            load16_f32<TW>(w + i, v);                                                                          \
            _Pragma("unroll") for (int q = 0; q < V; ++q) out[i + q] = v[q];                                   \
        }                                                                                                      \
    }
ROUTER_WIDEN(f16, TF16)
ROUTER_WIDEN(bf16, TBF16)

// moe_router_select_e<width>: the selection of router_select_tokens on logits [T, E] already written; grid
// ceil(T / ROUTER_TPB) blocks of ROUTER_THREADS threads (warp j < ROUTER_TPB selects token blockIdx.x * ROUTER_TPB
// + j), the dynamic shared memory of the fused kernel (router_shared_bytes).
#define ROUTER_SELECT(WIDTH, EPL)                                                                               \
    extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)                                              \
        moe_router_select_e##WIDTH(const float* logits, const float* bias, int* topk_ids, float* topk_w, int T,  \
                                   int E, int K, int scoring, int order, int normalize, float scale, int n_group,  \
                                   int topk_group) {                                                           \
        router_select_tokens<EPL>(logits, bias, topk_ids, topk_w, T, E, K, scoring, order, normalize, scale,    \
                                  n_group, topk_group);                                                        \
    }
ROUTER_SELECT(32, 1)
ROUTER_SELECT(64, 2)
ROUTER_SELECT(128, 4)
ROUTER_SELECT(256, 8)
ROUTER_SELECT(512, 16)
