// 4-bit experts (int4_group, mxfp4; docs/spec.md): decode GEMVs that read the packed blobs directly, and the
// expansion of a pass's routed experts into int8_group blobs for the prefill grouped GEMM (moe_gemm.cu).
//
// A packed row holds two weights a byte: weight 2c in the low nibble of byte c, 2c + 1 in the high nibble, so in
// a little-endian 32-bit word weight i of the word is bits 4i..4i+3. One scale per group of `group` weights of a
// row (int4_group: float16, group 32/64/128; mxfp4: an E8M0 byte e, 2^(e - 127), group 32), stored [rows, groups].
// A 16-byte chunk is 32 weights, so it never straddles two groups. Weights are decoded in registers:
//   int4_group: the two's-complement nibble's integer;
//   mxfp4:      twice the E2M1 value (an integer, |v| <= 12), the 1/2 folded into the scale 2^(e - 128).
// Both are exact in fp32, and so is integer x scale: the expansion's int8 weights times its float32 scales are the
// NumPy engine's dequantized weights bit for bit; the GEMVs multiply each chunk's partial sum by its scale instead
// (fp32 rounding apart, the same products).
//
// The GEMVs have the contract, the work items and the fill on read of moe_gemv.cu's kernels, walked by
// common.cuh's packed4_gemv (shared with moe_gemv4_dp4a.cu):
//   moe4_gate_up_*: act[pos, i] = silu(x[tok] . gate[i]) * (x[tok] . up[i]), tok = perm[pos] / k
//   moe4_down_*:    y[pair, h] = w[pair] * (act[pos] . down[h]), pair = perm[pos]
// A warp item is R rows; each lane takes 16-byte chunks of them, two chunks per row in flight, and (FloatDot) sums
// its chunk's 32 products per token before one multiply by the chunk's group scale. fp32 accumulation throughout.
#include "common.cuh"

#ifndef GEMV4_THREADS
#error "GEMV4_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef EXPAND_THREADS
#error "EXPAND_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif

template <bool MX>
struct Packed;

template <>
struct Packed<false> {  // int4_group
    typedef u16 scale_t;
    static __device__ __forceinline__ float scale(u16 s) { return TF16::to_f32(s); }
    // (v ^ 8) is v + 8 in 0..15 for a nibble v: byte j of `even` holds weight 2j + 8, of `odd` weight 2j + 1 + 8;
    // the float with bits 0x4B000000 | u (a byte u placed by __byte_perm) is exactly 2^23 + u
    static __device__ __forceinline__ void weights(unsigned int w, float* out) {
        const unsigned int even = (w & 0x0F0F0F0Fu) ^ 0x08080808u, odd = ((w >> 4) & 0x0F0F0F0Fu) ^ 0x08080808u;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            out[2 * j] = __uint_as_float(__byte_perm(even, 0x4B000000u, 0x7650 + j)) - 8388616.0f;
            out[2 * j + 1] = __uint_as_float(__byte_perm(odd, 0x4B000000u, 0x7650 + j)) - 8388616.0f;
        }
    }
};

template <>
struct Packed<true> {  // mxfp4
    typedef unsigned char scale_t;
    static __device__ __forceinline__ float scale(unsigned char e) { return ldexpf(1.0f, (int)e - 128); }
    // 2|E2M1| of the nibble's low three bits (exponent, mantissa) 0..7 is 0, 1, 2, 3, 4, 6, 8, 12: bytes 0..7 of
    // the word pair (0x03020100, 0x0C080604), picked for four weights at once by __byte_perm; bit 3 is the sign
    static __device__ __forceinline__ void weights(unsigned int w, float* out) {
        const unsigned int mag[2] = {__byte_perm(0x03020100u, 0x0C080604u, w & 0x7777u),
                                     __byte_perm(0x03020100u, 0x0C080604u, (w >> 16) & 0x7777u)};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float m = __uint_as_float(__byte_perm(mag[i >> 2], 0x4B000000u, 0x7650 + (i & 3))) - 8388608.0f;
            out[i] = __uint_as_float(__float_as_uint(m) ^ ((w << (28 - 4 * i)) & 0x80000000u));
        }
    }
};

// float inputs: each chunk's 32 products per token summed, then one multiply by the chunk's group scale
template <bool MX>
struct FloatDot {
    typedef typename Packed<MX>::scale_t scale_t;
    const float* in;  // [rows, ncols]
    int ncols;

