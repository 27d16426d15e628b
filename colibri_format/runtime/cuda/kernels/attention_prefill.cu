// Flash attention for prefill on the tensor cores (numpy_backend.attention's contract for the rows it covers).
//
// A pass's rows are packed sequences; a "pair" is (query row, query head of the kv head's group), and the host plan
// (ops.prefill_attention_plan) cuts each span of consecutive rows of one sequence into tiles of FA_BM pairs, so a
// tile never straddles two sequences. Block = (tile, kv head): FA_THREADS / 32 warps of 16 pairs each. The tile's
// queries stay in shared memory; K and V tiles of BN keys are staged in shared memory, double buffered (cp.async
// for bf16 caches; fp32 caches are converted on the way, synchronously). S = Q K^T and O += P V run as mma.sync
// m16n8k16 bf16 with fp32 accumulation; the online softmax runs in fp32 registers (base-2 exponents, the softmax
// scale folded in). Pair p attends to keys [max(0, len - window), len) (window <= 0: all), len = q_len[row]; an
// attention sink (gpt-oss) joins the final denominator as one more logit whose value is dropped.
//
// fp32-class accuracy, as moe_gemm.cu's tensor-core GEMM: every fp32 operand x is split into hi = bf16(x) and
// lo = bf16(x - hi) (about 16 significant bits together): q and the probabilities always, K and V when the cache is
// fp32 (a bf16 cache is exact). Each product is hi * hi + lo * hi (+ hi * lo with an fp32 cache); lo * lo (2^-16
// relative) is dropped. Plain bf16 operands were measured (NumPy emulation) at 3e-3 relative error in the output and
// 1e-2 to 5e-2 in a tiny model's logits, as softmax amplifies errors in the scores.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 and ldmatrix): lane = 4 g + t. A (16 x 16, row-major) regs a0..a3 hold
// A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]; B (16 x 8, "col") b0, b1 hold B[2t..2t+1][g] and
// B[2t+8..2t+9][g]; C c0, c1 = C[g][2t..2t+1], c2, c3 = C[g+8][2t..2t+1]. ldmatrix.x4 loads four 8 x 8 bf16
// matrices whose rows' addresses come from lanes 8i..8i+7 (matrix i); lane receives row g, columns 2t..2t+1 of
// each (with .trans: of each transpose).
#include "common.cuh"

#ifndef FA_THREADS
#error "FA_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FA_BN
#error "FA_BN undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FA_BN_F32
#error "FA_BN_F32 undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FA_BN_HD256
#error "FA_BN_HD256 undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FA_PAD
#error "FA_PAD undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FA_PLAN_FIELDS
#error "FA_PLAN_FIELDS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(FA_PAD % 8 == 0, "padded shared rows stay 16-byte aligned (ldmatrix, cp.async)");
static_assert(FA_PLAN_FIELDS == 5, "a tile: first row of its span, first pair, pairs, first key, keys end");
static_assert(FA_THREADS % 32 == 0, "whole warps");
static_assert(FA_BN % 16 == 0 && FA_BN_F32 % 16 == 0 && FA_BN_HD256 % 16 == 0, "key tiles are whole mma k-steps");
#define FA_BM (FA_THREADS / 32 * 16)      // pairs a block: 16 a warp (one mma row block)

__device__ __forceinline__ unsigned int fa_pack_bf16(float lo_col, float hi_col) {
    return (unsigned int)TBF16::from_f32(lo_col) | ((unsigned int)TBF16::from_f32(hi_col) << 16);
}

// x4 = hi + lo: hi's and lo's four bf16 values stored at hi_dst and lo_dst (8 bytes each)
__device__ __forceinline__ void fa_store_split4(u16* hi_dst, u16* lo_dst, float4 x) {
    const float h0 = TBF16::to_f32(TBF16::from_f32(x.x)), h1 = TBF16::to_f32(TBF16::from_f32(x.y));
    const float h2 = TBF16::to_f32(TBF16::from_f32(x.z)), h3 = TBF16::to_f32(TBF16::from_f32(x.w));
    *reinterpret_cast<uint2*>(hi_dst) = make_uint2(fa_pack_bf16(h0, h1), fa_pack_bf16(h2, h3));
    *reinterpret_cast<uint2*>(lo_dst) = make_uint2(fa_pack_bf16(x.x - h0, x.y - h1), fa_pack_bf16(x.z - h2, x.w - h3));
}

