// Gated DeltaNet kernels (Qwen3-Next, Qwen3.5 linear-attention layers); all math fp32, every weight f32.
//
//   deltanet_decode_plan:  a decode step's plan (row n is sequence seq[n]'s only row) and the state lengths
//   deltanet_conv:         causal depthwise conv + silu over each span's rows, the rolling conv state advanced
//   deltanet_prepare:      l2-normed q (times dk^-1/2) and k per key head, beta = sigmoid(b), g = -e^A softplus(a + dt)
//   deltanet_recurrent:    the gated delta rule row by row over each span's [dk x dv] state per value head
//   deltanet_gated_norm:   rmsnorm of each value head's output times w times silu(z)
//
// A pass's rows come in spans: the consecutive rows of one sequence, in position order. plan [4, NS] int32 holds
// per span its first row, its row count, its sequence (the state index) and `fresh` (1: the sequence starts from
// zero states; its stored states are not read). The NumPy twins are in runtime/numpy_backend.py (causal_conv,
// l2norm / softplus, delta_rule, rmsnorm * silu) and gated_delta_net composes them the same way.
#include "common.cuh"

#ifndef DELTANET_THREADS
#error "DELTANET_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DELTANET_MAX_VALUE_DIM
#error "DELTANET_MAX_VALUE_DIM undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
// DELTANET_THREADS: conv and plan blocks; deltanet_recurrent runs a thread per value column (at most
// DELTANET_MAX_VALUE_DIM, one block); prepare and gated_norm run a warp per head.
static_assert(DELTANET_THREADS % 32 == 0 && DELTANET_THREADS <= 1024, "whole warps, one block");
static_assert(DELTANET_MAX_VALUE_DIM % 32 == 0 && DELTANET_MAX_VALUE_DIM <= 1024, "one block of whole warps");

// ------------------------------------------------------------------------------------------------ decode plan
// Row n is its own span. A sequence starts afresh at position 0, or when its state does not hold exactly pos[n]
// tokens (a serving loop's idle slot fed another slot's token); lengths[s] then counts pos[n] + 1 tokens.
// Each row must be a distinct sequence (a decode step).
extern "C" __global__ void __launch_bounds__(DELTANET_THREADS)
    deltanet_decode_plan(const int* __restrict__ seq, const int* __restrict__ pos, long long* __restrict__ lengths,
                         int* __restrict__ plan, int T) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= T) return;
    const int s = seq[n], p = pos[n];
    plan[n] = n;
    plan[T + n] = 1;
    plan[2 * T + n] = s;
    plan[3 * T + n] = (p == 0 || lengths[s] != (long long)p) ? 1 : 0;
    lengths[s] = (long long)p + 1;
}

// ------------------------------------------------------------------------------------------------ causal conv
// x, u [T, C] (the q|k|v projection and its conv output), w [C, K], state [S, C, K-1] (the K-1 inputs before each
// sequence's next row). A thread per (span, channel): output i of a span reads inputs i-K+1 .. i of it, the ones
// before its first row from the state. Then the state becomes the span's last K-1 inputs, written in ascending
// order: entry k reads old entry n + k (> k) before anything overwrites it.
extern "C" __global__ void __launch_bounds__(DELTANET_THREADS)
    deltanet_conv(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ state,
                  const int* __restrict__ plan, float* __restrict__ u, int NS, int C, int K) {
    const long long total = (long long)NS * C;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int sp = (int)(idx / C), c = (int)(idx % C);
        const int r0 = plan[sp], n = plan[NS + sp], s = plan[2 * NS + sp], fresh = plan[3 * NS + sp];
        float* st = state + ((size_t)s * C + c) * (K - 1);
        const float* wc = w + (size_t)c * K;
        for (int i = 0; i < n; ++i) {
            float acc = 0.0f;
            for (int k = 0; k < K; ++k) {
                const int m = i - (K - 1) + k;       // input m of the span; m < 0: state entry K-1+m
                const float v = m >= 0 ? x[(size_t)(r0 + m) * C + c] : (fresh ? 0.0f : st[K - 1 + m]);
                acc = fmaf(wc[k], v, acc);
            }
            u[(size_t)(r0 + i) * C + c] = silu_f32(acc);
        }
        for (int k = 0; k < K - 1; ++k) {
            const int m = n - (K - 1) + k;
            st[k] = m >= 0 ? x[(size_t)(r0 + m) * C + c] : (fresh ? 0.0f : st[K - 1 + m]);
        }
    }
}