    template <int TOKC, int R>
    __device__ __forceinline__ void chunk(float (&acc)[R][TOKC], const int4 (&raw)[R], const scale_t (&sraw)[R],
                                          const int (&trow)[TOKC], int nt, int cc) const {
        float part[R][TOKC];
#pragma unroll
        for (int q = 0; q < R; ++q)
#pragma unroll
            for (int j = 0; j < TOKC; ++j) part[q][j] = 0.0f;
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {  // the chunk's four words, 8 weights each
            float xv[TOKC][8];
#pragma unroll
            for (int j = 0; j < TOKC; ++j) {
                if (j < nt) {
                    const float4* p =
                        reinterpret_cast<const float4*>(in + (size_t)trow[j] * ncols + (cc << 5) + (wi << 3));
                    const float4 a = __ldg(p), b = __ldg(p + 1);
                    xv[j][0] = a.x; xv[j][1] = a.y; xv[j][2] = a.z; xv[j][3] = a.w;
                    xv[j][4] = b.x; xv[j][5] = b.y; xv[j][6] = b.z; xv[j][7] = b.w;
                }
            }
#pragma unroll
            for (int q = 0; q < R; ++q) {
                const int4 v = raw[q];
                float wf[8];
                Packed<MX>::weights((unsigned int)(wi == 0 ? v.x : wi == 1 ? v.y : wi == 2 ? v.z : v.w), wf);
#pragma unroll
                for (int j = 0; j < TOKC; ++j) {
                    if (j < nt) {
#pragma unroll
                        for (int u = 0; u < 8; ++u) part[q][j] = fmaf(wf[u], xv[j][u], part[q][j]);
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < R; ++q) {
            const float s = Packed<MX>::scale(sraw[q]);
#pragma unroll
            for (int j = 0; j < TOKC; ++j) acc[q][j] = fmaf(part[q][j], s, acc[q][j]);
        }
    }
};

#define GATE_UP4_KERNEL(NAME, MX, TOKC, R)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV4_THREADS)                                                \
        NAME(const float* x, const unsigned long long* blobs, const unsigned long long* fills, long long off_w,  \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta, float* act, \
             int H, int I, int k, int group) {                                                                 \
        packed4_gemv<FloatDot<MX>, TOKC, R, 2, true>(FloatDot<MX>{x, H}, blobs, fills, off_w, off_s, perm, offsets, \
                                                  active, meta, nullptr, act, H, I, k, group);                 \
    }
#define DOWN4_KERNEL(NAME, MX, TOKC, R)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV4_THREADS)                                                \
        NAME(const float* act, const unsigned long long* blobs, const unsigned long long* fills, long long off_w, \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta,         \
             const float* pair_w, float* y, int H, int I, int group) {                                         \
        packed4_gemv<FloatDot<MX>, TOKC, R, 2, false>(FloatDot<MX>{act, I}, blobs, fills, off_w, off_s, perm, offsets, \
                                                   active, meta, pair_w, y, I, H, 1, group);                   \
    }

// suffix: <int4 | mxfp4>_t<TOKC> (tokens per pass); rows per warp item: 4, or 2 from 4 tokens (registers)
GATE_UP4_KERNEL(moe4_gate_up_int4_t1, false, 1, 4)
GATE_UP4_KERNEL(moe4_gate_up_int4_t2, false, 2, 4)
GATE_UP4_KERNEL(moe4_gate_up_int4_t4, false, 4, 2)
GATE_UP4_KERNEL(moe4_gate_up_int4_t8, false, 8, 2)
GATE_UP4_KERNEL(moe4_gate_up_mxfp4_t1, true, 1, 4)
GATE_UP4_KERNEL(moe4_gate_up_mxfp4_t2, true, 2, 4)
GATE_UP4_KERNEL(moe4_gate_up_mxfp4_t4, true, 4, 2)
GATE_UP4_KERNEL(moe4_gate_up_mxfp4_t8, true, 8, 2)
DOWN4_KERNEL(moe4_down_int4_t1, false, 1, 4)
DOWN4_KERNEL(moe4_down_int4_t2, false, 2, 4)
DOWN4_KERNEL(moe4_down_int4_t4, false, 4, 2)
DOWN4_KERNEL(moe4_down_int4_t8, false, 8, 2)
DOWN4_KERNEL(moe4_down_mxfp4_t1, true, 1, 4)
DOWN4_KERNEL(moe4_down_mxfp4_t2, true, 2, 4)
DOWN4_KERNEL(moe4_down_mxfp4_t4, true, 4, 2)
DOWN4_KERNEL(moe4_down_mxfp4_t8, true, 8, 2)

// one token, no dispatch: the t1 kernels by pair (packed4_gemv's BYPAIR); ids [P] int32 straight from the router
#define GATE_UP4_PAIRS_KERNEL(NAME, MX)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV4_THREADS)                                                \
        NAME(const float* x, const int* ids, const unsigned long long* blobs, const unsigned long long* fills,  \
             long long off_w, long long off_s, float* act, int H, int I, int k, int group, int P, int E) {     \
        packed4_gemv<FloatDot<MX>, 1, 4, 2, true, true>(FloatDot<MX>{x, H}, blobs, fills, off_w, off_s, nullptr, \
                                                        nullptr, ids, nullptr, nullptr, act, H, I, k, group, P, E); \
    }
#define DOWN4_PAIRS_KERNEL(NAME, MX)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV4_THREADS)                                                \
        NAME(const float* act, const int* ids, const unsigned long long* blobs, const unsigned long long* fills, \
             long long off_w, long long off_s, const float* pair_w, float* y, int H, int I, int group, int P,   \
             int E) {                                                                                          \
        packed4_gemv<FloatDot<MX>, 1, 4, 2, false, true>(FloatDot<MX>{act, I}, blobs, fills, off_w, off_s,     \
                                                         nullptr, nullptr, ids, nullptr, pair_w, y, I, H, 1, group, \
                                                         P, E);                                               \
    }
GATE_UP4_PAIRS_KERNEL(moe4_gate_up_pairs_int4, false)
GATE_UP4_PAIRS_KERNEL(moe4_gate_up_pairs_mxfp4, true)
DOWN4_PAIRS_KERNEL(moe4_down_pairs_int4, false)
DOWN4_PAIRS_KERNEL(moe4_down_pairs_mxfp4, true)

// ---- prefill: routed experts re-encoded as int8_group blobs ----------------------------------------------------
// Grid (x, E): blockIdx.y is an active slot (those past meta[0] return); expert e = active[slot] is written to
// dst + e * dst_size in the int8_group layout of the same group size (mxfp4: 32): each weight's decoded integer
// as an int8 (|v| <= 12) and each scale as float32 (float16 value, or 2^(e - 128)). The matrices and scales are in
// the same row-major order in both layouts, so packed byte c becomes int8 weights 2c and 2c + 1, scale s scale s.
template <bool MX>
__device__ __forceinline__ void expand_to_int8(const unsigned long long* __restrict__ blobs,
                                               const int* __restrict__ active, const int* __restrict__ meta,
                                               char* __restrict__ dst, long long dst_size, const long long* src_off,
                                               const long long* dst_off, long long gu_chunks, long long dn_chunks,
                                               long long gu_scales, long long dn_scales) {
    typedef typename Packed<MX>::scale_t scale_t;
    if ((int)blockIdx.y >= meta[0]) return;
    const int e = active[blockIdx.y];
    const char* src = reinterpret_cast<const char*>(blobs[e]);
    char* out = dst + (size_t)e * dst_size;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < gu_chunks + dn_chunks; c += stride) {
        const bool down = c >= gu_chunks;
        const long long cc = down ? c - gu_chunks : c;
        const int4 v = __ldg(reinterpret_cast<const int4*>(src + (down ? src_off[2] : src_off[0])) + cc);
        const unsigned int words[4] = {(unsigned int)v.x, (unsigned int)v.y, (unsigned int)v.z, (unsigned int)v.w};
        unsigned int q[8];  // 32 int8 weights
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
            float f[8];
            Packed<MX>::weights(words[wi], f);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned int b = 0;
#pragma unroll
                for (int u = 0; u < 4; ++u) b |= ((unsigned int)(int)f[4 * h + u] & 0xFFu) << (8 * u);
                q[2 * wi + h] = b;
            }
        }
        int4* o = reinterpret_cast<int4*>(out + (down ? dst_off[2] : dst_off[0])) + 2 * cc;
        o[0] = make_int4((int)q[0], (int)q[1], (int)q[2], (int)q[3]);
        o[1] = make_int4((int)q[4], (int)q[5], (int)q[6], (int)q[7]);
    }
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < gu_scales + dn_scales; s += stride) {
        const bool down = s >= gu_scales;
        const long long ss = down ? s - gu_scales : s;
        const scale_t raw = reinterpret_cast<const scale_t*>(src + (down ? src_off[3] : src_off[1]))[ss];
        reinterpret_cast<float*>(out + (down ? dst_off[3] : dst_off[1]))[ss] = Packed<MX>::scale(raw);
    }
}

#define EXPAND_KERNEL(NAME, MX)                                                                                \
    extern "C" __global__ void __launch_bounds__(EXPAND_THREADS)                                               \
        NAME(const unsigned long long* blobs, const int* active, const int* meta, char* dst, long long dst_size, \
             long long src_gu, long long src_gus, long long src_dn, long long src_dns, long long dst_gu,       \
             long long dst_gus, long long dst_dn, long long dst_dns, long long gu_chunks, long long dn_chunks, \
             long long gu_scales, long long dn_scales) {                                                       \
        const long long src_off[4] = {src_gu, src_gus, src_dn, src_dns};                                       \
        const long long dst_off[4] = {dst_gu, dst_gus, dst_dn, dst_dns};                                       \
        expand_to_int8<MX>(blobs, active, meta, dst, dst_size, src_off, dst_off, gu_chunks, dn_chunks, gu_scales, \
                           dn_scales);                                                                         \
    }

EXPAND_KERNEL(moe4_expand_int4, false)
EXPAND_KERNEL(moe4_expand_mxfp4, true)
