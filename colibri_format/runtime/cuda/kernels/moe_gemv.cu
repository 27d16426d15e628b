// Decode-time int8 expert GEMVs over all (token, expert) pairs of a step, one launch each.
//
// Weights come straight from the resident expert blobs: blobs[e] is the device address of expert e's blob (of
// this layer); off_w / off_s are the byte offsets of the int8 matrix and of its float32 scales inside a blob
// (docs/design.md, "Expert blobs"). Dequantized weight = q[r, c] * scale[r, c / group].
//
// Work is a flat list of warp items (active expert slot, group of rows) walked by a grid-stride loop over warps,
// so any number of active experts fills the machine. A warp reads each weight row once with 16-byte loads (the
// next chunk's loads are issued before the current chunk is used) and dots it with up to TOKC token vectors of
// that expert at once (tokens beyond TOKC take further passes). Accumulation is fp32 throughout.
//
//   moe_gate_up_*: act[pos, i] = silu(x[tok] . gate[i]) * (x[tok] . up[i]), gate = rows [0, I), up = [I, 2I)
//                  of gate_up [2I, H]; pos is the pair's sorted position (dispatch), tok = perm[pos] / k.
//   moe_down_*:    y[pair, h] = w[pair] * (act[pos] . down[h]), down [H, I], pair = perm[pos]; each pair row is
//                  written by exactly one warp, so the later combine is deterministic.
//   *_pairs_w4_*:  one token a pass without a dispatch: items by pair straight from the router's ids, act in pair
//                  order (ops.moe_experts runs them for one-token passes: a launch fewer a MoE layer).
//   *_extras:      the same with gpt-oss's per-expert biases (gate_up before the activation, down before the routing
//                  weight) and clamped SwiGLU instead of silu(gate) * up (common.cuh ExpertExtras).
//
// Fill on read (paged experts): fills[e], when fills is given and fills[e] != 0, is the device slot the expert
// cache admitted expert e into. Every int8 chunk and scale a warp reads for its first token group it also
// stores at the same offset from fills[e]; the items of a launch cover every row and scale of the matrix, so
// after the gate_up and down launches of a pass the slot holds the expert's arrays. The expert is typically
// read from host memory (a miss), so the admission costs device-memory writes, not a second trip over PCIe.
#include "common.cuh"

#ifndef GEMV_THREADS
#error "GEMV_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef WIDE_GU_W4_ROWS
#error "WIDE_GU_W4_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef WIDE_GU_W4_CPL
#error "WIDE_GU_W4_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef WIDE_DN_W4_ROWS
#error "WIDE_DN_W4_ROWS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef WIDE_DN_W4_CPL
#error "WIDE_DN_W4_CPL undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif

