// Prefill grouped int8 expert products on cuBLAS (ops.moe_experts_cublas): the element-wise work around its bf16
// GEMMs. cuBLAS multiplies bf16 (not int8 x bf16) matrices, so an expert's int8 matrix is widened to bf16 in a
// workspace (exactly: |q| <= 127 needs 8 significant bits), the rows of its pairs are gathered in bf16, and the row
// scales, SiLU, routing weights and the scatter back to pair order run here, in moe_gemm_fast.cu's rounding order.
// With "split" activations a row is hi = bf16(v) and lo = bf16(v - hi) (about 16 significant bits), and an expert's
// n rows are stacked as its n hi rows then its n lo rows, so that ONE product of the 2n rows reads its weights once;
// the epilogues add row r's and row n + r's products.
//   gather_bf16:       rows of expert e (sorted positions offsets[e] .. offsets[e+1]) -> out rows, from x[perm / k]:
//                      split: pos's hi at pos + offsets[e], its lo at pos + offsets[e+1]; else bf16(x) at pos
//   widen_int8_bf16:   w[i] = bf16(q[i]) for q the n int8 values at blobs[e] + off
//   gate_up_epilogue:  a = silu(g s[i]) (u s[I + i]), g / u the gate / up products of row r (split: plus row n + r's),
//                      stored like the gather (split: hi at r, lo at n + r)
//   down_epilogue:     ypair[perm[start + r], h] = (w[perm[start + r]] * y) * s[h], y row r's product (split: plus
//                      row n + r's)
// with s the expert's f32 row scales at blobs[e] + off_s. Every kernel is grid-stride over groups of 4 (the gather,
// epilogues: for_each_group) or 16 (the widening) elements; ops.py checks that the shapes are whole groups.
#include "common.cuh"

#ifndef GLUE_THREADS
#error "GLUE_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef QUANT_WARP_VECS
#error "QUANT_WARP_VECS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef QUANT_ROW_VECS
#error "QUANT_ROW_VECS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif

struct alignas(8) Bf16x4 {
    u16 v[4];
};

struct alignas(16) Bf16x8 {
    u16 v[8];
};

// 4 floats as bf16 at element i of out, and, when split, their lo = bf16(v - hi) at element i + lo_step
__device__ __forceinline__ void store_bf16x4(const float (&v)[4], u16* __restrict__ out, long long i, bool split,
                                             long long lo_step) {
    Bf16x4 h, l;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        h.v[j] = TBF16::from_f32(v[j]);
        l.v[j] = TBF16::from_f32(v[j] - TBF16::to_f32(h.v[j]));
    }
    *reinterpret_cast<Bf16x4*>(out + i) = h;
    if (split) *reinterpret_cast<Bf16x4*>(out + i + lo_step) = l;
}

// f(r, c) for every row r < rows and every W-th column c < cols (cols a multiple of W), spread over the grid
template <int W, typename F>
__device__ __forceinline__ void for_each_group(int rows, int cols, F f) {
    const int groups = cols / W;
    const long long n = (long long)rows * groups;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < n; q += stride)
        f((int)(q / groups), (int)(q % groups) * W);
}

