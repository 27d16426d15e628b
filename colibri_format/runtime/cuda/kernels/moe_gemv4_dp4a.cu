// 4-bit (int4_group) expert decode GEMVs on int8 activations: `__dp4a` sums of four int8 products instead of an
// fp32 FMA per weight and token (moe_gemv4.cu's kernels are instruction-bound, docs/benchmarks.md). The contract,
// the work items, the last-item shift and the fill on read are moe_gemv4.cu's: both walk common.cuh's packed4_gemv:
//   moe4a8_gate_up_int4_t<TOKC>: act[pos, i] = silu(x[tok] . gate[i]) * (x[tok] . up[i]), tok = perm[pos] / k
//   moe4a8_down_int4_t<TOKC>:    y[pair, h] = w[pair] * (act[pos] . down[h]), pair = perm[pos]
// with each input row x[tok] (act[pos]) replaced by its int8 rounding (EngineConfig.int8_activations):
//
// Activations: moe4a8_quantize rounds each group of 32 consecutive inputs of a row, once per launch, to
// q = rint(v / s), s = max|v| / 127 of the group (symmetric; a group of zeros has s = 0 and q = 0), fp32 IEEE
// division and rintf (half to even) as NumPy's float32 np.rint(v / s) (the twin: ops.quantize_int8_groups_reference;
// benchmarks/quality_activations.py's "int8_g32" form). q is stored with each 8 inputs permuted to
// (0, 2, 4, 6, 1, 3, 5, 7): the order in which a packed word's even and odd nibbles are picked. s: one float a group.
// moe4a8_round writes rint(v / s) * s as floats instead (the prefill GEMM's inputs: the same rounding everywhere).
//
// Weights: a 16-byte chunk is 32 weights, one activation group, inside one weight group (32, 64 or 128). A word w
// (weights 8u .. 8u + 7, low nibble first) gives two dp4a operands with no sign extension: (w << 4) & 0xF0F0F0F0
// holds 16 x the even weights as signed bytes, w & 0xF0F0F0F0 16 x the odd ones; the 1/16 is folded into the weight
// scale (exact). Per chunk, row and token: 8 dp4a into an int32 (|sum| <= 32 * 128 * 127 < 2^24: exact as a
// float), then acc += sum * (weight scale / 16 * activation scale) in fp32.
#include "common.cuh"

#ifndef A8_THREADS
#error "A8_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_QUANT_THREADS
#error "A8_QUANT_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
// A8_{GU,DN}_T<tokens>_{ROWS,CPL}: limits.py's A8_PLANS
#ifndef A8_GU_T1_ROWS
#error "A8_GU_T1_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T1_CPL
#error "A8_GU_T1_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T1_ROWS
#error "A8_DN_T1_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T1_CPL
#error "A8_DN_T1_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T2_ROWS
#error "A8_GU_T2_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T2_CPL
#error "A8_GU_T2_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T2_ROWS
#error "A8_DN_T2_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T2_CPL
#error "A8_DN_T2_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T4_ROWS
#error "A8_GU_T4_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T4_CPL
#error "A8_GU_T4_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T4_ROWS
#error "A8_DN_T4_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T4_CPL
#error "A8_DN_T4_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T8_ROWS
#error "A8_GU_T8_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_GU_T8_CPL
#error "A8_GU_T8_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T8_ROWS
#error "A8_DN_T8_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef A8_DN_T8_CPL
#error "A8_DN_T8_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(A8_THREADS % 32 == 0 && A8_QUANT_THREADS % 32 == 0, "whole warps");

// ---- activations: int8 per group of 32 (common.cuh's a8_quantize; moe_dispatch_a8 in dispatch.cu runs it too) ------
extern "C" __global__ void __launch_bounds__(A8_QUANT_THREADS)
    moe4a8_quantize(const float* x, signed char* q, float* s, long long ngroups) {
    a8_quantize<true>(x, q, s, nullptr, ngroups, global_warp(), total_warps());
}

extern "C" __global__ void __launch_bounds__(A8_QUANT_THREADS)
    moe4a8_round(const float* x, float* rounded, long long ngroups) {
    a8_quantize<false>(x, nullptr, nullptr, rounded, ngroups, global_warp(), total_warps());
}

// ---- the GEMVs ----------------------------------------------------------------------------------------------------
__device__ __forceinline__ int a8_word(const int4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// int8 inputs (staged by moe4a8_quantize): per chunk, row and token 8 dp4a into an int32, then one multiply by the
// weight group's scale / 16 times the activation group's scale
struct A8Dot {
    typedef u16 scale_t;
    const signed char* inq;  // [rows, ncols], each 8 inputs in a8_position order
    const float* ins;        // [rows, ncols / 32]
    int ncols;

    template <int TOKC, int R>
    __device__ __forceinline__ void chunk(float (&acc)[R][TOKC], const int4 (&raw)[R], const u16 (&sraw)[R],
                                          const int (&trow)[TOKC], int nt, int cc) const {
        float ws[R];
#pragma unroll
        for (int r = 0; r < R; ++r) ws[r] = TF16::to_f32(sraw[r]) * 0.0625f;
#pragma unroll
        for (int j = 0; j < TOKC; ++j) {
            if (j < nt) {
                const int4* ap = reinterpret_cast<const int4*>(inq + (size_t)trow[j] * ncols) + 2 * cc;
                const int4 a0 = __ldg(ap), a1 = __ldg(ap + 1);
                const float as = __ldg(ins + (size_t)trow[j] * (ncols >> 5) + cc);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int sum = 0;
#pragma unroll
                    for (int wi = 0; wi < 4; ++wi) {
                        const unsigned int w = (unsigned int)a8_word(raw[r], wi);
                        const int4& a = wi < 2 ? a0 : a1;
                        sum = __dp4a((int)((w << 4) & 0xF0F0F0F0u), a8_word(a, 2 * (wi & 1)), sum);
                        sum = __dp4a((int)(w & 0xF0F0F0F0u), a8_word(a, 2 * (wi & 1) + 1), sum);
                    }
                    acc[r][j] = fmaf((float)sum, ws[r] * as, acc[r][j]);
                }
            }
        }
    }
};

