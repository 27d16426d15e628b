// Shared helpers for the colibri-format CUDA kernels.
//
// No CUDA headers are included, so the same source compiles with nvcc and with NVRTC (CuPy RawModule)
// without include paths. 16-bit floats travel as raw `unsigned short` bits; conversions use PTX `cvt`.
#pragma once

#if defined(__CUDACC_RTC__)
typedef decltype(sizeof(0)) size_t;  // NVRTC compiles without system headers
#endif

#define COLIBRI_FULL_MASK 0xffffffffu

typedef unsigned short u16;

// ---- element types: a tag per storage format, each with to_f32 / from_f32 --------------------------------------
struct TF32 {
    typedef float storage;
    static __device__ __forceinline__ float to_f32(float v) { return v; }
    static __device__ __forceinline__ float from_f32(float v) { return v; }
};

struct TF16 {
    typedef u16 storage;
    static __device__ __forceinline__ float to_f32(u16 v) {
        float f;
        asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ u16 from_f32(float v) {
        u16 h;
        asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
        return h;
    }
};

struct TBF16 {
    typedef u16 storage;
    static __device__ __forceinline__ float to_f32(u16 v) { return __uint_as_float(((unsigned int)v) << 16); }
    static __device__ __forceinline__ u16 from_f32(float v) {
        u16 h;
        asm("{ cvt.rn.bf16.f32 %0, %1; }" : "=h"(h) : "f"(v));
        return h;
    }
};

// Loads 16 bytes at p (16-byte aligned) and widens them: 4 floats for TF32, 8 for the 16-bit types.
template <typename T>
struct Vec16 {
    static constexpr int N = 16 / (int)sizeof(typename T::storage);
};

template <typename T>
__device__ __forceinline__ void load16_f32(const typename T::storage* p, float* out);

template <>
__device__ __forceinline__ void load16_f32<TF32>(const float* p, float* out) {
    float4 v = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
}

template <typename T>
__device__ __forceinline__ void load16_f32_16bit(const u16* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    out[0] = T::to_f32((u16)(v.x & 0xffffu)); out[1] = T::to_f32((u16)(v.x >> 16));
    out[2] = T::to_f32((u16)(v.y & 0xffffu)); out[3] = T::to_f32((u16)(v.y >> 16));
    out[4] = T::to_f32((u16)(v.z & 0xffffu)); out[5] = T::to_f32((u16)(v.z >> 16));
    out[6] = T::to_f32((u16)(v.w & 0xffffu)); out[7] = T::to_f32((u16)(v.w >> 16));
}

template <>
__device__ __forceinline__ void load16_f32<TF16>(const u16* p, float* out) { load16_f32_16bit<TF16>(p, out); }

template <>
__device__ __forceinline__ void load16_f32<TBF16>(const u16* p, float* out) { load16_f32_16bit<TBF16>(p, out); }

// Loads (stores) 4 consecutive elements at p, aligned to 4 elements (`vec4_aligned`), widened to (narrowed from)
// floats: one 16-byte access for TF32, one 8-byte access for the 16-bit types. Plain (coherent) loads: the norms
// read rows that the same launch rewrites in place.
template <typename T>
__device__ __forceinline__ bool vec4_aligned(const typename T::storage* p) {
    return ((size_t)p & (4 * sizeof(typename T::storage) - 1)) == 0;
}

template <typename T>
__device__ __forceinline__ void widen4_f32(const uint2& v, float* out) {   // four 16-bit values
    out[0] = T::to_f32((u16)(v.x & 0xffffu)); out[1] = T::to_f32((u16)(v.x >> 16));
    out[2] = T::to_f32((u16)(v.y & 0xffffu)); out[3] = T::to_f32((u16)(v.y >> 16));
}

template <typename T>
__device__ __forceinline__ void load4_f32(const typename T::storage* p, float* out) {
    if constexpr (sizeof(typename T::storage) == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    } else {
        widen4_f32<T>(*reinterpret_cast<const uint2*>(p), out);
    }
}

// load4_f32 through the read-only data cache: for inputs that no kernel writes while it runs (weights)
template <typename T>
__device__ __forceinline__ void ldg4_f32(const typename T::storage* p, float* out) {
    if constexpr (sizeof(typename T::storage) == 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p));
        out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    } else {
        widen4_f32<T>(__ldg(reinterpret_cast<const uint2*>(p)), out);
    }
}

