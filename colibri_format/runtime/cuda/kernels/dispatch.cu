// Dispatch: group the P = T*k (token, slot) pairs of a step by expert, on the device, deterministically.
//
// One block of DISPATCH_THREADS threads. Pairs are ranked inside their expert in ascending pair order (a stable
// counting sort built from warp match masks, no atomics), so the output never depends on scheduling.
// Outputs:
//   counts[E]        pairs routed to each expert
//   offsets[E+1]     exclusive prefix sum of counts
//   perm[P]          sorted position -> pair index (pair = token * k + slot)
//   inv[P]           pair index -> sorted position
//   active[E]        experts with count > 0, ascending; entries past num_active are -1
//   meta[4]          {num_active, num_tiles, invalid ids, 0}
//   tile_expert[], tile_start[]  tiles of tile_m consecutive sorted rows that belong to one expert (prefill
//                    GEMM); max_tiles entries are written (-1 past num_tiles), max_tiles >= P / tile_m + E.
// Expert ids outside [0, E) are counted in meta[2] and left out (their inv entry is -1).
// moe_dispatch_a8: the same on block 0, and the pass's expert inputs rounded to int8 (common.cuh's a8_quantize) on
// the blocks after it.
#include "common.cuh"

#ifndef DISPATCH_THREADS
#error "DISPATCH_THREADS undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#ifndef DISPATCH_MAX_E
#error "DISPATCH_MAX_E undefined: compile with the -D options of runtime/cuda/limits.py (KERNEL_DEFINES)"
#endif
#define DISPATCH_WARPS (DISPATCH_THREADS / 32)
static_assert(DISPATCH_THREADS % 32 == 0 && DISPATCH_THREADS >= 128, "warps 0, 1 and 2 run the three scans");

// Exclusive scan of n <= 32 * 16 values held in shared memory, by warp 0; returns the total to every lane of it.
__device__ int warp0_exclusive_scan(int* vals, int n) {
    const int lane = threadIdx.x & 31;
    const int per = (n + 31) / 32;
    const int lo = min(lane * per, n), hi = min(lo + per, n);
    int local = 0;
    for (int i = lo; i < hi; ++i) local += vals[i];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(COLIBRI_FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    int run = incl - local;
    for (int i = lo; i < hi; ++i) {
        const int v = vals[i];
        vals[i] = run;
        run += v;
    }
    return __shfl_sync(COLIBRI_FULL_MASK, incl, 31);
}

// A dispatch block's shared tables
struct DispatchShared {
    int warp[DISPATCH_WARPS][DISPATCH_MAX_E];   // per-warp counts, then per-warp bases
    int run[DISPATCH_MAX_E];                     // running count per expert
    int off[DISPATCH_MAX_E];
    int act[DISPATCH_MAX_E];
    int tiles[DISPATCH_MAX_E];
    int bad;
};

// Pass 1 over pairs [p0, p1): inv[p] = the pair's rank among the range's pairs of its expert (-1: id out of range);
// sh.run[e] = the range's pairs of expert e, sh.bad = its ids out of range. Ends with a barrier.
__device__ __forceinline__ void rank_pairs(const int* __restrict__ ids, int p0, int p1, int E, DispatchShared& sh,
                                           int* __restrict__ inv) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += DISPATCH_THREADS) sh.run[e] = 0;
    if (tid == 0) sh.bad = 0;
    __syncthreads();
    for (int c0 = p0; c0 < p1; c0 += DISPATCH_THREADS) {
        for (int i = tid; i < DISPATCH_WARPS * E; i += DISPATCH_THREADS) sh.warp[i / E][i % E] = 0;
        __syncthreads();
        const int p = c0 + tid;
        int e = (p < p1) ? ids[p] : -1;
        if (p < p1 && (e < 0 || e >= E)) {
            atomicAdd(&sh.bad, 1);
            e = -1;
        }
        const unsigned int peers = __match_any_sync(COLIBRI_FULL_MASK, e);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        if (e >= 0 && rank == 0) sh.warp[warp][e] = __popc(peers);
        __syncthreads();
        for (int x = tid; x < E; x += DISPATCH_THREADS) {
            int run = sh.run[x];
            for (int w = 0; w < DISPATCH_WARPS; ++w) {
                const int c = sh.warp[w][x];
                sh.warp[w][x] = run;
                run += c;
            }
            sh.run[x] = run;
        }
        __syncthreads();
        if (p < p1) inv[p] = (e >= 0) ? sh.warp[warp][e] + rank : -1;
        __syncthreads();
    }
}

