// Prefill grouped int8 expert GEMM, pipelined: the contract of moe_gemm.cu's tensor-core kernels (moe_gemm_tc_*),
// per-row scales, fed by the same dispatch tile lists (tiles of FAST_BM = the dispatch's tile_m sorted rows).
//   moe_gemm_fast_gate_up_*: act[pos, i] = silu(x[perm[pos] / k] . gate[i]) * (x[perm[pos] / k] . up[i])
//   moe_gemm_fast_down_*:    y[perm[pos], h] = w[perm[pos]] * (act[pos] . down[h])
// The activations arrive already in bf16 (ops.split_bf16 on the host side of the launch), so that the copies into
// shared memory are plain asynchronous 16-byte copies: suffix _bf16 reads hi = bf16(x) only (one MMA a weight),
// _split reads hi and lo = bf16(x - hi) too (two MMAs a weight, ~16 significant bits, like moe_gemm_tc).
//
// Block: FAST_THREADS = 8 warps side by side along the weight rows; the block tile is FAST_BM rows x FAST_BN weight
// rows (down: FAST_BN outputs; gate_up: FAST_BN / 2 outputs, their gate rows then their up rows), each warp owning
// all FAST_BM rows x 32 weight rows (4 x 4 mma.sync m16n8k16 tiles). K advances FAST_BK columns a step through a
// FAST_STAGES-deep ring of shared-memory stages filled by cp.async, so global loads overlap the MMAs.
//
// The int8 weights stay bytes in shared memory and become bf16 (exact) only in registers, as B fragments. To make
// that cheap, the k order inside each 32-column slice is permuted, identically for A and B (a dot product does not
// depend on the order of its terms): lane (g, t) holds columns 8t..8t+7 of the slice, so one 8-byte shared load
// gives it the B fragments of both k16 MMAs of the slice (4 weights each) and one 16-byte load per row its A
// fragments (the same shared-load count as ldmatrix.x4, which cannot produce this order).
#include "common.cuh"

#ifndef FAST_THREADS
#error "FAST_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_BM
#error "FAST_BM undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_BN
#error "FAST_BN undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_BK
#error "FAST_BK undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_STAGES
#error "FAST_STAGES undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_MIN_BLOCKS
#error "FAST_MIN_BLOCKS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(FAST_THREADS == 256 && FAST_BM == 64 && FAST_BN == 256,
              "8 warps along the weight rows, each owning 64 rows x 32 weight rows (4 x 4 m16n8 tiles)");
static_assert(FAST_BK == 64, "the shared-memory swizzles assume 8 bf16 chunks (A) and 4 int8 chunks (B) a row");
static_assert(FAST_STAGES >= 2, "a pipeline needs at least two stages");
static_assert((FAST_BM * FAST_BK / 8) % FAST_THREADS == 0 && (FAST_BN * FAST_BK / 16) % FAST_THREADS == 0,
              "every thread issues the same number of 16-byte copies a stage");

#define FAST_WARPS (FAST_THREADS / 32)
#define FAST_WARP_N (FAST_BN / FAST_WARPS)      // weight rows a warp owns: 32
#define FAST_MT (FAST_BM / 16)                  // m16 tiles a warp covers: 4
#define FAST_NT (FAST_WARP_N / 8)               // n8 tiles a warp covers: 4
#define FAST_A_CHUNKS (FAST_BK / 8)             // 16-byte chunks of a bf16 A row in a stage: 8
#define FAST_B_CHUNKS (FAST_BK / 16)            // 16-byte chunks of an int8 B row in a stage: 4
#define FAST_A_BYTES (FAST_BM * FAST_BK * 2)
#define FAST_B_BYTES (FAST_BN * FAST_BK)

// ---- asynchronous copies (sm_80+) ----------------------------------------------------------------------------
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, or 16 zero bytes when !valid (src is then not read). The "memory" clobbers keep the
// compiler from moving shared-memory accesses across the copies and the waits.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// ---- shared-memory layout ---------------------------------------------------------------------------------------
// Chunk slots are XOR-swizzled so that the fragment loads of a warp hit 32 distinct banks: a 16-byte A load phase
// (8 lanes) reads rows g, g + 1 at the same 4 logical chunks, an 8-byte B load phase (16 lanes) rows g..g+3 at the
// same 2 chunks; the writes (8 lanes, one row's or two rows' chunks) stay conflict-free too.
__device__ __forceinline__ int a_slot(int row, int chunk) { return chunk ^ ((row & 1) << 2); }
__device__ __forceinline__ int b_slot(int row, int chunk) { return chunk ^ (((row >> 1) & 1) << 1); }

template <bool SPLIT>
struct FastStage {
    static constexpr int A_PARTS = SPLIT ? 2 : 1;   // hi, then lo
    static constexpr int BYTES = A_PARTS * FAST_A_BYTES + FAST_B_BYTES;
};