#define GATE_UP_A8_KERNEL(NAME, TOKC, R, CPL)                                                                     \
    extern "C" __global__ void __launch_bounds__(A8_THREADS)                                                    \
        NAME(const signed char* xq, const float* xs, const unsigned long long* blobs,                           \
             const unsigned long long* fills, long long off_w, long long off_s, const int* perm,                \
             const int* offsets, const int* active, const int* meta, float* act, int H, int I, int k, int group) { \
        packed4_gemv<A8Dot, TOKC, R, CPL, true>(A8Dot{xq, xs, H}, blobs, fills, off_w, off_s, perm, offsets,     \
                                                active, meta, nullptr, act, H, I, k, group);                    \
    }
#define DOWN_A8_KERNEL(NAME, TOKC, R, CPL)                                                                        \
    extern "C" __global__ void __launch_bounds__(A8_THREADS)                                                    \
        NAME(const signed char* aq, const float* as, const unsigned long long* blobs,                           \
             const unsigned long long* fills, long long off_w, long long off_s, const int* perm,                \
             const int* offsets, const int* active, const int* meta, const float* pair_w, float* y, int H, int I, \
             int group) {                                                                                       \
        packed4_gemv<A8Dot, TOKC, R, CPL, false>(A8Dot{aq, as, I}, blobs, fills, off_w, off_s, perm, offsets,    \
                                                 active, meta, pair_w, y, I, H, 1, group);                      \
    }

// suffix: t<TOKC> (tokens per pass); rows per warp item and chunks a lane loads per row at once: limits.py's A8_PLANS
GATE_UP_A8_KERNEL(moe4a8_gate_up_int4_t1, 1, A8_GU_T1_ROWS, A8_GU_T1_CPL)
GATE_UP_A8_KERNEL(moe4a8_gate_up_int4_t2, 2, A8_GU_T2_ROWS, A8_GU_T2_CPL)
GATE_UP_A8_KERNEL(moe4a8_gate_up_int4_t4, 4, A8_GU_T4_ROWS, A8_GU_T4_CPL)
GATE_UP_A8_KERNEL(moe4a8_gate_up_int4_t8, 8, A8_GU_T8_ROWS, A8_GU_T8_CPL)
DOWN_A8_KERNEL(moe4a8_down_int4_t1, 1, A8_DN_T1_ROWS, A8_DN_T1_CPL)
DOWN_A8_KERNEL(moe4a8_down_int4_t2, 2, A8_DN_T2_ROWS, A8_DN_T2_CPL)
DOWN_A8_KERNEL(moe4a8_down_int4_t4, 4, A8_DN_T4_ROWS, A8_DN_T4_CPL)
DOWN_A8_KERNEL(moe4a8_down_int4_t8, 8, A8_DN_T8_ROWS, A8_DN_T8_CPL)

// one token, no dispatch: the t1 kernels by pair (packed4_gemv's BYPAIR); ids [P] int32 straight from the router;
// x rounded by moe4a8_quantize (the dispatch launch that rounds it is gone with the dispatch)
extern "C" __global__ void __launch_bounds__(A8_THREADS)
    moe4a8_gate_up_pairs_int4(const signed char* xq, const float* xs, const int* ids, const unsigned long long* blobs,
                              const unsigned long long* fills, long long off_w, long long off_s, float* act, int H,
                              int I, int k, int group, int P, int E) {
    packed4_gemv<A8Dot, 1, A8_GU_T1_ROWS, A8_GU_T1_CPL, true, true>(A8Dot{xq, xs, H}, blobs, fills, off_w, off_s,
                                                                    nullptr, nullptr, ids, nullptr, nullptr, act, H,
                                                                    I, k, group, P, E);
}

extern "C" __global__ void __launch_bounds__(A8_THREADS)
    moe4a8_down_pairs_int4(const signed char* aq, const float* as, const int* ids, const unsigned long long* blobs,
                           const unsigned long long* fills, long long off_w, long long off_s, const float* pair_w,
                           float* y, int H, int I, int group, int P, int E) {
    packed4_gemv<A8Dot, 1, A8_DN_T1_ROWS, A8_DN_T1_CPL, false, true>(A8Dot{aq, as, I}, blobs, fills, off_w, off_s,
                                                                     nullptr, nullptr, ids, nullptr, pair_w, y, I, H,
                                                                     1, group, P, E);
}
