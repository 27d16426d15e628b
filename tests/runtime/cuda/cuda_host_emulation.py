"""CUDA kernels built for the CPU and run on NumPy arrays: a check of their indexing, shared-memory layouts,
pipelines, fragment layouts and cross-block protocols on machines without a GPU: moe_gemm_fast.cu
(test_moe_gemm_fast_emulated.py), moe_gemv.cu (test_moe_gemv_emulated.py), moe_gemv4_tc.cu
(test_moe_gemv4_tc_emulated.py), moe_gemv4_dp4a.cu (test_moe_gemv4_dp4a_emulated.py), layers.cu's attention_decode
(test_attention_decode_emulated.py), the norms (layers.cu's rmsnorm, fused.cu's add_rmsnorm:
test_norms_emulated.py), router.cu's router and add_rmsnorm_route (test_router_emulated.py), moe_gemm_cublas.cu's
element-wise kernels around cuBLAS (test_moe_gemm_cublas_emulated.py) and dispatch.cu (test_dispatch_emulated.py).

The kernel source is what NVRTC compiles (`ops.kernel_source`, the -D options of limits.py), with the helpers that
wrap PTX removed (PTX_HELPERS, and the 16-bit float conversions PTX_STRUCTS); cuda_host_shim.h stands in for them and
for the CUDA built-ins (see its header).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_format import spec as S
from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

GXX = shutil.which("g++")
SHIM_DIR = Path(__file__).resolve().parent
PTX_HELPERS = ("shared_address", "copy16_async", "copy16_async_l2", "commit_copies", "wait_copies", "mma_16816",
               "mma_16832_s8", "bf16x2_sub", "load16_stream")
PTX_STRUCTS = ("TF16", "TBF16")
DYNAMIC_SHARED = "extern __shared__ __align__(128) unsigned char fast_smem[];"

DRIVER = r"""
extern "C" void emu_widen_bytes(const unsigned int* words, unsigned int* pairs, int n) {
    for (int i = 0; i < n; ++i) i8x4_to_bf16x2(words[i], pairs[2 * i], pairs[2 * i + 1]);
}

extern "C" void emu_gate_up(int split, int grid_x, int grid_y, size_t smem, const u16* x_hi, const u16* x_lo,
                            const unsigned long long* blobs, long long off_w, long long off_s, const int* perm,
                            const int* offsets, const int* tile_expert, const int* tile_start, float* act, int H,
                            int I, int k, int num_tiles) {
    emu_launch({grid_x, grid_y, 1}, FAST_THREADS, smem, [&] {
        (split ? moe_gemm_fast_gate_up_split : moe_gemm_fast_gate_up_bf16)(
            x_hi, x_lo, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, act, H, I, k, num_tiles);
    });
}

extern "C" void emu_down(int split, int grid_x, int grid_y, size_t smem, const u16* a_hi, const u16* a_lo,
                         const unsigned long long* blobs, long long off_w, long long off_s, const int* perm,
                         const int* offsets, const int* tile_expert, const int* tile_start, const float* pair_w,
                         float* y, int H, int I, int num_tiles) {
    emu_launch({grid_x, grid_y, 1}, FAST_THREADS, smem, [&] {
        (split ? moe_gemm_fast_down_split : moe_gemm_fast_down_bf16)(
            a_hi, a_lo, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, y, H, I, num_tiles);
    });
}

extern "C" void emu_gate_up_int8(int grid_x, int grid_y, size_t smem, const signed char* xq, const float* xs,
                                 const unsigned long long* blobs, long long off_w, long long off_s, const int* perm,
                                 const int* offsets, const int* tile_expert, const int* tile_start, float* act,
                                 int H, int I, int k, int num_tiles) {
    emu_launch({grid_x, grid_y, 1}, FAST_THREADS, smem, [&] {
        moe_gemm_fast_gate_up_int8(xq, xs, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, act, H, I, k,
                                   num_tiles);
    });
}

extern "C" void emu_down_int8(int grid_x, int grid_y, size_t smem, const signed char* aq, const float* as,
                              const unsigned long long* blobs, long long off_w, long long off_s, const int* perm,
                              const int* offsets, const int* tile_expert, const int* tile_start, const float* pair_w,
                              float* y, int H, int I, int num_tiles) {
    emu_launch({grid_x, grid_y, 1}, FAST_THREADS, smem, [&] {
        moe_gemm_fast_down_int8(aq, as, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, y, H, I,
                                num_tiles);
    });
}
"""


def _without_block(src: str, pattern: str, what: str) -> str:
    """src less the first definition matching `pattern` through its closing brace (and a `;` right after)."""
    m = re.search(pattern, src, re.MULTILINE)
    assert m, f"no definition of {what} in the kernel source"
    depth, i = 0, src.index("{", m.end())
    while True:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            break
        i += 1
    return src[:m.start()] + src[i + 1:].removeprefix(";")


def _without_definition(src: str, name: str) -> str:
    """src less the definition of function `name` (its template line too)."""
    return _without_block(src, rf"^(template <[^\n]*>\n)?__device__ __forceinline__ [^\n]*\b{name}\(", name)


def host_module_source(module: str) -> str:
    """Kernel module `module` as g++ compiles it: the shim first, the PTX helpers and structs left out."""
    src = ops.kernel_source(module)
    for name in PTX_HELPERS:
        if re.search(rf"__device__ __forceinline__ [^\n]*\b{name}\(", src):
            src = _without_definition(src, name)
    for name in PTX_STRUCTS:
        src = _without_block(src, rf"^struct {name} ", name)
    return '#include "cuda_host_shim.h"\n' + src


def host_source() -> str:
    src = host_module_source("moe_gemm_fast")
    assert DYNAMIC_SHARED in src
    return src.replace(DYNAMIC_SHARED, "unsigned char* fast_smem = emu_block->shared.data();") + DRIVER


def _defines(stages: int, skip_empty_m: int, stage_steps: int, persistent: int) -> list[str]:
    changed = ("-DFAST_STAGES=", "-DFAST_SKIP_EMPTY_M=", "-DFAST_STAGE_STEPS=", "-DFAST_PERSISTENT=")
    return [o for o in limits.define_options("moe_gemm_fast") if not o.startswith(changed)] + [
        f"-DFAST_STAGES={stages}", f"-DFAST_SKIP_EMPTY_M={skip_empty_m}", f"-DFAST_STAGE_STEPS={stage_steps}",
        f"-DFAST_PERSISTENT={persistent}"]


def _compile(tmp_path: Path, name: str, source: str, defines) -> ctypes.CDLL:
    src = tmp_path / f"{name}_host.cpp"
    src.write_text(source)
    lib = tmp_path / f"{name}_host.so"
    cmd = [GXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{SHIM_DIR}",
           *defines, "-o", str(lib), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))


def build(tmp_path: Path, stages: int = limits.FAST_STAGES, skip_empty_m: int = limits.FAST_SKIP_EMPTY_M,
          stage_steps: int = limits.FAST_STAGE_STEPS, persistent: int = limits.FAST_PERSISTENT) -> ctypes.CDLL:
    """The kernels for the CPU, with limits.py's constants but for the pipeline depth `stages`, FAST_SKIP_EMPTY_M,
    the K steps a stage holds (FAST_STAGE_STEPS) and FAST_PERSISTENT."""
    return _compile(tmp_path, "moe_gemm_fast", host_source(),
                    _defines(stages, skip_empty_m, stage_steps, persistent))


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    assert a.flags.c_contiguous
    return ctypes.c_void_p(a.ctypes.data)


def _nullable(a: np.ndarray | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None) if a is None else _ptr(a)


def _routing(disp: dict) -> list:
    """A host dispatch's (perm, offsets, active, meta) as kernel arguments."""
    return [_ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["active"]), _ptr(disp["meta"])]