template <typename T>
__device__ __forceinline__ void store4_f32(typename T::storage* p, const float* v) {
    if constexpr (sizeof(typename T::storage) == 4) {
        float4 o;
        o.x = v[0]; o.y = v[1]; o.z = v[2]; o.w = v[3];
        *reinterpret_cast<float4*>(p) = o;
    } else {
        uint2 o;
        o.x = (unsigned int)T::from_f32(v[0]) | ((unsigned int)T::from_f32(v[1]) << 16);
        o.y = (unsigned int)T::from_f32(v[2]) | ((unsigned int)T::from_f32(v[3]) << 16);
        *reinterpret_cast<uint2*>(p) = o;
    }
}

// ---- int8 -> float without the (slow) conversion unit --------------------------------------------------------
// For a signed byte b, (b ^ 0x80) is b + 128 as an unsigned byte u; the float whose bits are 0x4B000000 | u is
// exactly 2^23 + u, so subtracting 2^23 + 128 gives b exactly.
__device__ __forceinline__ void i8x4_to_f32(unsigned int w, float* out) {
    const unsigned int u = w ^ 0x80808080u;
    const float bias = 8388736.0f;  // 2^23 + 128
    out[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650)) - bias;
    out[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7651)) - bias;
    out[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7652)) - bias;
    out[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7653)) - bias;
}

__device__ __forceinline__ void i8x16_to_f32(const int4& v, float* out) {
    i8x4_to_f32((unsigned int)v.x, out);
    i8x4_to_f32((unsigned int)v.y, out + 4);
    i8x4_to_f32((unsigned int)v.z, out + 8);
    i8x4_to_f32((unsigned int)v.w, out + 12);
}