template <int TOKC, int R, int PF, bool GROUPED, bool GATEUP, bool EXTRAS = false>
__device__ __forceinline__ void moe_gemv(const float* __restrict__ in, const unsigned long long* __restrict__ blobs,
                                         const unsigned long long* __restrict__ fills, long long off_w, long long off_s, const int* __restrict__ perm,
                                         const int* __restrict__ offsets, const int* __restrict__ active,
                                         const int* __restrict__ meta, const float* __restrict__ pair_w,
                                         float* __restrict__ out, int ncols, int nout, int k, int group,
                                         const ExpertExtras ex = ExpertExtras{}) {
    constexpr int ROUT = GATEUP ? R / 2 : R;  // output elements per warp item
    const int lane = threadIdx.x & 31;
    const int n_rg = (nout + ROUT - 1) / ROUT;
    const int total = meta[0] * n_rg;
    const int nchunk = ncols >> 4;  // 16-byte chunks per row
    const int ngroups = GROUPED ? ncols / group : 1;
    const int warps_total = (gridDim.x * blockDim.x) >> 5;

    for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total; item += warps_total) {
        const int slot = item / n_rg;
        const int o0 = (item - slot * n_rg) * ROUT;
        const int e = active[slot];
        const char* blob = reinterpret_cast<const char*>(blobs[e]);
        const signed char* wbase = reinterpret_cast<const signed char*>(blob + off_w);
        const float* sbase = reinterpret_cast<const float*>(blob + off_s);
        char* fill = fills ? reinterpret_cast<char*>(fills[e]) : nullptr;
        int4* fw = fill ? reinterpret_cast<int4*>(fill + off_w) : nullptr;      // this item's copy of the matrix
        float* fs = fill ? reinterpret_cast<float*>(fill + off_s) : nullptr;    // and of its scales
        // the last item of an expert is shifted down to stay inside the matrix (nout >= ROUT); it then writes
        // only the outputs at or past its own o0
        const int ob = min(o0, nout - ROUT);
        const int4* wrow = reinterpret_cast<const int4*>(wbase + (size_t)ob * ncols);  // first row of the item
        const int4* wrow2 = reinterpret_cast<const int4*>(wbase + (size_t)(ob + (GATEUP ? nout : 0)) * ncols);
        const int stride = nchunk;  // int4 per row
        const int start = offsets[e];
        const int cnt = offsets[e + 1] - start;

        for (int c0 = 0; c0 < cnt; c0 += TOKC) {
            const int nt = min(TOKC, cnt - c0);
            int xr[TOKC];  // input row of each token of this pass
#pragma unroll
            for (int j = 0; j < TOKC; ++j) {
                const int pos = start + c0 + min(j, nt - 1);
                xr[j] = GATEUP ? perm[pos] / k : pos;
            }
            float acc[R][TOKC];
#pragma unroll
            for (int q = 0; q < R; ++q)
#pragma unroll
                for (int j = 0; j < TOKC; ++j) acc[q][j] = 0.0f;

            // PF + 1 chunks of R rows in registers: the loads of chunk cc + 32 * PF are issued before chunk cc
            // is used
            int4 buf[PF + 1][R];
#pragma unroll
            for (int f = 0; f < PF; ++f) {
                const int cf = lane + 32 * f;
                if (cf < nchunk) {
#pragma unroll
                    for (int q = 0; q < R; ++q)
                        buf[f][q] = __ldg((q < ROUT ? wrow : wrow2) + (q % ROUT) * stride + cf);
                }
            }
#pragma unroll 1
            for (int cc = lane; cc < nchunk; cc += 32) {
                const int cn = cc + 32 * PF;
                if (cn < nchunk) {
#pragma unroll
                    for (int q = 0; q < R; ++q)
                        buf[PF][q] = __ldg((q < ROUT ? wrow : wrow2) + (q % ROUT) * stride + cn);
                }
                int4 raw[R];
#pragma unroll
                for (int q = 0; q < R; ++q) raw[q] = buf[0][q];
                if (fw && c0 == 0) {
#pragma unroll
                    for (int q = 0; q < R; ++q)
                        fw[(size_t)(ob + (q % ROUT) + (q >= ROUT ? nout : 0)) * stride + cc] = raw[q];
                }
                float sc[R];
                if (GROUPED) {
                    const int g = (cc << 4) / group;
#pragma unroll
                    for (int q = 0; q < R; ++q) sc[q] = __ldg(sbase + (size_t)(ob + (q % ROUT) + (GATEUP && q >= ROUT ? nout : 0)) * ngroups + g);
                    if (fs && c0 == 0) {
#pragma unroll
                        for (int q = 0; q < R; ++q) fs[(size_t)(ob + (q % ROUT) + (q >= ROUT ? nout : 0)) * ngroups + g] = sc[q];
                    }
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // two halves of 8 columns keep the token vectors small
                    float xv[TOKC][8];
#pragma unroll
                    for (int j = 0; j < TOKC; ++j) {
                        if (j < nt) {
                            const float4* p = reinterpret_cast<const float4*>(in + (size_t)xr[j] * ncols + (cc << 4) + (h << 3));
                            const float4 a = __ldg(p), b = __ldg(p + 1);
                            xv[j][0] = a.x; xv[j][1] = a.y; xv[j][2] = a.z; xv[j][3] = a.w;
                            xv[j][4] = b.x; xv[j][5] = b.y; xv[j][6] = b.z; xv[j][7] = b.w;
                        }
                    }
#pragma unroll
                    for (int q = 0; q < R; ++q) {
                        float wf[8];
                        i8x4_to_f32((unsigned int)(h ? raw[q].z : raw[q].x), wf);
                        i8x4_to_f32((unsigned int)(h ? raw[q].w : raw[q].y), wf + 4);
                        if (GROUPED) {
#pragma unroll
                            for (int u = 0; u < 8; ++u) wf[u] *= sc[q];
                        }
#pragma unroll
                        for (int j = 0; j < TOKC; ++j) {
                            if (j < nt) {
#pragma unroll
                                for (int u = 0; u < 8; ++u) acc[q][j] = fmaf(wf[u], xv[j][u], acc[q][j]);
                            }
                        }
                    }
                }
#pragma unroll
                for (int f = 0; f < PF; ++f)
#pragma unroll
                    for (int q = 0; q < R; ++q) buf[f][q] = buf[f + 1][q];
            }

            if (!GROUPED && fs && c0 == 0 && lane == 0) {
#pragma unroll
                for (int q = 0; q < R; ++q) {
                    const int r = ob + (q % ROUT) + (q >= ROUT ? nout : 0);     // gate rows, then their up rows
                    fs[r] = __ldg(sbase + r);
                }
            }
            warp_item_sums<R, TOKC, GATEUP>(acc, [&](int q, int j, float row_sum, float up_sum) {
                if (j >= nt || ob + q < o0) return;
                const int pos = start + c0 + j;
                const float a = row_sum * (GROUPED ? 1.0f : __ldg(sbase + ob + q));
                if (GATEUP) {
                    const float b = up_sum * (GROUPED ? 1.0f : __ldg(sbase + nout + ob + q));
                    out[(size_t)pos * nout + ob + q] = expert_activation<EXTRAS>(a, b, ex, e, nout, ob + q);
                } else {
                    const int pair = perm[pos];
                    out[(size_t)pair * nout + ob + q] =
                        __ldg(pair_w + pair) * expert_down_out<EXTRAS>(a, ex, e, nout, ob + q);
                }
            });
        }
    }
}