// One K step of the block tile into a stage: FAST_BM gathered activation rows (rows < 0: zeros) and FAST_BN weight
// rows (rows < 0: zeros), columns k0 .. k0 + FAST_BK (zeros past ncols, which is a multiple of 16).
template <bool SPLIT>
__device__ __forceinline__ void load_stage(unsigned char* stage, const u16* __restrict__ in_hi,
                                           const u16* __restrict__ in_lo, const signed char* __restrict__ w,
                                           const int* s_row, const int* s_wrow, int ncols, int k0) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int it = 0; it < FAST_BM * FAST_A_CHUNKS / FAST_THREADS; ++it) {
        const int i = tid + it * FAST_THREADS;
        const int r = i / FAST_A_CHUNKS, c = i % FAST_A_CHUNKS;
        const int src = s_row[r], col = k0 + c * 8;
        const bool ok = src >= 0 && col < ncols;
        const size_t off = ok ? (size_t)src * ncols + col : 0;
        unsigned char* dst = stage + (r * FAST_A_CHUNKS + a_slot(r, c)) * 16;
        copy16_async(dst, in_hi + off, ok);
        if (SPLIT) copy16_async(dst + FAST_A_BYTES, in_lo + off, ok);
    }
    unsigned char* bstage = stage + FastStage<SPLIT>::A_PARTS * FAST_A_BYTES;
#pragma unroll
    for (int it = 0; it < FAST_BN * FAST_B_CHUNKS / FAST_THREADS; ++it) {
        const int i = tid + it * FAST_THREADS;
        const int j = i / FAST_B_CHUNKS, c = i % FAST_B_CHUNKS;
        const int wr = s_wrow[j], col = k0 + c * 16;
        const bool ok = wr >= 0 && col < ncols;
        copy16_async(bstage + (j * FAST_B_CHUNKS + b_slot(j, c)) * 16, w + (ok ? (size_t)wr * ncols + col : 0), ok);
    }
}

// ---- fragments and MMAs -----------------------------------------------------------------------------------------
// Two signed bytes at bits 0-7 and 16-23 -> their bf16 pair, exactly, in 3 instructions: with r = b & 0x7f, bf16
// bits 0x4300 | r are 128 + r, and b = (128 + r) - (b < 0 ? 256 : 128), an integer of |b| <= 128 that bf16 holds.
__device__ __forceinline__ unsigned int i8x2_to_bf16x2(unsigned int spread) {
    const unsigned int biased = (spread & 0x007f007fu) | 0x43004300u;   // 128 + r
    const unsigned int offset = (spread & 0x00800080u) | 0x43004300u;   // 128, or 256 (0x4380) where b < 0
    return bf16x2_sub(biased, offset);
}

// 4 signed bytes (k order 0..3) -> bf16 pairs (0, 1) and (2, 3), low half first.
__device__ __forceinline__ void i8x4_to_bf16x2(unsigned int w, unsigned int& b01, unsigned int& b23) {
    b01 = i8x2_to_bf16x2(__byte_perm(w, 0u, 0x4140));   // bytes 0, 1 -> bits 0-7, 16-23
    b23 = i8x2_to_bf16x2(__byte_perm(w, 0u, 0x4342));   // bytes 2, 3
}

// The shared B row of n8 tile nt of a warp. down: the warp's 32 consecutive rows. gate_up: the warp's 16 outputs,
// tiles 0, 1 their gate rows (first half of the stage), tiles 2, 3 the matching up rows (second half), so that
// silu(gate) * up is formed in registers.
template <bool GATEUP>
__device__ __forceinline__ int warp_b_row(int warp, int nt) {
    if (!GATEUP) return warp * FAST_WARP_N + nt * 8;
    return (nt >= FAST_NT / 2 ? FAST_BN / 2 : 0) + warp * (FAST_WARP_N / 2) + (nt % (FAST_NT / 2)) * 8;
}