// ------------------------------------------------------------------------------------------------ q, k, beta, g
// u [T, C]: row n holds q (nk heads of dk), k (nk heads of dk), then v. Grid (T, nk), one warp: key head h of row
// n l2-normed (x / sqrt(sum x^2 + l2_eps)), q also times dk^-1/2, into q_out, k_out [T, nk, dk]; the warps of
// head 0 also compute beta, g [T, nv] from b, a [T, nv] and A_log, dt_bias [nv].
extern "C" __global__ void __launch_bounds__(32)
    deltanet_prepare(const float* __restrict__ u, const float* __restrict__ b, const float* __restrict__ a,
                     const float* __restrict__ A_log, const float* __restrict__ dt_bias, float* __restrict__ q_out,
                     float* __restrict__ k_out, float* __restrict__ beta, float* __restrict__ g, int C, int nk,
                     int nv, int dk, float l2_eps) {
    const int n = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const float* q = u + (size_t)n * C + (size_t)h * dk;
    const float* k = q + (size_t)nk * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int i = lane; i < dk; i += 32) {
        sq = fmaf(q[i], q[i], sq);
        sk = fmaf(k[i], k[i], sk);
    }
    const float inv_q = rsqrtf((float)dk) / sqrtf(warp_sum(sq) + l2_eps);
    const float inv_k = 1.0f / sqrtf(warp_sum(sk) + l2_eps);
    const size_t dst = ((size_t)n * nk + h) * dk;
    for (int i = lane; i < dk; i += 32) {
        q_out[dst + i] = q[i] * inv_q;
        k_out[dst + i] = k[i] * inv_k;
    }
    if (h != 0) return;
    for (int j = lane; j < nv; j += 32) {
        const size_t r = (size_t)n * nv + j;
        beta[r] = 1.0f / (1.0f + expf(-b[r]));
        const float x = a[r] + dt_bias[j];
        const float softplus = x > 20.0f ? x : log1pf(expf(x));     // torch's threshold
        g[r] = -expf(A_log[j]) * softplus;
    }
}

// ------------------------------------------------------------------------------------------------ delta rule
// Grid (spans, nv), a thread per value column j (blockDim >= dv). For each row t of the span, in order, with S the
// [dk, dv] state of (sequence, value head h) and kh = h / (nv / nk) its key head:
//   S *= e^g[t];  delta = beta[t] (v[t] - k[t] S);  S += k[t] delta;  o[t] = q[t] S
// Thread j owns column j of S (two passes over it a row: k S, then the update and q S). q, k of the row are
// staged in shared memory (2 dk floats). v is read from u (row stride C, offset v_offset); o [T, nv, dv].
extern "C" __global__ void __launch_bounds__(DELTANET_MAX_VALUE_DIM)
    deltanet_recurrent(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ u,
                       const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                       const int* __restrict__ plan, float* __restrict__ o, int NS, int C, int v_offset, int nk,
                       int nv, int dk, int dv) {
    extern __shared__ float s_qk[];               // q [dk], then k [dk]
    float* sq = s_qk;
    float* sk = s_qk + dk;
    const int sp = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const int r0 = plan[sp], n = plan[NS + sp], s = plan[2 * NS + sp], fresh = plan[3 * NS + sp];
    const int kh = h / (nv / nk);
    float* S = state + ((size_t)s * nv + h) * dk * dv;
    if (fresh && j < dv)
        for (int i = 0; i < dk; ++i) S[(size_t)i * dv + j] = 0.0f;
    for (int t = r0; t < r0 + n; ++t) {
        __syncthreads();                          // the previous row's q, k are no longer read
        for (int i = j; i < dk; i += blockDim.x) {
            sq[i] = q[((size_t)t * nk + kh) * dk + i];
            sk[i] = k[((size_t)t * nk + kh) * dk + i];
        }
        __syncthreads();
        if (j >= dv) continue;
        const float decay = expf(g[(size_t)t * nv + h]);
        float kv = 0.0f;
#pragma unroll 8     // a column's loads in flight together (a decode step is latency-bound: few blocks)
        for (int i = 0; i < dk; ++i) kv = fmaf(S[(size_t)i * dv + j] * decay, sk[i], kv);
        const float delta = (u[(size_t)t * C + v_offset + (size_t)h * dv + j] - kv) * beta[(size_t)t * nv + h];
        float out = 0.0f;
#pragma unroll 8
        for (int i = 0; i < dk; ++i) {
            const float v = fmaf(sk[i], delta, S[(size_t)i * dv + j] * decay);
            S[(size_t)i * dv + j] = v;
            out = fmaf(v, sq[i], out);
        }
        o[((size_t)t * nv + h) * dv + j] = out;
    }
}

// ------------------------------------------------------------------------------------------------ gated norm
// Grid (T, nv), one warp: y[n, h*dv + j] = o[n, h, j] / sqrt(mean_j o[n, h, :]^2 + eps) * w[j] * silu(z[n, h*dv + j]).
extern "C" __global__ void __launch_bounds__(32)
    deltanet_gated_norm(const float* __restrict__ o, const float* __restrict__ z, const float* __restrict__ w,
                        float* __restrict__ y, int nv, int dv, float eps) {
    const size_t row = ((size_t)blockIdx.x * nv + blockIdx.y) * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += 32) ss = fmaf(o[row + j], o[row + j], ss);
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += 32) y[row + j] = o[row + j] * inv * w[j] * silu_f32(z[row + j]);
}
