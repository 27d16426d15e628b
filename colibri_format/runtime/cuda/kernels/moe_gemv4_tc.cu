// 4-bit (int4_group) expert decode GEMVs on the tensor cores: the contract of moe_gemv4.cu's moe4_gate_up_int4_* and
// moe4_down_int4_* (see there and moe_gemv.cu), fill on read and last-item shift included, with the products on
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) instead of an fp32 FMA per weight and token (those kernels are
// instruction-bound at ~1/4 of HBM bandwidth).
//   moe4tc_gate_up_int4_t<TOKC>: act[pos, i] = silu(x[tok] . gate[i]) * (x[tok] . up[i]), tok = perm[pos] / k
//   moe4tc_down_int4_t<TOKC>:    y[pair, h] = w[pair] * (act[pos] . down[h]), pair = perm[pos]
//
// Activations: moe4tc_stage writes each input row once per launch as bf16 hi = bf16(x) and lo = bf16(x - hi) (two
// B columns, ~16 significant bits: ~1e-5 relative, like the fp32 path), staged [rows, 2 (hi, lo), ncols / 2] bf16
// pairs with each 8-column word permuted to the pairs (c0, c4), (c1, c5), (c2, c6), (c3, c7): the order in which a
// packed word's nibbles decode (a dot product does not depend on the order of its terms).
//
// Weights: an MMA tile is 16 rows; lane (g, t) (g = lane / 4, t = lane % 4) loads rows g and g + 8 at chunk 4 kb + t
// of k-block kb (4 chunks, 128 columns), so each row's 64 bytes of a k-block come from one quad in whole sectors. A
// word (8 nibbles) becomes 4 bf16 pairs exactly, 3 instructions a pair: with u = w ^ 0x88888888 (v -> v + 8),
// ((u >> 4s) & 0x000F000F) | 0x43004300 is the pair (128 + 8 + v_s, 128 + 8 + v_{s+4}), less (136, 136). Pairs s = 0, 1
// are the A fragment (a0/a1, a2/a3) of one MMA, s = 2, 3 of the next.
//
// Group scales: an MMA sums over the k of all 4 lanes of a quad, i.e. over 4 chunks (4 groups when group = 32). So
// that each chunk keeps its own sum, B's 8 columns are (chunk slot, part) pairs of one token: column 2s + p holds part
// p (hi, lo) of the activations on slot s's columns, zero on the other slots' k. Lane (g, t) feeds B column g, so only
// lane (g, g / 2) loads activations (its own chunk, part g % 2), the others feed zeros; accumulator columns 2t, 2t + 1
// of lane (g, t) are then its own chunk's hi and lo sums for rows g and g + 8, which it scales by the group scales it
// loaded with the chunk. One MMA per token per 16 x 16 weights.
//
// Block: TC4_THREADS threads share a block item (active expert slot, ROUT outputs: gate_up a tile of gate rows and
// the tile of their up rows, down two tiles of rows); its warps split the k-blocks (warp w takes TC4_KSTEP
// consecutive k-blocks, loaded before they are used, every TC4_WARPS * TC4_KSTEP), so that even down's few items
// keep enough bytes in flight; their sums meet in shared memory in a fixed order (deterministic outputs).
#include "common.cuh"

#ifndef TC4_THREADS
#error "TC4_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef TC4_KSTEP
#error "TC4_KSTEP undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(TC4_THREADS % 32 == 0 && TC4_KSTEP >= 1, "whole warps, at least one k-block a step");

#define TC4_WARPS (TC4_THREADS / 32)
#define TC4_TILE 16          // weight rows of an MMA tile
#define TC4_MT 2             // MMA tiles of a block item
#define TC4_KB_CHUNKS 4      // 16-byte chunks (32 weights) of a k-block: one per lane of a quad

// ---- activations --------------------------------------------------------------------------------------------------
// in [rows, ncols] f32 -> staged [rows, 2, ncols / 2] bf16 pairs (header): pair q of part p of a row holds columns
// 8 (q / 4) + q % 4 and that + 4.
extern "C" __global__ void __launch_bounds__(TC4_THREADS)
    moe4tc_stage(const float* __restrict__ in, unsigned int* __restrict__ staged, int rows, int ncols) {
    const int half = ncols >> 1;
    const long long n = (long long)rows * ncols;   // pairs: ncols / 2 per part, two parts a row
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long r = i / ncols;
        const int q = (int)(i - r * ncols);
        const bool lo = q >= half;
        const int pq = lo ? q - half : q;
        const float* src = in + r * ncols + 8 * (pq >> 2) + (pq & 3);
        unsigned int pair = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float v = src[4 * h];
            const u16 hi = TBF16::from_f32(v);
            pair |= (unsigned int)(lo ? TBF16::from_f32(v - TBF16::to_f32(hi)) : hi) << (16 * h);
        }
        staged[i] = pair;
    }
}