__device__ __forceinline__ void fa_ldmatrix_x4(unsigned int* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

__device__ __forceinline__ void fa_ldmatrix_x4_trans(unsigned int* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

__device__ __forceinline__ void fa_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One tile of BN cache rows [k0, k0 + BN) (rows >= kend as zeros) of the sequence and kv head whose first element
// is src into dst [parts][BN][HD + FA_PAD] bf16. bf16 caches (one part): cp.async (completes at the caller's wait); fp32 (hi, lo): loaded, split, stored now.
template <typename TC, int HD, int BN>
__device__ __forceinline__ void fa_load_kv_tile(u16* dst, const typename TC::storage* __restrict__ src, size_t row,
                                                int k0, int kend) {
    constexpr int LD = HD + FA_PAD;
    if constexpr (sizeof(typename TC::storage) == 2) {
        constexpr int CHUNKS = HD / 8;                     // 16-byte chunks a row
        for (int i = threadIdx.x; i < BN * CHUNKS; i += FA_THREADS) {
            const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
            const bool valid = k0 + r < kend;
            const typename TC::storage* s = src + (valid ? (size_t)(k0 + r) * row + c : 0);
            copy16_async(dst + r * LD + c, s, valid);
        }
    } else {
        // BATCH loads in flight before their stores: few round trips to L2 a tile, and registers to spare
        constexpr int CHUNKS = HD / 4, PER_THREAD = BN * CHUNKS / FA_THREADS;   // float4 chunks a row, a thread
        constexpr int BATCH = PER_THREAD < 8 ? PER_THREAD : 8;
        static_assert(BN * CHUNKS % FA_THREADS == 0 && PER_THREAD % BATCH == 0, "whole batches of float4 chunks");
#pragma unroll 1
        for (int u0 = 0; u0 < PER_THREAD; u0 += BATCH) {
            float4 v[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int i = threadIdx.x + (u0 + u) * FA_THREADS, r = i / CHUNKS, c = (i % CHUNKS) * 4;
                v[u] = k0 + r < kend ? __ldg(reinterpret_cast<const float4*>(src + (size_t)(k0 + r) * row + c))
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int i = threadIdx.x + (u0 + u) * FA_THREADS, r = i / CHUNKS, c = (i % CHUNKS) * 4;
                fa_store_split4(dst + r * LD + c, dst + BN * LD + r * LD + c, v[u]);
            }
        }
    }
}

// The tile's FA_BM pairs' queries (rows past the tile's pairs: zeros) into s_q [2: hi, lo][FA_BM][HD + FA_PAD].
template <int HD>
__device__ __forceinline__ void fa_load_queries(u16* s_q, const float* __restrict__ q, int row0, int pair0,
                                                int npairs, int nh, int G, int kvh) {
    constexpr int LD = HD + FA_PAD, CHUNKS = HD / 4;
    for (int i = threadIdx.x; i < FA_BM * CHUNKS; i += FA_THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < npairs) {
            const int pair = pair0 + r, n = row0 + pair / G, head = kvh * G + pair % G;
            v = __ldg(reinterpret_cast<const float4*>(q + ((size_t)n * nh + head) * HD + c));
        }
        fa_store_split4(s_q + r * LD + c, s_q + FA_BM * LD + r * LD + c, v);
    }
}

template <typename TC, int HD, int BN>
__device__ __forceinline__ void attention_prefill_impl(const float* __restrict__ q,
                                                       const typename TC::storage* __restrict__ kc,
                                                       const typename TC::storage* __restrict__ vc,
                                                       const int* __restrict__ q_seq, const int* __restrict__ q_len,
                                                       const float* __restrict__ sinks, const int* __restrict__ plan,
                                                       float* __restrict__ out, int nh, int nkv, int capacity,
                                                       int window, float scale) {
    static_assert(HD % 16 == 0, "whole mma k-steps over the head dimension");
    constexpr int LD = HD + FA_PAD, NT = BN / 8, DT = HD / 8;    // key and head-dim n-tiles of 8
    constexpr bool SPLIT_KV = sizeof(typename TC::storage) == 4;   // fp32 cache: K and V as hi + lo
    constexpr int TILE = (SPLIT_KV ? 2 : 1) * BN * LD;             // one buffer of K (or V), all its parts
    constexpr float LOG2E = 1.4426950408889634f;
    const float NEG_INF = __int_as_float(0xff800000);
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* s_q = fa_smem;                                   // [hi, lo][FA_BM][LD]
    u16* s_k = s_q + 2 * FA_BM * LD;                      // [2 buffers][parts][BN][LD]
    u16* s_v = s_k + 2 * TILE;                            // [2 buffers][parts][BN][LD]

    const int* tile = plan + (size_t)blockIdx.x * FA_PLAN_FIELDS;
    const int row0 = tile[0], pair0 = tile[1], npairs = tile[2], kbegin = tile[3], kend = tile[4];
    const int kvh = blockIdx.y, G = nh / nkv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const size_t row = (size_t)nkv * HD;                  // cache elements between consecutive positions
    const size_t seq_off = (size_t)q_seq[row0] * capacity * row + (size_t)kvh * HD;
    const typename TC::storage* kb = kc + seq_off;
    const typename TC::storage* vb = vc + seq_off;

    // this lane's two pairs: warp rows g and g + 8; an idle pair (past npairs) has an empty key range
    int lo[2], len[2], head[2], n_row[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        const int pair = pair0 + min(r, npairs - 1);
        n_row[h] = row0 + pair / G;
        head[h] = kvh * G + pair % G;
        len[h] = r < npairs ? q_len[n_row[h]] : 0;
        lo[h] = window > 0 ? max(0, len[h] - window) : 0;
    }
    // the warp's key range, to skip tiles none of its pairs attends to
    int warp_lo = min(lo[0], lo[1]), warp_hi = max(len[0], len[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        warp_lo = min(warp_lo, __shfl_xor_sync(COLIBRI_FULL_MASK, warp_lo, o));
        warp_hi = max(warp_hi, __shfl_xor_sync(COLIBRI_FULL_MASK, warp_hi, o));
    }

    fa_load_queries<HD>(s_q, q, row0, pair0, npairs, nh, G, kvh);
    fa_load_kv_tile<TC, HD, BN>(s_k, kb, row, kbegin, kend);
    fa_load_kv_tile<TC, HD, BN>(s_v, vb, row, kbegin, kend);
    commit_copies();

    float o_acc[DT][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) o_acc[j][c] = 0.0f;
    const float scale_log2 = scale * LOG2E;
    const int ntiles = (kend - kbegin + BN - 1) / BN;

    for (int it = 0; it < ntiles; ++it) {
        const int k0 = kbegin + it * BN, buf = it & 1;
        if (it + 1 < ntiles) {                            // the next tile's buffer was released by the last barrier
            fa_load_kv_tile<TC, HD, BN>(s_k + (buf ^ 1) * TILE, kb, row, k0 + BN, kend);
            fa_load_kv_tile<TC, HD, BN>(s_v + (buf ^ 1) * TILE, vb, row, k0 + BN, kend);
        }
        commit_copies();                                  // an empty group on the last tile keeps the count uniform
        wait_copies<1>();                                 // this tile's group is complete
        __syncthreads();
        if (k0 < warp_hi && k0 + BN > warp_lo) {
            const u16* kt = s_k + buf * TILE;
            const u16* vt = s_v + buf * TILE;
            float s[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[j][c] = 0.0f;
            // S = Q K^T: A rows = the warp's 16 pairs, B columns = keys (K rows are B's columns: "col" layout)
#pragma unroll
            for (int ks = 0; ks < HD; ks += 16) {
                const int q_off = (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + ks + (lane >> 4) * 8;
                unsigned int a_hi[4], a_lo[4];
                fa_ldmatrix_x4(a_hi, s_q + q_off);
                fa_ldmatrix_x4(a_lo, s_q + FA_BM * LD + q_off);
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    // keys 8j.. (b[0], b[1]) and 8j+8.. (b[2], b[3]), dims ks..ks+15
                    const int k_off = (j * 8 + (lane & 7) + (lane >> 4) * 8) * LD + ks + ((lane >> 3) & 1) * 8;
                    unsigned int b[4];
                    fa_ldmatrix_x4(b, kt + k_off);
                    fa_mma(s[j], a_lo, b[0], b[1]);
                    fa_mma(s[j + 1], a_lo, b[2], b[3]);
                    if constexpr (SPLIT_KV) {
                        unsigned int b_lo[4];
                        fa_ldmatrix_x4(b_lo, kt + BN * LD + k_off);
                        fa_mma(s[j], a_hi, b_lo[0], b_lo[1]);
                        fa_mma(s[j + 1], a_hi, b_lo[2], b_lo[3]);
                    }
                    fa_mma(s[j], a_hi, b[0], b[1]);       // the largest term last
                    fa_mma(s[j + 1], a_hi, b[2], b[3]);
                }
            }
            // online softmax in base 2: masked keys -inf; m_use 0 while a pair has seen no key (exp2(-inf) = 0)
            float m_use[2], corr[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = NEG_INF;
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int key = k0 + j * 8 + 2 * t + c;
                        const bool ok = key >= lo[h] && key < len[h];
                        s[j][2 * h + c] = ok ? s[j][2 * h + c] * scale_log2 : NEG_INF;
                        mx = fmaxf(mx, s[j][2 * h + c]);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(COLIBRI_FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(COLIBRI_FULL_MASK, mx, 2));
                const float m_new = fmaxf(m[h], mx);
                m_use[h] = m_new == NEG_INF ? 0.0f : m_new;
                corr[h] = exp2f(m[h] - m_use[h]);
                m[h] = m_new;
                l[h] *= corr[h];
            }
#pragma unroll
            for (int j = 0; j < DT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) o_acc[j][c] *= corr[c >> 1];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    s[j][c] = exp2f(s[j][c] - m_use[c >> 1]);
                    l[c >> 1] += s[j][c];                 // this lane's columns only; summed over t at the end
                }
            // O += P V: P's accumulator layout is the A layout of the next product (keys 16kk.. = n-tiles 2kk, 2kk+1)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                float p[4][2];                            // a0..a3's two columns each
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int c = 0; c < 2; ++c) p[i][c] = s[2 * kk + (i >> 1)][2 * (i & 1) + c];
                unsigned int a_hi[4], a_lo[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float h0 = TBF16::to_f32(TBF16::from_f32(p[i][0]));
                    const float h1 = TBF16::to_f32(TBF16::from_f32(p[i][1]));
                    a_hi[i] = fa_pack_bf16(h0, h1);
                    a_lo[i] = fa_pack_bf16(p[i][0] - h0, p[i][1] - h1);
                }
#pragma unroll
                for (int d = 0; d < DT; d += 2) {
                    // V rows are keys (B's k): transposed loads; dims 8d.. (b[0], b[1]) and 8d+8.. (b[2], b[3])
                    const int v_off = (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + d * 8 + (lane >> 4) * 8;
                    unsigned int b[4];
                    fa_ldmatrix_x4_trans(b, vt + v_off);
                    fa_mma(o_acc[d], a_lo, b[0], b[1]);
                    fa_mma(o_acc[d + 1], a_lo, b[2], b[3]);
                    if constexpr (SPLIT_KV) {
                        unsigned int b_lo[4];
                        fa_ldmatrix_x4_trans(b_lo, vt + BN * LD + v_off);
                        fa_mma(o_acc[d], a_hi, b_lo[0], b_lo[1]);
                        fa_mma(o_acc[d + 1], a_hi, b_lo[2], b_lo[3]);
                    }
                    fa_mma(o_acc[d], a_hi, b[0], b[1]);
                    fa_mma(o_acc[d + 1], a_hi, b[2], b[3]);
                }
            }
        }
        __syncthreads();                                  // every warp is done with this buffer
    }
    wait_copies<0>();                                     // no copy outlives the block (an all-idle tile's zeros)

    // normalize (the sink's logit joins the denominator) and store this lane's two pairs
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float den = l[h];
        den += __shfl_xor_sync(COLIBRI_FULL_MASK, den, 1);
        den += __shfl_xor_sync(COLIBRI_FULL_MASK, den, 2);
        float keep = 1.0f;                                // rescales num and den when the sink is the larger logit
        if (sinks != nullptr) {
            const float sk = __ldg(sinks + head[h]) * LOG2E;
            const float mx = fmaxf(m[h], sk);
            keep = exp2f(m[h] - mx);                      // 0 when no key was seen
            den = den * keep + exp2f(sk - mx);
        }
        const float mult = den > 0.0f ? keep / den : 0.0f;
        if (warp * 16 + g + 8 * h < npairs) {
            float* o = out + ((size_t)n_row[h] * nh + head[h]) * HD + 2 * t;
#pragma unroll
            for (int j = 0; j < DT; ++j)
                *reinterpret_cast<float2*>(o + j * 8) = make_float2(o_acc[j][2 * h] * mult, o_acc[j][2 * h + 1] * mult);
        }
    }
}