// The MMAs of one stage: for each 32-column slice s, lane (g, t) takes columns 32s + 8t .. + 7 (see the header):
// B: weight row g of each n8 tile, 8 bytes -> fragments of MMA 0 (columns +0..+3) and MMA 1 (+4..+7);
// A: rows g and g + 8 of each m16 tile, 16 bytes each -> a0..a3 of MMA 0 (.x, .y) and MMA 1 (.z, .w).
template <bool GATEUP, bool SPLIT>
__device__ __forceinline__ void mma_stage(const unsigned char* stage, float (&acc)[FAST_MT][FAST_NT][4], int warp,
                                          int lane) {
    const int g = lane >> 2, t = lane & 3;
    const unsigned char* bstage = stage + FastStage<SPLIT>::A_PARTS * FAST_A_BYTES;
    // not unrolled: with both slices' fragments in flight the kernel spills under the 128-register bound
#pragma unroll 1
    for (int s = 0; s < FAST_BK / 32; ++s) {
        unsigned int b[FAST_NT][4];
#pragma unroll
        for (int nt = 0; nt < FAST_NT; ++nt) {
            const int j = warp_b_row<GATEUP>(warp, nt) + g;
            const int c = 2 * s + (t >> 1);
            const uint2 q = *reinterpret_cast<const uint2*>(bstage + (j * FAST_B_CHUNKS + b_slot(j, c)) * 16 +
                                                            8 * (t & 1));
            i8x4_to_bf16x2(q.x, b[nt][0], b[nt][1]);
            i8x4_to_bf16x2(q.y, b[nt][2], b[nt][3]);
        }
#pragma unroll
        for (int mi = 0; mi < FAST_MT; ++mi) {
            const int r0 = mi * 16 + g, r1 = r0 + 8, c = 4 * s + t;
#pragma unroll
            for (int part = 0; part < FastStage<SPLIT>::A_PARTS; ++part) {
                const unsigned char* a = stage + part * FAST_A_BYTES;
                const uint4 row_g = *reinterpret_cast<const uint4*>(a + (r0 * FAST_A_CHUNKS + a_slot(r0, c)) * 16);
                const uint4 row_g8 = *reinterpret_cast<const uint4*>(a + (r1 * FAST_A_CHUNKS + a_slot(r1, c)) * 16);
#pragma unroll
                for (int nt = 0; nt < FAST_NT; ++nt) {
                    mma_16816(acc[mi][nt], row_g.x, row_g8.x, row_g.y, row_g8.y, b[nt][0], b[nt][1]);
                    mma_16816(acc[mi][nt], row_g.z, row_g8.z, row_g.w, row_g8.w, b[nt][2], b[nt][3]);
                }
            }
        }
    }
}

// ---- epilogues: accumulator r of tile (mi, nt) is row mi*16 + g (+8 for r >= 2), column nt*8 + 2t + (r & 1) ------
__device__ __forceinline__ void store_gate_up(const float (&acc)[FAST_MT][FAST_NT][4], const float* __restrict__ scale,
                                              float* __restrict__ out, int start, int cnt, int n0, int nout,
                                              int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < FAST_MT; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = mi * 16 + g + 8 * half;
            if (m >= cnt) continue;
            float* row = out + (size_t)(start + m) * nout;
#pragma unroll
            for (int nt = 0; nt < FAST_NT / 2; ++nt) {
                const int o = n0 + warp * (FAST_WARP_N / 2) + nt * 8 + 2 * t;
                if (o >= nout) continue;   // nout is even: o + 1 < nout too
                const float* gate = acc[mi][nt] + 2 * half;
                const float* up = acc[mi][nt + FAST_NT / 2] + 2 * half;
                float2 v;
                v.x = silu_f32(gate[0] * __ldg(scale + o)) * (up[0] * __ldg(scale + nout + o));
                v.y = silu_f32(gate[1] * __ldg(scale + o + 1)) * (up[1] * __ldg(scale + nout + o + 1));
                *reinterpret_cast<float2*>(row + o) = v;
            }
        }
}

__device__ __forceinline__ void store_down(const float (&acc)[FAST_MT][FAST_NT][4], const float* __restrict__ scale,
                                           const int* __restrict__ perm, const float* __restrict__ pair_w,
                                           float* __restrict__ out, int start, int cnt, int n0, int nout, int warp,
                                           int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < FAST_MT; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = mi * 16 + g + 8 * half;
            if (m >= cnt) continue;
            const int pair = perm[start + m];
            const float pw = __ldg(pair_w + pair);
            float* row = out + (size_t)pair * nout;
#pragma unroll
            for (int nt = 0; nt < FAST_NT; ++nt) {
                const int o = n0 + warp * FAST_WARP_N + nt * 8 + 2 * t;
                if (o >= nout) continue;   // nout is even: o + 1 < nout too
                const float* c = acc[mi][nt] + 2 * half;
                float2 v;
                v.x = pw * c[0] * __ldg(scale + o);   // moe_gemm_tc's rounding order
                v.y = pw * c[1] * __ldg(scale + o + 1);
                *reinterpret_cast<float2*>(row + o) = v;
            }
        }
}