#define GATE_UP_KERNEL(NAME, TOKC, R, PF, GROUPED)                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, PF > 1 ? 3 : 1)                                 \
        NAME(const float* x, const unsigned long long* blobs, const unsigned long long* fills, long long off_w,  \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta, float* act, \
             int H, int I, int k, int group) {                                                                 \
        moe_gemv<TOKC, R, PF, GROUPED, true>(x, blobs, fills, off_w, off_s, perm, offsets, active, meta, nullptr, \
                                             act, H, I, k, group);                                             \
    }

#define DOWN_KERNEL(NAME, TOKC, R, PF, GROUPED)                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, PF > 1 ? 3 : 1)                                 \
        NAME(const float* act, const unsigned long long* blobs, const unsigned long long* fills, long long off_w, \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta,         \
             const float* pair_w, float* y, int H, int I, int group) {                                         \
        moe_gemv<TOKC, R, PF, GROUPED, false>(act, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w, \
                                              y, I, H, 1, group);                                              \
    }

// suffix: t<TOKC>_<r: per-row scales | g: group scales>; arguments: tokens per pass, rows per warp item,
// prefetch depth (chunks of loads in flight ahead of use), grouped scales
GATE_UP_KERNEL(moe_gate_up_t1_r, 1, 8, 1, false)
GATE_UP_KERNEL(moe_gate_up_t2_r, 2, 8, 1, false)
GATE_UP_KERNEL(moe_gate_up_t4_r, 4, 4, 1, false)
GATE_UP_KERNEL(moe_gate_up_t8_r, 8, 4, 1, false)
GATE_UP_KERNEL(moe_gate_up_t1_g, 1, 8, 1, true)
GATE_UP_KERNEL(moe_gate_up_t2_g, 2, 8, 1, true)
GATE_UP_KERNEL(moe_gate_up_t4_g, 4, 4, 1, true)
GATE_UP_KERNEL(moe_gate_up_t8_g, 8, 4, 1, true)


