// Prefill grouped int8 expert products on cuBLAS (ops.moe_experts_cublas): the element-wise work around its bf16
// GEMMs. cuBLAS multiplies bf16 (not int8 x bf16) matrices, so an expert's int8 matrix is widened to bf16 in a
// workspace (exactly: |q| <= 127 needs 8 significant bits), the rows of its pairs are gathered in bf16 (hi, and for
// "split" lo = bf16(x - hi): about 16 significant bits), and the row scales, SiLU, routing weights and the scatter
// back to pair order run here, in moe_gemm_fast.cu's rounding order:
//   gather_split_bf16:   hi/lo[pos, :] = split(x[perm[pos] / k, :])                         pos in [0, P)
//   widen_int8_bf16:     w[i] = bf16(q[i]) for q the n int8 values at blobs[e] + off
//   gate_up_epilogue:    hi/lo[r, i] = split(silu(gu[r, i] * s[i]) * (gu[r, I + i] * s[I + i]))    r in [0, n)
//   down_epilogue:       ypair[perm[start + r], h] = (w[perm[start + r]] * yd[r, h]) * s[h]
// with s the expert's f32 row scales at blobs[e] + off_s. Every kernel is grid-stride over groups of 4 (the
// gather, epilogues) or 16 (the widening) elements; ops.py checks the shapes are whole groups and 16-byte aligned.
#include "common.cuh"

#ifndef GLUE_THREADS
#error "GLUE_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif

struct alignas(8) Bf16x4 {
    u16 v[4];
};

struct alignas(16) Bf16x8 {
    u16 v[8];
};

// hi (and lo unless it is null) of 4 floats, stored at element i of both
__device__ __forceinline__ void store_split4(const float (&v)[4], u16* __restrict__ hi, u16* __restrict__ lo,
                                             long long i) {
    Bf16x4 h, l;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        h.v[j] = TBF16::from_f32(v[j]);
        l.v[j] = TBF16::from_f32(v[j] - TBF16::to_f32(h.v[j]));
    }
    *reinterpret_cast<Bf16x4*>(hi + i) = h;
    if (lo) *reinterpret_cast<Bf16x4*>(lo + i) = l;
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
gather_split_bf16(const float* __restrict__ x, const int* __restrict__ perm, u16* __restrict__ hi, u16* __restrict__ lo,
                  int num_pairs, int cols, int k) {
    const int quads = cols / 4;
    const long long n = (long long)num_pairs * quads;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < n; q += stride) {
        const int pos = (int)(q / quads), c = (int)(q % quads) * 4;
        const float4 v = *reinterpret_cast<const float4*>(x + (size_t)(perm[pos] / k) * cols + c);
        const float vals[4] = {v.x, v.y, v.z, v.w};
        store_split4(vals, hi, lo, (long long)pos * cols + c);
    }
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
widen_int8_bf16(const unsigned long long* __restrict__ blobs, int e, long long off, long long n, u16* __restrict__ w) {
    const signed char* q = reinterpret_cast<const signed char*>(blobs[e] + off);
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 16; i < n;
         i += (long long)gridDim.x * blockDim.x * 16) {
        const int4 packed = *reinterpret_cast<const int4*>(q + i);
        const signed char* b = reinterpret_cast<const signed char*>(&packed);
        Bf16x8 lo8, hi8;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            lo8.v[j] = TBF16::from_f32((float)b[j]);       // exact: an int8 value has at most 8 significant bits
            hi8.v[j] = TBF16::from_f32((float)b[8 + j]);
        }
        *reinterpret_cast<Bf16x8*>(w + i) = lo8;
        *reinterpret_cast<Bf16x8*>(w + i + 8) = hi8;
    }
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
gate_up_epilogue(const float* __restrict__ gu, const unsigned long long* __restrict__ blobs, int e, long long off_s,
                 u16* __restrict__ hi, u16* __restrict__ lo, int rows, int inter) {
    const float* s = reinterpret_cast<const float*>(blobs[e] + off_s);
    const int quads = inter / 4;
    const long long n = (long long)rows * quads;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < n; q += stride) {
        const int r = (int)(q / quads), c = (int)(q % quads) * 4;
        const float4 g = *reinterpret_cast<const float4*>(gu + (size_t)r * 2 * inter + c);
        const float4 u = *reinterpret_cast<const float4*>(gu + (size_t)r * 2 * inter + inter + c);
        const float4 sg = *reinterpret_cast<const float4*>(s + c);
        const float4 su = *reinterpret_cast<const float4*>(s + inter + c);
        const float vals[4] = {silu_f32(g.x * sg.x) * (u.x * su.x), silu_f32(g.y * sg.y) * (u.y * su.y),
                               silu_f32(g.z * sg.z) * (u.z * su.z), silu_f32(g.w * sg.w) * (u.w * su.w)};
        store_split4(vals, hi, lo, (long long)r * inter + c);
    }
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
down_epilogue(const float* __restrict__ yd, const unsigned long long* __restrict__ blobs, int e, long long off_s,
              const int* __restrict__ perm, int start, const float* __restrict__ pair_w, float* __restrict__ ypair,
              int rows, int hidden) {
    const float* s = reinterpret_cast<const float*>(blobs[e] + off_s);
    const int quads = hidden / 4;
    const long long n = (long long)rows * quads;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < n; q += stride) {
        const int r = (int)(q / quads), c = (int)(q % quads) * 4;
        const int pair = perm[start + r];
        const float pw = pair_w[pair];
        const float4 v = *reinterpret_cast<const float4*>(yd + (size_t)r * hidden + c);
        const float4 sc = *reinterpret_cast<const float4*>(s + c);
        *reinterpret_cast<float4*>(ypair + (size_t)pair * hidden + c) =
            make_float4(pw * v.x * sc.x, pw * v.y * sc.y, pw * v.z * sc.z, pw * v.w * sc.w);
    }
}