// From sh.run (every expert's pairs) and sh.bad: counts, offsets, the active list, meta and the tile lists; sh.off
// keeps the offsets for the scatter. Ends with a barrier.
__device__ __forceinline__ void write_groups(int E, int tile_m, int max_tiles, DispatchShared& sh,
                                             int* __restrict__ counts, int* __restrict__ offsets,
                                             int* __restrict__ active, int* __restrict__ meta,
                                             int* __restrict__ tile_expert, int* __restrict__ tile_start) {
    const int tid = threadIdx.x, warp = tid >> 5;
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        sh.off[e] = sh.run[e];
        sh.act[e] = sh.run[e] > 0 ? 1 : 0;
        sh.tiles[e] = (sh.run[e] + tile_m - 1) / tile_m;
    }
    __syncthreads();
    int total = 0, nact = 0, ntiles = 0;
    if (warp == 0) total = warp0_exclusive_scan(sh.off, E);
    if (warp == 1) nact = warp0_exclusive_scan(sh.act, E);
    if (warp == 2) ntiles = warp0_exclusive_scan(sh.tiles, E);
    __syncthreads();
    if (tid == 0) offsets[E] = total;
    if (tid == 32) meta[0] = nact;
    if (tid == 64) meta[1] = ntiles;
    if (tid == 96) { meta[2] = sh.bad; meta[3] = 0; }
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        counts[e] = sh.run[e];
        offsets[e] = sh.off[e];
        active[e] = -1;
    }
    for (int i = tid; i < max_tiles; i += DISPATCH_THREADS) {
        tile_expert[i] = -1;
        tile_start[i] = 0;
    }
    __syncthreads();
    __threadfence_block();
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        const int n = sh.run[e];
        if (n > 0) {
            active[sh.act[e]] = e;
            const int nt = (n + tile_m - 1) / tile_m;
            for (int j = 0; j < nt; ++j) {
                const int slot = sh.tiles[e] + j;
                if (slot < max_tiles) {
                    tile_expert[slot] = e;
                    tile_start[slot] = sh.off[e] + j * tile_m;
                }
            }
        }
    }
    __syncthreads();
}

// Pass 2 over pairs p0, p0 + step, ... < P: a pair of expert e goes to sorted position base(p, e) + its rank inv[p]
// (base: where the pairs of e in p's range start), written to inv[p]; perm[position] = p. Out-of-range ids are skipped.
template <typename Base>
__device__ __forceinline__ void scatter_pairs(const int* __restrict__ ids, int p0, int step, int P, int E, Base base,
                                              int* __restrict__ inv, int* __restrict__ perm) {
    for (int p = p0; p < P; p += step) {
        const int e = ids[p];
        if (e >= 0 && e < E) {
            const int pos = base(p, e) + inv[p];
            inv[p] = pos;
            perm[pos] = p;
        }
    }
}

__device__ __forceinline__ void dispatch_pairs(const int* __restrict__ ids, int P, int E, int tile_m, int max_tiles,
                                               int* __restrict__ counts, int* __restrict__ offsets,
                                               int* __restrict__ perm, int* __restrict__ inv, int* __restrict__ active,
                                               int* __restrict__ meta, int* __restrict__ tile_expert,
                                               int* __restrict__ tile_start) {
    __shared__ DispatchShared sh;
    rank_pairs(ids, 0, P, E, sh, inv);
    write_groups(E, tile_m, max_tiles, sh, counts, offsets, active, meta, tile_expert, tile_start);
    scatter_pairs(ids, threadIdx.x, DISPATCH_THREADS, P, E, [&](int, int e) { return sh.off[e]; }, inv, perm);
}