// (FA_THREADS, 1): without the minimum of one block ptxas capped the hd64 kernels at 128 registers and spilled
#define ATTENTION_PREFILL_KERNEL(SUF, TC, HD, BN)                                                               \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)                                               \
        attention_prefill_##SUF(const float* q, const TC::storage* kc, const TC::storage* vc, const int* q_seq, \
                                const int* q_len, const float* sinks, const int* plan, float* out, int nh,      \
                                int nkv, int capacity, int window, float scale) {                              \
        attention_prefill_impl<TC, HD, BN>(q, kc, vc, q_seq, q_len, sinks, plan, out, nh, nkv, capacity,       \
                                           window, scale);                                                    \
    }
ATTENTION_PREFILL_KERNEL(f32_hd64, TF32, 64, FA_BN_F32)
ATTENTION_PREFILL_KERNEL(f32_hd128, TF32, 128, FA_BN_F32)
ATTENTION_PREFILL_KERNEL(f32_hd256, TF32, 256, FA_BN_HD256)
ATTENTION_PREFILL_KERNEL(bf16_hd64, TBF16, 64, FA_BN)
ATTENTION_PREFILL_KERNEL(bf16_hd128, TBF16, 128, FA_BN)
ATTENTION_PREFILL_KERNEL(bf16_hd256, TBF16, 256, FA_BN_HD256)