// ---- tensor cores (sm_80+): bf16 pairs, low half first -----------------------------------------------------------
__device__ __forceinline__ unsigned int bf16x2_sub(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// c += A B over one m16n8k16 tile, bf16 in, fp32 accumulate; the fragments are the PTX ISA's: lane 4g + t holds A
// rows g (a0, a2) and g + 8 (a1, a3) at k 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2, a3), B column g at k 2t, 2t + 1
// (b0) and 2t + 8, 2t + 9 (b1), and C rows g (c[0], c[1]) and g + 8 (c[2], c[3]) at columns 2t, 2t + 1.
__device__ __forceinline__ void mma_16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                          unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += A B over one m16n8k32 tile, int8 in, exact int32 accumulate; lane 4g + t holds the 4 bytes of A rows g (a0,
// a2) and g + 8 (a1, a3) at k 4t..4t+3 (a0, a1) and 16 + 4t.. (a2, a3), of B column g at k 4t.. (b0) and 16 + 4t..
// (b1), byte i at k + i; C as mma_16816's.
__device__ __forceinline__ void mma_16832_s8(int* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                             unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- asynchronous copies global -> shared (sm_80+) -------------------------------------------------------------
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared past L1, or 16 zero bytes when !valid (src is then not read). The "memory" clobbers
// keep the compiler from moving shared-memory accesses across the copies and the waits.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most PENDING of this thread's committed copy groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// ---- warp reductions ------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(COLIBRI_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(COLIBRI_FULL_MASK, v, o));
    return v;
}

// The warp sums of N values a lane (N a power of two): sums[j] = the sum over the lanes of v[j], in every lane. A
// transposed butterfly: at each of the first log2(min(N, 32)) rounds a lane keeps half of its values and adds its
// partner's copy of that half (the other half goes to the partner), so that after them the lanes whose top bits are
// j hold value j's sum; the rounds left are plain xor sums, and a shuffle from one such lane gives every lane each
// sum. Per 32 values: 31 reducing and 32 broadcasting shuffles, at most 6 deep, where N warp_sums are 5N, 5 deep
// each.
template <int C, int O, int N>
__device__ __forceinline__ void warp_sum_halving(float (&v)[N], int lane) {
    if constexpr (O >= 1) {
        if constexpr (C > 1) {
            const bool upper = lane & O;
#pragma unroll
            for (int i = 0; i < C / 2; ++i) {
                const float send = upper ? v[i] : v[i + C / 2];
                const float keep = upper ? v[i + C / 2] : v[i];
                v[i] = keep + __shfl_xor_sync(COLIBRI_FULL_MASK, send, O);
            }
            warp_sum_halving<C / 2, O / 2, N>(v, lane);
        } else {
            v[0] += __shfl_xor_sync(COLIBRI_FULL_MASK, v[0], O);
            warp_sum_halving<1, O / 2, N>(v, lane);
        }
    }
}

// Groups of G = min(N, 32) values a reduction takes, and how far right a lane's number is shifted to name the
// value whose sum it holds after warp_sum_halving<G, 16, G> (the lanes past that many bits hold copies)
template <int N>
struct WarpSumsShape {
    static_assert(N >= 1 && (N & (N - 1)) == 0, "a power of two of values a lane");
    static constexpr int G = N < 32 ? N : 32;
    static constexpr int SHIFT = G == 32 ? 0 : G == 16 ? 1 : G == 8 ? 2 : G == 4 ? 3 : G == 2 ? 4 : 5;
};

// The warp's sum of value (lane >> SHIFT) of the G values at v (warp_sum_halving on a copy of them)
template <int G>
__device__ __forceinline__ float warp_group_sum(const float* v, int lane) {
    float part[G];
#pragma unroll
    for (int i = 0; i < G; ++i) part[i] = v[i];
    warp_sum_halving<G, 16, G>(part, lane);
    return part[0];
}

template <int N>
__device__ __forceinline__ void warp_sums(const float (&v)[N], float (&sums)[N]) {
    typedef WarpSumsShape<N> W;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int g0 = 0; g0 < N; g0 += W::G) {
        const float mine = warp_group_sum<W::G>(v + g0, lane);
#pragma unroll
        for (int j = 0; j < W::G; ++j) sums[g0 + j] = __shfl_sync(COLIBRI_FULL_MASK, mine, j << W::SHIFT);
    }
}

// dst[i] = the warp's sum of v[i] for i < N, each stored by one lane (warp_sums' reduction without its broadcast;
// N not a power of two, as a benchmark's plan may make it: a warp_sum a value).
template <int N>
__device__ __forceinline__ void warp_sums_store(const float (&v)[N], float* dst) {
    const int lane = threadIdx.x & 31;
    if constexpr ((N & (N - 1)) != 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const float sum = warp_sum(v[i]);
            if (lane == 0) dst[i] = sum;
        }
    } else {
        typedef WarpSumsShape<N> W;
#pragma unroll
        for (int g0 = 0; g0 < N; g0 += W::G) {
            const float mine = warp_group_sum<W::G>(v + g0, lane);
            if ((lane & ((1 << W::SHIFT) - 1)) == 0) dst[g0 + (lane >> W::SHIFT)] = mine;
        }
    }
}