// The same grouping over several blocks, for long passes (ops.dispatch, limits.dispatch_blocks), in three launches:
// moe_dispatch_ranks: block b ranks the pairs [b chunk, (b + 1) chunk) as pass 1 does (inv: the rank inside the
//   block's pairs of its expert) and writes its per-expert counts and bad ids to block_counts[b], block_bad[b];
// moe_dispatch_groups (one block): block_base[b][e] = the pairs of expert e in blocks before b, then counts, offsets,
//   active, meta and tiles from the totals;
// moe_dispatch_scatter: inv[p] = offsets[e] + block_base[b][e] + rank, perm[inv[p]] = p.
// Pairs keep ascending order inside their expert, block by block: the output equals moe_dispatch's.
extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS)
    moe_dispatch_ranks(const int* __restrict__ ids, int P, int E, int chunk, int* __restrict__ inv,
                       int* __restrict__ block_counts, int* __restrict__ block_bad) {
    __shared__ DispatchShared sh;
    const int p0 = blockIdx.x * chunk;
    rank_pairs(ids, p0, min(P, p0 + chunk), E, sh, inv);
    for (int e = threadIdx.x; e < E; e += DISPATCH_THREADS) block_counts[(size_t)blockIdx.x * E + e] = sh.run[e];
    if (threadIdx.x == 0) block_bad[blockIdx.x] = sh.bad;
}

extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS)
    moe_dispatch_groups(const int* __restrict__ block_counts, const int* __restrict__ block_bad, int blocks, int E,
                        int tile_m, int max_tiles, int* __restrict__ block_base, int* __restrict__ counts,
                        int* __restrict__ offsets, int* __restrict__ active, int* __restrict__ meta,
                        int* __restrict__ tile_expert, int* __restrict__ tile_start) {
    __shared__ DispatchShared sh;
    for (int e = threadIdx.x; e < E; e += DISPATCH_THREADS) {
        int run = 0;
        for (int b = 0; b < blocks; ++b) {
            block_base[(size_t)b * E + e] = run;
            run += block_counts[(size_t)b * E + e];
        }
        sh.run[e] = run;
    }
    if (threadIdx.x == 0) {
        int bad = 0;
        for (int b = 0; b < blocks; ++b) bad += block_bad[b];
        sh.bad = bad;
    }
    __syncthreads();
    write_groups(E, tile_m, max_tiles, sh, counts, offsets, active, meta, tile_expert, tile_start);
}

extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS)
    moe_dispatch_scatter(const int* __restrict__ ids, int P, int E, int chunk, const int* __restrict__ block_base,
                         const int* __restrict__ offsets, int* __restrict__ inv, int* __restrict__ perm) {
    scatter_pairs(ids, blockIdx.x * DISPATCH_THREADS + threadIdx.x, gridDim.x * DISPATCH_THREADS, P, E,
                  [&](int p, int e) { return offsets[e] + block_base[(size_t)(p / chunk) * E + e]; }, inv, perm);
}

#define DISPATCH_ARGS                                                                                              \
    const int *__restrict__ ids, int P, int E, int tile_m, int max_tiles, int *__restrict__ counts,              \
        int *__restrict__ offsets, int *__restrict__ perm, int *__restrict__ inv, int *__restrict__ active,      \
        int *__restrict__ meta, int *__restrict__ tile_expert, int *__restrict__ tile_start
extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS) moe_dispatch(DISPATCH_ARGS) {
    dispatch_pairs(ids, P, E, tile_m, max_tiles, counts, offsets, perm, inv, active, meta, tile_expert, tile_start);
}

// The dispatch (block 0) and, on blocks 1.., the int8 rounding of the pass's expert inputs x [T, H] (H % 32 == 0) into
// xq, xs as moe4a8_quantize writes them: the dp4a 4-bit decode GEMVs' first input staged in the launch that
// precedes them instead of one of its own (a decode step is a chain of latency-bound launches).
extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS)
    moe_dispatch_a8(DISPATCH_ARGS, const float* __restrict__ x, signed char* __restrict__ xq, float* __restrict__ xs,
                    long long ngroups) {
    if (blockIdx.x == 0) {
        dispatch_pairs(ids, P, E, tile_m, max_tiles, counts, offsets, perm, inv, active, meta, tile_expert,
                       tile_start);
        return;
    }
    a8_quantize<true>(x, xq, xs, nullptr, ngroups, global_warp() - DISPATCH_WARPS, total_warps() - DISPATCH_WARPS);
}

// Route counting for paged experts: totals[e] += the pairs routed to expert e (ids outside [0, E) ignored). The
// totals are cumulative and wrap modulo 2^32; the host reads them after each pass to run its cache policy off
// the critical path (runtime/expert_pool.py), so routing never has to reach the host inside a pass.
extern "C" __global__ void count_routes(const int* __restrict__ ids, int P, int E, unsigned int* __restrict__ totals) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < P; p += gridDim.x * blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < E) atomicAdd(totals + e, 1u);
    }
}
