// Prefill grouped int8 expert GEMM, pipelined: the contract of moe_gemm.cu's tensor-core kernels (moe_gemm_tc_*),
// per-row scales, fed by the same dispatch tile lists (tiles of FAST_BM = the dispatch's tile_m sorted rows).
//   moe_gemm_fast_gate_up_*: act[pos, i] = silu(x[perm[pos] / k] . gate[i]) * (x[perm[pos] / k] . up[i])
//   moe_gemm_fast_down_*:    y[perm[pos], h] = w[perm[pos]] * (act[pos] . down[h])
// The activations arrive already in bf16 (ops.split_bf16 on the host side of the launch), so that the copies into
// shared memory are plain asynchronous 16-byte copies: suffix _bf16 reads hi = bf16(x) only (one MMA a weight),
// _split reads hi and lo = bf16(x - hi) too (two MMAs a weight, ~16 significant bits, like moe_gemm_tc). Suffix
// _int8 (W8A8) reads int8 rows with one scale a row (ops.quantize_rows_int8: x a token, act a pair) and multiplies
// bytes by bytes (mma.sync m16n8k32 s8, exact int32 sums; a quarter of _split's MMAs and no widening); its
// epilogues scale each sum by the row's scale, then the weight row's, in moe_gemm_cublas.cu's W8A8 order, so that
// it computes what the W8A8 cuBLAS route computes.
//
// Block: FAST_THREADS = 8 warps side by side along the weight rows; the block tile is FAST_BM rows x FAST_BN weight
// rows (down: FAST_BN outputs; gate_up: FAST_BN / 2 outputs, their gate rows then their up rows), each warp owning
// all FAST_BM rows x 32 weight rows (4 x 4 mma.sync m16n8k16 tiles). K advances FAST_BK columns a step,
// FAST_STAGE_STEPS steps a stage, through a FAST_STAGES-deep ring of shared-memory stages filled by cp.async, so
// global loads overlap the MMAs.
//
// The int8 weights stay bytes in shared memory and become bf16 (exact) only in registers, as B fragments. To make
// that cheap, the k order inside each 32-column slice is permuted, identically for A and B (a dot product does not
// depend on the order of its terms): lane (g, t) holds columns 8t..8t+7 of the slice, so one 8-byte shared load
// gives it the B fragments of both k16 MMAs of the slice (4 weights each) and one 16-byte load per row its A
// fragments (the same shared-load count as ldmatrix.x4, which cannot produce this order). With int8 activations
// the same order serves m16n8k32: one 8-byte load a row gives a lane its A bytes of both halves of the slice.
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
#ifndef FAST_SKIP_EMPTY_M
#error "FAST_SKIP_EMPTY_M undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_STAGE_STEPS
#error "FAST_STAGE_STEPS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_L2_PREFETCH
#error "FAST_L2_PREFETCH undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef FAST_PERSISTENT
#error "FAST_PERSISTENT undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
static_assert(FAST_THREADS == 256 && FAST_BM == 64 && FAST_BN == 256,
              "8 warps along the weight rows, each owning 64 rows x 32 weight rows (4 x 4 m16n8 tiles)");
static_assert(FAST_BK == 64, "the shared-memory swizzles assume 8 bf16 chunks (A) and 4 int8 chunks (B) a row");
static_assert(FAST_STAGES >= 2, "a pipeline needs at least two stages");
static_assert(FAST_STAGE_STEPS >= 1, "a stage holds at least one K step");

#define FAST_WARPS (FAST_THREADS / 32)
#define FAST_WARP_N (FAST_BN / FAST_WARPS)      // weight rows a warp owns: 32
#define FAST_MT (FAST_BM / 16)                  // m16 tiles a warp covers: 4
#define FAST_NT (FAST_WARP_N / 8)               // n8 tiles a warp covers: 4
#define FAST_A_CHUNKS (FAST_BK / 8)             // 16-byte chunks of a bf16 A row in a step: 8
#define FAST_B_CHUNKS (FAST_BK / 16)            // 16-byte chunks of an int8 B row in a step: 4
#define FAST_A_BYTES (FAST_BM * FAST_BK * 2)
#define FAST_STAGE_COLS (FAST_BK * FAST_STAGE_STEPS)   // K columns a pipeline stage holds
#define FAST_B_BYTES (FAST_BN * FAST_BK)

