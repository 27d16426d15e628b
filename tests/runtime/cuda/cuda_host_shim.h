// Host emulation of the CUDA features that moe_gemm_fast.cu, moe_gemv4_tc.cu, moe_gemv4_dp4a.cu, layers.cu and
// router.cu use, so that their kernels run, unchanged but for the helpers that wrap PTX (cuda_host_emulation.py
// removes those and these stand in), on a CPU:
//   - one fiber (ucontext) per CUDA thread, all of a block's fibers on the calling OS thread, resumed in turn: a
//     fiber runs until it waits at a barrier (or ends), so a block costs user-space switches, not OS threads and
//     futex wake-ups; __syncthreads is a barrier of the block, __syncwarp of the warp; blocks run one at a time, in
//     grid order or a shuffled one (so a kernel whose last block to take a ticket merges runs with various ones
//     last); a round in which no fiber moves (threads waiting at a barrier others never reach) is reported and the
//     block abandoned;
//   - __shared__ variables are static objects: every thread of the running block sees them, and they keep the
//     previous block's values (not poisoned: GCC drops a section attribute on a template's static locals);
//   - __shfl_xor_sync, __shfl_sync and __shfl_up_sync (of values up to 8 bytes) and __match_any_sync are
//     warp-collective like mma.sync (below): post, meet, read the partner's (or every lane's), meet;
//   - atomicAdd and __threadfence are the host's (blocks do not overlap: what the fences order is not exercised);
//   - TF16 / TBF16 (common.cuh's 16-bit float conversions, PTX cvt there) convert with _Float16 and round to nearest
//     even;
//   - mma.sync m16n8k16 (bf16 in, fp32 accumulate) and m16n8k32 (int8 in, int32) are warp-collective: each lane
//     posts its fragments, the warp meets, each lane computes its 4 accumulators from the PTX ISA's fragment
//     layouts, the warp meets again;
//   - cp.async copies are only queued; a copy lands when the wait_group that retires its group runs (as late as
//     the hardware may land it), and each is checked: 16-byte aligned, inside the dynamic shared memory, and (when
//     not zero-filling) inside an input array registered with emu_allow_source.
// Problems are counted (emu_error_count) and the first is described (emu_first_error); nothing aborts.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <ucontext.h>
#include <vector>

using std::max;
using std::min;

#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))   // alignas may not follow `static`
#define __shared__ static   // every thread of the (one running) block sees the same object

struct EmuDim { int x = 0, y = 0, z = 0; };
thread_local EmuDim threadIdx, blockIdx, blockDim, gridDim;

struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct alignas(4) char4 { signed char x, y, z, w; };