// ---- weights ------------------------------------------------------------------------------------------------------
// The 8 int4 weights of a word as bf16 pairs (nibble s, nibble s + 4), s = 0..3, exactly (header).
__device__ __forceinline__ void int4_word_to_bf16x2(unsigned int w, unsigned int (&pairs)[4]) {
    const unsigned int u = w ^ 0x88888888u;
#pragma unroll
    for (int s = 0; s < 4; ++s) pairs[s] = bf16x2_sub(((u >> (4 * s)) & 0x000F000Fu) | 0x43004300u, 0x43084308u);
}

__device__ __forceinline__ unsigned int word_of(const int4& v, int i) {
    return (unsigned int)(i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w);
}

// This lane's chunks and group scales of TC4_KSTEP k-blocks from kb0 (rows[tile][h]: rows g, g + 8 of each tile);
// chunks past the row (the last k-block of a row of 32 * odd columns) read as zeros with scale 0. fill (the first
// token pass of a filling expert): every chunk and scale read is stored at the same offset from the slot.
__device__ __forceinline__ void load_kstep(const int4* __restrict__ wbase, const u16* __restrict__ sbase,
                                           char* fill, long long off_w, long long off_s,
                                           const int (&rows)[TC4_MT][2], int kb0, int t, int nchunk, int ngroups,
                                           int group, int4 (&raw)[TC4_KSTEP][TC4_MT][2],
                                           float (&scale)[TC4_KSTEP][TC4_MT][2]) {
#pragma unroll
    for (int u = 0; u < TC4_KSTEP; ++u) {
        const int cc = (kb0 + u) * TC4_KB_CHUNKS + t;
#pragma unroll
        for (int tile = 0; tile < TC4_MT; ++tile)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                raw[u][tile][h] = int4{0, 0, 0, 0};
                scale[u][tile][h] = 0.0f;
                if (cc >= nchunk) continue;
                const size_t w_at = (size_t)rows[tile][h] * nchunk + cc;
                const size_t s_at = (size_t)rows[tile][h] * ngroups + (cc << 5) / group;
                raw[u][tile][h] = __ldg(wbase + w_at);
                const u16 s = sbase[s_at];
                scale[u][tile][h] = TF16::to_f32(s);
                if (fill) {
                    reinterpret_cast<int4*>(fill + off_w)[w_at] = raw[u][tile][h];
                    reinterpret_cast<u16*>(fill + off_s)[s_at] = s;
                }
            }
    }
}

// The MMAs of one k-block for the pass's nt tokens, into sums[tile][token][h] (rows g, g + 8; hi + lo, scaled).
// b_rows[j]: token j's staged part (g % 2) as uint4 (4 pairs, one word's columns); cc: this lane's chunk; feeds:
// whether this lane's B column is its own chunk's (lane (g, g / 2)).
template <int TOKC>
__device__ __forceinline__ void mma_kblock(const int4 (&raw)[TC4_MT][2], const float (&scale)[TC4_MT][2],
                                           const uint4* const (&b_rows)[TOKC], int cc, int nchunk, bool feeds,
                                           int nt, float (&sums)[TC4_MT][TOKC][2]) {
    feeds = feeds && cc < nchunk;   // a chunk past the row: zeros
    float c[TC4_MT][TOKC][4];
#pragma unroll
    for (int tile = 0; tile < TC4_MT; ++tile)
#pragma unroll
        for (int j = 0; j < TOKC; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) c[tile][j][i] = 0.0f;
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
        unsigned int a[TC4_MT][2][4];
#pragma unroll
        for (int tile = 0; tile < TC4_MT; ++tile)
#pragma unroll
            for (int h = 0; h < 2; ++h) int4_word_to_bf16x2(word_of(raw[tile][h], wi), a[tile][h]);
#pragma unroll
        for (int j = 0; j < TOKC; ++j) {
            if (j >= nt) break;   // warp-uniform
            const uint4 b = feeds ? __ldg(b_rows[j] + cc * 4 + wi) : uint4{0u, 0u, 0u, 0u};
#pragma unroll
            for (int tile = 0; tile < TC4_MT; ++tile) {
                mma_16816(c[tile][j], a[tile][0][0], a[tile][1][0], a[tile][0][1], a[tile][1][1], b.x, b.y);
                mma_16816(c[tile][j], a[tile][0][2], a[tile][1][2], a[tile][0][3], a[tile][1][3], b.z, b.w);
            }
        }
    }