// The outputs of a GEMV warp item from its lane partials acc[R][TOKC] (rows q, tokens j; for GATEUP the first R / 2
// rows are gate rows and the rest their up rows): emit(q, j, sum of row q, sum of up row q + R / 2 (GATEUP, else 0))
// runs once per output (q < R / 2 for GATEUP, else q < R; every j) in one lane. The sums come from one transposed
// reduction (warp_sum_halving) of the R * TOKC values, in groups of 32: a gate row's up sum sits in the lane 16 above
// (up to 32 values) or in the same lane of the group half the groups later. Counts that are not a power of two (a
// benchmark's plan) take a warp_sum a value and emit from lane 0.
template <int R, int TOKC, bool GATEUP, typename Emit>
__device__ __forceinline__ void warp_item_sums(const float (&acc)[R][TOKC], Emit&& emit) {
    constexpr int N = R * TOKC, ROUT = GATEUP ? R / 2 : R;
    const int lane = threadIdx.x & 31;
    const float* flat = &acc[0][0];                                  // value q * TOKC + j
    if constexpr ((N & (N - 1)) != 0) {
#pragma unroll
        for (int q = 0; q < ROUT; ++q)
#pragma unroll
            for (int j = 0; j < TOKC; ++j) {
                const float a = warp_sum(acc[q][j]);
                const float b = GATEUP ? warp_sum(acc[q + ROUT][j]) : 0.0f;
                if (lane == 0) emit(q, j, a, b);
            }
    } else if constexpr (N <= 32) {
        typedef WarpSumsShape<N> W;
        const float mine = warp_group_sum<N>(flat, lane);
        const float up = GATEUP ? __shfl_xor_sync(COLIBRI_FULL_MASK, mine, 16) : 0.0f;
        const int i = lane >> W::SHIFT;
        if ((lane & ((1 << W::SHIFT) - 1)) == 0 && i < ROUT * TOKC) emit(i / TOKC, i % TOKC, mine, up);
    } else {
        constexpr int NG = N / 32, OUT_GROUPS = GATEUP ? NG / 2 : NG;
        float mine[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) mine[g] = warp_group_sum<32>(flat + 32 * g, lane);
#pragma unroll
        for (int g = 0; g < OUT_GROUPS; ++g) {
            const int i = 32 * g + lane;
            emit(i / TOKC, i % TOKC, mine[g], GATEUP ? mine[g + NG / 2] : 0.0f);
        }
    }
}

// WARP_REDUCE (warp_sum, warp_max) of v over the block (every thread gets it; 0 stands for the missing warps, so a
// max is of values >= 0); s_red holds 32 floats (at most 32 warps); starts with a barrier, so s_red may be reused by
// consecutive calls.
template <float (*WARP_REDUCE)(float)>
__device__ __forceinline__ float block_reduce(float v, float* s_red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = WARP_REDUCE(v);
    __syncthreads();                       // s_red may still be read from a previous call
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    return WARP_REDUCE(lane < nwarps ? s_red[lane] : 0.0f);
}

__device__ __forceinline__ float block_sum(float v, float* s_red) { return block_reduce<warp_sum>(v, s_red); }

// ---- activations rounded to int8 per group of 32 (the dp4a 4-bit GEMVs' inputs; moe_gemv4_dp4a.cu's header) -----------
// position of input l (0..31) of a group in its staged bytes: evens of each 8 first, then odds
__device__ __forceinline__ int a8_position(int l) { return (l & ~7) | ((l & 1) << 2) | ((l & 7) >> 1); }

