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

__device__ __forceinline__ void dispatch_pairs(const int* __restrict__ ids, int P, int E, int tile_m, int max_tiles,
                                               int* __restrict__ counts, int* __restrict__ offsets,
                                               int* __restrict__ perm, int* __restrict__ inv, int* __restrict__ active,
                                               int* __restrict__ meta, int* __restrict__ tile_expert,
                                               int* __restrict__ tile_start) {
    __shared__ int s_warp[DISPATCH_WARPS][DISPATCH_MAX_E];  // per-warp counts, then per-warp bases
    __shared__ int s_run[DISPATCH_MAX_E];                    // running count per expert
    __shared__ int s_off[DISPATCH_MAX_E];
    __shared__ int s_act[DISPATCH_MAX_E];
    __shared__ int s_tiles[DISPATCH_MAX_E];
    __shared__ int s_bad;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += DISPATCH_THREADS) s_run[e] = 0;
    if (tid == 0) s_bad = 0;
    __syncthreads();

    // pass 1: rank of each pair inside its expert
    for (int c0 = 0; c0 < P; c0 += DISPATCH_THREADS) {
        for (int i = tid; i < DISPATCH_WARPS * E; i += DISPATCH_THREADS) s_warp[i / E][i % E] = 0;
        __syncthreads();
        const int p = c0 + tid;
        int e = (p < P) ? ids[p] : -1;
        if (p < P && (e < 0 || e >= E)) {
            atomicAdd(&s_bad, 1);
            e = -1;
        }
        const unsigned int peers = __match_any_sync(COLIBRI_FULL_MASK, e);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        if (e >= 0 && rank == 0) s_warp[warp][e] = __popc(peers);
        __syncthreads();
        for (int x = tid; x < E; x += DISPATCH_THREADS) {
            int run = s_run[x];
            for (int w = 0; w < DISPATCH_WARPS; ++w) {
                const int c = s_warp[w][x];
                s_warp[w][x] = run;
                run += c;
            }
            s_run[x] = run;
        }
        __syncthreads();
        if (p < P) inv[p] = (e >= 0) ? s_warp[warp][e] + rank : -1;
        __syncthreads();
    }

    // offsets, active list and tile counts
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        s_off[e] = s_run[e];
        s_act[e] = s_run[e] > 0 ? 1 : 0;
        s_tiles[e] = (s_run[e] + tile_m - 1) / tile_m;
    }
    __syncthreads();
    int total = 0, nact = 0, ntiles = 0;
    if (warp == 0) total = warp0_exclusive_scan(s_off, E);
    if (warp == 1) nact = warp0_exclusive_scan(s_act, E);
    if (warp == 2) ntiles = warp0_exclusive_scan(s_tiles, E);
    __syncthreads();
    if (tid == 0) offsets[E] = total;
    if (tid == 32) meta[0] = nact;
    if (tid == 64) meta[1] = ntiles;
    if (tid == 96) { meta[2] = s_bad; meta[3] = 0; }
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        counts[e] = s_run[e];
        offsets[e] = s_off[e];
        active[e] = -1;
    }
    for (int i = tid; i < max_tiles; i += DISPATCH_THREADS) {
        tile_expert[i] = -1;
        tile_start[i] = 0;
    }
    __syncthreads();
    __threadfence_block();
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        const int n = s_run[e];
        if (n > 0) {
            active[s_act[e]] = e;
            const int nt = (n + tile_m - 1) / tile_m;
            for (int j = 0; j < nt; ++j) {
                const int slot = s_tiles[e] + j;
                if (slot < max_tiles) {
                    tile_expert[slot] = e;
                    tile_start[slot] = s_off[e] + j * tile_m;
                }
            }
        }
    }
    // pass 2: scatter
    for (int p = tid; p < P; p += DISPATCH_THREADS) {
        const int e = ids[p];
        if (e >= 0 && e < E) {
            const int pos = s_off[e] + inv[p];
            inv[p] = pos;
            perm[pos] = p;
        }
    }
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