DOWN_KERNEL(moe_down_t1_r, 1, 8, 1, false)
DOWN_KERNEL(moe_down_t2_r, 2, 8, 1, false)
DOWN_KERNEL(moe_down_t4_r, 4, 4, 1, false)
DOWN_KERNEL(moe_down_t8_r, 8, 4, 1, false)
DOWN_KERNEL(moe_down_t1_g, 1, 8, 1, true)
DOWN_KERNEL(moe_down_t2_g, 2, 8, 1, true)
DOWN_KERNEL(moe_down_t4_g, 4, 4, 1, true)
DOWN_KERNEL(moe_down_t8_g, 8, 4, 1, true)

// y[t, h] = residual[t, h] (if given) + alpha * sum over slots j in order 0..k-1 of ypair[t * k + j, h]
// ---- one token per pass, all loads of a block of CPL chunks issued at once ("wide") ------------------------------
// For short rows (small experts) the double-buffered loop above spends most of an item waiting on its first loads;
// here a warp item of R rows issues the 16-byte loads of CPL chunks per lane for all its rows together, then
// computes, so an item of up to 32 * CPL chunks per row costs one memory round trip. Same outputs as above.
// BYPAIR (the *_pairs kernels below): no dispatch; active is the pass's ids [npairs] in pair order, an item is (pair,
// rows), act and ypair rows are in pair order, and an id outside [0, nexp) gives zero rows (perm, offsets and meta
// unused). Each pair reads its expert's rows, so only passes whose pairs name distinct experts (one token) should.
// A wide item's outputs (one token) from its rows' lane partials acc[R] (gate rows, then up rows, for GATEUP): row
// sums by warp_item_sums, then one lane a row scales, activates and stores (fs: the fill copy's scales, or null).
template <int R, bool GROUPED, bool GATEUP, bool EXTRAS>
__device__ __forceinline__ void wide_item_outputs(float (&acc)[R], const float* sbase, float* fs,
                                                  const float* __restrict__ pair_w, float* __restrict__ out,
                                                  bool valid, int e, int nout, int ob, int o0, int pos, int pair,
                                                  const ExpertExtras& ex) {
    warp_item_sums<R, 1, GATEUP>(reinterpret_cast<float (&)[R][1]>(acc), [&](int q, int, float row_sum, float up_sum) {
        const float sa = GROUPED ? 1.0f : __ldg(sbase + ob + q);
        if (!GROUPED && fs) fs[ob + q] = sa;
        const float a = row_sum * sa;
        if (GATEUP) {
            const float sb = GROUPED ? 1.0f : __ldg(sbase + nout + ob + q);
            if (!GROUPED && fs) fs[nout + ob + q] = sb;
            if (ob + q >= o0)
                out[(size_t)pos * nout + ob + q] =
                    valid ? expert_activation<EXTRAS>(a, up_sum * sb, ex, e, nout, ob + q) : 0.0f;
        } else if (ob + q >= o0) {
            out[(size_t)pair * nout + ob + q] =
                valid ? __ldg(pair_w + pair) * expert_down_out<EXTRAS>(a, ex, e, nout, ob + q) : 0.0f;
        }
    });
}