// ---- the kernel body --------------------------------------------------------------------------------------------
template <bool GATEUP, bool SPLIT>
__device__ __forceinline__ void moe_gemm_fast(const u16* __restrict__ in_hi, const u16* __restrict__ in_lo,
                                              const unsigned long long* __restrict__ blobs, long long off_w,
                                              long long off_s, const int* __restrict__ perm,
                                              const int* __restrict__ offsets, const int* __restrict__ tile_expert,
                                              const int* __restrict__ tile_start, const float* __restrict__ pair_w,
                                              float* __restrict__ out, int ncols, int nout, int k) {
    extern __shared__ __align__(128) unsigned char fast_smem[];
    __shared__ int s_row[FAST_BM];    // activation row of each tile row (-1: past the expert's rows)
    __shared__ int s_wrow[FAST_BN];   // weight row of each B row (-1: past nout)
    constexpr int OUT_PER_BLOCK = GATEUP ? FAST_BN / 2 : FAST_BN;

    const int e = tile_expert[blockIdx.y];
    if (e < 0) return;
    const int start = tile_start[blockIdx.y];
    const int cnt = min(FAST_BM, offsets[e + 1] - start);
    const int n0 = blockIdx.x * OUT_PER_BLOCK;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const char* blob = reinterpret_cast<const char*>(blobs[e]);
    const signed char* w = reinterpret_cast<const signed char*>(blob + off_w);
    const float* scale = reinterpret_cast<const float*>(blob + off_s);

    for (int r = tid; r < FAST_BM; r += FAST_THREADS)
        s_row[r] = r < cnt ? (GATEUP ? perm[start + r] / k : start + r) : -1;
    for (int j = tid; j < FAST_BN; j += FAST_THREADS) {
        const int o = n0 + j % OUT_PER_BLOCK;
        s_wrow[j] = o < nout ? (GATEUP && j >= OUT_PER_BLOCK ? nout + o : o) : -1;
    }
    __syncthreads();

    float acc[FAST_MT][FAST_NT][4];
#pragma unroll
    for (int mi = 0; mi < FAST_MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < FAST_NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mi][nt][r] = 0.0f;

    constexpr int STAGE_BYTES = FastStage<SPLIT>::BYTES;
    const int steps = (ncols + FAST_BK - 1) / FAST_BK;
    // prologue: the first FAST_STAGES - 1 steps in flight; one commit group per step (empty past the end), so
    // that "all but FAST_STAGES - 2 groups done" always means "step kt has landed"
#pragma unroll
    for (int s = 0; s < FAST_STAGES - 1; ++s) {
        if (s < steps) load_stage<SPLIT>(fast_smem + s * STAGE_BYTES, in_hi, in_lo, w, s_row, s_wrow, ncols, s * FAST_BK);
        commit_copies();
    }
    for (int kt = 0; kt < steps; ++kt) {
        wait_copies<FAST_STAGES - 2>();
        // step kt visible to every warp, and every warp done with step kt - 1, whose stage is refilled next
        __syncthreads();
        const int next = kt + FAST_STAGES - 1;
        if (next < steps)
            load_stage<SPLIT>(fast_smem + (next % FAST_STAGES) * STAGE_BYTES, in_hi, in_lo, w, s_row, s_wrow, ncols,
                              next * FAST_BK);
        commit_copies();
        mma_stage<GATEUP, SPLIT>(fast_smem + (kt % FAST_STAGES) * STAGE_BYTES, acc, warp, lane);
    }
    wait_copies<0>();   // only empty groups remain; leave none outstanding at exit

    if (GATEUP)
        store_gate_up(acc, scale, out, start, cnt, n0, nout, warp, lane);
    else
        store_down(acc, scale, perm, pair_w, out, start, cnt, n0, nout, warp, lane);
}

// in_lo is read only by the _split kernels (the _bf16 ones take any pointer there, e.g. in_hi).
#define FAST_GATE_UP_KERNEL(NAME, SPLIT)                                                                        \
    extern "C" __global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS)                                \
        NAME(const u16* x_hi, const u16* x_lo, const unsigned long long* blobs, long long off_w, long long off_s, \
             const int* perm, const int* offsets, const int* tile_expert, const int* tile_start, float* act,     \
             int H, int I, int k) {                                                                            \
        moe_gemm_fast<true, SPLIT>(x_hi, x_lo, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start,    \
                                   nullptr, act, H, I, k);                                                     \
    }
#define FAST_DOWN_KERNEL(NAME, SPLIT)                                                                           \
    extern "C" __global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS)                                \
        NAME(const u16* act_hi, const u16* act_lo, const unsigned long long* blobs, long long off_w,             \
             long long off_s, const int* perm, const int* offsets, const int* tile_expert, const int* tile_start, \
             const float* pair_w, float* y, int H, int I) {                                                    \
        moe_gemm_fast<false, SPLIT>(act_hi, act_lo, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, \
                                    pair_w, y, I, H, 1);                                                       \
    }

FAST_GATE_UP_KERNEL(moe_gemm_fast_gate_up_bf16, false)
FAST_GATE_UP_KERNEL(moe_gemm_fast_gate_up_split, true)
FAST_DOWN_KERNEL(moe_gemm_fast_down_bf16, false)
FAST_DOWN_KERNEL(moe_gemm_fast_down_split, true)