#pragma unroll
    for (int tile = 0; tile < TC4_MT; ++tile)
#pragma unroll
        for (int j = 0; j < TOKC; ++j) {
            sums[tile][j][0] = fmaf(scale[tile][0], c[tile][j][0] + c[tile][j][1], sums[tile][j][0]);
            sums[tile][j][1] = fmaf(scale[tile][1], c[tile][j][2] + c[tile][j][3], sums[tile][j][1]);
        }
}

template <int TOKC, bool GATEUP>
__device__ __forceinline__ void moe_gemv4_tc(const unsigned int* __restrict__ staged,
                                             const unsigned long long* __restrict__ blobs,
                                             const unsigned long long* __restrict__ fills, long long off_w,
                                             long long off_s, const int* __restrict__ perm,
                                             const int* __restrict__ offsets, const int* __restrict__ active,
                                             const int* __restrict__ meta, const float* __restrict__ pair_w,
                                             float* __restrict__ out, int ncols, int nout, int k, int group) {
    constexpr int ROUT = GATEUP ? TC4_TILE : TC4_MT * TC4_TILE;   // outputs of a block item
    __shared__ float partial[TC4_WARPS][TC4_MT][TOKC][TC4_TILE];  // each warp's sums of its k-blocks
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool feeds = t == (g >> 1);
    const int n_rg = (nout + ROUT - 1) / ROUT;
    const int total = meta[0] * n_rg;
    const int nchunk = ncols >> 5, ngroups = ncols / group;
    const int nkb = (nchunk + TC4_KB_CHUNKS - 1) / TC4_KB_CHUNKS;

    for (int item = blockIdx.x; item < total; item += gridDim.x) {
        const int slot = item / n_rg;
        const int o0 = (item - slot * n_rg) * ROUT;
        const int e = active[slot];
        const char* blob = reinterpret_cast<const char*>(blobs[e]);
        const int4* wbase = reinterpret_cast<const int4*>(blob + off_w);
        const u16* sbase = reinterpret_cast<const u16*>(blob + off_s);
        char* fill = fills ? reinterpret_cast<char*>(fills[e]) : nullptr;
        // the last item of an expert is shifted down to stay inside the matrix (nout >= ROUT); it then writes
        // only the outputs at or past its own o0
        const int ob = min(o0, nout - ROUT);
        int rows[TC4_MT][2];
#pragma unroll
        for (int tile = 0; tile < TC4_MT; ++tile) {
            const int first = GATEUP ? ob + tile * nout : ob + tile * TC4_TILE;   // gate_up: gate, then up rows
            rows[tile][0] = first + g;
            rows[tile][1] = first + g + 8;
        }
        const int start = offsets[e];
        const int cnt = offsets[e + 1] - start;

        for (int c0 = 0; c0 < cnt; c0 += TOKC) {
            const int nt = min(TOKC, cnt - c0);
            const uint4* b_rows[TOKC];
#pragma unroll
            for (int j = 0; j < TOKC; ++j) {
                const int pos = start + c0 + min(j, nt - 1);
                const int r = GATEUP ? perm[pos] / k : pos;
                b_rows[j] = reinterpret_cast<const uint4*>(staged + ((size_t)r * 2 + (g & 1)) * (ncols >> 1));
            }
            float sums[TC4_MT][TOKC][2];
#pragma unroll
            for (int tile = 0; tile < TC4_MT; ++tile)
#pragma unroll
                for (int j = 0; j < TOKC; ++j) sums[tile][j][0] = sums[tile][j][1] = 0.0f;

#pragma unroll 1
            for (int kb0 = warp * TC4_KSTEP; kb0 < nkb; kb0 += TC4_WARPS * TC4_KSTEP) {
                int4 raw[TC4_KSTEP][TC4_MT][2];
                float scale[TC4_KSTEP][TC4_MT][2];
                load_kstep(wbase, sbase, c0 == 0 ? fill : nullptr, off_w, off_s, rows, kb0, t, nchunk, ngroups,
                           group, raw, scale);
#pragma unroll
                for (int u = 0; u < TC4_KSTEP; ++u)
                    if (kb0 + u < nkb)   // warp-uniform
                        mma_kblock<TOKC>(raw[u], scale[u], b_rows, (kb0 + u) * TC4_KB_CHUNKS + t, nchunk, feeds,
                                         nt, sums);
            }
            // quad sums (the 4 chunk slots) -> shared, then the warps' sums in warp order
#pragma unroll
            for (int tile = 0; tile < TC4_MT; ++tile)
#pragma unroll
                for (int j = 0; j < TOKC; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float v = sums[tile][j][h];
                        v += __shfl_xor_sync(COLIBRI_FULL_MASK, v, 1);
                        v += __shfl_xor_sync(COLIBRI_FULL_MASK, v, 2);
                        if (t == 0) partial[warp][tile][j][g + 8 * h] = v;
                    }
            __syncthreads();
            for (int idx = threadIdx.x; idx < nt * ROUT; idx += TC4_THREADS) {
                const int j = idx / ROUT, q = idx - j * ROUT;
                const int pos = start + c0 + j;
                float v[TC4_MT] = {};
#pragma unroll
                for (int w = 0; w < TC4_WARPS; ++w)
#pragma unroll
                    for (int tile = 0; tile < TC4_MT; ++tile) v[tile] += partial[w][tile][j][q % TC4_TILE];
                if (ob + q < o0) continue;
                if (GATEUP) {
                    out[(size_t)pos * nout + ob + q] = silu_f32(v[0]) * v[1];
                } else {
                    const int pair = perm[pos];
                    out[(size_t)pair * nout + ob + q] = __ldg(pair_w + pair) * v[q / TC4_TILE];
                }
            }
            __syncthreads();   // partial is rewritten by the next pass
        }
    }
}

