"""moe_gemm_fast.cu built for the CPU and run on NumPy arrays: a check of its indexing, shared-memory layout,
pipeline and fragment layouts on machines without a GPU (tests/runtime/cuda/test_moe_gemm_fast_emulated.py).

The kernel source is what NVRTC compiles (`ops.kernel_source`, the -D options of limits.py), with the five helpers
that wrap PTX removed (PTX_HELPERS); cuda_host_shim.h stands in for them and for the CUDA built-ins (see its header).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import ops

GXX = shutil.which("g++")
SHIM_DIR = Path(__file__).resolve().parent
PTX_HELPERS = ("shared_address", "copy16_async", "commit_copies", "wait_copies", "mma_16816", "bf16x2_sub")
DYNAMIC_SHARED = "extern __shared__ __align__(128) unsigned char fast_smem[];"

DRIVER = r"""
extern "C" void emu_widen_bytes(const unsigned int* words, unsigned int* pairs, int n) {
    for (int i = 0; i < n; ++i) i8x4_to_bf16x2(words[i], pairs[2 * i], pairs[2 * i + 1]);
}

extern "C" void emu_gate_up(int split, int grid_x, int grid_y, size_t smem, const u16* x_hi, const u16* x_lo,
                            const unsigned long long* blobs, long long off_w, long long off_s, const int* perm,
                            const int* offsets, const int* tile_expert, const int* tile_start, float* act, int H,
                            int I, int k) {
    emu_launch(grid_x, grid_y, FAST_THREADS, smem, [&] {
        (split ? moe_gemm_fast_gate_up_split : moe_gemm_fast_gate_up_bf16)(
            x_hi, x_lo, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, act, H, I, k);
    });
}

extern "C" void emu_down(int split, int grid_x, int grid_y, size_t smem, const u16* a_hi, const u16* a_lo,
                         const unsigned long long* blobs, long long off_w, long long off_s, const int* perm,
                         const int* offsets, const int* tile_expert, const int* tile_start, const float* pair_w,
                         float* y, int H, int I) {
    emu_launch(grid_x, grid_y, FAST_THREADS, smem, [&] {
        (split ? moe_gemm_fast_down_split : moe_gemm_fast_down_bf16)(
            a_hi, a_lo, blobs, off_w, off_s, perm, offsets, tile_expert, tile_start, pair_w, y, H, I);
    });
}
"""


def _without_definition(src: str, name: str) -> str:
    """src less the definition of function `name` (its template line too), found by matching its braces."""
    m = re.search(rf"^(template <[^\n]*>\n)?__device__ __forceinline__ [^\n]*\b{name}\(", src, re.MULTILINE)
    assert m, f"no definition of {name} in moe_gemm_fast.cu"
    depth, i = 0, src.index("{", m.end())
    while True:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            break
        i += 1
    return src[:m.start()] + src[i + 1:]


def host_source() -> str:
    src = ops.kernel_source("moe_gemm_fast")
    for name in PTX_HELPERS:
        src = _without_definition(src, name)
    assert DYNAMIC_SHARED in src
    src = src.replace(DYNAMIC_SHARED, "unsigned char* fast_smem = emu_block->shared.data();")
    return '#include "cuda_host_shim.h"\n' + src + DRIVER


def _defines(stages: int) -> list[str]:
    return [o for o in limits.define_options("moe_gemm_fast") if not o.startswith("-DFAST_STAGES=")] + [
        f"-DFAST_STAGES={stages}"]


def build(tmp_path: Path, stages: int = limits.FAST_STAGES) -> ctypes.CDLL:
    """The kernels for the CPU, with limits.py's constants but for the pipeline depth `stages`."""
    src = tmp_path / "moe_gemm_fast_host.cpp"
    src.write_text(host_source())
    lib = tmp_path / "moe_gemm_fast_host.so"
    cmd = [GXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", f"-I{SHIM_DIR}",
           *_defines(stages), "-o", str(lib), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    assert a.flags.c_contiguous
    return ctypes.c_void_p(a.ctypes.data)


class Emulator:
    """The kernels of a built library, launched over host arrays (kept alive by the caller)."""

    def __init__(self, lib: ctypes.CDLL, stages: int = limits.FAST_STAGES) -> None:
        self.lib, self.stages = lib, stages
        lib.emu_first_error.restype = ctypes.c_char_p

    def shared_bytes(self, split: bool) -> int:
        return limits.fast_gemm_shared_bytes(split) // limits.FAST_STAGES * self.stages

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

    def errors(self) -> tuple[int, str]:
        return int(self.lib.emu_error_count()), self.lib.emu_first_error().decode()

    def gate_up(self, split: bool, hi, lo, blobs, ptrs, layout, disp: dict, k: int, act) -> None:
        H, I = layout.hidden_size, layout.intermediate_size
        self._sources(hi, lo, blobs)
        grid = (-(-I // (limits.FAST_BN // 2)), disp["tile_expert"].size)
        self.lib.emu_gate_up(
            int(split), *grid, ctypes.c_size_t(self.shared_bytes(split)), _ptr(hi), _ptr(lo), _ptr(ptrs),
            ctypes.c_longlong(layout.array("gate_up").offset), ctypes.c_longlong(layout.array("gate_up_scale").offset),
            _ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["tile_expert"]), _ptr(disp["tile_start"]),
            _ptr(act), H, I, k)

    def down(self, split: bool, hi, lo, blobs, ptrs, layout, disp: dict, weights, y) -> None:
        H, I = layout.hidden_size, layout.intermediate_size
        self._sources(hi, lo, blobs)
        grid = (-(-H // limits.FAST_BN), disp["tile_expert"].size)
        self.lib.emu_down(
            int(split), *grid, ctypes.c_size_t(self.shared_bytes(split)), _ptr(hi), _ptr(lo), _ptr(ptrs),
            ctypes.c_longlong(layout.array("down").offset), ctypes.c_longlong(layout.array("down_scale").offset),
            _ptr(disp["perm"]), _ptr(disp["offsets"]), _ptr(disp["tile_expert"]), _ptr(disp["tile_start"]),
            _ptr(weights), _ptr(y), H, I)