template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
inline uint4 load16_stream(const void* p) { uint4 r; std::memcpy(&r, p, 16); return r; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline char4 make_char4(signed char x, signed char y, signed char z, signed char w) { return {x, y, z, w}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const uint64_t bytes = ((uint64_t)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((bytes >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}

// dp4a: c + the sum of the four signed-byte products of a and b
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}

// ---- problems ---------------------------------------------------------------------------------------------------
static std::atomic<int> emu_errors{0};
static std::mutex emu_error_mutex;
static std::string emu_error_text;

static void emu_error(const std::string& what) {
    if (emu_errors.fetch_add(1) == 0) {
        std::lock_guard<std::mutex> lock(emu_error_mutex);
        emu_error_text = what;
    }
}

extern "C" int emu_error_count() { return emu_errors.load(); }
extern "C" const char* emu_first_error() { return emu_error_text.c_str(); }

// ---- fibers ---------------------------------------------------------------------------------------------------------
// A fiber is a stack and its saved stack pointer. On x86-64, emu_switch pushes the callee-saved registers, stores
// the stack pointer in *from, loads `to` and pops that fiber's registers (the SSE and x87 control words are the same
// in every fiber and are not switched): no system call, unlike swapcontext, whose signal-mask call doubled the
// emulated tests' time. Elsewhere fibers are ucontexts.
#if defined(__x86_64__)
extern "C" void emu_switch(void** from, void* to);
asm(".text\n.globl emu_switch\n.hidden emu_switch\n.type emu_switch, @function\nemu_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
    ".size emu_switch, .-emu_switch\n");

struct EmuContext {
    void* sp = nullptr;
    // a fresh stack whose first switch "returns" into entry with the alignment of a call (rsp + 8 a multiple of 16)
    void start(char* stack, size_t bytes, void (*entry)()) {
        void** top = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(stack + bytes)) & ~uintptr_t(15));
        top[-1] = nullptr;                                  // entry's return address: it never returns
        top[-2] = reinterpret_cast<void*>(entry);
        for (int r = 3; r <= 8; ++r) top[-r] = nullptr;     // rbp, rbx, r12-r15
        sp = top - 8;
    }
    void switch_to(EmuContext& to) { emu_switch(&sp, to.sp); }
};
#else
struct EmuContext {
    ucontext_t uc;
    void start(char* stack, size_t bytes, void (*entry)()) {
        getcontext(&uc);
        uc.uc_stack.ss_sp = stack;
        uc.uc_stack.ss_size = bytes;
        uc.uc_link = nullptr;                               // entry never returns
        makecontext(&uc, entry, 0);
    }
    void switch_to(EmuContext& to) { swapcontext(&uc, &to.uc); }
};
#endif

// The running fiber hands control back to the block's scheduler (emu_launch), which resumes the next one.
thread_local EmuContext emu_scheduler;
thread_local EmuContext* emu_running = nullptr;
thread_local long long emu_moves = 0;   // barrier arrivals and fiber ends: a round without any is a deadlock

inline void emu_yield() { emu_running->switch_to(emu_scheduler); }

// A barrier of `count` fibers: the last to arrive opens it and goes on; the others yield until it has opened.
struct EmuBarrier {
    explicit EmuBarrier(int count) : count(count) {}
    void arrive_and_wait() {
        ++emu_moves;
        const unsigned int generation = opened;
        if (++arrived == count) {
            arrived = 0;
            ++opened;
            return;
        }
        while (opened == generation) emu_yield();
    }
    int count, arrived = 0;
    unsigned int opened = 0;
};

// ---- the running block --------------------------------------------------------------------------------------------
struct EmuBlock {
    explicit EmuBlock(int threads, size_t shared_bytes)
        : block(threads), shared(shared_bytes, 0x7f), warps(threads / 32) {   // 0x7f7f: a huge bf16, visible
        for (auto& w : warps) w.meet = std::make_unique<EmuBarrier>(32);
    }
    EmuBarrier block;
    std::vector<unsigned char> shared;
    struct Warp {
        std::unique_ptr<EmuBarrier> meet;
        unsigned int a[32][4], b[32][2];
        uint64_t shuffled[32];
    };
    std::vector<Warp> warps;
};
thread_local EmuBlock* emu_block = nullptr;

inline void __syncthreads() { emu_block->block.arrive_and_wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { emu_block->warps[threadIdx.x >> 5].meet->arrive_and_wait(); }

// ---- cp.async -------------------------------------------------------------------------------------------------------
struct EmuCopy { void* dst; const void* src; bool valid; };
thread_local std::vector<EmuCopy> emu_open_group;
thread_local std::deque<std::vector<EmuCopy>> emu_groups;

static std::vector<std::pair<const unsigned char*, size_t>> emu_sources;

extern "C" void emu_allow_source(const void* p, size_t nbytes) {
    emu_sources.emplace_back(static_cast<const unsigned char*>(p), nbytes);
}
extern "C" void emu_clear_sources() { emu_sources.clear(); }

static bool emu_source_ok(const void* p) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (const auto& s : emu_sources)
        if (c >= s.first && c + 16 <= s.first + s.second) return true;
    return false;
}

inline void copy16_async(void* dst, const void* src, bool valid) {
    unsigned char* d = static_cast<unsigned char*>(dst);
    const auto& sh = emu_block->shared;
    if (d < sh.data() || d + 16 > sh.data() + sh.size()) emu_error("cp.async destination outside shared memory");
    if ((uintptr_t)dst % 16 || (valid && (uintptr_t)src % 16)) emu_error("cp.async address not 16-byte aligned");
    if (valid && !emu_source_ok(src)) emu_error("cp.async source outside every input array");
    emu_open_group.push_back({dst, src, valid});
}

inline void copy16_async_l2(void* dst, const void* src, bool valid) { copy16_async(dst, src, valid); }

inline void commit_copies() {
    emu_groups.push_back(std::move(emu_open_group));
    emu_open_group.clear();
}

template <int PENDING>
inline void wait_copies() {
    while ((int)emu_groups.size() > PENDING) {
        for (const EmuCopy& c : emu_groups.front()) {
            if (c.valid) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        emu_groups.pop_front();
    }
}

// ---- sub.rn.bf16x2 -------------------------------------------------------------------------------------------------
inline unsigned int emu_round_bf16(float f) {   // round to nearest even (no NaN inputs here)
    const unsigned int u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

inline unsigned int bf16x2_sub(unsigned int a, unsigned int b) {
    const float lo = __uint_as_float(a << 16) - __uint_as_float(b << 16);
    const float hi = __uint_as_float(a & 0xffff0000u) - __uint_as_float(b & 0xffff0000u);
    return emu_round_bf16(lo) | (emu_round_bf16(hi) << 16);
}

// ---- 16-bit floats (common.cuh's TF16, TBF16) ----------------------------------------------------------------------
typedef unsigned short u16;

struct TF16 {
    typedef u16 storage;
    static float to_f32(u16 v) { _Float16 h; std::memcpy(&h, &v, 2); return (float)h; }
    static u16 from_f32(float v) { const _Float16 h = (_Float16)v; u16 r; std::memcpy(&r, &h, 2); return r; }
};

struct TBF16 {
    typedef u16 storage;
    static float to_f32(u16 v) { return __uint_as_float(((unsigned int)v) << 16); }
    static u16 from_f32(float v) { return (u16)emu_round_bf16(v); }
};

// ---- shfl.sync.bfly, shfl.sync.idx ---------------------------------------------------------------------------------
// (floats, and the router's packed 64-bit selection keys)
template <typename T>
inline T emu_shuffle(T v, int from) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffled value fits a lane's slot");
    EmuBlock::Warp& w = emu_block->warps[threadIdx.x >> 5];
    std::memcpy(&w.shuffled[threadIdx.x & 31], &v, sizeof(T));
    w.meet->arrive_and_wait();
    T r;
    std::memcpy(&r, &w.shuffled[from & 31], sizeof(T));
    w.meet->arrive_and_wait();
    return r;
}
template <typename T>
inline T __shfl_xor_sync(unsigned int, T v, int mask) { return emu_shuffle(v, (threadIdx.x & 31) ^ mask); }
template <typename T>
inline T __shfl_sync(unsigned int, T v, int lane) { return emu_shuffle(v, lane); }
template <typename T>   // shfl.sync.up: lanes below delta keep their own value
inline T __shfl_up_sync(unsigned int, T v, unsigned int delta) {
    const int lane = threadIdx.x & 31;
    return emu_shuffle(v, lane >= (int)delta ? lane - (int)delta : lane);
}

// match.any.sync (the dispatch's stable ranks): the lanes whose value equals this lane's, as a mask
inline unsigned int __match_any_sync(unsigned int, int v) {
    EmuBlock::Warp& w = emu_block->warps[threadIdx.x >> 5];
    std::memcpy(&w.shuffled[threadIdx.x & 31], &v, sizeof(int));
    w.meet->arrive_and_wait();
    unsigned int mask = 0;
    for (int l = 0; l < 32; ++l) {
        int other;
        std::memcpy(&other, &w.shuffled[l], sizeof(int));
        if (other == v) mask |= 1u << l;
    }
    w.meet->arrive_and_wait();
    return mask;
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }

// ---- mma.sync -----------------------------------------------------------------------------------------------------
inline float emu_bf16(unsigned int reg, int high) { return __uint_as_float((high ? reg >> 16 : reg & 0xffffu) << 16); }

// Posts this lane's A and B fragments and meets the warp: every lane's are then readable in the returned record
// (the caller meets again once it has read them).
inline EmuBlock::Warp& emu_post_fragments(unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                          unsigned int b0, unsigned int b1) {
    const int lane = threadIdx.x & 31;
    EmuBlock::Warp& w = emu_block->warps[threadIdx.x >> 5];
    w.a[lane][0] = a0; w.a[lane][1] = a1; w.a[lane][2] = a2; w.a[lane][3] = a3;
    w.b[lane][0] = b0; w.b[lane][1] = b1;
    w.meet->arrive_and_wait();
    return w;
}

// c += A B over one m16n8 tile of depth K, PER elements a 32-bit register, as the PTX ISA lays the fragments out:
// element (r, k) of A is in lane 4 (r % 8) + (k % (K / 2)) / PER, register (r >= 8) + 2 (k >= K / 2); element
// (k, n) of B in lane 4 n + (k % (K / 2)) / PER, register (k >= K / 2); element(reg, i) unpacks the i-th of a
// register; C: c[i] is (row g + 8 (i >= 2), column 2t + i % 2) for lane 4g + t.
template <int K, int PER, typename Acc, typename Element>
inline void emu_mma(Acc* c, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3, unsigned int b0,
                    unsigned int b1, Element element) {
    EmuBlock::Warp& w = emu_post_fragments(a0, a1, a2, a3, b0, b1);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, half = K / 2;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
        Acc sum = 0;
        for (int k = 0; k < K; ++k)
            sum += element(w.a[4 * (r % 8) + (k % half) / PER][(r >= 8) + 2 * (k >= half)], k % PER) *
                   element(w.b[4 * n + (k % half) / PER][k >= half], k % PER);
        c[i] += sum;
    }
    w.meet->arrive_and_wait();
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32: two bf16 a register, fp32 sums
inline void mma_16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3, unsigned int b0,
                      unsigned int b1) {
    emu_mma<16, 2>(c, a0, a1, a2, a3, b0, b1, emu_bf16);
}

// mma.sync.m16n8k32.row.col.s32.s8.s8.s32: four int8 a register, exact int32 sums
inline int emu_s8(unsigned int reg, int byte) { return (int)(signed char)((reg >> (8 * byte)) & 0xffu); }

inline void mma_16832_s8(int* c, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3, unsigned int b0,
                         unsigned int b1) {
    emu_mma<32, 4>(c, a0, a1, a2, a3, b0, b1, emu_s8);
}

// ---- launches -------------------------------------------------------------------------------------------------------
struct EmuFiber {
    EmuContext context;
    bool done = false;
    std::vector<EmuCopy> open_group;              // its cp.async state, swapped into the globals while it runs
    std::deque<std::vector<EmuCopy>> groups;
};
constexpr size_t EMU_STACK_BYTES = 256 * 1024;
thread_local void (*emu_fiber_body)(void*) = nullptr;
thread_local void* emu_fiber_arg = nullptr;
thread_local EmuFiber* emu_fiber = nullptr;

inline void emu_fiber_main() {
    emu_fiber_body(emu_fiber_arg);
    if (!emu_open_group.empty() || !emu_groups.empty()) emu_error("cp.async copies left at exit");
    emu_open_group.clear();
    emu_groups.clear();
    emu_fiber->done = true;
    ++emu_moves;
    emu_yield();        // never resumed: the scheduler skips finished fibers
}

// Runs body() as every thread of every block of the grid, one block at a time: in x, y, z order, or (order_seed
// != 0) in an order shuffled with that seed.
template <typename Body>
void emu_launch(EmuDim grid, int threads, size_t shared_bytes, Body body, unsigned order_seed = 0) {
    std::vector<EmuDim> blocks;
    for (int bz = 0; bz < grid.z; ++bz)
        for (int by = 0; by < grid.y; ++by)
            for (int bx = 0; bx < grid.x; ++bx) blocks.push_back({bx, by, bz});
    if (order_seed != 0) std::shuffle(blocks.begin(), blocks.end(), std::mt19937(order_seed));
    std::vector<char> stacks((size_t)threads * EMU_STACK_BYTES);
    emu_fiber_body = [](void* b) { (*static_cast<Body*>(b))(); };
    emu_fiber_arg = &body;
    for (const EmuDim& b : blocks) {
        EmuBlock blk(threads, shared_bytes);
        std::vector<EmuFiber> fibers(threads);
        for (int tx = 0; tx < threads; ++tx)
            fibers[tx].context.start(stacks.data() + (size_t)tx * EMU_STACK_BYTES, EMU_STACK_BYTES, emu_fiber_main);
        blockIdx = b;
        blockDim.x = threads;
        gridDim = grid;
        emu_block = &blk;
        for (int left = threads; left > 0;) {
            const long long moves = emu_moves;
            for (int tx = 0; tx < threads; ++tx) {
                EmuFiber& f = fibers[tx];
                if (f.done) continue;
                threadIdx.x = tx;
                emu_fiber = &f;
                emu_running = &f.context;
                std::swap(emu_open_group, f.open_group);
                std::swap(emu_groups, f.groups);
                emu_scheduler.switch_to(f.context);
                std::swap(emu_open_group, f.open_group);
                std::swap(emu_groups, f.groups);
                left -= f.done;
            }
            if (left > 0 && emu_moves == moves) {
                emu_error("deadlock: threads wait at a barrier the others never reach");
                return;     // the fibers are abandoned with their stacks
            }
        }
    }
}