class LibraryEmulator:
    """The kernels of one built library over host arrays (kept alive by the caller), and its error record."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.emu_first_error.restype = ctypes.c_char_p

    def errors(self) -> tuple[int, str]:
        return int(self.lib.emu_error_count()), self.lib.emu_first_error().decode()


class GridStrideEmulator(LibraryEmulator):
    """A library whose kernels walk their items in a grid-stride loop: `blocks` blocks a launch, as few as 1."""

    default_blocks = 2

    def __init__(self, lib: ctypes.CDLL, blocks: int | None = None) -> None:
        super().__init__(lib)
        self.blocks = self.default_blocks if blocks is None else blocks


class Emulator(LibraryEmulator):
    """The kernels of a built library, launched over host arrays (kept alive by the caller)."""

    def __init__(self, lib: ctypes.CDLL, stages: int = limits.FAST_STAGES,
                 stage_steps: int = limits.FAST_STAGE_STEPS, blocks: int | None = None) -> None:
        """blocks: a persistent grid of that many blocks, each taking several work items (None: the classic grid,
        an item a block)."""
        super().__init__(lib)
        self.stages, self.stage_steps, self.blocks = stages, stage_steps, blocks

    def grid(self, n_blocks: int, disp: dict) -> tuple[int, int, int]:
        """(grid x, grid y, num_tiles) of a launch over n_blocks output blocks and the dispatch's tiles."""
        tiles = disp["tile_expert"].size
        return (n_blocks, tiles, tiles) if self.blocks is None else (self.blocks, 1, tiles)

    def shared_bytes(self, activations: str) -> int:
        one_step = limits.fast_gemm_shared_bytes(activations) // (limits.FAST_STAGES * limits.FAST_STAGE_STEPS)
        return one_step * self.stages * self.stage_steps

    def _sources(self, *arrays: np.ndarray) -> None:
        self.lib.emu_clear_sources()
        for a in arrays:
            self.lib.emu_allow_source(_ptr(a), ctypes.c_size_t(a.nbytes))

    def widen_bytes(self, words: np.ndarray) -> np.ndarray:
        """The kernel's int8 -> bf16 widening of uint32 words (4 bytes each): [n, 2] uint32 bf16 pairs."""
        words = np.ascontiguousarray(words, np.uint32)
        pairs = np.zeros((words.size, 2), np.uint32)
        self.lib.emu_widen_bytes(_ptr(words), _ptr(pairs), words.size)
        return pairs

    def gate_up(self, split: bool, hi, lo, blobs, ptrs, layout, disp: dict, k: int, act) -> None:
        H, I = layout.hidden_size, layout.intermediate_size
        self._sources(hi, lo, blobs)
        gx, gy, tiles = self.grid(-(-I // (limits.FAST_BN // 2)), disp)
        self.lib.emu_gate_up(
            int(split), gx, gy, ctypes.c_size_t(self.shared_bytes("split" if split else "bf16")), _ptr(hi), _ptr(lo),
            _ptr(ptrs), ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            _ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["tile_expert"]), _ptr(disp["tile_start"]),
            _ptr(act), H, I, k, tiles)

    def down(self, split: bool, hi, lo, blobs, ptrs, layout, disp: dict, weights, y) -> None:
        H, I = layout.hidden_size, layout.intermediate_size
        self._sources(hi, lo, blobs)
        gx, gy, tiles = self.grid(-(-H // limits.FAST_BN), disp)
        self.lib.emu_down(
            int(split), gx, gy, ctypes.c_size_t(self.shared_bytes("split" if split else "bf16")), _ptr(hi), _ptr(lo),
            _ptr(ptrs), ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            _ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["tile_expert"]), _ptr(disp["tile_start"]),
            _ptr(weights), _ptr(y), H, I, tiles)


    def gate_up_int8(self, xq, xs, blobs, ptrs, layout, disp: dict, k: int, act) -> None:
        """W8A8 gate_up: xq [T, H] int8 with a scale a token xs [T]."""
        H, I = layout.hidden_size, layout.intermediate_size
        self._sources(xq, xs, blobs)
        gx, gy, tiles = self.grid(-(-I // (limits.FAST_BN // 2)), disp)
        self.lib.emu_gate_up_int8(
            gx, gy, ctypes.c_size_t(self.shared_bytes("int8")), _ptr(xq), _ptr(xs), _ptr(ptrs),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            _ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["tile_expert"]), _ptr(disp["tile_start"]),
            _ptr(act), H, I, k, tiles)

    def down_int8(self, aq, a_scale, blobs, ptrs, layout, disp: dict, weights, y) -> None:
        """W8A8 down: aq [P, I] int8 (sorted order) with a scale a row a_scale [P]."""
        H, I = layout.hidden_size, layout.intermediate_size
        self._sources(aq, a_scale, blobs)
        gx, gy, tiles = self.grid(-(-H // limits.FAST_BN), disp)
        self.lib.emu_down_int8(
            gx, gy, ctypes.c_size_t(self.shared_bytes("int8")), _ptr(aq), _ptr(a_scale), _ptr(ptrs),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            _ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["tile_expert"]), _ptr(disp["tile_start"]),
            _ptr(weights), _ptr(y), H, I, tiles)


# ---- moe_gemv4_tc.cu ------------------------------------------------------------------------------------------------
GEMV4_TC_DRIVER = r"""
extern "C" void emu_stage(int blocks, const float* in, unsigned int* staged, int rows, int ncols) {
    emu_launch({blocks, 1, 1}, TC4_THREADS, 0, [&] { moe4tc_stage(in, staged, rows, ncols); });
}

#define TC4_BY_TOKC(STAGE, tokc) \
    (tokc == 1 ? STAGE##_t1 : tokc == 2 ? STAGE##_t2 : tokc == 4 ? STAGE##_t4 : STAGE##_t8)

extern "C" void emu_gate_up(int tokc, int blocks, const unsigned int* staged, const unsigned long long* blobs,
                            const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                            const int* offsets, const int* active, const int* meta, float* act, int H, int I, int k,
                            int group) {
    emu_launch({blocks, 1, 1}, TC4_THREADS, 0, [&] {
        TC4_BY_TOKC(moe4tc_gate_up_int4, tokc)(staged, blobs, fills, off_w, off_s, perm, offsets, active, meta, act,
                                               H, I, k, group);
    });
}

extern "C" void emu_down(int tokc, int blocks, const unsigned int* staged, const unsigned long long* blobs,
                         const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                         const int* offsets, const int* active, const int* meta, const float* pair_w, float* y,
                         int H, int I, int group) {
    emu_launch({blocks, 1, 1}, TC4_THREADS, 0, [&] {
        TC4_BY_TOKC(moe4tc_down_int4, tokc)(staged, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w,
                                            y, H, I, group);
    });
}
"""


def build_gemv4_tc(tmp_path: Path) -> ctypes.CDLL:
    """moe_gemv4_tc.cu for the CPU, with limits.py's constants."""
    return _compile(tmp_path, "moe_gemv4_tc", host_module_source("moe_gemv4_tc") + GEMV4_TC_DRIVER,
                    limits.define_options("moe_gemv4_tc"))


class Gemv4TcEmulator(GridStrideEmulator):
    """moe_gemv4_tc.cu's kernels over host arrays (kept alive by the caller); `blocks` blocks a launch, as few as 1
    (the grid-stride loop over block items)."""

    default_blocks = 3

    def stage(self, a: np.ndarray) -> np.ndarray:
        """a [rows, ncols] f32 -> [rows, 2, ncols // 2] uint32 (the kernel's bf16 hi/lo pairs)."""
        a = np.ascontiguousarray(a, np.float32)
        staged = np.zeros((a.shape[0], 2, a.shape[1] // 2), np.uint32)
        self.lib.emu_stage(self.blocks, _ptr(a), _ptr(staged), *a.shape)
        return staged

    def gate_up(self, tokc: int, staged, ptrs, fills, layout, disp: dict, k: int, act) -> None:
        self.lib.emu_gate_up(
            tokc, self.blocks, _ptr(staged), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            *_routing(disp), _ptr(act), layout.hidden_size, layout.intermediate_size, k, layout.group_size)

    def down(self, tokc: int, staged, ptrs, fills, layout, disp: dict, weights, y) -> None:
        self.lib.emu_down(
            tokc, self.blocks, _ptr(staged), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            *_routing(disp), _ptr(weights), _ptr(y), layout.hidden_size, layout.intermediate_size,
            layout.group_size)


# ---- moe_gemv4.cu (float inputs) -------------------------------------------------------------------------------------
GEMV4_DRIVER = r"""
#define G4_BY_TOKC(STAGE, tokc) \
    (tokc == 1 ? STAGE##_t1 : tokc == 2 ? STAGE##_t2 : tokc == 4 ? STAGE##_t4 : STAGE##_t8)
#define G4_BY_FORMAT(STAGE, mx, tokc) (mx ? G4_BY_TOKC(STAGE##_mxfp4, tokc) : G4_BY_TOKC(STAGE##_int4, tokc))

extern "C" void emu_gate_up(int mx, int tokc, int blocks, const float* x, const unsigned long long* blobs,
                            const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                            const int* offsets, const int* active, const int* meta, float* act, int H, int I, int k,
                            int group) {
    emu_launch({blocks, 1, 1}, GEMV4_THREADS, 0, [&] {
        G4_BY_FORMAT(moe4_gate_up, mx, tokc)(x, blobs, fills, off_w, off_s, perm, offsets, active, meta, act, H, I, k,
                                             group);
    });
}

extern "C" void emu_down(int mx, int tokc, int blocks, const float* a, const unsigned long long* blobs,
                         const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                         const int* offsets, const int* active, const int* meta, const float* pair_w, float* y,
                         int H, int I, int group) {
    emu_launch({blocks, 1, 1}, GEMV4_THREADS, 0, [&] {
        G4_BY_FORMAT(moe4_down, mx, tokc)(a, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w, y, H, I,
                                          group);
    });
}

extern "C" void emu_gate_up_pairs(int mx, int blocks, const float* x, const int* ids, const unsigned long long* blobs,
                                  const unsigned long long* fills, long long off_w, long long off_s, float* act, int H,
                                  int I, int k, int group, int P, int E) {
    emu_launch({blocks, 1, 1}, GEMV4_THREADS, 0, [&] {
        (mx ? moe4_gate_up_pairs_mxfp4 : moe4_gate_up_pairs_int4)(x, ids, blobs, fills, off_w, off_s, act, H, I, k,
                                                                  group, P, E);
    });
}

extern "C" void emu_down_pairs(int mx, int blocks, const float* a, const int* ids, const unsigned long long* blobs,
                               const unsigned long long* fills, long long off_w, long long off_s, const float* pair_w,
                               float* y, int H, int I, int group, int P, int E) {
    emu_launch({blocks, 1, 1}, GEMV4_THREADS, 0, [&] {
        (mx ? moe4_down_pairs_mxfp4 : moe4_down_pairs_int4)(a, ids, blobs, fills, off_w, off_s, pair_w, y, H, I,
                                                            group, P, E);
    });
}
"""


def build_gemv4(tmp_path: Path) -> ctypes.CDLL:
    """moe_gemv4.cu (the float-input 4-bit GEMVs) for the CPU, with limits.py's constants."""
    return _compile(tmp_path, "moe_gemv4", host_module_source("moe_gemv4") + GEMV4_DRIVER,
                    limits.define_options("moe_gemv4"))


class Gemv4Emulator(GridStrideEmulator):
    """moe_gemv4.cu's decode GEMVs (int4_group and mxfp4 blobs, float inputs) over host arrays; `blocks` blocks a
    launch (the grid-stride loop over warp items)."""

    @staticmethod
    def _mx(layout) -> int:
        return int(layout.expert_format == S.ExpertFormat.MXFP4)

    def gate_up(self, tokc: int, x, ptrs, fills, layout, disp: dict, k: int, act) -> None:
        self.lib.emu_gate_up(
            self._mx(layout), tokc, self.blocks, _ptr(x), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            *_routing(disp), _ptr(act), layout.hidden_size, layout.intermediate_size, k,
            layout.group_size)

    def down(self, tokc: int, a, ptrs, fills, layout, disp: dict, weights, y) -> None:
        self.lib.emu_down(
            self._mx(layout), tokc, self.blocks, _ptr(a), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            *_routing(disp), _ptr(weights), _ptr(y), layout.hidden_size, layout.intermediate_size,
            layout.group_size)

    def gate_up_pairs(self, x, ids, ptrs, fills, layout, act, num_experts: int) -> None:
        """moe4_gate_up_pairs_*: ids [T, k] int32 straight from the router, act in pair order."""
        T, k = ids.shape
        self.lib.emu_gate_up_pairs(
            self._mx(layout), self.blocks, _ptr(x), _ptr(ids), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            _ptr(act), layout.hidden_size, layout.intermediate_size, k, layout.group_size, T * k, num_experts)

    def down_pairs(self, a, ids, ptrs, fills, layout, weights, y, num_experts: int) -> None:
        self.lib.emu_down_pairs(
            self._mx(layout), self.blocks, _ptr(a), _ptr(ids), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            _ptr(weights), _ptr(y), layout.hidden_size, layout.intermediate_size, layout.group_size, ids.size,
            num_experts)


# ---- moe_gemv4_dp4a.cu ----------------------------------------------------------------------------------------------
GEMV4_DP4A_DRIVER = r"""
extern "C" void emu_quantize(int blocks, const float* x, signed char* q, float* s, long long ngroups) {
    emu_launch({blocks, 1, 1}, A8_QUANT_THREADS, 0, [&] { moe4a8_quantize(x, q, s, ngroups); });
}

extern "C" void emu_round(int blocks, const float* x, float* rounded, long long ngroups) {
    emu_launch({blocks, 1, 1}, A8_QUANT_THREADS, 0, [&] { moe4a8_round(x, rounded, ngroups); });
}

#define A8_BY_TOKC(STAGE, tokc) \
    (tokc == 1 ? STAGE##_t1 : tokc == 2 ? STAGE##_t2 : tokc == 4 ? STAGE##_t4 : STAGE##_t8)

extern "C" void emu_gate_up(int tokc, int blocks, const signed char* xq, const float* xs,
                            const unsigned long long* blobs, const unsigned long long* fills, long long off_w,
                            long long off_s, const int* perm, const int* offsets, const int* active, const int* meta,
                            float* act, int H, int I, int k, int group) {
    emu_launch({blocks, 1, 1}, A8_THREADS, 0, [&] {
        A8_BY_TOKC(moe4a8_gate_up_int4, tokc)(xq, xs, blobs, fills, off_w, off_s, perm, offsets, active, meta, act, H,
                                              I, k, group);
    });
}

extern "C" void emu_down(int tokc, int blocks, const signed char* aq, const float* as, const unsigned long long* blobs,
                         const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                         const int* offsets, const int* active, const int* meta, const float* pair_w, float* y,
                         int H, int I, int group) {
    emu_launch({blocks, 1, 1}, A8_THREADS, 0, [&] {
        A8_BY_TOKC(moe4a8_down_int4, tokc)(aq, as, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w,
                                           y, H, I, group);
    });
}

extern "C" void emu_gate_up_pairs(int blocks, const signed char* xq, const float* xs, const int* ids,
                                  const unsigned long long* blobs, const unsigned long long* fills, long long off_w,
                                  long long off_s, float* act, int H, int I, int k, int group, int P, int E) {
    emu_launch({blocks, 1, 1}, A8_THREADS, 0, [&] {
        moe4a8_gate_up_pairs_int4(xq, xs, ids, blobs, fills, off_w, off_s, act, H, I, k, group, P, E);
    });
}

extern "C" void emu_down_pairs(int blocks, const signed char* aq, const float* as, const int* ids,
                               const unsigned long long* blobs, const unsigned long long* fills, long long off_w,
                               long long off_s, const float* pair_w, float* y, int H, int I, int group, int P, int E) {
    emu_launch({blocks, 1, 1}, A8_THREADS, 0, [&] {
        moe4a8_down_pairs_int4(aq, as, ids, blobs, fills, off_w, off_s, pair_w, y, H, I, group, P, E);
    });
}
"""


def build_gemv4_dp4a(tmp_path: Path, plans: dict | None = None) -> ctypes.CDLL:
    """moe_gemv4_dp4a.cu for the CPU, with limits.py's constants (`plans`: other A8_PLANS, as gemv_sweep.py
    builds them)."""
    defines = {**limits.KERNEL_DEFINES["moe_gemv4_dp4a"], **limits.a8_plan_defines(plans or limits.A8_PLANS)}
    return _compile(tmp_path, "moe_gemv4_dp4a", host_module_source("moe_gemv4_dp4a") + GEMV4_DP4A_DRIVER,
                    [f"-D{k}={v}" for k, v in defines.items()])


class Gemv4Dp4aEmulator(GridStrideEmulator):
    """moe_gemv4_dp4a.cu's kernels over host arrays (kept alive by the caller); `blocks` blocks a launch (the
    grid-stride loops over groups and warp items)."""

    def quantize(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """a [rows, ncols] f32 -> (q int8 [rows, ncols] staged, s f32 [rows, ncols // 32]) (moe4a8_quantize)."""
        a = np.ascontiguousarray(a, np.float32)
        rows, ncols = a.shape
        q = np.full((rows, ncols), 99, np.int8)
        s = np.full((rows, ncols // 32), np.nan, np.float32)
        self.lib.emu_quantize(self.blocks, _ptr(a), _ptr(q), _ptr(s), ctypes.c_longlong(rows * ncols // 32))
        return q, s

    def round(self, a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """moe4a8_round: a rounded as floats q * s (out may be a: in place)."""
        a = np.ascontiguousarray(a, np.float32)
        out = np.full(a.shape, np.nan, np.float32) if out is None else out
        self.lib.emu_round(self.blocks, _ptr(a), _ptr(out), ctypes.c_longlong(a.size // 32))
        return out

    def gate_up(self, tokc: int, xq, xs, ptrs, fills, layout, disp: dict, k: int, act) -> None:
        self.lib.emu_gate_up(
            tokc, self.blocks, _ptr(xq), _ptr(xs), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            *_routing(disp), _ptr(act), layout.hidden_size, layout.intermediate_size, k, layout.group_size)

    def down(self, tokc: int, aq, as_, ptrs, fills, layout, disp: dict, weights, y) -> None:
        self.lib.emu_down(
            tokc, self.blocks, _ptr(aq), _ptr(as_), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            *_routing(disp), _ptr(weights), _ptr(y), layout.hidden_size, layout.intermediate_size,
            layout.group_size)

    def gate_up_pairs(self, xq, xs, ids, ptrs, fills, layout, act, num_experts: int) -> None:
        """moe4a8_gate_up_pairs_int4: ids [T, k] int32 straight from the router, act in pair order."""
        T, k = ids.shape
        self.lib.emu_gate_up_pairs(
            self.blocks, _ptr(xq), _ptr(xs), _ptr(ids), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            _ptr(act), layout.hidden_size, layout.intermediate_size, k, layout.group_size, T * k, num_experts)

    def down_pairs(self, aq, as_, ids, ptrs, fills, layout, weights, y, num_experts: int) -> None:
        self.lib.emu_down_pairs(
            self.blocks, _ptr(aq), _ptr(as_), _ptr(ids), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            _ptr(weights), _ptr(y), layout.hidden_size, layout.intermediate_size, layout.group_size, ids.size,
            num_experts)


# ---- layers.cu: attention_decode -------------------------------------------------------------------------------------
ATTENTION_DECODE_KERNELS = tuple(f"{c}_hd{hd}" for c in ("f32", "f16", "bf16") for hd in (64, 128, 256))

RMSNORM_KERNELS = ("f32_f32_f32", "f32_f32_bf16", "f32_bf16_f16", "bf16_f32_f32")   # <x>_<out>_<weight>

WARP_SUMS_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# (rows, tokens, gate_up) of the warp_item_sums instances: powers of two up to 32 values and past them, and counts
# that are not powers of two (the warp_sum-a-value path)
WARP_ITEM_SHAPES = ((2, 1, True), (4, 1, True), (4, 1, False), (8, 8, True), (4, 8, False), (8, 2, False),
                    (6, 1, True), (3, 2, False))

LAYERS_DRIVER = r"""
#define EMU_WARP_SUMS(N)                                                                                          \
    extern "C" void emu_warp_sums_##N(const float* v, float* sums, float* stored) {                              \
        emu_launch({1, 1, 1}, 32, 0, [&] {                                                                         \
            const int lane = threadIdx.x;                                                                          \
            float mine[N], again[N], out[N];                                                                       \
            for (int i = 0; i < N; ++i) mine[i] = again[i] = v[lane * N + i];                                     \
            warp_sums<N>(mine, out);                                                                               \
            for (int i = 0; i < N; ++i) sums[lane * N + i] = out[i];                                              \
            warp_sums_store<N>(again, stored);                                                                     \
        });                                                                                                        \
    }
#define EMU_WARP_ITEM_SUMS(R, TOKC, GU)                                                                          \
    extern "C" void emu_warp_item_sums_##R##_##TOKC##_##GU(const float* v, float* a_out, float* b_out,          \
                                                          int* counts) {                                          \
        emu_launch({1, 1, 1}, 32, 0, [&] {                                                                         \
            const int lane = threadIdx.x;                                                                          \
            float acc[R][TOKC];                                                                                    \
            for (int q = 0; q < R; ++q)                                                                            \
                for (int j = 0; j < TOKC; ++j) acc[q][j] = v[(lane * R + q) * TOKC + j];                          \
            warp_item_sums<R, TOKC, GU>(acc, [&](int q, int j, float a, float b) {                                 \
                a_out[q * TOKC + j] = a;                                                                           \
                b_out[q * TOKC + j] = b;                                                                           \
                counts[q * TOKC + j] += 1;                                                                         \
            });                                                                                                    \
        });                                                                                                        \
    }
#define EMU_ATTENTION_DECODE(SUF, TC)                                                                            \
    extern "C" void emu_attention_decode_##SUF(int gx, int gy, int gz, size_t smem, unsigned order,             \
                                               const float* q, const TC::storage* kc, const TC::storage* vc,    \
                                               const int* q_seq, const int* q_len, const float* sinks,          \
                                               float* ml, float* acc, int* tickets, float* out, int nh, int nkv, \
                                               int capacity, int window, float scale, int nsplit) {             \
        emu_launch({gx, gy, gz}, ATT_THREADS, smem, [&] {                                                        \
            attention_decode_##SUF(q, kc, vc, q_seq, q_len, sinks, ml, acc, tickets, out, nh, nkv, capacity,     \
                                   window, scale, nsplit);                                                       \
        }, order);                                                                                               \
    }
#define EMU_ATTENTION_SPLIT(SUF, TC)                                                                             \
    extern "C" void emu_attention_split_##SUF(int gx, int gy, int gz, unsigned order, const float* q,           \
                                              const TC::storage* kc, const TC::storage* vc, const int* q_seq,   \
                                              const int* q_len, const float* sinks, float* ml, float* acc,      \
                                              float* out, int nh, int nkv, int capacity, int window,            \
                                              float scale, int nsplit) {                                        \
        emu_launch({gx, gy, gz}, ATT_THREADS, 0, [&] {                                                           \
            attention_split_##SUF(q, kc, vc, q_seq, q_len, sinks, ml, acc, out, nh, nkv, capacity, window, scale, \
                                  nsplit);                                                                       \
        }, order);                                                                                               \
    }
extern "C" void emu_attention_merge(int rows, int threads, unsigned order, const float* ml, const float* acc,
                                    const float* sinks, float* out, int hd, int nsplit, int nh) {
    emu_launch({rows, 1, 1}, threads, 0, [&] { attention_merge(ml, acc, sinks, out, hd, nsplit, nh); }, order);
}
#define EMU_RMSNORM(SUF, TX, TO, TW)                                                                             \
    extern "C" void emu_rmsnorm_##SUF(int rows, int threads, const TX::storage* x, const TW::storage* w,          \
                                      TO::storage* out, int D, float eps, float w_offset) {                     \
        emu_launch({rows, 1, 1}, threads, 0, [&] { rmsnorm_##SUF(x, w, out, D, eps, w_offset); });               \
    }
#define EMU_DENSE_GEMV(SUF, TW, TOK)                                                                             \
    extern "C" void emu_dense_gemv_##SUF##_t##TOK(int blocks, unsigned order, const float* x, const TW::storage* w,  \
                                                  const float* bias, float* y, int T, int N, int K, int splits) {   \
        emu_launch({blocks, 1, 1}, DG_THREADS, 0, [&] { dense_gemv_##SUF##_t##TOK(x, w, bias, y, T, N, K, splits); }, \
                   order);                                                                                       \
    }
#define EMU_DENSE_GEMV_NORMED(SUF, TW, TOK)                                                                      \
    extern "C" void emu_dense_gemv_normed_##SUF##_t##TOK(int blocks, unsigned order, const float* x,              \
                                                         const TW::storage* w, const float* bias, float* y, int T, \
                                                         int N, int K, int splits, const float* gamma, float eps, \
                                                         float* x_out) {                                          \
        emu_launch({blocks, 1, 1}, DG_THREADS, 0,                                                                 \
                   [&] { dense_gemv_normed_##SUF##_t##TOK(x, w, bias, y, T, N, K, splits, gamma, eps, x_out); },  \
                   order);                                                                                        \
    }
#define EMU_DENSE_GEMV_TC(NT)                                                                                    \
    extern "C" void emu_dense_gemv_tc_bf16_n##NT(int blocks, unsigned order, const float* x, const u16* w,       \
                                                 const float* bias, float* y, int T, int N, int K, int splits) {  \
        emu_launch({blocks, 1, 1}, DG_THREADS, 0, [&] { dense_gemv_tc_bf16_n##NT(x, w, bias, y, T, N, K, splits); }, \
                   order);                                                                                       \
    }                                                                                                            \
    extern "C" void emu_dense_gemv_tc_normed_bf16_n##NT(int blocks, unsigned order, const float* x, const u16* w, \
                                                        const float* bias, float* y, int T, int N, int K,        \
                                                        int splits, const float* gamma, float eps, float* x_out) { \
        emu_launch({blocks, 1, 1}, DG_THREADS, 0,                                                                 \
                   [&] { dense_gemv_tc_normed_bf16_n##NT(x, w, bias, y, T, N, K, splits, gamma, eps, x_out); },  \
                   order);                                                                                       \
    }
""" + "".join(f"EMU_WARP_SUMS({n})\n" for n in WARP_SUMS_COUNTS) + "".join(
    f"EMU_WARP_ITEM_SUMS({r}, {t}, {str(g).lower()})\n" for r, t, g in WARP_ITEM_SHAPES) + "".join(
    f"EMU_DENSE_GEMV_TC({nt})\n" for nt in limits.DG_TC_TILES) + "".join(
    f"EMU_ATTENTION_DECODE({k}, T{k.split('_')[0].upper()})\n" for k in ATTENTION_DECODE_KERNELS) + "".join(
    f"EMU_ATTENTION_SPLIT({k}, T{k.split('_')[0].upper()})\n" for k in ATTENTION_DECODE_KERNELS) + "".join(
    f"EMU_RMSNORM({k}, {', '.join('T' + c.upper() for c in k.split('_'))})\n" for k in RMSNORM_KERNELS) + "".join(
    f"EMU_DENSE_GEMV({c}, T{c.upper()}, {tok})\nEMU_DENSE_GEMV_NORMED({c}, T{c.upper()}, {tok})\n"
    for c in ("f32", "bf16") for tok in limits.DG_PLANS)


ATTENTION_TILES_SHARED = "extern __shared__ __align__(16) unsigned char att_tiles[];"


def build_layers(tmp_path: Path, **defines: int) -> ctypes.CDLL:
    """layers.cu for the CPU, with limits.py's constants (but `defines`: other values, e.g. a dense_gemv plan)."""
    options = {**limits.KERNEL_DEFINES["layers"], **defines}
    src = host_module_source("layers")
    assert ATTENTION_TILES_SHARED in src
    src = src.replace(ATTENTION_TILES_SHARED, "unsigned char* att_tiles = emu_block->shared.data();")
    return _compile(tmp_path, "layers", src + LAYERS_DRIVER, [f"-D{k}={v}" for k, v in options.items()])


class AttentionEmulator(LibraryEmulator):
    """layers.cu's attention kernels over host arrays, launched as `ops.attention` (flash_prefill off) launches
    them: attention_decode for up to ATT_DECODE_MAX_ROWS query rows, attention_split (+ attention_merge) beyond;
    blocks run in a shuffled order (`order` seeds it, 0: grid order). max_splits, stages: the ATT_MAX_SPLITS and
    ATT_DECODE_STAGES the library was built with (build_layers' defines, limits.py's by default)."""

    def __init__(self, lib: ctypes.CDLL, max_splits: int = limits.ATT_MAX_SPLITS,
                 stages: int = limits.ATT_DECODE_STAGES) -> None:
        super().__init__(lib)
        self.max_splits, self.stages = max_splits, stages

    @staticmethod
    def workspace(num_rows: int, heads: int, head_dim: int, nsplit: int) -> dict:
        """ops.AttentionWorkspace's arrays: partials NaN (a merge that reads one not written this launch shows),
        tickets zero."""
        return {"ml": np.full(num_rows * heads * nsplit * 2, np.nan, np.float32),
                "acc": np.full(num_rows * heads * nsplit * head_dim, np.nan, np.float32),
                "tickets": np.zeros(num_rows * heads, np.int32)}

    def attention(self, q, k_cache, v_cache, q_seq, q_len, scale: float, *, window: int = 0, sinks=None,
                  nsplit: int = 1, workspace: dict | None = None, order: int = 1) -> np.ndarray:
        """As `ops.attention` (flash_prefill off): up to ATT_DECODE_MAX_ROWS rows `attention_decode`, more
        `attention_split` and, with splits, `attention_merge` (one block a (row, head), a thread a value)."""
        NQ, nh, hd = q.shape
        assert 1 <= nsplit <= self.max_splits
        nkv, cap = k_cache.shape[2], k_cache.shape[1]
        code = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}[k_cache.dtype]
        out = np.full(q.shape, np.nan, np.float32)
        if nsplit > 1:
            ws = workspace or self.workspace(NQ, nh, hd, nsplit)
            ml, acc, tickets = _ptr(ws["ml"]), _ptr(ws["acc"]), _ptr(ws["tickets"])
        else:
            ml = acc = _ptr(out)
            tickets = ctypes.c_void_p(None)
        grid = (NQ, nkv, -(-(nh // nkv) // limits.ATT_GMAX) * nsplit)
        rows = (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(q_seq), _ptr(q_len), _nullable(sinks), ml, acc)
        tail = (nh, nkv, cap, window, ctypes.c_float(scale), nsplit)
        if NQ <= limits.ATT_DECODE_MAX_ROWS:     # its tiles are copied (cp.async) from the caches only
            self.lib.emu_clear_sources()
            for cache in (k_cache, v_cache):
                self.lib.emu_allow_source(_ptr(cache), ctypes.c_size_t(cache.nbytes))
            smem = limits.attention_decode_shared_bytes(k_cache.itemsize, self.stages)
            getattr(self.lib, f"emu_attention_decode_{code}_hd{hd}")(*grid, ctypes.c_size_t(smem),
                                                                     ctypes.c_uint(order), *rows, tickets, _ptr(out),
                                                                     *tail)
            return out
        getattr(self.lib, f"emu_attention_split_{code}_hd{hd}")(*grid, ctypes.c_uint(order), *rows, _ptr(out), *tail)
        if nsplit > 1:
            self.lib.emu_attention_merge(NQ * nh, hd, ctypes.c_uint(order), ml, acc, _nullable(sinks), _ptr(out), hd,
                                         nsplit, nh)
        return out


H200_SMS = 132      # multiprocessors the emulated dense_gemv launches plan for


class DenseGemvEmulator(LibraryEmulator):
    """layers.cu's dense_gemv kernels over host arrays (bf16 as uint16 bits), launched as `ops.dense_gemv` launches
    them; blocks run in a shuffled order (`order` seeds it, 0: grid order). rows: the output rows a warp item of the
    built plans takes, by tokens a pass (default limits.DG_PLANS')."""

    def __init__(self, lib: ctypes.CDLL, rows: dict[int, int] | None = None) -> None:
        super().__init__(lib)
        self.rows = rows or {t: plan[0] for t, plan in limits.DG_PLANS.items()}

    def gemv(self, x, w, *, bias=None, splits: int | None = None, order: int = 1) -> np.ndarray:
        return self._launch("dense_gemv", x, w, bias, splits, order, ())

    def gemv_normed(self, x, gamma, eps: float, w, *, bias=None, splits: int | None = None,
                    order: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(y, x_out) of `ops.dense_gemv_normed`: rmsnorm(x) @ w.T (+ bias) and rmsnorm(x)."""
        return self._normed(self._launch, "dense_gemv_normed", x, gamma, eps, w, bias, splits, order)

    def gemv_tc(self, x, w, *, bias=None, splits: int | None = None, order: int = 1) -> np.ndarray:
        """`ops.dense_gemv_tc`: x @ w.T (+ bias) for bf16 w on the tensor-core kernel, launched as the wrapper
        launches it."""
        return self._launch_tc("dense_gemv_tc", x, w, bias, splits, order, ())

    def gemv_tc_normed(self, x, gamma, eps: float, w, *, bias=None, splits: int | None = None,
                       order: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(y, x_out) of `ops.dense_gemv_tc_normed`: rmsnorm(x) @ w.T (+ bias) and rmsnorm(x)."""
        return self._normed(self._launch_tc, "dense_gemv_tc_normed", x, gamma, eps, w, bias, splits, order)

    @staticmethod
    def _normed(launch, family: str, x, gamma, eps: float, w, bias, splits, order) -> tuple[np.ndarray, np.ndarray]:
        """(y, x_out) of a normed family's launch: the norm's arguments (gamma, eps, x_out) after the shared ones."""
        x_out = np.full(x.shape, np.nan, np.float32)
        return launch(family, x, w, bias, splits, order, (_ptr(gamma), ctypes.c_float(eps), _ptr(x_out))), x_out

    def _launch_tc(self, family: str, x, w, bias, splits: int | None, order: int, tail: tuple) -> np.ndarray:
        T, K = x.shape
        N = w.shape[0]
        tiles = min(n for n in limits.DG_TC_TILES if 8 * n >= T)
        splits = ops.dense_gemv_tc_splits(N, K, H200_SMS) if splits is None else splits
        blocks = -(-N // limits.DG_TC_ROWS // (limits.DG_THREADS // 32 // splits))
        y = np.full((T, N), np.nan, np.float32)
        getattr(self.lib, f"emu_{family}_bf16_n{tiles}")(
            blocks, ctypes.c_uint(order), _ptr(x), _ptr(w), _nullable(bias), _ptr(y), T, N, K, splits, *tail)
        return y

    def _launch(self, family: str, x, w, bias, splits: int | None, order: int, tail: tuple) -> np.ndarray:
        T, K = x.shape
        N = w.shape[0]
        tok = min(t for t in limits.DG_PLANS if t >= T)
        splits = ops.dense_gemv_splits(N, K, tok, w.dtype.itemsize, H200_SMS) if splits is None else splits
        blocks = -(-N // self.rows[tok] // (limits.DG_THREADS // 32 // splits))
        y = np.full((T, N), np.nan, np.float32)
        getattr(self.lib, f"emu_{family}_{_code(w)}_t{tok}")(
            blocks, ctypes.c_uint(order), _ptr(x), _ptr(w), _nullable(bias), _ptr(y), T, N, K, splits, *tail)
        return y


# ---- layers.cu's rmsnorm, fused.cu's add_rmsnorm ----------------------------------------------------------------------
FUSED_DRIVER = r"""
#define EMU_ADD_RMSNORM(SUF, TW)                                                                                  \
    extern "C" void emu_add_rmsnorm_##SUF(int rows, float* h, const float* b, const TW::storage* w, float* x,    \
                                          int D, float alpha, float eps) {                                       \
        emu_launch({rows, 1, 1}, FUSED_THREADS, 0, [&] { add_rmsnorm_##SUF(h, b, w, x, D, alpha, eps); });       \
    }
EMU_ADD_RMSNORM(f32, TF32)
EMU_ADD_RMSNORM(bf16, TBF16)
#define EMU_QKV_ROPE_KV(SUF, TC, TW)                                                                              \
    extern "C" void emu_qkv_rope_kv_##SUF(int rows, int gy, const float* qkv, float* q_out, TC::storage* kc,      \
                                          TC::storage* vc, const TW::storage* wq, const TW::storage* wk,          \
                                          const int* seq, const int* pos, const int* rpos, const float* cos_t,    \
                                          const float* sin_t, int nh, int nkv, int hd, int half, int capacity,    \
                                          int norm_mode, float eps, float clip) {                                 \
        emu_launch({rows, gy, 1}, QKV_THREADS, 0, [&] {                                                          \
            qkv_rope_kv_##SUF(qkv, q_out, kc, vc, wq, wk, seq, pos, rpos, cos_t, sin_t, nh, nkv, hd, half,       \
                              capacity, norm_mode, eps, clip);                                                    \
        });                                                                                                      \
    }
EMU_QKV_ROPE_KV(f32_f32, TF32, TF32)
EMU_QKV_ROPE_KV(f32_bf16, TF32, TBF16)
"""


def build_fused(tmp_path: Path) -> ctypes.CDLL:
    """fused.cu for the CPU, with limits.py's constants."""
    return _compile(tmp_path, "fused", host_module_source("fused") + FUSED_DRIVER, limits.define_options("fused"))


def _code(a: np.ndarray) -> str:
    return {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}[a.dtype]


class NormEmulator:
    """layers.cu's rmsnorm and fused.cu's add_rmsnorm and qkv_rope_kv over host arrays (16-bit bf16 as uint16 bits),
    launched as ops.rmsnorm / ops.add_rmsnorm / ops.qkv_rope_kv launch them; arrays may be views at any element
    offset."""

    def __init__(self, layers: ctypes.CDLL, fused: ctypes.CDLL) -> None:
        self.layers, self.fused = layers, fused
        for lib in (layers, fused):
            lib.emu_first_error.restype = ctypes.c_char_p

    def errors(self) -> tuple[int, str]:
        for lib in (self.layers, self.fused):
            if int(lib.emu_error_count()):
                return int(lib.emu_error_count()), lib.emu_first_error().decode()
        return 0, ""

    def rmsnorm(self, x, w, out, eps: float, *, w_offset: float = 0.0, threads: int = 256) -> None:
        rows, D = x.shape
        getattr(self.layers, f"emu_rmsnorm_{_code(x)}_{_code(out)}_{_code(w)}")(
            rows, threads, _ptr(x), _ptr(w), _ptr(out), D, ctypes.c_float(eps), ctypes.c_float(w_offset))

    def add_rmsnorm(self, h, b, w, x, eps: float, *, alpha: float = 1.0) -> None:
        rows, D = h.shape
        getattr(self.fused, f"emu_add_rmsnorm_{_code(w)}")(
            rows, _ptr(h), _ptr(b), _ptr(w), _ptr(x), D, ctypes.c_float(alpha), ctypes.c_float(eps))

    def qkv_rope_kv(self, qkv, heads: int, kv_heads: int, k_cache, v_cache, seq, pos, rpos, cos, sin, q_out, *,
                    norm: str, wq, wk, eps: float, clip: float | None) -> None:
        """fused.cu's qkv_rope_kv (f32 caches) with ops.qkv_rope_kv's grid: a block per row and head group."""
        rows, hd = qkv.shape[0], k_cache.shape[3]
        gy = -(-(heads + kv_heads) // (limits.QKV_THREADS // 32))
        getattr(self.fused, f"emu_qkv_rope_kv_f32_{_code(wq)}")(
            rows, gy, _ptr(qkv), _ptr(q_out), _ptr(k_cache), _ptr(v_cache), _ptr(wq), _ptr(wk), _ptr(seq), _ptr(pos),
            _ptr(rpos), _ptr(cos), _ptr(sin), heads, kv_heads, hd, cos.shape[1], k_cache.shape[1], limits.QK_NORM_MODES[norm],
            ctypes.c_float(eps), ctypes.c_float(clip if clip is not None else 0.0))


# ---- router.cu: the router and add_rmsnorm_route ---------------------------------------------------------------------
ROUTER_DYNAMIC_SHARED = "extern __shared__ float s_dyn[];"
ROUTER_SELECTION = ("const float* bias, float* logits, unsigned int* tickets, int* ids, float* weights, int T, int H, "
                    "int E, int K, int scoring, int ord, int normalize, float scale, int n_group, int topk_group")
ROUTER_SELECTION_ARGS = ("bias, logits, tickets, ids, weights, T, H, E, K, scoring, ord, normalize, scale, n_group, "
                         "topk_group")
ROUTER_DRIVER = rf"""
#define EMU_ROUTER(SUF, TW)                                                                                      \
    extern "C" void emu_router_##SUF(int gx, int gy, size_t smem, unsigned order, const float* x,                \
                                     const TW::storage* w, {ROUTER_SELECTION}) {{                                  \
        emu_launch({{gx, gy, 1}}, ROUTER_THREADS, smem, [&] {{ moe_router_##SUF(x, w, {ROUTER_SELECTION_ARGS}); }},  \
                   order);                                                                                       \
    }}                                                                                                           \
    extern "C" void emu_add_rmsnorm_route_##SUF(int gx, int gy, size_t smem, unsigned order, float* h,           \
                                                const float* o, const TW::storage* wn, float* x,                 \
                                                const TW::storage* w, {ROUTER_SELECTION}, float alpha,           \
                                                float eps) {{                                                    \
        emu_launch({{gx, gy, 1}}, ROUTER_THREADS, smem, [&] {{                                                     \
            add_rmsnorm_route_##SUF(h, o, wn, x, w, {ROUTER_SELECTION_ARGS}, alpha, eps);                         \
        }}, order);                                                                                              \
    }}
#define EMU_SELECT(WIDTH)                                                                                        \
    extern "C" void emu_router_select_e##WIDTH(int gx, size_t smem, unsigned order, const float* logits,          \
                                               const float* bias, int* ids, float* weights, int T, int E, int K,    \
                                               int scoring, int ord, int normalize, float scale, int n_group,      \
                                               int topk_group) {{                                                  \
        emu_launch({{gx, 1, 1}}, ROUTER_THREADS, smem, [&] {{                                                       \
            moe_router_select_e##WIDTH(logits, bias, ids, weights, T, E, K, scoring, ord, normalize, scale,        \
                                       n_group, topk_group);                                                     \
        }}, order);                                                                                              \
    }}
extern "C" void emu_router_widen_bf16(int blocks, const u16* w, float* out, long long n) {{
    emu_launch({{blocks, 1, 1}}, 256, 0, [&] {{ router_widen_bf16(w, out, n); }}, 0u);
}}
""" + "".join(f"EMU_ROUTER({c}_e{width}, T{c.upper()})\n" for c in ("f32", "bf16") for width in limits.ROUTER_WIDTHS) \
    + "".join(f"EMU_SELECT({width})\n" for width in limits.ROUTER_WIDTHS)


def build_router(tmp_path: Path) -> ctypes.CDLL:
    """router.cu for the CPU, with limits.py's constants; the selecting warps' dynamic shared memory is the block's."""
    src = host_module_source("router")
    assert ROUTER_DYNAMIC_SHARED in src
    src = src.replace(ROUTER_DYNAMIC_SHARED, "float* s_dyn = reinterpret_cast<float*>(emu_block->shared.data());")
    return _compile(tmp_path, "router", src + ROUTER_DRIVER, limits.define_options("router"))


@dataclass
class Routed:
    """What a router launch wrote: ids [T, k], weights [T, k], logits [T, E] and the tickets (zero after a launch)."""
    ids: np.ndarray
    weights: np.ndarray
    logits: np.ndarray
    tickets: np.ndarray


class RouterEmulator(LibraryEmulator):
    """router.cu's moe_router and add_rmsnorm_route kernels over host arrays (bf16 as uint16 bits), launched on the
    grid, kernel width and shared memory of `ops.router` / `ops.add_rmsnorm_route`; blocks run in a shuffled order
    (`shuffle` seeds it, 0: grid order), so that various blocks of a token group take the last ticket. `how`: the
    router's bias, scoring, order, normalize, scale and groups."""

    def _launch(self, name: str, T: int, H: int, w: np.ndarray, k: int, shuffle: int, inputs: tuple, tail: tuple,
                bias=None, scoring="softmax", order="softmax_topk", normalize=False, scale=1.0, groups=None) -> Routed:
        E = w.shape[0]
        out = Routed(np.full((T, k), -7, np.int32), np.full((T, k), np.nan, np.float32),
                     np.full((T, E), np.nan, np.float32), np.zeros(-(-T // limits.ROUTER_TPB), np.uint32))
        n_group, topk_group = groups or (1, 1)
        width = next(c for c in limits.ROUTER_WIDTHS if c >= E)
        getattr(self.lib, f"emu_{name}_{_code(w)}_e{width}")(
            -(-T // limits.ROUTER_TPB), -(-E // limits.ROUTER_EPB), ctypes.c_size_t(ops.router_shared_bytes(E, groups)),
            ctypes.c_uint(shuffle), *inputs, _nullable(bias), _ptr(out.logits), _ptr(out.tickets), _ptr(out.ids),
            _ptr(out.weights), T, H, E, k, limits.ROUTER_SCORING[scoring], limits.ROUTER_ORDER[order], int(normalize),
            ctypes.c_float(scale), n_group, topk_group, *tail)
        return out

    def router(self, x, w, k: int, *, shuffle: int = 1, **how) -> Routed:
        T, H = x.shape
        return self._launch("router", T, H, w, k, shuffle, (_ptr(x), _ptr(w)), (), **how)

    def select(self, logits, k: int, *, shuffle: int = 1, bias=None, scoring="softmax", order="softmax_topk",
               normalize=False, scale=1.0, groups=None) -> Routed:
        """moe_router_select on given logits [T, E] (the GEMM route's second launch), on ops.router's grid."""
        T, E = logits.shape
        out = Routed(np.full((T, k), -7, np.int32), np.full((T, k), np.nan, np.float32), logits,
                     np.zeros(0, np.uint32))
        n_group, topk_group = groups or (1, 1)
        width = next(c for c in limits.ROUTER_WIDTHS if c >= E)
        getattr(self.lib, f"emu_router_select_e{width}")(
            -(-T // limits.ROUTER_TPB), ctypes.c_size_t(ops.router_shared_bytes(E, groups)), ctypes.c_uint(shuffle),
            _ptr(logits), _nullable(bias), _ptr(out.ids), _ptr(out.weights), T, E, k, limits.ROUTER_SCORING[scoring],
            limits.ROUTER_ORDER[order], int(normalize), ctypes.c_float(scale), n_group, topk_group)
        return out

    def widen_bf16(self, w: np.ndarray, blocks: int = 3) -> np.ndarray:
        """router_widen_bf16: bf16 bits [E, H] as float32 (a grid of `blocks`: the grid-stride loop wraps)."""
        out = np.full(w.shape, np.nan, np.float32)
        self.lib.emu_router_widen_bf16(blocks, _ptr(w), _ptr(out), ctypes.c_longlong(w.size))
        return out

    def add_rmsnorm_route(self, h, b, norm_w, x, eps: float, w, k: int, *, alpha: float = 1.0, shuffle: int = 1,
                          **how) -> Routed:
        """h += alpha b in place; x = rmsnorm(h) * norm_w; the router on x."""
        T, H = h.shape
        inputs = (_ptr(h), _ptr(b), _ptr(norm_w), _ptr(x), _ptr(w))
        return self._launch("add_rmsnorm_route", T, H, w, k, shuffle, inputs,
                            (ctypes.c_float(alpha), ctypes.c_float(eps)), **how)


# ---- moe_gemv.cu (int8 experts, float inputs: the decode GEMVs) ------------------------------------------------------
GEMV_KINDS = ("t1", "t2", "t4", "t8", "w2", "w4")   # tokens a pass (t<n>) or the one-token "wide" plans (w2, w4)

GEMV_DRIVER = r"""
#define GEMV_TABLE(STAGE, SUFFIX) {STAGE##_t1_r##SUFFIX, STAGE##_t2_r##SUFFIX, STAGE##_t4_r##SUFFIX,                \
    STAGE##_t8_r##SUFFIX, STAGE##_w2_r##SUFFIX, STAGE##_w4_r##SUFFIX, STAGE##_t1_g##SUFFIX, STAGE##_t2_g##SUFFIX, \
    STAGE##_t4_g##SUFFIX, STAGE##_t8_g##SUFFIX, STAGE##_w2_g##SUFFIX, STAGE##_w4_g##SUFFIX}
typedef void (*GateUpFn)(const float*, const unsigned long long*, const unsigned long long*, long long, long long,
                         const int*, const int*, const int*, const int*, float*, int, int, int, int);
typedef void (*DownFn)(const float*, const unsigned long long*, const unsigned long long*, long long, long long,
                       const int*, const int*, const int*, const int*, const float*, float*, int, int, int);
typedef void (*GateUpExtrasFn)(const float*, const unsigned long long*, const unsigned long long*, long long,
                               long long, const int*, const int*, const int*, const int*, float*, int, int, int, int,
                               const float*, float, float, float);
typedef void (*DownExtrasFn)(const float*, const unsigned long long*, const unsigned long long*, long long, long long,
                             const int*, const int*, const int*, const int*, const float*, float*, int, int, int,
                             const float*);
static const GateUpFn GATE_UP[] = GEMV_TABLE(moe_gate_up, );
static const DownFn DOWN[] = GEMV_TABLE(moe_down, );
static const GateUpExtrasFn GATE_UP_EXTRAS[] = GEMV_TABLE(moe_gate_up, _extras);
static const DownExtrasFn DOWN_EXTRAS[] = GEMV_TABLE(moe_down, _extras);

// kernel: index of GEMV_KINDS, + 6 for group scales; extras: gpt-oss's variant (bias may be null)
extern "C" void emu_gate_up(int kernel, int extras, int blocks, const float* x, const unsigned long long* blobs,
                            const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                            const int* offsets, const int* active, const int* meta, float* act, int H, int I, int k,
                            int group, const float* bias, float alpha, float limit, float up_offset) {
    emu_launch({blocks, 1, 1}, GEMV_THREADS, 0, [&] {
        if (extras)
            GATE_UP_EXTRAS[kernel](x, blobs, fills, off_w, off_s, perm, offsets, active, meta, act, H, I, k, group,
                                   bias, alpha, limit, up_offset);
        else
            GATE_UP[kernel](x, blobs, fills, off_w, off_s, perm, offsets, active, meta, act, H, I, k, group);
    });
}

// the by-pair w4 kernels (no dispatch); grouped: group scales; extras: gpt-oss's variant (bias may be null)
extern "C" void emu_gate_up_pairs(int grouped, int extras, int blocks, const float* x, const int* ids,
                                  const unsigned long long* blobs, const unsigned long long* fills, long long off_w,
                                  long long off_s, float* act, int H, int I, int k, int group, int P, int E,
                                  const float* bias, float alpha, float limit, float up_offset) {
    emu_launch({blocks, 1, 1}, GEMV_THREADS, 0, [&] {
        if (extras)
            (grouped ? moe_gate_up_pairs_w4_g_extras : moe_gate_up_pairs_w4_r_extras)(
                x, ids, blobs, fills, off_w, off_s, act, H, I, k, group, P, E, bias, alpha, limit, up_offset);
        else
            (grouped ? moe_gate_up_pairs_w4_g : moe_gate_up_pairs_w4_r)(x, ids, blobs, fills, off_w, off_s, act, H,
                                                                        I, k, group, P, E);
    });
}

extern "C" void emu_down_pairs(int grouped, int extras, int blocks, const float* a, const int* ids,
                               const unsigned long long* blobs, const unsigned long long* fills, long long off_w,
                               long long off_s, const float* pair_w, float* y, int H, int I, int group, int P,
                               int E, const float* bias) {
    emu_launch({blocks, 1, 1}, GEMV_THREADS, 0, [&] {
        if (extras)
            (grouped ? moe_down_pairs_w4_g_extras : moe_down_pairs_w4_r_extras)(a, ids, blobs, fills, off_w, off_s,
                                                                                pair_w, y, H, I, group, P, E, bias);
        else
            (grouped ? moe_down_pairs_w4_g : moe_down_pairs_w4_r)(a, ids, blobs, fills, off_w, off_s, pair_w, y, H,
                                                                  I, group, P, E);
    });
}

extern "C" void emu_down(int kernel, int extras, int blocks, const float* a, const unsigned long long* blobs,
                         const unsigned long long* fills, long long off_w, long long off_s, const int* perm,
                         const int* offsets, const int* active, const int* meta, const float* pair_w, float* y,
                         int H, int I, int group, const float* bias) {
    emu_launch({blocks, 1, 1}, GEMV_THREADS, 0, [&] {
        if (extras)
            DOWN_EXTRAS[kernel](a, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w, y, H, I, group,
                                bias);
        else
            DOWN[kernel](a, blobs, fills, off_w, off_s, perm, offsets, active, meta, pair_w, y, H, I, group);
    });
}
"""


def build_gemv(tmp_path: Path, plan: tuple | None = None) -> ctypes.CDLL:
    """moe_gemv.cu for the CPU, with limits.py's constants (`plan`: another GEMV_W4_PLAN, as gemv_sweep.py builds
    it)."""
    defines = {**limits.KERNEL_DEFINES["moe_gemv"], **limits.w4_plan_defines(plan or limits.GEMV_W4_PLAN)}
    return _compile(tmp_path, "moe_gemv", host_module_source("moe_gemv") + GEMV_DRIVER,
                    [f"-D{k}={v}" for k, v in defines.items()])


@dataclass(frozen=True)
class GemvExtras:
    """gpt-oss's expert extras as the *_extras kernels take them (bias arrays kept alive by the caller)."""
    gate_up_bias: np.ndarray | None
    down_bias: np.ndarray | None
    alpha: float
    limit: float
    up_offset: float


class GemvEmulator(GridStrideEmulator):
    """moe_gemv.cu's int8 decode GEMVs over host arrays; `blocks` blocks a launch (the grid-stride loop over warp
    items)."""

    @staticmethod
    def _kernel(kind: str, layout) -> int:
        return GEMV_KINDS.index(kind) + (len(GEMV_KINDS) if layout.group_size else 0)

    def gate_up(self, kind: str, x, ptrs, fills, layout, disp: dict, k: int, act,
                extras: GemvExtras | None = None) -> None:
        ex = extras or GemvExtras(None, None, 1.0, float("inf"), 0.0)
        self.lib.emu_gate_up(
            self._kernel(kind, layout), int(extras is not None), self.blocks, _ptr(x), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            *_routing(disp), _ptr(act), layout.hidden_size, layout.intermediate_size, k, layout.group_size,
            _nullable(ex.gate_up_bias), ctypes.c_float(ex.alpha), ctypes.c_float(ex.limit),
            ctypes.c_float(ex.up_offset))

    def down(self, kind: str, a, ptrs, fills, layout, disp: dict, weights, y,
             extras: GemvExtras | None = None) -> None:
        self.lib.emu_down(
            self._kernel(kind, layout), int(extras is not None), self.blocks, _ptr(a), _ptr(ptrs), _nullable(fills),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            *_routing(disp), _ptr(weights), _ptr(y), layout.hidden_size, layout.intermediate_size, layout.group_size,
            _nullable(None if extras is None else extras.down_bias))


    def gate_up_pairs(self, x, ids, ptrs, fills, layout, act, num_experts: int,
                      extras: GemvExtras | None = None) -> None:
        T, k = ids.shape
        ex = extras or GemvExtras(None, None, 1.0, float("inf"), 0.0)
        self.lib.emu_gate_up_pairs(
            int(bool(layout.group_size)), int(extras is not None), self.blocks, _ptr(x), _ptr(ids), _ptr(ptrs),
            _nullable(fills), ctypes.c_longlong(layout.array("gate_up").offset),
            ctypes.c_longlong(layout.array("gate_up_scale").offset), _ptr(act), layout.hidden_size,
            layout.intermediate_size, k, layout.group_size, T * k, num_experts, _nullable(ex.gate_up_bias),
            ctypes.c_float(ex.alpha), ctypes.c_float(ex.limit), ctypes.c_float(ex.up_offset))

    def down_pairs(self, a, ids, ptrs, fills, layout, weights, y, num_experts: int,
                   extras: GemvExtras | None = None) -> None:
        self.lib.emu_down_pairs(
            int(bool(layout.group_size)), int(extras is not None), self.blocks, _ptr(a), _ptr(ids), _ptr(ptrs),
            _nullable(fills), ctypes.c_longlong(layout.array("down").offset),
            ctypes.c_longlong(layout.array("down_scale").offset), _ptr(weights), _ptr(y), layout.hidden_size,
            layout.intermediate_size, layout.group_size, ids.size, num_experts,
            _nullable(None if extras is None else extras.down_bias))


# ---- moe_gemm_cublas.cu ---------------------------------------------------------------------------------------------
GLUE_DRIVER = r"""
extern "C" void emu_gather(int blocks, const float* x, const int* perm, const int* offsets, int E, u16* out, int P,
                           int H, int k, int split) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] { gather_bf16(x, perm, offsets, E, out, P, H, k, split); });
}

extern "C" void emu_widen(int blocks, const unsigned long long* blobs, int e, long long off, long long n, u16* w) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] { widen_int8_bf16(blobs, e, off, n, w); });
}

extern "C" void emu_gate_up_epilogue(int blocks, const float* gu, const unsigned long long* blobs, int e,
                                     long long off_s, u16* out, int rows, int inter, int split) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] {
        gate_up_epilogue(gu, blobs, e, off_s, out, rows, inter, split);
    });
}

extern "C" void emu_down_epilogue(int blocks, const float* yd, const unsigned long long* blobs, int e,
                                  long long off_s, const int* perm, int start, const float* pair_w, float* ypair,
                                  int rows, int hidden, int split) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] {
        down_epilogue(yd, blobs, e, off_s, perm, start, pair_w, ypair, rows, hidden, split);
    });
}

extern "C" void emu_quantize_rows(int blocks, const float* x, signed char* q, float* s, int rows, int cols) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] { quantize_rows_int8(x, q, s, rows, cols); });
}

extern "C" void emu_gather_int8(int blocks, const signed char* q, const float* s, const int* perm, signed char* out,
                                float* out_s, int P, int H, int k) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] { gather_rows_int8(q, s, perm, out, out_s, P, H, k); });
}

extern "C" void emu_gate_up_epilogue_int8(int blocks, const int* gu, const float* rs, const int* offsets, int E,
                                          const unsigned long long* blobs, long long off_s, float* act, int P,
                                          int inter) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] {
        gate_up_epilogue_int8(gu, rs, offsets, E, blobs, off_s, act, P, inter);
    });
}

extern "C" void emu_down_epilogue_int8(int blocks, const int* yd, const float* rs, const int* offsets, int E,
                                       const unsigned long long* blobs, long long off_s, const int* perm,
                                       const float* pair_w, float* ypair, int P, int hidden) {
    emu_launch({blocks, 1, 1}, GLUE_THREADS, 0, [&] {
        down_epilogue_int8(yd, rs, offsets, E, blobs, off_s, perm, pair_w, ypair, P, hidden);
    });
}
"""


def build_glue(tmp_path: Path) -> ctypes.CDLL:
    """moe_gemm_cublas.cu (the element-wise kernels around cuBLAS) for the CPU, with limits.py's constants."""
    return _compile(tmp_path, "moe_gemm_cublas", host_module_source("moe_gemm_cublas") + GLUE_DRIVER,
                    limits.define_options("moe_gemm_cublas"))


class GlueEmulator(GridStrideEmulator):
    """moe_gemm_cublas.cu's kernels over host arrays (blobs: host blob bytes, ptrs: their addresses, uint64 [E]);
    `blocks` blocks a launch (the grid-stride loops)."""

    def gather(self, x, perm, k: int, offsets, out) -> None:
        """offsets None: bf16 rows; else split rows stacked per expert (ops.gather_bf16)."""
        E = 0 if offsets is None else offsets.size - 1
        self.lib.emu_gather(self.blocks, _ptr(x), _ptr(perm), _nullable(offsets), E, _ptr(out), perm.size,
                            x.shape[1], k, int(offsets is not None))

    def widen(self, ptrs, e: int, off: int, w) -> None:
        self.lib.emu_widen(self.blocks, _ptr(ptrs), e, ctypes.c_longlong(off), ctypes.c_longlong(w.size), _ptr(w))

    def gate_up_epilogue(self, gu, ptrs, e: int, off_s: int, out, split: bool) -> None:
        rows, inter = out.shape[0] // (2 if split else 1), out.shape[1]
        self.lib.emu_gate_up_epilogue(self.blocks, _ptr(gu), _ptr(ptrs), e, ctypes.c_longlong(off_s), _ptr(out),
                                      rows, inter, int(split))

    def down_epilogue(self, yd, ptrs, e: int, off_s: int, perm, start: int, weights, ypair, split: bool) -> None:
        rows, hidden = yd.shape[0] // (2 if split else 1), yd.shape[1]
        self.lib.emu_down_epilogue(self.blocks, _ptr(yd), _ptr(ptrs), e, ctypes.c_longlong(off_s), _ptr(perm),
                                   start, _ptr(weights), _ptr(ypair), rows, hidden, int(split))

    def quantize_rows(self, x, q, scales) -> None:
        self.lib.emu_quantize_rows(self.blocks, _ptr(x), _ptr(q), _ptr(scales), x.shape[0], x.shape[1])

    def gather_int8(self, q, scales, perm, k: int, out, out_scales) -> None:
        self.lib.emu_gather_int8(self.blocks, _ptr(q), _ptr(scales), _ptr(perm), _ptr(out), _ptr(out_scales),
                                 perm.size, q.shape[1], k)

    def gate_up_epilogue_int8(self, gu, row_scales, offsets, ptrs, off_s: int, act) -> None:
        P, inter = act.shape
        self.lib.emu_gate_up_epilogue_int8(self.blocks, _ptr(gu), _ptr(row_scales), _ptr(offsets), offsets.size - 1,
                                           _ptr(ptrs), ctypes.c_longlong(off_s), _ptr(act), P, inter)

    def down_epilogue_int8(self, yd, row_scales, offsets, ptrs, off_s: int, perm, weights, ypair) -> None:
        P, hidden = yd.shape
        self.lib.emu_down_epilogue_int8(self.blocks, _ptr(yd), _ptr(row_scales), _ptr(offsets), offsets.size - 1,
                                        _ptr(ptrs), ctypes.c_longlong(off_s), _ptr(perm), _ptr(weights),
                                        _ptr(ypair), P, hidden)


# ---- dispatch.cu --------------------------------------------------------------------------------------------------
DISPATCH_DRIVER = r"""
extern "C" void emu_dispatch(const int* ids, int P, int E, int tile_m, int max_tiles, int* counts, int* offsets,
                             int* perm, int* inv, int* active, int* meta, int* tile_expert, int* tile_start) {
    emu_launch({1, 1, 1}, DISPATCH_THREADS, 0, [&] {
        moe_dispatch(ids, P, E, tile_m, max_tiles, counts, offsets, perm, inv, active, meta, tile_expert, tile_start);
    });
}

extern "C" void emu_dispatch_blocks(int blocks, int chunk, unsigned order, const int* ids, int P, int E, int tile_m,
                                    int max_tiles, int* counts, int* offsets, int* perm, int* inv, int* active,
                                    int* meta, int* tile_expert, int* tile_start, int* block_counts, int* block_bad,
                                    int* block_base) {
    emu_launch({blocks, 1, 1}, DISPATCH_THREADS, 0, [&] {
        moe_dispatch_ranks(ids, P, E, chunk, inv, block_counts, block_bad);
    }, order);
    emu_launch({1, 1, 1}, DISPATCH_THREADS, 0, [&] {
        moe_dispatch_groups(block_counts, block_bad, blocks, E, tile_m, max_tiles, block_base, counts, offsets, active,
                            meta, tile_expert, tile_start);
    });
    emu_launch({2, 1, 1}, DISPATCH_THREADS, 0, [&] {
        moe_dispatch_scatter(ids, P, E, chunk, block_base, offsets, inv, perm);
    }, order);
}
"""


def build_dispatch(tmp_path: Path) -> ctypes.CDLL:
    """dispatch.cu for the CPU, with limits.py's constants (its warp match masks emulated by the shim)."""
    return _compile(tmp_path, "dispatch", host_module_source("dispatch") + DISPATCH_DRIVER,
                    limits.define_options("dispatch"))


class DispatchEmulator(LibraryEmulator):
    """moe_dispatch (one block, as ops.dispatch launches it) over host arrays."""

    NAMES = ("counts", "offsets", "perm", "inv", "active", "meta", "tile_expert", "tile_start")

    def dispatch(self, ids: np.ndarray, num_experts: int, tile_m: int = limits.GEMM_BM,
                 blocks: tuple[int, int] | None = None, order: int = 0) -> dict:
        """The dispatch's outputs; blocks (blocks, chunk): the three launches over several blocks (moe_dispatch_ranks
        on `blocks` blocks of `chunk` pairs, in an order shuffled with `order`, then groups, then scatter)."""
        ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
        P, E = ids.size, num_experts
        max_tiles = P // tile_m + min(E, P) + 1                                    # ops.max_tiles
        out = {"counts": np.full(E, -7, np.int32), "offsets": np.full(E + 1, -7, np.int32),
               "perm": np.full(P, -7, np.int32), "inv": np.full(P, -7, np.int32), "active": np.full(E, -7, np.int32),
               "meta": np.full(4, -7, np.int32), "tile_expert": np.full(max_tiles, -7, np.int32),
               "tile_start": np.full(max_tiles, -7, np.int32)}
        outs = [_ptr(out[n]) for n in self.NAMES]
        if blocks is None:
            self.lib.emu_dispatch(_ptr(ids), P, E, tile_m, max_tiles, *outs)
            return out
        n, chunk = blocks
        scratch = [np.full(n * E, -7, np.int32), np.full(n, -7, np.int32), np.full(n * E, -7, np.int32)]
        self.lib.emu_dispatch_blocks(n, chunk, ctypes.c_uint(order), _ptr(ids), P, E, tile_m, max_tiles, *outs,
                                     *(_ptr(a) for a in scratch))
        return out