// What a kernel's activations are: bf16 (hi), bf16 hi + lo, or int8 with a scale a row
enum FastInput { FAST_IN_BF16, FAST_IN_SPLIT, FAST_IN_INT8 };

// ---- asynchronous copies (sm_80+) ----------------------------------------------------------------------------
// The copy instruction: FAST_L2_PREFETCH bytes around each source read brought into L2 (0: no prefetch size, the
// sectors read only), so that a 64-byte read of a weight row fetches the row's next bytes from DRAM with it
#if FAST_L2_PREFETCH == 0
#define FAST_CP_ASYNC "cp.async.cg.shared.global"
#elif FAST_L2_PREFETCH == 128
#define FAST_CP_ASYNC "cp.async.cg.shared.global.L2::128B"
#elif FAST_L2_PREFETCH == 256
#define FAST_CP_ASYNC "cp.async.cg.shared.global.L2::256B"
#else
#error "FAST_L2_PREFETCH must be 0, 128 or 256"
#endif

// common.cuh's copy16_async with FAST_CP_ASYNC's L2 prefetch size (commit_copies / wait_copies as there)
__device__ __forceinline__ void copy16_async_l2(void* dst, const void* src, bool valid) {
    asm volatile(FAST_CP_ASYNC " [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

// ---- shared-memory layout ---------------------------------------------------------------------------------------
// Chunk slots are XOR-swizzled so that the fragment loads of a warp hit 32 distinct banks: a 16-byte A load phase
// (8 lanes) reads rows g, g + 1 at the same 4 logical chunks, an 8-byte B load phase (16 lanes) rows g..g+3 at the
// same 2 chunks; the writes (8 lanes, one row's or two rows' chunks) stay conflict-free too.
__device__ __forceinline__ int a_slot(int row, int chunk) { return chunk ^ ((row & 1) << 2); }
__device__ __forceinline__ int b_slot(int row, int chunk) { return chunk ^ (((row >> 1) & 1) << 1); }

template <int IN>
struct FastStage {
    static constexpr int A_PARTS = IN == FAST_IN_SPLIT ? 2 : 1;   // hi, then lo
    static constexpr int A_BYTES = IN == FAST_IN_INT8 ? FAST_BM * FAST_BK : FAST_A_BYTES;
    static constexpr int BYTES = A_PARTS * A_BYTES + FAST_B_BYTES;
};

template <int IN>
struct FastAcc {            // the accumulators: fp32, or exact int32 sums of int8 products
    typedef float T;
};
template <>
struct FastAcc<FAST_IN_INT8> {
    typedef int T;
};

// One pipeline stage of the block tile: FAST_STAGE_STEPS K steps of FAST_BK columns from k0 (zeros past ncols, which
// is a multiple of 16), each step in its own FastStage<IN>::BYTES of the stage: FAST_BM gathered activation rows
// (rows < 0: zeros), then FAST_BN weight rows (rows < 0: zeros). int8 activation rows are laid out as the weight rows
// are (4 chunks, b_slot). A copy's 16-byte chunk runs fastest, then its step: consecutive lanes copy a row's
// consecutive bytes, FAST_STAGE_COLS of them (64 for an int8 row of one step; whether longer runs of a row read HBM
// faster is what benchmarks/prefill_gemm.py --sweep times with 2 steps a stage).
template <int CHUNKS, int ROWS>
struct StageCopy {          // copy i of a stage's rows of CHUNKS chunks a step: (row, step, chunk)
    static constexpr int PER_THREAD = ROWS * CHUNKS * FAST_STAGE_STEPS / FAST_THREADS;
    static_assert(ROWS * CHUNKS * FAST_STAGE_STEPS % FAST_THREADS == 0, "whole 16-byte copies a thread");
    int row, step, chunk;
    __device__ __forceinline__ explicit StageCopy(int i)
        : row(i / (CHUNKS * FAST_STAGE_STEPS)), step(i / CHUNKS % FAST_STAGE_STEPS), chunk(i % CHUNKS) {}
};

template <int IN>
__device__ __forceinline__ void load_stage(unsigned char* stage, const void* __restrict__ in_hi,
                                           const u16* __restrict__ in_lo, const signed char* __restrict__ w,
                                           const int* s_row, const int* s_wrow, int ncols, int k0) {
    constexpr int STEP_BYTES = FastStage<IN>::BYTES;
    const int tid = threadIdx.x;
    if (IN == FAST_IN_INT8) {
        const signed char* in = static_cast<const signed char*>(in_hi);
        typedef StageCopy<FAST_B_CHUNKS, FAST_BM> Copy;
#pragma unroll 4
        for (int it = 0; it < Copy::PER_THREAD; ++it) {
            const Copy cp(tid + it * FAST_THREADS);
            const int src = s_row[cp.row], col = k0 + cp.step * FAST_BK + cp.chunk * 16;
            const bool ok = src >= 0 && col < ncols;
            copy16_async_l2(stage + cp.step * STEP_BYTES + (cp.row * FAST_B_CHUNKS + b_slot(cp.row, cp.chunk)) * 16,
                            in + (ok ? (size_t)src * ncols + col : 0), ok);
        }
    } else {
        const u16* hi = static_cast<const u16*>(in_hi);
        typedef StageCopy<FAST_A_CHUNKS, FAST_BM> Copy;
#pragma unroll 4
        for (int it = 0; it < Copy::PER_THREAD; ++it) {
            const Copy cp(tid + it * FAST_THREADS);
            const int src = s_row[cp.row], col = k0 + cp.step * FAST_BK + cp.chunk * 8;
            const bool ok = src >= 0 && col < ncols;
            const size_t off = ok ? (size_t)src * ncols + col : 0;
            unsigned char* dst =
                stage + cp.step * STEP_BYTES + (cp.row * FAST_A_CHUNKS + a_slot(cp.row, cp.chunk)) * 16;
            copy16_async_l2(dst, hi + off, ok);
            if (IN == FAST_IN_SPLIT) copy16_async_l2(dst + FAST_A_BYTES, in_lo + off, ok);
        }
    }
    unsigned char* bstage = stage + FastStage<IN>::A_PARTS * FastStage<IN>::A_BYTES;
    typedef StageCopy<FAST_B_CHUNKS, FAST_BN> Copy;
#pragma unroll 4   // more in flight at once spilled registers (2 steps a stage, 2 blocks a multiprocessor)
    for (int it = 0; it < Copy::PER_THREAD; ++it) {
        const Copy cp(tid + it * FAST_THREADS);
        const int wr = s_wrow[cp.row], col = k0 + cp.step * FAST_BK + cp.chunk * 16;
        const bool ok = wr >= 0 && col < ncols;
        copy16_async_l2(bstage + cp.step * STEP_BYTES + (cp.row * FAST_B_CHUNKS + b_slot(cp.row, cp.chunk)) * 16,
                        w + (ok ? (size_t)wr * ncols + col : 0), ok);
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
// An m16 row tile of the block's FAST_BM rows whose MMAs can be left out: past the expert's `rows` (zeros, never
// stored), where FAST_SKIP_EMPTY_M asks for it (rows is block-uniform: the branch does not split a warp).
__device__ __forceinline__ bool empty_m_tile(int mi, int rows) { return FAST_SKIP_EMPTY_M && mi * 16 >= rows; }

template <bool GATEUP, int IN>
__device__ __forceinline__ void mma_stage(const unsigned char* stage, float (&acc)[FAST_MT][FAST_NT][4], int warp,
                                          int lane, int rows) {
    const int g = lane >> 2, t = lane & 3;
    const unsigned char* bstage = stage + FastStage<IN>::A_PARTS * FAST_A_BYTES;
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
            if (empty_m_tile(mi, rows)) continue;
            const int r0 = mi * 16 + g, r1 = r0 + 8, c = 4 * s + t;
#pragma unroll
            for (int part = 0; part < FastStage<IN>::A_PARTS; ++part) {
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

// The int8 MMAs of one stage, in the same k order: for each 32-column slice s, lane (g, t) loads 8 bytes at
// columns 32s + 8t of each B row g and each A row g, g + 8: bytes 0-3 are k 4t..4t+3 of m16n8k32 (a0, a1, b0), bytes
// 4-7 its k 16 + 4t.. (a2, a3, b1). A rows sit in shared memory as the B rows do (b_slot).
template <bool GATEUP>
__device__ __forceinline__ void mma_stage_int8(const unsigned char* stage, int (&acc)[FAST_MT][FAST_NT][4], int warp,
                                               int lane, int rows) {
    const int g = lane >> 2, t = lane & 3;
    const unsigned char* bstage = stage + FastStage<FAST_IN_INT8>::A_BYTES;
#pragma unroll
    for (int s = 0; s < FAST_BK / 32; ++s) {
        const int c = 2 * s + (t >> 1), half = 8 * (t & 1);
        uint2 b[FAST_NT];
#pragma unroll
        for (int nt = 0; nt < FAST_NT; ++nt) {
            const int j = warp_b_row<GATEUP>(warp, nt) + g;
            b[nt] = *reinterpret_cast<const uint2*>(bstage + (j * FAST_B_CHUNKS + b_slot(j, c)) * 16 + half);
        }
#pragma unroll
        for (int mi = 0; mi < FAST_MT; ++mi) {
            if (empty_m_tile(mi, rows)) continue;
            const int r0 = mi * 16 + g, r1 = r0 + 8;
            const uint2 a0 = *reinterpret_cast<const uint2*>(stage + (r0 * FAST_B_CHUNKS + b_slot(r0, c)) * 16 + half);
            const uint2 a1 = *reinterpret_cast<const uint2*>(stage + (r1 * FAST_B_CHUNKS + b_slot(r1, c)) * 16 + half);
#pragma unroll
            for (int nt = 0; nt < FAST_NT; ++nt) mma_16832_s8(acc[mi][nt], a0.x, a1.x, a0.y, a1.y, b[nt].x, b[nt].y);
        }
    }
}

// ---- epilogues: accumulator r of tile (mi, nt) is row mi*16 + g (+8 for r >= 2), column nt*8 + 2t + (r & 1) ------
// An accumulator before the weight row's scale: itself, or (int8 activations) its int32 sum times the row's scale.
__device__ __forceinline__ float row_scaled(float v, float) { return v; }
__device__ __forceinline__ float row_scaled(int v, float row_scale) { return (float)v * row_scale; }

template <typename Acc>
__device__ __forceinline__ void store_gate_up(const Acc (&acc)[FAST_MT][FAST_NT][4], const float* __restrict__ scale,
                                              const float* s_rs, float* __restrict__ out, int start, int cnt, int n0,
                                              int nout, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < FAST_MT; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = mi * 16 + g + 8 * half;
            if (m >= cnt) continue;
            float* row = out + (size_t)(start + m) * nout;
            const float rs = s_rs[m];
#pragma unroll
            for (int nt = 0; nt < FAST_NT / 2; ++nt) {
                const int o = n0 + warp * (FAST_WARP_N / 2) + nt * 8 + 2 * t;
                if (o >= nout) continue;   // nout is even: o + 1 < nout too
                const Acc* gate = acc[mi][nt] + 2 * half;
                const Acc* up = acc[mi][nt + FAST_NT / 2] + 2 * half;
                float2 v;
                v.x = silu_f32(row_scaled(gate[0], rs) * __ldg(scale + o)) *
                      (row_scaled(up[0], rs) * __ldg(scale + nout + o));
                v.y = silu_f32(row_scaled(gate[1], rs) * __ldg(scale + o + 1)) *
                      (row_scaled(up[1], rs) * __ldg(scale + nout + o + 1));
                *reinterpret_cast<float2*>(row + o) = v;
            }
        }
}

template <typename Acc>
__device__ __forceinline__ void store_down(const Acc (&acc)[FAST_MT][FAST_NT][4], const float* __restrict__ scale,
                                           const float* s_rs, const int* __restrict__ perm,
                                           const float* __restrict__ pair_w, float* __restrict__ out, int start,
                                           int cnt, int n0, int nout, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < FAST_MT; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = mi * 16 + g + 8 * half;
            if (m >= cnt) continue;
            const int pair = perm[start + m];
            const float pw = __ldg(pair_w + pair), rs = s_rs[m];
            float* row = out + (size_t)pair * nout;
#pragma unroll
            for (int nt = 0; nt < FAST_NT; ++nt) {
                const int o = n0 + warp * FAST_WARP_N + nt * 8 + 2 * t;
                if (o >= nout) continue;   // nout is even: o + 1 < nout too
                const Acc* c = acc[mi][nt] + 2 * half;
                float2 v;
                v.x = pw * row_scaled(c[0], rs) * __ldg(scale + o);   // moe_gemm_tc's rounding order
                v.y = pw * row_scaled(c[1], rs) * __ldg(scale + o + 1);
                *reinterpret_cast<float2*>(row + o) = v;
            }
        }
}

// A stage's MMAs for the kernel's activations (the accumulator type picks the int8 ones)
template <bool GATEUP, int IN>
__device__ __forceinline__ void mma_step(const unsigned char* stage, float (&acc)[FAST_MT][FAST_NT][4], int warp,
                                         int lane, int rows) {
    mma_stage<GATEUP, IN>(stage, acc, warp, lane, rows);
}
template <bool GATEUP, int IN>
__device__ __forceinline__ void mma_step(const unsigned char* stage, int (&acc)[FAST_MT][FAST_NT][4], int warp,
                                         int lane, int rows) {
    mma_stage_int8<GATEUP>(stage, acc, warp, lane, rows);
}

// ---- the kernel body --------------------------------------------------------------------------------------------
// Work items: item w is n-block w % n_blocks of dispatch tile w / n_blocks, and a block takes items b, b + B, b + 2B,
// ... (b its index in the grid, B the grid's blocks). The classic grid (n_blocks x num_tiles blocks) gives each block
// one item; built with FAST_PERSISTENT = 1 the kernel also takes a persistent grid (as many blocks as run at once,
// ops._fast_launch), whose blocks take several, and the cp.async ring runs on across them: the next item's first
// stages load while the current one's last steps multiply and its epilogue stores, instead of each block filling and
// draining the pipeline once. Tiles past the dispatch's are -1 and listed last, so a block's first item without an
// expert ends its list. An item's tables sit in one of two slots: the copies fill item j + 1's while the MMAs read
// item j's, which holds when an item spans at least FAST_STAGES stages (the host takes the classic grid otherwise).
struct FastItem {
    int expert, start, cnt, n0;   // expert (-1: none), first sorted row, rows (<= FAST_BM), first output
};

struct FastSlot {
    int row[FAST_BM];     // activation row of each tile row (-1: past the expert's rows)
    int wrow[FAST_BN];    // weight row of each B row (-1: past nout)
    float rs[FAST_BM];    // int8 activations: each tile row's scale (else unread)
    FastItem item;
};

// Item `item`'s tables into `slot` (every thread its share; a barrier must follow before they are read): its expert,
// or -1 when the block has no such item.
template <bool GATEUP, int IN>
__device__ __forceinline__ int setup_item(FastSlot& slot, int item, int n_blocks, int items,
                                          const int* __restrict__ tile_expert, const int* __restrict__ tile_start,
                                          const int* __restrict__ offsets, const int* __restrict__ perm,
                                          const float* __restrict__ in_scale, int nout, int k) {
    constexpr int OUT_PER_BLOCK = GATEUP ? FAST_BN / 2 : FAST_BN;
    const int tid = threadIdx.x, tile = item / n_blocks;
    const int e = item < items ? tile_expert[tile] : -1;
    if (e < 0) {
        if (tid == 0) slot.item.expert = -1;
        return -1;
    }
    const int start = tile_start[tile];
    const int cnt = min(FAST_BM, offsets[e + 1] - start);
    const int n0 = (item % n_blocks) * OUT_PER_BLOCK;
    for (int r = tid; r < FAST_BM; r += FAST_THREADS) {
        const int row = r < cnt ? (GATEUP ? perm[start + r] / k : start + r) : -1;
        slot.row[r] = row;
        slot.rs[r] = IN == FAST_IN_INT8 && r < cnt ? in_scale[row] : 0.0f;
    }
    for (int j = tid; j < FAST_BN; j += FAST_THREADS) {
        const int o = n0 + j % OUT_PER_BLOCK;
        slot.wrow[j] = o < nout ? (GATEUP && j >= OUT_PER_BLOCK ? nout + o : o) : -1;
    }
    if (tid == 0) slot.item = FastItem{e, start, cnt, n0};
    return e;
}

// Array `offset` bytes into expert e's blob
template <typename T>
__device__ __forceinline__ const T* expert_array(const unsigned long long* __restrict__ blobs, int e,
                                                long long offset) {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(blobs[e]) + offset);
}

// The copy side of the ring: the stages of the items set up so far end at stage `end` (counted over the block's
// items); `item`, `slot` and `w` are the last such item's, whose stages are copied until then.
struct FastLoads {
    int end, slot, item;
    const signed char* w;
};

// Stage g of the block's items into `stage`; after an item's last stage, the block's next item set up (if any)
template <bool GATEUP, int IN>
__device__ __forceinline__ void copy_stage(FastLoads& L, FastSlot* slots, unsigned char* stage, int g, int steps,
                                           int n_blocks, int items, const void* __restrict__ in_hi,
                                           const u16* __restrict__ in_lo, const float* __restrict__ in_scale,
                                           const unsigned long long* __restrict__ blobs, long long off_w,
                                           const int* __restrict__ perm, const int* __restrict__ offsets,
                                           const int* __restrict__ tile_expert, const int* __restrict__ tile_start,
                                           int ncols, int nout, int k) {
    load_stage<IN>(stage, in_hi, in_lo, L.w, slots[L.slot].row, slots[L.slot].wrow, ncols,
                   (g - (L.end - steps)) * FAST_STAGE_COLS);
    if (!FAST_PERSISTENT || g + 1 < L.end) return;
    L.item += gridDim.x * gridDim.y;
    const int e = setup_item<GATEUP, IN>(slots[L.slot ^ 1], L.item, n_blocks, items, tile_expert, tile_start, offsets,
                                         perm, in_scale, nout, k);
    if (e < 0) return;      // the block's last item: L.end stays, no stage follows
    L.slot ^= 1;
    L.end += steps;
    L.w = expert_array<signed char>(blobs, e, off_w);
}

template <typename Acc>
__device__ __forceinline__ void zero_acc(Acc (&acc)[FAST_MT][FAST_NT][4]) {
#pragma unroll
    for (int mi = 0; mi < FAST_MT; ++mi)
#pragma unroll
        for (int nt = 0; nt < FAST_NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mi][nt][r] = 0;
}

template <bool GATEUP, int IN>
__device__ __forceinline__ void moe_gemm_fast(const void* __restrict__ in_hi, const u16* __restrict__ in_lo,
                                              const float* __restrict__ in_scale,
                                              const unsigned long long* __restrict__ blobs, long long off_w,
                                              long long off_s, const int* __restrict__ perm,
                                              const int* __restrict__ offsets, const int* __restrict__ tile_expert,
                                              const int* __restrict__ tile_start, const float* __restrict__ pair_w,
                                              float* __restrict__ out, int ncols, int nout, int k, int num_tiles) {
    extern __shared__ __align__(128) unsigned char fast_smem[];
    __shared__ FastSlot slots[2];
    constexpr int OUT_PER_BLOCK = GATEUP ? FAST_BN / 2 : FAST_BN;
    constexpr int STAGE_BYTES = FastStage<IN>::BYTES * FAST_STAGE_STEPS;
    const int n_blocks = (nout + OUT_PER_BLOCK - 1) / OUT_PER_BLOCK, items = n_blocks * num_tiles;
    const int steps = (ncols + FAST_STAGE_COLS - 1) / FAST_STAGE_COLS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    const int first = blockIdx.y * gridDim.x + blockIdx.x;
    const int e = setup_item<GATEUP, IN>(slots[0], first, n_blocks, items, tile_expert, tile_start, offsets, perm,
                                         in_scale, nout, k);
    if (e < 0) return;
    FastLoads L{steps, 0, first, expert_array<signed char>(blobs, e, off_w)};
    __syncthreads();

    typename FastAcc<IN>::T acc[FAST_MT][FAST_NT][4];
    zero_acc(acc);
    // prologue: the first FAST_STAGES - 1 stages in flight; one commit group per stage (empty past the block's last
    // item), so that "all but FAST_STAGES - 2 groups done" always means "stage f has landed"
#pragma unroll
    for (int s = 0; s < FAST_STAGES - 1; ++s) {
        if (s < L.end)
            copy_stage<GATEUP, IN>(L, slots, fast_smem + s * STAGE_BYTES, s, steps, n_blocks, items, in_hi, in_lo,
                                   in_scale, blobs, off_w, perm, offsets, tile_expert, tile_start, ncols, nout, k);
        commit_copies();
    }
    for (int slot = 0, f = 0;;) {   // the block's items in turn (the classic grid: one); f counts stages
        const int cnt = slots[slot].item.cnt;
        for (int kt = 0; kt < steps; ++kt, ++f) {
            wait_copies<FAST_STAGES - 2>();
            // stage f (and the tables of any item set up since) visible to every warp, and every warp done with
            // stage f - 1, which is refilled next
            __syncthreads();
            const int g = f + FAST_STAGES - 1;
            if (g < L.end)
                copy_stage<GATEUP, IN>(L, slots, fast_smem + (g % FAST_STAGES) * STAGE_BYTES, g, steps, n_blocks,
                                       items, in_hi, in_lo, in_scale, blobs, off_w, perm, offsets, tile_expert,
                                       tile_start, ncols, nout, k);
            commit_copies();
            // one step's fragments at a time (unrolled, two steps spilled under the 128-register bound)
#pragma unroll 1
            for (int u = 0; u < FAST_STAGE_STEPS; ++u)
                mma_step<GATEUP, IN>(fast_smem + (f % FAST_STAGES) * STAGE_BYTES + u * FastStage<IN>::BYTES, acc,
                                     warp, lane, cnt);
        }
        const FastItem it = slots[slot].item;
        const float* scale = expert_array<float>(blobs, it.expert, off_s);
        if (GATEUP)
            store_gate_up(acc, scale, slots[slot].rs, out, it.start, it.cnt, it.n0, nout, warp, lane);
        else
            store_down(acc, scale, slots[slot].rs, perm, pair_w, out, it.start, it.cnt, it.n0, nout, warp, lane);
        if (!FAST_PERSISTENT) break;
        zero_acc(acc);
        slot ^= 1;
        if (slots[slot].item.expert < 0) break;   // set up (or found missing) by the copies, stages ago
    }
    wait_copies<0>();   // only empty groups remain; leave none outstanding at exit
}

// in_lo is read only by the _split kernels (the _bf16 ones take any pointer there, e.g. in_hi).
#define FAST_GATE_UP_KERNEL(NAME, IN)                                                                           \
    extern "C" __global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS)                                \
        NAME(const u16* x_hi, const u16* x_lo, const unsigned long long* blobs, long long off_w, long long off_s, \
             const int* perm, const int* offsets, const int* tile_expert, const int* tile_start, float* act,     \
             int H, int I, int k, int num_tiles) {                                                             \
        moe_gemm_fast<true, IN>(x_hi, x_lo, nullptr, blobs, off_w, off_s, perm, offsets, tile_expert,          \
                                tile_start, nullptr, act, H, I, k, num_tiles);                                 \
    }
#define FAST_DOWN_KERNEL(NAME, IN)                                                                              \
    extern "C" __global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS)                                \
        NAME(const u16* act_hi, const u16* act_lo, const unsigned long long* blobs, long long off_w,             \
             long long off_s, const int* perm, const int* offsets, const int* tile_expert, const int* tile_start, \
             const float* pair_w, float* y, int H, int I, int num_tiles) {                                     \
        moe_gemm_fast<false, IN>(act_hi, act_lo, nullptr, blobs, off_w, off_s, perm, offsets, tile_expert,     \
                                 tile_start, pair_w, y, I, H, 1, num_tiles);                                   \
    }

FAST_GATE_UP_KERNEL(moe_gemm_fast_gate_up_bf16, FAST_IN_BF16)
FAST_GATE_UP_KERNEL(moe_gemm_fast_gate_up_split, FAST_IN_SPLIT)
FAST_DOWN_KERNEL(moe_gemm_fast_down_bf16, FAST_IN_BF16)
FAST_DOWN_KERNEL(moe_gemm_fast_down_split, FAST_IN_SPLIT)

// W8A8: xq [T, H] int8 with x_scale [T] (a token's), aq [P, I] int8 (sorted order) with a_scale [P] (a pair's)
extern "C" __global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS)
moe_gemm_fast_gate_up_int8(const signed char* xq, const float* x_scale, const unsigned long long* blobs,
                           long long off_w, long long off_s, const int* perm, const int* offsets,
                           const int* tile_expert, const int* tile_start, float* act, int H, int I, int k,
                           int num_tiles) {
    moe_gemm_fast<true, FAST_IN_INT8>(xq, nullptr, x_scale, blobs, off_w, off_s, perm, offsets, tile_expert,
                                      tile_start, nullptr, act, H, I, k, num_tiles);
}

extern "C" __global__ void __launch_bounds__(FAST_THREADS, FAST_MIN_BLOCKS)
moe_gemm_fast_down_int8(const signed char* aq, const float* a_scale, const unsigned long long* blobs,
                        long long off_w, long long off_s, const int* perm, const int* offsets,
                        const int* tile_expert, const int* tile_start, const float* pair_w, float* y, int H, int I,
                        int num_tiles) {
    moe_gemm_fast<false, FAST_IN_INT8>(aq, nullptr, a_scale, blobs, off_w, off_s, perm, offsets, tile_expert,
                                       tile_start, pair_w, y, I, H, 1, num_tiles);
}