template <int R, int CPL, bool GROUPED, bool GATEUP, bool EXTRAS = false, bool BYPAIR = false>
__device__ __forceinline__ void moe_gemv_wide(const float* __restrict__ in, const unsigned long long* __restrict__ blobs,
                                              const unsigned long long* __restrict__ fills, long long off_w, long long off_s, const int* __restrict__ perm,
                                              const int* __restrict__ offsets, const int* __restrict__ active,
                                              const int* __restrict__ meta, const float* __restrict__ pair_w,
                                              float* __restrict__ out, int ncols, int nout, int k, int group,
                                              const ExpertExtras ex = ExpertExtras{}, int npairs = 0, int nexp = 0) {
    constexpr int ROUT = GATEUP ? R / 2 : R;
    const int lane = threadIdx.x & 31;
    const int n_rg = (nout + ROUT - 1) / ROUT;
    const int total = (BYPAIR ? npairs : meta[0]) * n_rg;
    const int nchunk = ncols >> 4;
    const int ngroups = GROUPED ? ncols / group : 1;
    const int warps_total = (gridDim.x * blockDim.x) >> 5;

    for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total; item += warps_total) {
        const int slot = item / n_rg;
        const int o0 = (item - slot * n_rg) * ROUT;
        const int named = active[slot];
        const bool valid = !BYPAIR || (named >= 0 && named < nexp);
        const int e = valid ? named : 0;                 // an invalid pair reads expert 0 and writes zeros
        const char* blob = reinterpret_cast<const char*>(blobs[e]);
        const signed char* wbase = reinterpret_cast<const signed char*>(blob + off_w);
        const float* sbase = reinterpret_cast<const float*>(blob + off_s);
        char* fill = fills && valid ? reinterpret_cast<char*>(fills[e]) : nullptr;
        int4* fw = fill ? reinterpret_cast<int4*>(fill + off_w) : nullptr;      // this item's copy of the matrix
        float* fs = fill ? reinterpret_cast<float*>(fill + off_s) : nullptr;    // and of its scales
        const int ob = min(o0, nout - ROUT);
        const int4* wrow = reinterpret_cast<const int4*>(wbase + (size_t)ob * ncols);
        const int4* wrow2 = reinterpret_cast<const int4*>(wbase + (size_t)(ob + (GATEUP ? nout : 0)) * ncols);
        const int start = BYPAIR ? slot : offsets[e];
        const int cnt = BYPAIR ? 1 : offsets[e + 1] - start;
        for (int c0 = 0; c0 < cnt; ++c0) {
            const int pos = start + c0;
            const int pair = BYPAIR ? pos : perm[pos];
            const float* xrow = in + (size_t)(GATEUP ? pair / k : pos) * ncols;
            float acc[R];
#pragma unroll
            for (int q = 0; q < R; ++q) acc[q] = 0.0f;
#pragma unroll 1
            for (int cb = 0; cb < nchunk; cb += 32 * CPL) {
                int4 wv[CPL][R];
#pragma unroll
                for (int f = 0; f < CPL; ++f) {
                    const int cc = cb + f * 32 + lane;
                    if (cc < nchunk) {
#pragma unroll
                        for (int q = 0; q < R; ++q) wv[f][q] = __ldg((q < ROUT ? wrow : wrow2) + (q % ROUT) * nchunk + cc);
                        if (fw && c0 == 0) {
#pragma unroll
                            for (int q = 0; q < R; ++q)
                                fw[(size_t)(ob + (q % ROUT) + (q >= ROUT ? nout : 0)) * nchunk + cc] = wv[f][q];
                        }
                    }
                }
#pragma unroll
                for (int f = 0; f < CPL; ++f) {
                    const int cc = cb + f * 32 + lane;
                    if (cc < nchunk) {
                        float sc[R];
                        if (GROUPED) {
                            const int g = (cc << 4) / group;
#pragma unroll
                            for (int q = 0; q < R; ++q)
                                sc[q] = __ldg(sbase + (size_t)(ob + (q % ROUT) + (GATEUP && q >= ROUT ? nout : 0)) * ngroups + g);
                            if (fs && c0 == 0) {
#pragma unroll
                                for (int q = 0; q < R; ++q)
                                    fs[(size_t)(ob + (q % ROUT) + (q >= ROUT ? nout : 0)) * ngroups + g] = sc[q];
                            }
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const float4* p = reinterpret_cast<const float4*>(xrow + (cc << 4) + (h << 3));
                            const float4 a = __ldg(p), b = __ldg(p + 1);
                            const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                            for (int q = 0; q < R; ++q) {
                                float wf[8];
                                i8x4_to_f32((unsigned int)(h ? wv[f][q].z : wv[f][q].x), wf);
                                i8x4_to_f32((unsigned int)(h ? wv[f][q].w : wv[f][q].y), wf + 4);
                                float part = 0.0f;
#pragma unroll
                                for (int u = 0; u < 8; ++u) part = fmaf(wf[u], xv[u], part);
                                acc[q] = GROUPED ? fmaf(part, sc[q], acc[q]) : acc[q] + part;
                            }
                        }
                    }
                }
            }
            wide_item_outputs<R, GROUPED, GATEUP, EXTRAS>(acc, sbase, fs && c0 == 0 ? fs : nullptr, pair_w, out,
                                                          valid, e, nout, ob, o0, pos, pair, ex);
        }
    }
}