#define GATE_UP4_TC_KERNEL(NAME, TOKC)                                                                           \
    extern "C" __global__ void __launch_bounds__(TC4_THREADS)                                                  \
        NAME(const unsigned int* x_staged, const unsigned long long* blobs, const unsigned long long* fills,   \
             long long off_w, long long off_s, const int* perm, const int* offsets, const int* active,         \
             const int* meta, float* act, int H, int I, int k, int group) {                                    \
        moe_gemv4_tc<TOKC, true>(x_staged, blobs, fills, off_w, off_s, perm, offsets, active, meta, nullptr, act, \
                                 H, I, k, group);                                                              \
    }
#define DOWN4_TC_KERNEL(NAME, TOKC)                                                                              \
    extern "C" __global__ void __launch_bounds__(TC4_THREADS)                                                  \
        NAME(const unsigned int* act_staged, const unsigned long long* blobs, const unsigned long long* fills, \
             long long off_w, long long off_s, const int* perm, const int* offsets, const int* active,         \
             const int* meta, const float* pair_w, float* y, int H, int I, int group) {                        \
        moe_gemv4_tc<TOKC, false>(act_staged, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w, y, \
                                  I, H, 1, group);                                                             \
    }

// suffix: _t<TOKC>, tokens per pass (limits.GEMV4_TOKC)
GATE_UP4_TC_KERNEL(moe4tc_gate_up_int4_t1, 1)
GATE_UP4_TC_KERNEL(moe4tc_gate_up_int4_t2, 2)
GATE_UP4_TC_KERNEL(moe4tc_gate_up_int4_t4, 4)
GATE_UP4_TC_KERNEL(moe4tc_gate_up_int4_t8, 8)
DOWN4_TC_KERNEL(moe4tc_down_int4_t1, 1)
DOWN4_TC_KERNEL(moe4tc_down_int4_t2, 2)
DOWN4_TC_KERNEL(moe4tc_down_int4_t4, 4)
DOWN4_TC_KERNEL(moe4tc_down_int4_t8, 8)