// the expert whose sorted positions hold pos: the last e with offsets[e] <= pos (experts without rows share offsets)
__device__ __forceinline__ int expert_of(const int* __restrict__ offsets, int num_experts, int pos) {
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= pos) lo = mid; else hi = mid - 1;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
gather_bf16(const float* __restrict__ x, const int* __restrict__ perm, const int* __restrict__ offsets,
            int num_experts, u16* __restrict__ out, int num_pairs, int cols, int k, int split) {
    for_each_group<4>(num_pairs, cols, [&](int pos, int c) {
        const float4 v = *reinterpret_cast<const float4*>(x + (size_t)(perm[pos] / k) * cols + c);
        const float vals[4] = {v.x, v.y, v.z, v.w};
        int row = pos;
        long long lo_step = 0;
        if (split) {
            const int e = expert_of(offsets, num_experts, pos);
            row = pos + offsets[e];
            lo_step = (long long)(offsets[e + 1] - offsets[e]) * cols;
        }
        store_bf16x4(vals, out, (long long)row * cols + c, split, lo_step);
    });
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

// row r's products, plus row rows + r's when split (the lo half of a stacked product)
__device__ __forceinline__ float4 stacked_row4(const float* __restrict__ p, int r, int rows, int width, int c,
                                               bool split) {
    float4 v = *reinterpret_cast<const float4*>(p + (size_t)r * width + c);
    if (split) {
        const float4 w = *reinterpret_cast<const float4*>(p + (size_t)(rows + r) * width + c);
        v = make_float4(v.x + w.x, v.y + w.y, v.z + w.z, v.w + w.w);
    }
    return v;
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
gate_up_epilogue(const float* __restrict__ gu, const unsigned long long* __restrict__ blobs, int e, long long off_s,
                 u16* __restrict__ out, int rows, int inter, int split) {
    const float* s = reinterpret_cast<const float*>(blobs[e] + off_s);
    for_each_group<4>(rows, inter, [&](int r, int c) {
        const float4 g = stacked_row4(gu, r, rows, 2 * inter, c, split);
        const float4 u = stacked_row4(gu + inter, r, rows, 2 * inter, c, split);
        const float4 sg = *reinterpret_cast<const float4*>(s + c);
        const float4 su = *reinterpret_cast<const float4*>(s + inter + c);
        const float vals[4] = {silu_f32(g.x * sg.x) * (u.x * su.x), silu_f32(g.y * sg.y) * (u.y * su.y),
                               silu_f32(g.z * sg.z) * (u.z * su.z), silu_f32(g.w * sg.w) * (u.w * su.w)};
        store_bf16x4(vals, out, (long long)r * inter + c, split, (long long)rows * inter);
    });
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
down_epilogue(const float* __restrict__ yd, const unsigned long long* __restrict__ blobs, int e, long long off_s,
              const int* __restrict__ perm, int start, const float* __restrict__ pair_w, float* __restrict__ ypair,
              int rows, int hidden, int split) {
    const float* s = reinterpret_cast<const float*>(blobs[e] + off_s);
    for_each_group<4>(rows, hidden, [&](int r, int c) {
        const int pair = perm[start + r];
        const float pw = pair_w[pair];
        const float4 v = stacked_row4(yd, r, rows, hidden, c, split);
        const float4 sc = *reinterpret_cast<const float4*>(s + c);
        *reinterpret_cast<float4*>(ypair + (size_t)pair * hidden + c) =
            make_float4(pw * v.x * sc.x, pw * v.y * sc.y, pw * v.z * sc.z, pw * v.w * sc.w);
    });
}

// ---- W8A8 ("int8" activations): cuBLAS's int8 products on the blobs' int8 matrices, read in place ----------------
// Each product's input rows are rounded to int8 with one scale a row (a token's x, a pair's act): q = rint(v / s),
// s = max|v| / 127 of the row (a row of zeros: s = 0, q = 0), IEEE division and rintf as NumPy's float32
// np.rint(v / s) (the twin: numpy_backend.quantize_int8_groups with the whole row as its group). cuBLAS returns
// exact int32 sums; the epilogues scale them by the row's s and the weight row's scale, in that order.
//   quantize_rows_int8:     q, s of x [rows, cols], one block a row (grid-stride over rows)
//   gather_rows_int8:       out[pos] = q[perm[pos] / k], out_s[pos] = s[perm[pos] / k]         16-byte chunks
//   gate_up_epilogue_int8:  act[pos, i] = silu((g * rs[pos]) * s[i]) * ((u * rs[pos]) * s[I + i]), g, u the int32
//                           sums of sorted row pos, s the row scales of its expert (found from the dispatch offsets)
//   down_epilogue_int8:     ypair[perm[pos], h] = (w[perm[pos]] * (y * rs[pos])) * s[h]
// The epilogues take every pair's row in one launch (each expert's products written at its rows of one array), so
// that a layer costs the host two cuBLAS calls an expert and five launches.
__device__ __forceinline__ signed char round_int8(float v, float sc) {
    return (signed char)(int)(sc > 0.0f ? rintf(v / sc) : 0.0f);
}

// A thread's float4s of a row: v[i] = the row's values at 4 (first + i stride) (zeros past cols, a multiple of 4);
// returns the largest magnitude among them
template <int VECS>
__device__ __forceinline__ float load_row_vecs(const float* __restrict__ row, int cols, int first, int stride,
                                               float4 (&v)[VECS]) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
        const int c = 4 * (first + i * stride);
        v[i] = c < cols ? *reinterpret_cast<const float4*>(row + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        m = fmaxf(fmaxf(m, fmaxf(fabsf(v[i].x), fabsf(v[i].y))), fmaxf(fabsf(v[i].z), fabsf(v[i].w)));
    }
    return m;
}

// The int8 rounding (scale sc) of load_row_vecs' values, stored at their columns of qrow
template <int VECS>
__device__ __forceinline__ void store_row_vecs(signed char* __restrict__ qrow, int cols, int first, int stride,
                                               const float4 (&v)[VECS], float sc) {
#pragma unroll
    for (int i = 0; i < VECS; ++i) {
        const int c = 4 * (first + i * stride);
        if (c < cols)
            *reinterpret_cast<char4*>(qrow + c) = make_char4(round_int8(v[i].x, sc), round_int8(v[i].y, sc),
                                                             round_int8(v[i].z, sc), round_int8(v[i].w, sc));
    }
}

// A row of whole float4s, up to 32 x QUANT_WARP_VECS of them (limits.quantize_rows_by_warp), is a warp's: read once
// into its registers, its max reduced by shuffles alone, no barrier (the rows of Qwen3's x and act: 2,048 and 768
// values; a block a row walked them one after another, ~31 rows a block at 4,096 tokens). Longer rows are a block's:
// read once into registers up to GLUE_THREADS x QUANT_ROW_VECS float4s (Mixtral's 14,336 columns: 14 a thread), else
// twice, for their max and then for the rounding. The same bits every way.
__device__ __forceinline__ void quantize_rows_by_warp(const float* __restrict__ x, signed char* __restrict__ q,
                                                      float* __restrict__ s, int rows, int cols) {
    const int lane = threadIdx.x & 31, warps = (int)(gridDim.x * blockDim.x) >> 5;
    for (int r = (int)(blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const float* row = x + (size_t)r * cols;
        signed char* qrow = q + (size_t)r * cols;
        float4 v[QUANT_WARP_VECS];
        const float sc = warp_max(load_row_vecs(row, cols, lane, 32, v)) / 127.0f;
        store_row_vecs(qrow, cols, lane, 32, v, sc);
        if (lane == 0) s[r] = sc;
    }
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
quantize_rows_int8(const float* __restrict__ x, signed char* __restrict__ q, float* __restrict__ s, int rows,
                   int cols) {
    if (cols % 4 == 0 && cols <= 32 * 4 * QUANT_WARP_VECS) {   // the same test for the whole launch
        quantize_rows_by_warp(x, q, s, rows, cols);
        return;
    }
    __shared__ float s_red[32];
    const bool in_registers = cols % 4 == 0 && cols <= (int)blockDim.x * 4 * QUANT_ROW_VECS;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + (size_t)r * cols;
        signed char* qrow = q + (size_t)r * cols;
        float sc;
        if (in_registers) {
            float4 v[QUANT_ROW_VECS];
            sc = block_reduce<warp_max>(load_row_vecs(row, cols, threadIdx.x, blockDim.x, v), s_red) / 127.0f;
            store_row_vecs(qrow, cols, threadIdx.x, blockDim.x, v, sc);
        } else {
            float m = 0.0f;
            for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(row[c]));
            sc = block_reduce<warp_max>(m, s_red) / 127.0f;
            for (int c = threadIdx.x; c < cols; c += blockDim.x) qrow[c] = round_int8(row[c], sc);
        }
        if (threadIdx.x == 0) s[r] = sc;
    }
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
gather_rows_int8(const signed char* __restrict__ q, const float* __restrict__ s, const int* __restrict__ perm,
                 signed char* __restrict__ out, float* __restrict__ out_s, int num_pairs, int cols, int k) {
    for_each_group<16>(num_pairs, cols, [&](int pos, int c) {
        const int tok = perm[pos] / k;
        *reinterpret_cast<int4*>(out + (size_t)pos * cols + c) =
            *reinterpret_cast<const int4*>(q + (size_t)tok * cols + c);
        if (c == 0) out_s[pos] = s[tok];
    });
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
gate_up_epilogue_int8(const int* __restrict__ gu, const float* __restrict__ rs, const int* __restrict__ offsets,
                      int num_experts, const unsigned long long* __restrict__ blobs, long long off_s,
                      float* __restrict__ act, int num_pairs, int inter) {
    for_each_group<4>(num_pairs, inter, [&](int r, int c) {
        const float* s = reinterpret_cast<const float*>(blobs[expert_of(offsets, num_experts, r)] + off_s);
        const int4 g = *reinterpret_cast<const int4*>(gu + (size_t)r * 2 * inter + c);
        const int4 u = *reinterpret_cast<const int4*>(gu + (size_t)r * 2 * inter + inter + c);
        const float4 sg = *reinterpret_cast<const float4*>(s + c);
        const float4 su = *reinterpret_cast<const float4*>(s + inter + c);
        const float x = rs[r];
        *reinterpret_cast<float4*>(act + (size_t)r * inter + c) = make_float4(
            silu_f32((g.x * x) * sg.x) * ((u.x * x) * su.x), silu_f32((g.y * x) * sg.y) * ((u.y * x) * su.y),
            silu_f32((g.z * x) * sg.z) * ((u.z * x) * su.z), silu_f32((g.w * x) * sg.w) * ((u.w * x) * su.w));
    });
}

extern "C" __global__ void __launch_bounds__(GLUE_THREADS)
down_epilogue_int8(const int* __restrict__ yd, const float* __restrict__ rs, const int* __restrict__ offsets,
                   int num_experts, const unsigned long long* __restrict__ blobs, long long off_s,
                   const int* __restrict__ perm, const float* __restrict__ pair_w, float* __restrict__ ypair,
                   int num_pairs, int hidden) {
    for_each_group<4>(num_pairs, hidden, [&](int r, int c) {
        const float* s = reinterpret_cast<const float*>(blobs[expert_of(offsets, num_experts, r)] + off_s);
        const int pair = perm[r];
        const float pw = pair_w[pair], a = rs[r];
        const int4 v = *reinterpret_cast<const int4*>(yd + (size_t)r * hidden + c);
        const float4 sc = *reinterpret_cast<const float4*>(s + c);
        *reinterpret_cast<float4*>(ypair + (size_t)pair * hidden + c) =
            make_float4(pw * (v.x * a) * sc.x, pw * (v.y * a) * sc.y, pw * (v.z * a) * sc.z, pw * (v.w * a) * sc.w);
    });
}