#define GATE_UP_WIDE_KERNEL(NAME, R, CPL, GROUPED)                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                 \
        NAME(const float* x, const unsigned long long* blobs, const unsigned long long* fills, long long off_w,  \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta, float* act, \
             int H, int I, int k, int group) {                                                                 \
        moe_gemv_wide<R, CPL, GROUPED, true>(x, blobs, fills, off_w, off_s, perm, offsets, active, meta, nullptr, \
                                             act, H, I, k, group);                                             \
    }
#define DOWN_WIDE_KERNEL(NAME, R, CPL, GROUPED)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                 \
        NAME(const float* act, const unsigned long long* blobs, const unsigned long long* fills, long long off_w, \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta,         \
             const float* pair_w, float* y, int H, int I, int group) {                                         \
        moe_gemv_wide<R, CPL, GROUPED, false>(act, blobs, fills, off_w, off_s, perm, offsets, active, meta,    \
                                              pair_w, y, I, H, 1, group);                                      \
    }
// suffix: w<2 | 4>_<r | g>; w2: 4 rows per warp item, 2 chunks a lane loads at once; w4 (the one-token default):
// limits.py's GEMV_W4_PLAN
GATE_UP_WIDE_KERNEL(moe_gate_up_w2_r, 4, 2, false)
GATE_UP_WIDE_KERNEL(moe_gate_up_w4_r, WIDE_GU_W4_ROWS, WIDE_GU_W4_CPL, false)
GATE_UP_WIDE_KERNEL(moe_gate_up_w2_g, 4, 2, true)
GATE_UP_WIDE_KERNEL(moe_gate_up_w4_g, WIDE_GU_W4_ROWS, WIDE_GU_W4_CPL, true)
DOWN_WIDE_KERNEL(moe_down_w2_r, 4, 2, false)
DOWN_WIDE_KERNEL(moe_down_w4_r, WIDE_DN_W4_ROWS, WIDE_DN_W4_CPL, false)
DOWN_WIDE_KERNEL(moe_down_w2_g, 4, 2, true)
DOWN_WIDE_KERNEL(moe_down_w4_g, WIDE_DN_W4_ROWS, WIDE_DN_W4_CPL, true)

// ---- one token, no dispatch: the w4 kernels by pair (BYPAIR above); ids [P] int32 straight from the router --------
// The *_extras forms add gpt-oss's ExpertExtras as the other *_extras kernels below (bias may be null).
#define GATE_UP_PAIRS_KERNEL(NAME, GROUPED, EXTRAS, EXTRA_PARAMS, EXTRA_VALUE)                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                 \
        NAME(const float* x, const int* ids, const unsigned long long* blobs, const unsigned long long* fills,  \
             long long off_w, long long off_s, float* act, int H, int I, int k, int group, int P,              \
             int E EXTRA_PARAMS) {                                                                             \
        moe_gemv_wide<WIDE_GU_W4_ROWS, WIDE_GU_W4_CPL, GROUPED, true, EXTRAS, true>(                           \
            x, blobs, fills, off_w, off_s, nullptr, nullptr, ids, nullptr, nullptr, act, H, I, k, group,       \
            EXTRA_VALUE, P, E);                                                                                \
    }
#define DOWN_PAIRS_KERNEL(NAME, GROUPED, EXTRAS, EXTRA_PARAMS, EXTRA_VALUE)                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                 \
        NAME(const float* act, const int* ids, const unsigned long long* blobs, const unsigned long long* fills, \
             long long off_w, long long off_s, const float* pair_w, float* y, int H, int I, int group, int P,   \
             int E EXTRA_PARAMS) {                                                                             \
        moe_gemv_wide<WIDE_DN_W4_ROWS, WIDE_DN_W4_CPL, GROUPED, false, EXTRAS, true>(                          \
            act, blobs, fills, off_w, off_s, nullptr, nullptr, ids, nullptr, pair_w, y, I, H, 1, group,        \
            EXTRA_VALUE, P, E);                                                                                \
    }