__device__ __forceinline__ long long global_warp() { return ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ long long total_warps() { return ((long long)gridDim.x * blockDim.x) >> 5; }

// Warps warp0, warp0 + nwarps, ... each round one group (lane l holds input l); groups are rows * ncols / 32
// consecutive runs of the row-major input. STAGED: q (a8_position order) and s (one scale a group); else rounded =
// q * s as floats, which may be x itself (each lane reads its input before it writes it).
template <bool STAGED>
__device__ __forceinline__ void a8_quantize(const float* x, signed char* __restrict__ q, float* __restrict__ s,
                                            float* rounded, long long ngroups, long long warp0, long long nwarps) {
    const int lane = threadIdx.x & 31;
    for (long long g = warp0; g < ngroups; g += nwarps) {
        const float v = x[g * 32 + lane];
        const float m = warp_max(fabsf(v));
        const float sc = m / 127.0f;
        const float qv = sc > 0.0f ? rintf(v / sc) : 0.0f;
        if (STAGED) {
            q[g * 32 + a8_position(lane)] = (signed char)(int)qv;
            if (lane == 0) s[g] = sc;
        } else {
            rounded[g * 32 + lane] = qv * sc;
        }
    }
}

// ---- a row held in registers (the norms at decode: one row a block, latency-bound) ---------------------------------
// Thread t holds elements 4 (u blockDim + t) .. + 3 for u < NV, so all of a row's loads are in flight at once and
// the row is read once. Rows of D % 4 == 0 elements, at most 4 NV blockDim, every pointer vec4-aligned; the
// kernels fall back to their strided loops otherwise (the test is uniform over the block).
template <int NV>
__device__ __forceinline__ bool row_fits_registers(int D) {
    return D % 4 == 0 && D <= 4 * NV * (int)blockDim.x;
}

template <int NV>
__device__ __forceinline__ int row_vec4(int u) { return 4 * (u * (int)blockDim.x + (int)threadIdx.x); }

// v [NV][4] = the row elements thread t holds (zero past D), as floats
template <typename T, int NV>
__device__ __forceinline__ void load_row_registers(const typename T::storage* p, float (&v)[NV][4], int D) {
#pragma unroll
    for (int u = 0; u < NV; ++u) {
        const int i = row_vec4<NV>(u);
        if (i < D) {
            load4_f32<T>(p + i, v[u]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[u][j] = 0.0f;
        }
    }
}

template <typename T, int NV>
__device__ __forceinline__ void store_row_registers(typename T::storage* p, const float (&v)[NV][4], int D) {
#pragma unroll
    for (int u = 0; u < NV; ++u) {
        const int i = row_vec4<NV>(u);
        if (i < D) store4_f32<T>(p + i, v[u]);
    }
}

// this thread's share of the sum of squares of the held elements (in order: vector by vector)
template <int NV>
__device__ __forceinline__ float sum_squares_registers(const float (&v)[NV][4]) {
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < NV; ++u)
#pragma unroll
        for (int j = 0; j < 4; ++j) ss = fmaf(v[u][j], v[u][j], ss);
    return ss;
}

// one normed element: v * inv * (w + w_offset), inv = rsqrt(mean(v^2) + eps) of its row (the norms' one expression:
// router.cu's add_rmsnorm_route writes the x of fused.cu's add_rmsnorm with it, bit for bit)
__device__ __forceinline__ float rms_scaled(float v, float inv, float w, float w_offset) {
    return v * inv * (w + w_offset);
}

// v [NV][4]: the held elements (zero past D); w [NV][4]: the norm weight; out = v * rsqrt(mean(v^2) + eps) * (w +
// w_offset), stored to o (TO) where in the row (v is overwritten with it)
template <typename TO, int NV>
__device__ __forceinline__ void norm_row_registers(float (&v)[NV][4], const float (&w)[NV][4],
                                                   typename TO::storage* o, int D, float eps, float w_offset,
                                                   float* s_red) {
    const float inv = rsqrtf(block_sum(sum_squares_registers<NV>(v), s_red) / (float)D + eps);
#pragma unroll
    for (int u = 0; u < NV; ++u)
#pragma unroll
        for (int j = 0; j < 4; ++j) v[u][j] = rms_scaled(v[u][j], inv, w[u][j], w_offset);
    store_row_registers<TO, NV>(o, v, D);
}

__device__ __forceinline__ float silu_f32(float g) { return g / (1.0f + expf(-g)); }

// ---- gpt-oss's expert extras (model.expert_act, model.expert_bias) ------------------------------------------------
// What the *_extras expert kernels compute beyond silu(gate) * up; the plain kernels are instantiated without it, so
// models without extras run exactly the code they ran before. Built in the kernel from its scalar arguments.
struct ExpertExtras {
    const float* bias;              // gate_up launch: [E, 2I] (gate then up); down launch: [E, H]; null: no bias
    float alpha, limit, up_offset;  // clamped SwiGLU; limit +inf clamps nothing (alpha 1, offset 0: silu(g) * u)
};

// Output o of expert e from its gate and up products (nout = I): silu(gate) * up, or, with EXTRAS, the biases
// added first (before the activation, as transformers' GptOssExperts does), then
// (clamp(up, -limit, limit) + up_offset) * g * sigmoid(alpha g), g = min(gate, limit) (numpy_backend.clamped_swiglu).
template <bool EXTRAS>
__device__ __forceinline__ float expert_activation(float gate, float up, const ExpertExtras& ex, int e, int nout,
                                                   int o) {
    if (!EXTRAS) return silu_f32(gate) * up;
    if (ex.bias) {
        const float* b = ex.bias + (size_t)e * 2 * nout;
        gate += __ldg(b + o);
        up += __ldg(b + nout + o);
    }
    gate = fminf(gate, ex.limit);
    up = fminf(fmaxf(up, -ex.limit), ex.limit);
    return (up + ex.up_offset) * gate / (1.0f + expf(-ex.alpha * gate));
}

// Output o of expert e's down product (nout = H), with its bias when EXTRAS has one: added before the routing
// weight multiplies it.
template <bool EXTRAS>
__device__ __forceinline__ float expert_down_out(float y, const ExpertExtras& ex, int e, int nout, int o) {
    return EXTRAS && ex.bias ? y + __ldg(ex.bias + (size_t)e * nout + o) : y;
}

// ---- 4-bit decode GEMVs: the walk over warp items (moe_gemv4.cu float inputs, moe_gemv4_dp4a.cu int8 inputs) -------
// The contract and the work items of moe_gemv.cu's kernels, over packed 4-bit rows (16-byte chunks of 32 weights,
// one scale per group of `group` weights, [rows, groups]):
//   GATEUP: act[pos, i] = silu(in[tok] . gate[i]) * (in[tok] . up[i]), gate rows [0, nout), up [nout, 2 nout),
//           tok = perm[pos] / k
//   down:   y[pair, h] = pair_w[pair] * (in[pos] . down[h]), pair = perm[pos]
// A warp item is R rows of one active expert; each lane loads CPL chunks of every row (and their scales) before
// handing each to `dot.chunk`, which adds its products with up to TOKC input rows (`trow`: row indices of `in`)
// to acc[R][TOKC]. Fill on read (fills[e] != 0): the first token pass also stores every chunk and scale it reads
// at the same offsets of the admitted slot; the items of a launch cover every row and scale of the matrix.
// BYPAIR (the *_pairs kernels, one token a pass, TOKC 1): moe_gemv.cu's by-pair mode: no dispatch; active is the
// router's ids [npairs] in pair order, an item is (pair, rows), in and out rows are in pair order, and an id outside
// [0, nexp) gives zero rows (perm, offsets and meta unused).
template <typename Dot, int TOKC, int R, int CPL, bool GATEUP, bool BYPAIR = false>
__device__ __forceinline__ void packed4_gemv(const Dot& dot, const unsigned long long* __restrict__ blobs,
                                             const unsigned long long* __restrict__ fills, long long off_w,
                                             long long off_s, const int* __restrict__ perm,
                                             const int* __restrict__ offsets, const int* __restrict__ active,
                                             const int* __restrict__ meta, const float* __restrict__ pair_w,
                                             float* __restrict__ out, int ncols, int nout, int k, int group,
                                             int npairs = 0, int nexp = 0) {
    typedef typename Dot::scale_t scale_t;
    static_assert(!BYPAIR || TOKC == 1, "a pair is one token");
    constexpr int ROUT = GATEUP ? R / 2 : R;  // output elements per warp item (gate_up: ROUT gate + ROUT up rows)
    const int lane = threadIdx.x & 31;
    const int n_rg = (nout + ROUT - 1) / ROUT;
    const int total = (BYPAIR ? npairs : meta[0]) * n_rg;
    const int nchunk = ncols >> 5;  // 16-byte chunks (32 weights) per row
    const int ngroups = ncols / group;
    const int warps_total = (gridDim.x * blockDim.x) >> 5;

    for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total; item += warps_total) {
        const int slot = item / n_rg;
        const int o0 = (item - slot * n_rg) * ROUT;
        const int named = active[slot];
        const bool valid = !BYPAIR || (named >= 0 && named < nexp);
        const int e = valid ? named : 0;                 // an invalid pair reads expert 0 and writes zeros
        const char* blob = reinterpret_cast<const char*>(blobs[e]);
        const int4* wbase = reinterpret_cast<const int4*>(blob + off_w);
        const scale_t* sbase = reinterpret_cast<const scale_t*>(blob + off_s);
        char* fill = fills && valid ? reinterpret_cast<char*>(fills[e]) : nullptr;
        // the last item of an expert is shifted down to stay inside the matrix (nout >= ROUT); it then writes
        // only the outputs at or past its own o0
        const int ob = min(o0, nout - ROUT);
        int row[R];
#pragma unroll
        for (int q = 0; q < R; ++q) row[q] = ob + (q % ROUT) + (q >= ROUT ? nout : 0);
        const int start = BYPAIR ? slot : offsets[e];
        const int cnt = BYPAIR ? 1 : offsets[e + 1] - start;

        for (int c0 = 0; c0 < cnt; c0 += TOKC) {
            const int nt = min(TOKC, cnt - c0);
            int trow[TOKC];  // input row of each token of the pass (the last one repeated past nt)
#pragma unroll
            for (int j = 0; j < TOKC; ++j) {
                const int pos = start + c0 + min(j, nt - 1);
                trow[j] = GATEUP ? (BYPAIR ? pos : perm[pos]) / k : pos;
            }
            float acc[R][TOKC];
#pragma unroll
            for (int q = 0; q < R; ++q)
#pragma unroll
                for (int j = 0; j < TOKC; ++j) acc[q][j] = 0.0f;

#pragma unroll 1
            for (int cb = 0; cb < nchunk; cb += 32 * CPL) {
                int4 raw[CPL][R];
                scale_t sraw[CPL][R];
#pragma unroll
                for (int f = 0; f < CPL; ++f) {
                    const int cc = cb + 32 * f + lane;
                    if (cc < nchunk) {
                        const int g = (cc << 5) / group;
#pragma unroll
                        for (int q = 0; q < R; ++q) {
                            raw[f][q] = __ldg(wbase + (size_t)row[q] * nchunk + cc);
                            sraw[f][q] = sbase[(size_t)row[q] * ngroups + g];
                        }
                        if (fill && c0 == 0) {  // fill on read: the chunk and its scale, at the same offsets
#pragma unroll
                            for (int q = 0; q < R; ++q) {
                                reinterpret_cast<int4*>(fill + off_w)[(size_t)row[q] * nchunk + cc] = raw[f][q];
                                reinterpret_cast<scale_t*>(fill + off_s)[(size_t)row[q] * ngroups + g] = sraw[f][q];
                            }
                        }
                    }
                }
#pragma unroll
                for (int f = 0; f < CPL; ++f) {
                    const int cc = cb + 32 * f + lane;
                    if (cc < nchunk) dot.template chunk<TOKC, R>(acc, raw[f], sraw[f], trow, nt, cc);
                }
            }
            warp_item_sums<R, TOKC, GATEUP>(acc, [&](int q, int j, float a, float b) {
                if (j >= nt || ob + q < o0) return;
                const int pos = start + c0 + j;
                if (GATEUP) {
                    out[(size_t)pos * nout + ob + q] = valid ? silu_f32(a) * b : 0.0f;
                } else {
                    const int pair = BYPAIR ? pos : perm[pos];
                    out[(size_t)pair * nout + ob + q] = valid ? __ldg(pair_w + pair) * a : 0.0f;
                }
            });
        }
    }
}