#define NO_EXTRAS ExpertExtras{}
#define GATE_UP_EXTRA_PARAMS , const float* bias, float alpha, float limit, float up_offset
#define GATE_UP_EXTRA_VALUE ExpertExtras{bias, alpha, limit, up_offset}
#define DOWN_EXTRA_PARAMS , const float* bias
#define DOWN_EXTRA_VALUE ExpertExtras{bias, 1.0f, 0.0f, 0.0f}
GATE_UP_PAIRS_KERNEL(moe_gate_up_pairs_w4_r, false, false, , NO_EXTRAS)
GATE_UP_PAIRS_KERNEL(moe_gate_up_pairs_w4_g, true, false, , NO_EXTRAS)
DOWN_PAIRS_KERNEL(moe_down_pairs_w4_r, false, false, , NO_EXTRAS)
DOWN_PAIRS_KERNEL(moe_down_pairs_w4_g, true, false, , NO_EXTRAS)
GATE_UP_PAIRS_KERNEL(moe_gate_up_pairs_w4_r_extras, false, true, GATE_UP_EXTRA_PARAMS, GATE_UP_EXTRA_VALUE)
GATE_UP_PAIRS_KERNEL(moe_gate_up_pairs_w4_g_extras, true, true, GATE_UP_EXTRA_PARAMS, GATE_UP_EXTRA_VALUE)
DOWN_PAIRS_KERNEL(moe_down_pairs_w4_r_extras, false, true, DOWN_EXTRA_PARAMS, DOWN_EXTRA_VALUE)
DOWN_PAIRS_KERNEL(moe_down_pairs_w4_g_extras, true, true, DOWN_EXTRA_PARAMS, DOWN_EXTRA_VALUE)

// ---- gpt-oss's experts: the kernels above with ExpertExtras (biases, clamped SwiGLU), suffix _extras ---------------
// bias: gate_up [E, 2I] / down [E, H] f32, or null; alpha, limit (+inf: no clamp), up_offset: see ExpertExtras.
#define GATE_UP_EXTRAS_KERNEL(NAME, BOUNDS, CALL)                                                                   \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                             \
        NAME(const float* x, const unsigned long long* blobs, const unsigned long long* fills, long long off_w,     \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta, float* act,  \
             int H, int I, int k, int group, const float* bias, float alpha, float limit, float up_offset) {        \
        CALL(x, blobs, fills, off_w, off_s, perm, offsets, active, meta, nullptr, act, H, I, k, group,              \
             ExpertExtras{bias, alpha, limit, up_offset});                                                          \
    }
#define DOWN_EXTRAS_KERNEL(NAME, BOUNDS, CALL)                                                                      \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                             \
        NAME(const float* act, const unsigned long long* blobs, const unsigned long long* fills, long long off_w,   \
             long long off_s, const int* perm, const int* offsets, const int* active, const int* meta,              \
             const float* pair_w, float* y, int H, int I, int group, const float* bias) {                           \
        CALL(act, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w, y, I, H, 1, group,               \
             ExpertExtras{bias, 1.0f, 0.0f, 0.0f});                                                                 \
    }
// the launch bounds and template arguments of each plain kernel above, with EXTRAS (parenthesized: a macro
// argument holds no bare comma)
#define GEMV_X(TOKC, R, GROUPED, GATEUP) (moe_gemv<TOKC, R, 1, GROUPED, GATEUP, true>)
#define WIDE_X(R, CPL, GROUPED, GATEUP) (moe_gemv_wide<R, CPL, GROUPED, GATEUP, true>)
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t1_r_extras, (GEMV_THREADS, 1), GEMV_X(1, 8, false, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t2_r_extras, (GEMV_THREADS, 1), GEMV_X(2, 8, false, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t4_r_extras, (GEMV_THREADS, 1), GEMV_X(4, 4, false, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t8_r_extras, (GEMV_THREADS, 1), GEMV_X(8, 4, false, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t1_g_extras, (GEMV_THREADS, 1), GEMV_X(1, 8, true, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t2_g_extras, (GEMV_THREADS, 1), GEMV_X(2, 8, true, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t4_g_extras, (GEMV_THREADS, 1), GEMV_X(4, 4, true, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_t8_g_extras, (GEMV_THREADS, 1), GEMV_X(8, 4, true, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_w2_r_extras, (GEMV_THREADS), WIDE_X(4, 2, false, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_w4_r_extras, (GEMV_THREADS), WIDE_X(WIDE_GU_W4_ROWS, WIDE_GU_W4_CPL, false, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_w2_g_extras, (GEMV_THREADS), WIDE_X(4, 2, true, true))
GATE_UP_EXTRAS_KERNEL(moe_gate_up_w4_g_extras, (GEMV_THREADS), WIDE_X(WIDE_GU_W4_ROWS, WIDE_GU_W4_CPL, true, true))
DOWN_EXTRAS_KERNEL(moe_down_t1_r_extras, (GEMV_THREADS, 1), GEMV_X(1, 8, false, false))
DOWN_EXTRAS_KERNEL(moe_down_t2_r_extras, (GEMV_THREADS, 1), GEMV_X(2, 8, false, false))
DOWN_EXTRAS_KERNEL(moe_down_t4_r_extras, (GEMV_THREADS, 1), GEMV_X(4, 4, false, false))
DOWN_EXTRAS_KERNEL(moe_down_t8_r_extras, (GEMV_THREADS, 1), GEMV_X(8, 4, false, false))
DOWN_EXTRAS_KERNEL(moe_down_t1_g_extras, (GEMV_THREADS, 1), GEMV_X(1, 8, true, false))
DOWN_EXTRAS_KERNEL(moe_down_t2_g_extras, (GEMV_THREADS, 1), GEMV_X(2, 8, true, false))
DOWN_EXTRAS_KERNEL(moe_down_t4_g_extras, (GEMV_THREADS, 1), GEMV_X(4, 4, true, false))
DOWN_EXTRAS_KERNEL(moe_down_t8_g_extras, (GEMV_THREADS, 1), GEMV_X(8, 4, true, false))
DOWN_EXTRAS_KERNEL(moe_down_w2_r_extras, (GEMV_THREADS), WIDE_X(4, 2, false, false))
DOWN_EXTRAS_KERNEL(moe_down_w4_r_extras, (GEMV_THREADS), WIDE_X(WIDE_DN_W4_ROWS, WIDE_DN_W4_CPL, false, false))
DOWN_EXTRAS_KERNEL(moe_down_w2_g_extras, (GEMV_THREADS), WIDE_X(4, 2, true, false))
DOWN_EXTRAS_KERNEL(moe_down_w4_g_extras, (GEMV_THREADS), WIDE_X(WIDE_DN_W4_ROWS, WIDE_DN_W4_CPL, true, false))

// (y may alias residual.) alpha is the residual multiplier of the block output.
extern "C" __global__ void moe_combine(const float* __restrict__ ypair, const float* residual, float* y, int T,
                                       int H, int k, float alpha) {
    const int n4 = (T * H) >> 2;  // H % 4 == 0
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += gridDim.x * blockDim.x) {
        const int t = (i << 2) / H, h = (i << 2) - t * H;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int j = 0; j < k; ++j) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(ypair + ((size_t)t * k + j) * H + h));
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
        if (residual) {
            const float4 r = reinterpret_cast<const float4*>(residual)[i];
            s.x = fmaf(alpha, s.x, r.x); s.y = fmaf(alpha, s.y, r.y); s.z = fmaf(alpha, s.z, r.z); s.w = fmaf(alpha, s.w, r.w);
        } else {
            s.x *= alpha; s.y *= alpha; s.z *= alpha; s.w *= alpha;
        }
        reinterpret_cast<float4*>(y)[i] = s;
    }
}
