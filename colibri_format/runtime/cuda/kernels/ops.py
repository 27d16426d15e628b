"""Checked Python wrappers around the CUDA kernels in this folder (CuPy RawModules).

CuPy validates nothing it passes to a raw kernel, so every wrapper here checks dtype, C-contiguity, shape and
device of each array, casts each scalar explicitly (np.int32 / np.int64 / np.float32), and computes its launch
shape in one place. Modules are compiled once per device from the `.cu` sources (with `common.cuh` inlined, so
CuPy's on-disk cache sees every source change), with their tile and thread constants passed as `-DNAME=value`
from `runtime/cuda/limits.py` (the one place they are declared), and memoized. CuPy is imported only inside
functions: the package imports without it.

bf16 arrays travel as uint16 arrays of raw bits (or as a `bfloat16` dtype where CuPy has one); float16 and
float32 are themselves. Every output can be passed in through `out=` (preallocated, e.g. for CUDA-graph capture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from colibri_format.runtime.cuda import limits
from colibri_format.runtime.cuda.kernels import cublas_direct
from colibri_format.runtime.cuda.limits import (
    A8_FORMATS, A8_GROUP, A8_QUANT_THREADS, A8_THREADS, EXPAND_THREADS, GEMV4_THREADS, GEMV4_TOKC, TC4_THREADS)
from colibri_format.runtime.cuda.limits import (  # also what callers read as ops.GEMM_BM, ops.GEMV_WIDE, ...
    ATTENTION_HEAD_DIMS, ATT_DECODE_MAX_ROWS, ATT_DECODE_MIN_KEYS, ATT_GMAX, ATT_THREADS, BLOB_ARRAY_ALIGNMENT,
    CUBLAS_INT8_MIN_EXPERT_MACS, CUBLAS_MIN_EXPERT_MACS, DG_PLANS, DG_ROWS, DG_TC_ROWS, DG_TC_TILES, DG_THREADS,
    DIM_MULTIPLE, DISPATCH_MAX_E,
    DISPATCH_THREADS, FAST_BN, FAST_THREADS, FUSED_THREADS, GEMM_BM, GEMM_BN, GEMM_THREADS, GEMV_THREADS, GEMV_TOKC, GEMV_WIDE,
    GLUE_THREADS, GROUP_MULTIPLE, QKV_THREADS, QK_NORM_MODES, ROUTER_EPB, ROUTER_GEMM_MIN_ROWS, ROUTER_MAX_E,
    ROUTER_MAX_K, ROUTER_THREADS, ROUTER_TPB, ROUTER_WIDTHS, TC_THREADS, W8A8_MIN_EXPERT_MACS, fast_gemm_shared_bytes,
    scale_groups)
from colibri_format.spec.constants import INT4_GROUP_SIZES, MXFP4_GROUP_SIZE, ExpertFormat
from colibri_format.spec.layout import blob_layout

SCORING, ORDER = limits.ROUTER_SCORING, limits.ROUTER_ORDER   # router.cu codes

KERNEL_DIR = Path(__file__).resolve().parent
MODULES = tuple(limits.KERNEL_DEFINES)  # router, dispatch, moe_gemv, moe_gemm, layers, fused
NVRTC_OPTIONS = ("-std=c++17",)  # no fast-math: expf/rsqrtf/division stay IEEE-accurate in fp32


def compile_options(name: str) -> tuple[str, ...]:
    """NVRTC options of module `name`: the common ones, then its -D tile and thread constants."""
    return NVRTC_OPTIONS + limits.define_options(name)


_CUPY: list = []    # the cupy module once imported (every wrapper asks for it: an import statement a call cost
                    # ~0.2 us of host time, ~110 calls a layer of a prefill)


def _cupy():
    if not _CUPY:
        import cupy  # noqa: PLC0415 -- optional dependency, only on GPU machines

        _CUPY.append(cupy)
    return _CUPY[0]


# ---- modules ----------------------------------------------------------------------------------------------------
def kernel_source(name: str) -> str:
    """The source of `<name>.cu` with `common.cuh` inlined (what NVRTC compiles)."""
    common = (KERNEL_DIR / "common.cuh").read_text()
    return (KERNEL_DIR / f"{name}.cu").read_text().replace('#include "common.cuh"', common)


_MODULES: dict[tuple[str, int], Any] = {}


def module(name: str):
    """The compiled RawModule `name` for the current device (built on first use, then cached)."""
    cp = _cupy()
    key = (name, cp.cuda.runtime.getDevice())
    if key not in _MODULES:
        if name not in MODULES:
            raise ValueError(f"unknown kernel module {name!r}")
        _MODULES[key] = cp.RawModule(code=kernel_source(name), options=compile_options(name))
    return _MODULES[key]


_FUNCTIONS: dict[tuple[str, str, int], Any] = {}


def kernel(module_name: str, function: str):
    """One kernel of a module, for the current device (looked up once)."""
    key = (module_name, function, _cupy().cuda.runtime.getDevice())     # a plain C call: this runs every launch
    if key not in _FUNCTIONS:
        _FUNCTIONS[key] = module(module_name).get_function(function)
    return _FUNCTIONS[key]


def forget_module(name: str) -> None:
    """Drop module `name`'s compiled code and kernels on every device: its next use compiles it again with the
    -D constants limits.KERNEL_DEFINES holds then (a benchmark's or test's rebuild with other constants)."""
    for cache in (_MODULES, _FUNCTIONS):
        for key in [key for key in cache if key[0] == name]:
            del cache[key]


_SHARED_OPT_IN: dict[int, tuple[Any, int]] = {}     # id(fn) -> (fn, the dynamic shared bytes it was opted in to);
                                                    # holding fn keeps its id from naming another function


def _opted_in(fn, shared_bytes: int):
    """fn, allowed `shared_bytes` of dynamic shared memory (beyond 48 KB a kernel must opt in): the driver is asked
    once per function and size, not at every launch (a cuFuncGetAttribute call each time)."""
    known = _SHARED_OPT_IN.get(id(fn))
    if known is None or known[1] < shared_bytes:
        if fn.max_dynamic_shared_size_bytes < shared_bytes:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        _SHARED_OPT_IN[id(fn)] = (fn, shared_bytes)
    return fn


# used only by eager passes (prefill), compiled at their first call
EAGER_MODULES = ("attention_prefill", "moe_gemm_cublas")


def warm_up() -> None:
    """Compiles and loads every module a graph may capture now (module loading cannot happen inside a capture);
    EAGER_MODULES wait for their first call: an engine that never prefills beyond 32 rows never compiles them."""
    for name in MODULES:
        if name not in EAGER_MODULES:
            module(name)


_SM_COUNT: dict[int, int] = {}


def _sm_count() -> int:
    """The current device's multiprocessors (a Device object is built only on a device's first call: most launches
    size their grid with it)."""
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    count = _SM_COUNT.get(dev)
    if count is None:
        count = _SM_COUNT[dev] = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
    return count


def _grid_stride_blocks(n: int, threads: int = 256) -> int:
    return max(1, min(-(-n // threads), _sm_count() * 16))


# ---- checks -------------------------------------------------------------------------------------------------------
_FLOAT_CODES = {"float32": "f32", "float16": "f16", "uint16": "bf16", "bfloat16": "bf16"}
_CODE_OF_DTYPE: dict = {}      # dtype -> its code, filled on first sight (str(dtype) costs ~4 µs a call)


def dtype_code(a) -> str:
    """'f32', 'f16' or 'bf16' (uint16 raw bits or a bfloat16 dtype)."""
    code = _CODE_OF_DTYPE.get(a.dtype)
    if code is None:
        code = _FLOAT_CODES.get(str(a.dtype))
        if code is None:
            raise TypeError(f"unsupported float dtype {a.dtype} (expected float32, float16, or bf16 as uint16)")
        _CODE_OF_DTYPE[a.dtype] = code
    return code


def _check(name: str, a, dtype=None, shape=None, ndim=None, codes=None):
    """`a` a C-contiguous CuPy array on the current device, of that dtype, shape, rank and dtype code: run on every
    argument of every launch, so its tests are the cheap ones (device ids by plain C calls, no Device objects)."""
    cp = _cupy()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray, got {type(a).__name__}")
    if a.data.device_id != cp.cuda.runtime.getDevice():
        raise ValueError(f"{name} is on device {a.data.device_id}, the current device is "
                         f"{cp.cuda.runtime.getDevice()}")
    if not a._c_contiguous:       # the array's own flag (a.flags builds a Flags object a call)
        raise ValueError(f"{name} must be C-contiguous")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {a.dtype}")
    if codes is not None and dtype_code(a) not in codes:
        raise TypeError(f"{name} dtype {a.dtype} not in {codes}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    return a


def _out(name: str, out, shape, dtype):
    cp = _cupy()
    if out is None:
        return cp.empty(shape, dtype=dtype)
    return _check(name, out, dtype=dtype, shape=shape)


def _ptr(a) -> Any:
    """A nullable pointer argument: the array, or a NULL pointer."""
    return a if a is not None else np.uint64(0)


# ---- router -------------------------------------------------------------------------------------------------------
class RouterWorkspace:
    """Scratch of the router: logits [T, E], per-token-group tickets (zero between launches) and, for the GEMM
    route's product, the router weight widened to float32 (allocated on the first 16-bit weight it widens: an
    engine's first pass of a size runs eagerly, before any capture)."""

    def __init__(self, max_tokens: int, num_experts: int) -> None:
        cp = _cupy()
        self.max_tokens, self.num_experts = max_tokens, num_experts
        self.logits = cp.empty((max_tokens, num_experts), dtype=cp.float32)
        self.tickets = cp.zeros((-(-max_tokens // ROUTER_TPB),), dtype=cp.uint32)
        self.wide = None

    def widened(self, w):
        """w [E, H] as float32: w itself, or its values widened into `wide` (router.cu's router_widen kernels)."""
        if dtype_code(w) == "f32":
            return w
        if self.wide is None or self.wide.shape != w.shape:
            self.wide = _cupy().empty(w.shape, dtype=np.float32)
        n = w.size      # a multiple of 8 (the router's H % 8): whole 16-byte loads
        kernel("router", f"router_widen_{dtype_code(w)}")((_grid_stride_blocks(n // 8),), (256,),
                                                          (w, self.wide, np.int64(n)))
        return self.wide


def router_shared_bytes(num_experts: int, groups: tuple[int, int] | None) -> int:
    """Dynamic shared memory of a router launch: the selecting warps' keys and group scores for a grouped top-k
    that masks groups, none otherwise."""
    if groups is None or groups[1] >= groups[0]:
        return 0
    return ROUTER_TPB * (num_experts + 2 * groups[0]) * 4


class _RouterCall(NamedTuple):
    """A checked router launch: its outputs, grid, kernel suffix, selection arguments and shared memory."""
    ids: Any
    weights: Any
    grid: tuple[int, int]
    suffix: str                 # <weight dtype>_e<width>
    selection: tuple            # (bias, logits, tickets, ids, weights) pointers, then T, H, E, k and the modes
    shared_bytes: int
    workspace: RouterWorkspace
    modes: tuple                # scoring, order, normalize, scale, n_group, topk_group as the kernels take them
    width: int                  # the kernels' expert width (ROUTER_WIDTHS): suffix e<width>


def _router_call(T: int, H: int, w, k: int, bias, scoring: str, order: str, normalize: bool, scale: float,
                 groups, workspace, out_ids, out_weights) -> _RouterCall:
    """The checks and launch arguments that `router` and `add_rmsnorm_route` share (rows of H values, T of them)."""
    cp = _cupy()
    _check("w", w, ndim=2, codes=("f32", "f16", "bf16"))
    E = w.shape[0]
    if w.shape[1] != H:
        raise ValueError(f"router weight is {tuple(w.shape)}, expected [E, {H}]")
    if H % 8:
        raise ValueError(f"hidden size {H} must be a multiple of 8 (16-byte loads)")
    if not (1 <= E <= ROUTER_MAX_E) or not (1 <= k <= min(E, ROUTER_MAX_K)):
        raise ValueError(f"router needs 1 <= E <= {ROUTER_MAX_E} and 1 <= k <= min(E, {ROUTER_MAX_K}), got E={E}, "
                         f"k={k}")
    if scoring not in SCORING or order not in ORDER:
        raise ValueError(f"scoring {scoring!r} / order {order!r} not supported")
    if bias is not None:
        _check("bias", bias, dtype=np.float32, shape=(E,))
    n_group, topk_group = (1, 1) if groups is None else (int(groups[0]), int(groups[1]))
    if not (1 <= topk_group <= n_group <= E) or E % n_group:
        raise ValueError(f"groups (n_group {n_group}, topk_group {topk_group}) must have 1 <= topk_group <= n_group "
                         f"and n_group dividing E={E}")
    if topk_group < n_group and order != "softmax_topk":
        raise ValueError(f"grouped top-k needs order 'softmax_topk', got {order!r}")
    ws = workspace or RouterWorkspace(T, E)
    if ws.num_experts != E or ws.max_tokens < T:
        raise ValueError("router workspace too small for this call")
    ids = _out("out_ids", out_ids, (T, k), cp.int32)
    weights = _out("out_weights", out_weights, (T, k), cp.float32)
    width = next(c for c in ROUTER_WIDTHS if c >= E)
    modes = (np.int32(SCORING[scoring]), np.int32(ORDER[order]), np.int32(bool(normalize)), np.float32(scale),
             np.int32(n_group), np.int32(topk_group))
    selection = (_ptr(bias), ws.logits, ws.tickets, ids, weights, np.int32(T), np.int32(H), np.int32(E), np.int32(k),
                 *modes)
    return _RouterCall(ids, weights, (-(-T // ROUTER_TPB), -(-E // ROUTER_EPB)), f"{dtype_code(w)}_e{width}",
                       selection, router_shared_bytes(E, (n_group, topk_group)), ws, modes, width)


def router_by_gemm(num_tokens: int, num_experts: int, min_rows: int = ROUTER_GEMM_MIN_ROWS) -> bool:
    """Whether `router` takes the GEMM route: passes of min_rows rows or more whose experts span several blocks of
    ROUTER_EPB (where the fused kernel re-reads each row of x once per block; a router of at most ROUTER_EPB experts,
    Mixtral's, reads it once and would only gain two launches, which an eager pass pays in host time)."""
    return num_tokens >= min_rows and num_experts > ROUTER_EPB


def router(x, w, k: int, *, bias=None, scoring: str = "softmax", order: str = "softmax_topk",
           normalize: bool = False, scale: float = 1.0, groups: tuple[int, int] | None = None,
           workspace: RouterWorkspace | None = None, out_ids=None, out_weights=None, by_gemm: bool | None = None):
    """Router: x [T, H] f32, w [E, H] f32/f16/bf16 -> (ids [T, k] int32, weights [T, k] f32); the logits x @ w.T
    are left in the workspace.

    bias [E] f32: with order softmax_topk it is added to the selection keys only; with topk_softmax it is part of
    the logits (top-k and softmax of logits + bias). groups (n_group, topk_group), softmax_topk only: grouped
    top-k on the selection keys (`numpy_backend.group_mask`); None or topk_group >= n_group: a plain top-k.
    Where `router_by_gemm` says so (by_gemm None) the logits come from cuBLAS's fp32 product and the selection is
    launched alone (capturable); otherwise the fused kernel runs (one launch); by_gemm True / False forces either.
    """
    _check("x", x, dtype=np.float32, ndim=2)
    T = x.shape[0]
    call = _router_call(T, x.shape[1], w, k, bias, scoring, order, normalize, scale, groups, workspace, out_ids,
                        out_weights)
    if not T:
        return call.ids, call.weights
    if router_by_gemm(T, w.shape[0]) if by_gemm is None else by_gemm:
        logits = call.workspace.logits[:T]
        gemm_f32(x, call.workspace.widened(w), logits)
        kernel("router", f"moe_router_select_e{call.width}")(
            (call.grid[0],), (ROUTER_THREADS,), (logits, _ptr(bias), call.ids, call.weights, np.int32(T),
                                                 np.int32(w.shape[0]), np.int32(k), *call.modes),
            shared_mem=call.shared_bytes)
    else:
        kernel("router", f"moe_router_{call.suffix}")(call.grid, (ROUTER_THREADS,), (x, w, *call.selection),
                                                      shared_mem=call.shared_bytes)
    return call.ids, call.weights


def _aligned16(a) -> bool:
    return a.data.ptr % 16 == 0


def add_rmsnorm_route(h, b, norm_w, eps: float, w, k: int, *, alpha: float = 1.0, out=None, bias=None,
                      scoring: str = "softmax", order: str = "softmax_topk", normalize: bool = False,
                      scale: float = 1.0, groups: tuple[int, int] | None = None,
                      workspace: RouterWorkspace | None = None, out_ids=None, out_weights=None):
    """`add_rmsnorm` then `router` on its output, in one launch (router.cu's add_rmsnorm_route kernels): h [T, H]
    f32 += alpha * b (in place), out [T, H] f32 = rmsnorm(h) * norm_w, then (ids, weights) of the router w on out;
    returns (out, ids, weights). norm_w [H] has w's dtype (f32/f16/bf16: a file's dense_dtype); every array starts
    on a 16-byte boundary. h and out equal add_rmsnorm's bit for bit for H <= 4 NORM_VECS FUSED_THREADS; the
    router's options and workspace are `router`'s."""
    cp = _cupy()
    _check("h", h, dtype=np.float32, ndim=2)
    T, H = h.shape
    _check("b", b, dtype=np.float32, shape=h.shape)
    _check("norm_w", norm_w, shape=(H,), codes=("f32", "f16", "bf16"))
    x = _out("out", out, h.shape, cp.float32)
    if x is h or x is b:
        raise ValueError("out must be a buffer of its own (not h or b)")
    call = _router_call(T, H, w, k, bias, scoring, order, normalize, scale, groups, workspace, out_ids, out_weights)
    if dtype_code(norm_w) != dtype_code(w):
        raise TypeError(f"norm_w ({norm_w.dtype}) must have the router weight's dtype ({w.dtype})")
    if not all(_aligned16(a) for a in (h, b, x, norm_w, w)):
        raise ValueError("h, b, out, norm_w and w must start on 16-byte boundaries")
    if T:
        kernel("router", f"add_rmsnorm_route_{call.suffix}")(
            call.grid, (ROUTER_THREADS,), (h, b, norm_w, x, w, *call.selection, np.float32(alpha), np.float32(eps)),
            shared_mem=call.shared_bytes)
    return x, call.ids, call.weights


# ---- dispatch -----------------------------------------------------------------------------------------------------
class Dispatch(NamedTuple):
    counts: Any       # [E] int32
    offsets: Any      # [E+1] int32
    perm: Any         # [P] sorted position -> pair
    inv: Any          # [P] pair -> sorted position
    active: Any       # [E] active experts ascending, -1 after
    meta: Any         # [4] {num_active, num_tiles, invalid ids, 0}
    tile_expert: Any  # [max_tiles]
    tile_start: Any   # [max_tiles]
    num_pairs: int
    num_experts: int
    tile_m: int
    spread: Any = None  # a pass ranked over several blocks (limits.dispatch_blocks): DispatchSpread, else None


class DispatchSpread(NamedTuple):
    """The scratch of a dispatch over several blocks (dispatch.cu's moe_dispatch_ranks / _groups / _scatter)."""
    blocks: int
    chunk: int          # pairs a block ranks
    block_counts: Any   # [blocks * E] int32: each block's pairs of each expert
    block_bad: Any      # [blocks] int32: each block's ids out of range
    block_base: Any     # [blocks * E] int32: an expert's pairs in the blocks before


def max_tiles(num_pairs: int, num_experts: int, tile_m: int = GEMM_BM) -> int:
    return num_pairs // tile_m + min(num_experts, num_pairs) + 1


def dispatch_buffers(num_pairs: int, num_experts: int, tile_m: int = GEMM_BM) -> Dispatch:
    """Empty buffers for `dispatch(..., out=)` (made once, e.g. before a graph capture)."""
    cp = _cupy()
    P, E, nt = num_pairs, num_experts, max_tiles(num_pairs, num_experts, tile_m)
    grid = limits.dispatch_blocks(P, _sm_count())
    spread = None if grid is None else DispatchSpread(*grid, cp.empty(grid[0] * E, cp.int32),
                                                      cp.empty(grid[0], cp.int32), cp.empty(grid[0] * E, cp.int32))
    return Dispatch(cp.empty(E, cp.int32), cp.empty(E + 1, cp.int32), cp.empty(P, cp.int32), cp.empty(P, cp.int32),
                    cp.empty(E, cp.int32), cp.empty(4, cp.int32), cp.empty(nt, cp.int32), cp.empty(nt, cp.int32),
                    P, E, tile_m, spread)


def _dispatch_spread(ids, P: int, E: int, tile_m: int, nt: int, out: Dispatch) -> None:
    """The dispatch in three launches over out.spread's blocks (dispatch.cu): the same outputs as moe_dispatch."""
    sp = out.spread
    kernel("dispatch", "moe_dispatch_ranks")((sp.blocks,), (DISPATCH_THREADS,),
                                            (ids, np.int32(P), np.int32(E), np.int32(sp.chunk), out.inv,
                                             sp.block_counts, sp.block_bad))
    kernel("dispatch", "moe_dispatch_groups")((1,), (DISPATCH_THREADS,),
                                             (sp.block_counts, sp.block_bad, np.int32(sp.blocks), np.int32(E),
                                              np.int32(tile_m), np.int32(nt), sp.block_base, out.counts, out.offsets,
                                              out.active, out.meta, out.tile_expert, out.tile_start))
    kernel("dispatch", "moe_dispatch_scatter")((_grid_stride_blocks(P, DISPATCH_THREADS),), (DISPATCH_THREADS,),
                                              (ids, np.int32(P), np.int32(E), np.int32(sp.chunk), sp.block_base,
                                               out.offsets, out.inv, out.perm))


def dispatch(ids, num_experts: int, *, tile_m: int = GEMM_BM, out: Dispatch | None = None,
             quantize: tuple | None = None) -> Dispatch:
    """Groups the pairs of ids [T, k] (or [P]) int32 by expert on the device (see dispatch.cu).

    quantize: (x [T, H] f32, xq int8 [T, H], xs f32 [T, H // A8_GROUP]): the same launch also writes x rounded to
    int8 as `quantize_activations_a8` does (moe_dispatch_a8: one launch fewer a decode step on int8 activations)."""
    cp = _cupy()
    _check("ids", ids, dtype=np.int32)
    P, E = int(ids.size), int(num_experts)
    if not (1 <= E <= DISPATCH_MAX_E):
        raise ValueError(f"dispatch supports 1..{DISPATCH_MAX_E} experts, got {E}")
    if tile_m < 1:
        raise ValueError("tile_m must be positive")
    nt = max_tiles(P, E, tile_m)
    if out is None:
        out = dispatch_buffers(P, E, tile_m)
    elif out.num_pairs != P or out.num_experts != E or out.tile_m != tile_m:
        raise ValueError("dispatch buffers were made for another shape")
    if quantize is None and out.spread is not None:
        _dispatch_spread(ids, P, E, tile_m, nt, out)
        return out
    args = (ids, np.int32(P), np.int32(E), np.int32(tile_m), np.int32(nt), out.counts, out.offsets, out.perm,
            out.inv, out.active, out.meta, out.tile_expert, out.tile_start)
    if quantize is None:
        kernel("dispatch", "moe_dispatch")((1,), (DISPATCH_THREADS,), args)
        return out
    x, xq, xs = quantize
    rows, ncols = _check_a8_input(x)
    _check_a8_pair(xq, xs, rows, ncols)
    groups = rows * ncols // A8_GROUP
    kernel("dispatch", "moe_dispatch_a8")(
        (1 + _grid_stride_blocks(max(groups, 1) * 32, DISPATCH_THREADS),), (DISPATCH_THREADS,),
        (*args, x, xq, xs, np.int64(groups)))
    return out


COUNT_THREADS = 256


def count_routes(ids, totals):
    """totals[e] += the pairs of ids [T, k] (int32) routed to expert e; totals uint32 [E], wrapping modulo 2^32."""
    _check("ids", ids, dtype=np.int32)
    _check("totals", totals, dtype=np.uint32, ndim=1)
    P, E = int(ids.size), int(totals.size)
    if P:
        kernel("dispatch", "count_routes")((-(-P // COUNT_THREADS),), (COUNT_THREADS,),
                                           (ids, np.int32(P), np.int32(E), totals))
    return totals


# ---- experts ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertTable:
    """Where one MoE layer's experts are: blob addresses the kernels read (a device slot, or the blob in the
    registered host mapping, read over PCIe) and the array offsets inside a blob."""

    blob_ptrs: Any          # cupy uint64 [E]: device-visible address of each expert's blob
    hidden_size: int
    intermediate_size: int
    off_gate_up: int
    off_gate_up_scale: int
    off_down: int
    off_down_scale: int
    group_size: int = 0     # 0: one scale per row
    route_totals: Any = None    # cupy uint32 [E] counted by the backend's moe (paged experts), or None
    fill_ptrs: Any = None       # cupy uint64 [E]: a slot the GEMV kernels copy expert e into as they read it (0: no)

    @classmethod
    def from_layout(cls, blob_ptrs, layout, route_totals=None, fill_ptrs=None) -> "ExpertTable":
        """From a `colibri_format.spec.BlobLayout` (the only place blob offsets are computed)."""
        return cls(blob_ptrs, layout.hidden_size, layout.intermediate_size, layout.array("gate_up").offset,
                   layout.array("gate_up_scale").offset, layout.array("down").offset,
                   layout.array("down_scale").offset, int(layout.group_size or 0), route_totals, fill_ptrs)

    @property
    def num_experts(self) -> int:
        return int(self.blob_ptrs.size)

    def groups(self) -> tuple[int, int, str]:
        """(group over H, group over I, kernel suffix 'r' per-row | 'g' grouped)."""
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size
        groups = scale_groups(H, I, g)
        if groups is None:
            raise ValueError(f"group size {g} must be a multiple of {GROUP_MULTIPLE} dividing H={H} and I={I}")
        return groups

    def check(self) -> None:
        _check("blob_ptrs", self.blob_ptrs, dtype=np.uint64, ndim=1)
        if self.fill_ptrs is not None:
            _check("fill_ptrs", self.fill_ptrs, dtype=np.uint64, shape=self.blob_ptrs.shape)
        H, I = self.hidden_size, self.intermediate_size
        if H % DIM_MULTIPLE or I % DIM_MULTIPLE:
            raise ValueError(f"H={H} and I={I} must be multiples of {DIM_MULTIPLE} (16-byte int8 loads)")
        if H < 8 or I < 8:
            raise ValueError("H and I must be at least 8")
        for name in ("off_gate_up", "off_gate_up_scale", "off_down", "off_down_scale"):
            if getattr(self, name) % BLOB_ARRAY_ALIGNMENT:
                raise ValueError(f"{name}={getattr(self, name)} is not {BLOB_ARRAY_ALIGNMENT}-byte aligned")
        self.groups()


@dataclass(frozen=True)
class ExpertExtras:
    """gpt-oss's experts beyond silu(gate) * up, run by the `*_extras` kernels (common.cuh ExpertExtras): per-expert
    biases, added before the activation (gate_up) and before the routing weight (down), and the clamped SwiGLU
    (model.expert_act). The defaults compute silu(gate) * up; `numpy_backend.expert_ffn` is the reference."""

    gate_up_bias: Any = None        # cupy f32 [E, 2I] (gate rows, then up rows), or None
    down_bias: Any = None           # cupy f32 [E, H], or None
    alpha: float = 1.0
    limit: float | None = None      # None: no clamp
    up_offset: float = 0.0

    @classmethod
    def from_model(cls, act: dict | None, gate_up_bias=None, down_bias=None) -> "ExpertExtras | None":
        """From the decoder's expert extras (model.expert_act and the bias tensors); None when there are none."""
        if act is None and gate_up_bias is None and down_bias is None:
            return None
        how = {} if act is None else {"alpha": act["alpha"], "limit": act.get("limit"), "up_offset": act["up_offset"]}
        return cls(gate_up_bias, down_bias, **how)

    def gate_up_args(self, table: ExpertTable) -> tuple:
        """The gate/up kernels' trailing arguments: bias (or NULL), alpha, limit (+inf: none), up_offset."""
        if self.gate_up_bias is not None:
            _check("gate_up_bias", self.gate_up_bias, dtype=np.float32,
                   shape=(table.num_experts, 2 * table.intermediate_size))
        limit = np.inf if self.limit is None else self.limit
        return _ptr(self.gate_up_bias), np.float32(self.alpha), np.float32(limit), np.float32(self.up_offset)

    def down_args(self, table: ExpertTable) -> tuple:
        """The down kernels' trailing argument: bias (or NULL)."""
        if self.down_bias is not None:
            _check("down_bias", self.down_bias, dtype=np.float32, shape=(table.num_experts, table.hidden_size))
        return (_ptr(self.down_bias),)


def _with_extras(name: str, extras: ExpertExtras | None) -> str:
    """The kernel that computes `extras` (the plain one without)."""
    return name if extras is None else f"{name}_extras"


def tokens_per_pass(num_tokens: int, k: int, num_experts: int) -> int:
    """GEMV variant: about twice the mean number of tokens per active expert, 1..8."""
    want = min(num_tokens, max(1, math.ceil(2 * num_tokens * k / num_experts)))
    return next(t for t in GEMV_TOKC if t >= min(want, 8))


def resident_blocks(fn, threads: int) -> int:
    """Blocks of `threads` threads of kernel `fn` that fit on one multiprocessor at once (by registers)."""
    try:
        regs = int(fn.attributes["num_regs"])
    except Exception:  # noqa: BLE001 -- attribute missing: a safe guess
        return 2
    warp_regs = -(-regs * 32 // 256) * 256          # registers are allocated per warp, 256 at a time
    warps = min(64, 65536 // warp_regs)
    return max(1, min(32, warps // (threads // 32)))


def _gemv_launch(name: str):
    """(kernel, grid) for a grid-stride GEMV: exactly the blocks the machine holds at once (no late blocks)."""
    fn = kernel("moe_gemv", name)
    return fn, (_sm_count() * resident_blocks(fn, GEMV_THREADS),)


def _check_moe_inputs(x_or_act, table: ExpertTable, disp: Dispatch, cols: int, rows: int):
    _check_table_dispatch(table, disp)
    _check("input", x_or_act, dtype=np.float32, shape=(rows, cols))


def _check_pair_weights(weights, pairs: int) -> None:
    """The routing weights of a down launch: float32, one a pair."""
    _check("weights", weights, dtype=np.float32)
    if weights.size != pairs:
        raise ValueError(f"weights has {weights.size} entries, expected {pairs}")


def _check_table_dispatch(table: ExpertTable, disp: Dispatch) -> None:
    table.check()
    if disp.num_experts != table.num_experts:
        raise ValueError(f"dispatch is for {disp.num_experts} experts, the table has {table.num_experts}")


def wide_variant(ncols: int) -> str | None:
    """Default one-token-per-pass kernel: 'w4' (fastest or within 15% of it at every shape measured on an H200,
    docs/benchmarks.md; 't1' and 'w2' stay selectable through `variant`)."""
    return "w4"


def _gemv_name(stage: str, tokc: int, kind: str, variant: str | None) -> str:
    if tokc not in GEMV_TOKC:
        raise ValueError(f"tokens per pass must be one of {GEMV_TOKC}")
    if variant is not None and variant not in ("t1",) + GEMV_WIDE:
        raise ValueError(f"GEMV variant {variant!r} unknown")
    if variant in GEMV_WIDE:
        if tokc != 1:
            raise ValueError("the wide GEMV variants take one token per pass")
        return f"moe_{stage}_{variant}_{kind}"
    return f"moe_{stage}_t{tokc}_{kind}"


def moe_gate_up(x, table: ExpertTable, disp: Dispatch, k: int, *, tokens_per_pass_: int | None = None,
                variant: str | None = None, extras: ExpertExtras | None = None, out=None):
    """Decode GEMV: act [P, I] f32 in sorted (dispatch) order from x [T, H] f32.

    tokens_per_pass_ (1, 2, 4, 8; default from T, k, E) picks the kernel; with one token per pass, variant 't1'
    (double-buffered loads), 'w2' or 'w4' (wide loads; default for short rows, see `wide_variant`). extras: gpt-oss's
    gate/up bias and clamped SwiGLU (`ExpertExtras`).
    """
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    T = disp.num_pairs // k
    if T * k != disp.num_pairs:
        raise ValueError("dispatch pairs are not T * k")
    _check_moe_inputs(x, table, disp, H, T)
    gh, _, kind = table.groups()
    tokc = tokens_per_pass_ or tokens_per_pass(T, k, table.num_experts)
    name = _gemv_name("gate_up", tokc, kind, variant or (wide_variant(H) if tokc == 1 else None))
    tail = extras.gate_up_args(table) if extras is not None else ()
    act = _out("out", out, (disp.num_pairs, I), cp.float32)
    fn, grid = _gemv_launch(_with_extras(name, extras))
    fn(grid, (GEMV_THREADS,),
        (x, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale),
         disp.perm, disp.offsets, disp.active, disp.meta, act, np.int32(H), np.int32(I), np.int32(k), np.int32(gh))
        + tail)
    return act


def moe_down(act, table: ExpertTable, disp: Dispatch, weights, *, tokens_per_pass_: int | None = None,
             variant: str | None = None, extras: ExpertExtras | None = None, out=None):
    """Decode GEMV: ypair [P, H] f32 (pair order) = routing weight * (down @ act (+ extras' down bias))."""
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    P = disp.num_pairs
    _check_moe_inputs(act, table, disp, I, P)
    _check_pair_weights(weights, P)
    k = weights.shape[-1] if weights.ndim == 2 else 1
    _, gi, kind = table.groups()
    tokc = tokens_per_pass_ or tokens_per_pass(P // k, k, table.num_experts)
    name = _gemv_name("down", tokc, kind, variant or (wide_variant(I) if tokc == 1 else None))
    tail = extras.down_args(table) if extras is not None else ()
    y = _out("out", out, (P, H), cp.float32)
    fn, grid = _gemv_launch(_with_extras(name, extras))
    fn(grid, (GEMV_THREADS,),
        (act, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
         disp.perm, disp.offsets, disp.active, disp.meta, weights, y, np.int32(H), np.int32(I), np.int32(gi)) + tail)
    return y


def pairs_path(num_tokens: int) -> bool:
    """Whether a GEMV pass of `moe_experts` runs by pair, without a dispatch (`moe_gate_up_pairs`): one token, whose
    k pairs name k distinct experts, so grouping them by expert would save no weight read."""
    return num_tokens == 1


def _pair_ids(table: ExpertTable, ids) -> tuple[int, int]:
    """(T, k) of a by-pair launch: the table and the router's ids [T, k] int32 checked."""
    table.check()
    _check("ids", ids, dtype=np.int32, ndim=2)
    return ids.shape


def _check_pairs(table: ExpertTable, ids, rows_input, cols: int, a_row_per_pair: bool) -> tuple[int, int]:
    """(T, k) of a by-pair launch on float inputs [T (a row a token) or T * k (a row a pair), cols], checked."""
    T, k = _pair_ids(table, ids)
    _check("input", rows_input, dtype=np.float32, shape=(T * k if a_row_per_pair else T, cols))
    return T, k


def moe_gate_up_pairs(x, ids, table: ExpertTable, *, extras: ExpertExtras | None = None, out=None):
    """Decode GEMV without a dispatch: act [P, I] f32 in pair order (p = t * k + j) = silu(gate x[t]) * (up x[t]) of
    expert ids[t, j], for x [T, H] f32 and the router's ids [T, k] int32; an id outside [0, E) gives a zero row. Each
    pair reads its expert (the w4 plan, fill on read as `moe_gate_up`): for `pairs_path` passes. extras: gpt-oss's
    gate/up bias and clamped SwiGLU (`ExpertExtras`)."""
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    T, k = _check_pairs(table, ids, x, H, False)
    gh, _, kind = table.groups()
    tail = extras.gate_up_args(table) if extras is not None else ()
    act = _out("out", out, (T * k, I), cp.float32)
    fn, grid = _gemv_launch(_with_extras(f"moe_gate_up_pairs_w4_{kind}", extras))
    fn(grid, (GEMV_THREADS,),
       (x, ids, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale),
        act, np.int32(H), np.int32(I), np.int32(k), np.int32(gh), np.int32(T * k), np.int32(table.num_experts))
       + tail)
    return act


def moe_down_pairs(act, ids, weights, table: ExpertTable, *, extras: ExpertExtras | None = None, out=None):
    """Decode GEMV without a dispatch: ypair [P, H] f32 = weights[p] * (down_{ids[p]} @ act[p] (+ extras' down
    bias)) for act [P, I] f32 in pair order (`moe_gate_up_pairs`); an id outside [0, E) gives a zero row."""
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    T, k = _check_pairs(table, ids, act, I, True)
    _check("weights", weights, dtype=np.float32, shape=(T, k))
    _, gi, kind = table.groups()
    tail = extras.down_args(table) if extras is not None else ()
    y = _out("out", out, (T * k, H), cp.float32)
    fn, grid = _gemv_launch(_with_extras(f"moe_down_pairs_w4_{kind}", extras))
    fn(grid, (GEMV_THREADS,),
       (act, ids, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
        weights, y, np.int32(H), np.int32(I), np.int32(gi), np.int32(T * k), np.int32(table.num_experts)) + tail)
    return y


def _use_tc(kind: str, tensor_cores: bool | None) -> bool:
    if tensor_cores and kind != "r":
        raise ValueError("the tensor-core grouped GEMM supports per-row scales only")
    return kind == "r" if tensor_cores is None else bool(tensor_cores)


def moe_gemm_gate_up(x, table: ExpertTable, disp: Dispatch, k: int, *, tensor_cores: bool | None = None,
                     extras: ExpertExtras | None = None, out=None):
    """Prefill grouped GEMM: act [P, I] f32 in sorted order from x [T, H] f32 (dispatch tile_m must be 64).

    tensor_cores (default: with per-row scales) runs the mma.sync bf16 kernel with split (hi + lo) activations.
    extras: gpt-oss's gate/up bias and clamped SwiGLU (`ExpertExtras`).
    """
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    T = disp.num_pairs // k
    _check_moe_inputs(x, table, disp, H, T)
    if disp.tile_m != GEMM_BM:
        raise ValueError(f"dispatch tile_m must be {GEMM_BM} for the grouped GEMM")
    gh, _, kind = table.groups()
    act = _out("out", out, (disp.num_pairs, I), cp.float32)
    grid = (-(-I // GEMM_BN), int(disp.tile_expert.size))
    args = (x, table.blob_ptrs, np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale), disp.perm,
            disp.offsets, disp.tile_expert, disp.tile_start, act, np.int32(H), np.int32(I), np.int32(k))
    tail = extras.gate_up_args(table) if extras is not None else ()
    if _use_tc(kind, tensor_cores):
        kernel("moe_gemm", _with_extras("moe_gemm_tc_gate_up_r", extras))(grid, (TC_THREADS,), args + tail)
    else:
        kernel("moe_gemm", _with_extras(f"moe_gemm_gate_up_{kind}", extras))(grid, (GEMM_THREADS,),
                                                                             args + (np.int32(gh),) + tail)
    return act


def moe_gemm_down(act, table: ExpertTable, disp: Dispatch, weights, *, tensor_cores: bool | None = None,
                  extras: ExpertExtras | None = None, out=None):
    """Prefill grouped GEMM: ypair [P, H] f32 (pair order) = routing weight * (down @ act (+ extras' down bias))."""
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    P = disp.num_pairs
    _check_moe_inputs(act, table, disp, I, P)
    _check_pair_weights(weights, P)
    if disp.tile_m != GEMM_BM:
        raise ValueError(f"dispatch tile_m must be {GEMM_BM} for the grouped GEMM")
    _, gi, kind = table.groups()
    y = _out("out", out, (P, H), cp.float32)
    grid = (-(-H // GEMM_BN), int(disp.tile_expert.size))
    args = (act, table.blob_ptrs, np.int64(table.off_down), np.int64(table.off_down_scale), disp.perm, disp.offsets,
            disp.tile_expert, disp.tile_start, weights, y, np.int32(H), np.int32(I))
    tail = extras.down_args(table) if extras is not None else ()
    if _use_tc(kind, tensor_cores):
        kernel("moe_gemm", _with_extras("moe_gemm_tc_down_r", extras))(grid, (TC_THREADS,), args + tail)
    else:
        kernel("moe_gemm", _with_extras(f"moe_gemm_down_{kind}", extras))(grid, (GEMM_THREADS,),
                                                                          args + (np.int32(gi),) + tail)
    return y


FAST_ACTIVATIONS = ("split", "bf16", "int8")   # moe_gemm_fast.cu: hi + lo bf16 (two MMAs a weight, ~1e-5), bf16
                                                 # (one), or int8 a row (W8A8: one s8 MMA per 32 weights)


class FastGemmStaging(NamedTuple):
    """The bf16 copies of the pipelined GEMM's inputs (ops.split_bf16 writes them; preallocated for capture)."""
    x_hi: Any      # [T, H] uint16
    x_lo: Any
    act_hi: Any    # [P, I] uint16
    act_lo: Any


def fast_gemm_staging(num_tokens: int, num_pairs: int, hidden: int, inter: int) -> FastGemmStaging:
    """Empty staging for `moe_experts(..., fast_gemm=..., staging=)` of T tokens and P pairs."""
    cp = _cupy()
    return FastGemmStaging(*(cp.empty(shape, cp.uint16) for shape in ((num_tokens, hidden),) * 2
                             + ((num_pairs, inter),) * 2))


def _check_fast(activations: str, table: ExpertTable, disp: Dispatch) -> None:
    """What the pipelined kernel cannot run, refused before any work."""
    if activations not in FAST_ACTIVATIONS:
        raise ValueError(f"activations must be one of {FAST_ACTIVATIONS}, got {activations!r}")
    if table.groups()[2] != "r":
        raise ValueError("the pipelined grouped GEMM supports per-row scales only")
    if disp.tile_m != GEMM_BM:
        raise ValueError(f"dispatch tile_m must be {GEMM_BM} for the grouped GEMM")


def _fast_launch(stage: str, activations: str, disp: Dispatch, grid_x: int, ncols: int, args: tuple) -> None:
    """Launches a moe_gemm_fast.cu kernel over grid_x output blocks of the dispatch's tiles, with its dynamic shared
    memory (opted in beyond 48 KB): a block an item, or (limits.fast_gemm_persistent) as many blocks as the GPU
    runs at once, each taking several."""
    smem = fast_gemm_shared_bytes(activations)
    fn = _opted_in(kernel("moe_gemm_fast", f"moe_gemm_fast_{stage}_{activations}"), smem)
    tiles = int(disp.tile_expert.size)
    grid = (grid_x, tiles)
    if limits.fast_gemm_persistent(ncols):
        per_sm = min(resident_blocks(fn, FAST_THREADS), limits.fast_gemm_blocks_per_sm(activations))
        grid = (max(1, min(grid_x * tiles, _sm_count() * per_sm)), 1)
    fn(grid, (FAST_THREADS,), args + (np.int32(tiles),), shared_mem=smem)


def moe_gemm_gate_up_fast(x, table: ExpertTable, disp: Dispatch, k: int, *, activations: str = "split",
                          hi=None, lo=None, out=None):
    """`moe_gemm_gate_up` (act [P, I] f32, sorted order, from x [T, H] f32) on the pipelined tensor-core kernel
    (moe_gemm_fast.cu), per-row scales only. activations: 'split' (x as bf16 hi + lo, about 1e-5 relative, like the
    tensor-core kernel), 'bf16' (x rounded to bf16 once, about 1e-3) or 'int8' (W8A8: x rounded to int8 a token,
    `quantize_rows_int8`, exact int32 sums: what the W8A8 cuBLAS route computes). hi, lo: [T, H] uint16 staging
    (optional; not used by 'int8')."""
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    T = disp.num_pairs // k
    if T * k != disp.num_pairs:
        raise ValueError("dispatch pairs are not T * k")
    _check_moe_inputs(x, table, disp, H, T)
    _check_fast(activations, table, disp)
    act = _out("out", out, (disp.num_pairs, I), cp.float32)
    x_hi, x_lo = quantize_rows_int8(x) if activations == "int8" else split_bf16(x, hi=hi, lo=lo)
    _fast_launch("gate_up", activations, disp, -(-I // (FAST_BN // 2)), H,
                 (x_hi, x_lo, table.blob_ptrs, np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale),
                  disp.perm, disp.offsets, disp.tile_expert, disp.tile_start, act, np.int32(H), np.int32(I),
                  np.int32(k)))
    return act


def moe_gemm_down_fast(act, table: ExpertTable, disp: Dispatch, weights, *, activations: str = "split", hi=None,
                       lo=None, out=None):
    """`moe_gemm_down` (ypair [P, H] f32, pair order = routing weight * down @ act) on the pipelined tensor-core
    kernel; activations, hi and lo ([P, I] uint16) as in `moe_gemm_gate_up_fast` ('int8': act rounded a pair)."""
    cp = _cupy()
    H, I = table.hidden_size, table.intermediate_size
    P = disp.num_pairs
    _check_moe_inputs(act, table, disp, I, P)
    _check_pair_weights(weights, P)
    _check_fast(activations, table, disp)
    y = _out("out", out, (P, H), cp.float32)
    a_hi, a_lo = quantize_rows_int8(act) if activations == "int8" else split_bf16(act, hi=hi, lo=lo)
    _fast_launch("down", activations, disp, -(-H // FAST_BN), I,
                 (a_hi, a_lo, table.blob_ptrs, np.int64(table.off_down), np.int64(table.off_down_scale), disp.perm,
                  disp.offsets, disp.tile_expert, disp.tile_start, weights, y, np.int32(H), np.int32(I)))
    return y


# ---- the grouped expert GEMM on cuBLAS (moe_gemm_cublas.cu around cublasGemmEx) ---------------------------------
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8I, CUDA_R_32I = 0, 14, 3, 10        # cudaDataType
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32I = 68, 72     # cublasComputeType_t: fp32 / int32 accumulation
CUBLAS_ACTIVATIONS = FAST_ACTIVATIONS   # int8: W8A8, each product's input rows rounded to int8 (a scale a row) and
                                        # multiplied on cuBLAS's int8 tensor cores
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
# alpha and beta, read by cuBLAS from host memory during the call (host pointer mode, a new handle's default):
# made once, never written
_ONE_F32, _ZERO_F32 = np.array(1.0, np.float32), np.array(0.0, np.float32)
_ONE_I32, _ZERO_I32 = np.array(1, np.int32), np.array(0, np.int32)
# their addresses, read once (ndarray.ctypes builds an object a call: ~2 us of host time a product)
_ONE_F32_AT, _ZERO_F32_AT, _ONE_I32_AT, _ZERO_I32_AT = (a.ctypes.data for a in (_ONE_F32, _ZERO_F32, _ONE_I32,
                                                                                   _ZERO_I32))


def _gemm_ex(a, w, out, a_type: int, out_type: int, compute: int, alpha: int, beta: int) -> None:
    """cublasGemmEx out [T, N] = alpha a [T, K] @ w [N, K].T + beta out (row-major), on the current stream, through
    `cublas_direct` (capturable); alpha and beta: host addresses of the scalars (host pointer mode)."""
    cp = _cupy()
    (T, K), N = a.shape, w.shape[0]
    # column-major view: out^T [N, T] = w [N, K] (row-major = col-major K x N, transposed) @ a^T [K, T]
    cublas_direct.handle(cp).gemm_ex(cp.cuda.get_current_stream().ptr, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, alpha,
                                     w.data.ptr, a_type, K, a.data.ptr, a_type, K, beta, out.data.ptr, out_type, N,
                                     compute, CUBLAS_GEMM_DEFAULT)


def _check_product(a, w, out, in_dtype, out_dtype) -> int:
    """T of a [T, K] @ w [N, K].T -> out [T, N], checked."""
    _check("a", a, dtype=in_dtype, ndim=2)
    _check("w", w, dtype=in_dtype, ndim=2)
    _check("out", out, dtype=out_dtype, shape=(a.shape[0], w.shape[0]))
    if w.shape[1] != a.shape[1]:
        raise ValueError(f"w {tuple(w.shape)} does not match a {tuple(a.shape)}")
    return a.shape[0]


def gemm_bf16(a, w, out, *, accumulate: bool = False):
    """out [T, N] f32 (+)= a [T, K] @ w.T for a and w [N, K] bf16 bits (uint16), on cuBLAS's tensor cores with fp32
    accumulation, on the current stream; row views of a and out (a[s:s+n]) are fine. Capturable (`_gemm_ex`)."""
    if _check_product(a, w, out, np.uint16, np.float32):
        beta = _ONE_F32_AT if accumulate else _ZERO_F32_AT
        _gemm_ex(a, w, out, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, _ONE_F32_AT, beta)
    return out


def gemm_f32(a, w, out):
    """out [T, N] f32 = a [T, K] @ w.T for a and w [N, K] float32, on cuBLAS with fp32 math, on the current stream
    (capturable, unlike CuPy's matmul); row views of a and out are fine."""
    if _check_product(a, w, out, np.float32, np.float32):
        _gemm_ex(a, w, out, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, _ONE_F32_AT, _ZERO_F32_AT)
    return out


def gemm_int8(a, w, out):
    """out [T, N] int32 = a [T, K] @ w.T for a and w [N, K] int8 (exact int32 sums), on cuBLAS's int8 tensor cores,
    on the current stream (K a multiple of 16, as DIM_MULTIPLE makes every expert width). Capturable (`_gemm_ex`)."""
    if a.ndim == 2 and a.shape[1] % 16:
        raise ValueError(f"K = {a.shape[1]} must be a multiple of 16 for the int8 product")
    if _check_product(a, w, out, np.int8, np.int32):
        _gemm_ex(a, w, out, CUDA_R_8I, CUDA_R_32I, CUBLAS_COMPUTE_32I, _ONE_I32_AT, _ZERO_I32_AT)
    return out


def _glue_launch(name: str, items: int, args: tuple) -> None:
    if items:
        kernel("moe_gemm_cublas", name)((_grid_stride_blocks(items, GLUE_THREADS),), (GLUE_THREADS,), args)


def gather_bf16(x, perm, k: int, *, offsets=None, out=None):
    """The pairs' rows of x [T, H] f32 in bf16 bits (uint16), in the dispatch's sorted order perm [P] int32: row pos =
    bf16(x[perm[pos] // k]), [P, H]; or, given the dispatch's offsets [E + 1] ("split" activations), [2P, H] with
    each expert's rows stacked as their hi then their lo = bf16(x - hi) (expert e's 2 n_e rows from 2 offsets[e])."""
    cp = _cupy()
    _check("x", x, dtype=np.float32, ndim=2)
    _check("perm", perm, dtype=np.int32, ndim=1)
    (T, H), P = x.shape, perm.size
    if H % 4 or P > T * k:
        raise ValueError(f"x {tuple(x.shape)} with perm [{P}] and k={k}: H must be a multiple of 4, P <= T * k")
    split = offsets is not None
    if split:
        _check("offsets", offsets, dtype=np.int32, ndim=1)
    rows = _out("out", out, ((2 if split else 1) * P, H), cp.uint16)
    _glue_launch("gather_bf16", P * H // 4, (x, perm, _ptr(offsets), np.int32(offsets.size - 1 if split else 0),
                                             rows, np.int32(P), np.int32(H), np.int32(k), np.int32(split)))
    return rows


def expert_matrix(table: ExpertTable, matrix: str, what: str) -> tuple[tuple[int, int], int]:
    """(shape, offset in the blob) of an int8 expert matrix, 'gate_up' [2I, H] or 'down' [H, I], of a per-row-scale
    table; `what` names the caller in the refusal of any other table or matrix."""
    if table.groups()[2] != "r" or type(table) is not ExpertTable:
        raise ValueError(f"{what} reads int8 experts with per-row scales only")
    H, I = table.hidden_size, table.intermediate_size
    if matrix == "gate_up":
        return (2 * I, H), table.off_gate_up
    if matrix == "down":
        return (H, I), table.off_down
    raise ValueError(f"matrix must be 'gate_up' or 'down', got {matrix!r}")


def widen_expert_bf16(table: ExpertTable, expert: int, matrix: str, *, out=None):
    """Expert `expert`'s int8 `matrix` ('gate_up' [2I, H] or 'down' [H, I]) as bf16 bits (exact; scales not
    applied), read through table.blob_ptrs on the device. Per-row-scale (int8) tables only."""
    cp = _cupy()
    table.check()
    shape, off = expert_matrix(table, matrix, "widen_expert_bf16")
    if not 0 <= expert < table.num_experts:
        raise ValueError(f"expert {expert} not in 0..{table.num_experts - 1}")
    if off % 16:
        raise ValueError(f"{matrix} offset {off} is not 16-byte aligned")
    w = _out("out", out, shape, cp.uint16)
    _glue_launch("widen_int8_bf16", w.size // 16, (table.blob_ptrs, np.int32(expert), np.int64(off),
                                                   np.int64(w.size), w))
    return w


def _stacked_rows(name: str, a, width: int, split: bool) -> int:
    """n of a product [n, width] f32, or [2n, width] (hi rows then lo rows) when split."""
    _check(name, a, dtype=np.float32, ndim=2)
    if a.shape[1] != width or (split and a.shape[0] % 2):
        raise ValueError(f"{name} {tuple(a.shape)} must be [{'2n' if split else 'n'}, {width}]")
    return a.shape[0] // (2 if split else 1)


def gate_up_epilogue(gu, table: ExpertTable, expert: int, *, split: bool = True, out=None):
    """act [n, I] in bf16 bits, act[r, i] = silu(g s[i]) (u s[I + i]) for g, u the unscaled products of expert
    `expert`'s gate and up rows in gu [n, 2I] f32 (split: [2n, 2I], rows r and n + r added) and s its row scales;
    split: [2n, I], act's hi rows then its lo rows (what the down product takes stacked)."""
    cp = _cupy()
    I = table.intermediate_size
    n = _stacked_rows("gu", gu, 2 * I, split)
    act = _out("out", out, gu.shape[:1] + (I,), cp.uint16)
    _glue_launch("gate_up_epilogue", n * I // 4, (gu, table.blob_ptrs, np.int32(expert),
                                                  np.int64(table.off_gate_up_scale), act, np.int32(n), np.int32(I),
                                                  np.int32(split)))
    return act


def down_epilogue(yd, table: ExpertTable, expert: int, perm, start: int, weights, ypair, *, split: bool = True):
    """ypair[perm[start + r]] = (weights[perm[start + r]] * y_r) * s for y_r row r of yd [n, H] f32, the unscaled
    down products of expert `expert`'s rows start..start+n of the sorted order (split: yd [2n, H], rows r and n + r
    added), s its row scales; ypair [P, H] f32."""
    H = table.hidden_size
    n = _stacked_rows("yd", yd, H, split)
    _check("perm", perm, dtype=np.int32, ndim=1)
    _check("weights", weights, dtype=np.float32)
    _check("ypair", ypair, dtype=np.float32, shape=(perm.size, H))
    if not 0 <= start <= perm.size - n or weights.size != perm.size:
        raise ValueError(f"yd {tuple(yd.shape)} rows from {start}: not within {perm.size} pairs of width {H}")
    _glue_launch("down_epilogue", n * H // 4, (yd, table.blob_ptrs, np.int32(expert), np.int64(table.off_down_scale),
                                               perm, np.int32(start), weights, ypair, np.int32(n), np.int32(H),
                                               np.int32(split)))
    return ypair


def quantize_rows_int8(x, *, q=None, scales=None):
    """(q [rows, cols] int8, s [rows] f32) of x [rows, cols] f32: q = rint(x / s), s = max|row| / 127 (a row of zeros:
    0, 0); twin: numpy_backend.quantize_int8_groups(x, cols)."""
    cp = _cupy()
    _check("x", x, dtype=np.float32, ndim=2)
    rows, cols = x.shape
    qo = _out("q", q, (rows, cols), cp.int8)
    so = _out("scales", scales, (rows,), cp.float32)
    if rows:
        kernel("moe_gemm_cublas", "quantize_rows_int8")((limits.quantize_rows_blocks(rows, cols, _sm_count()),),
                                                        (GLUE_THREADS,),
                                                        (x, qo, so, np.int32(rows), np.int32(cols)))
    return qo, so


def gather_rows_int8(q, scales, perm, k: int, *, out=None, out_scales=None):
    """(out [P, H] int8, out_scales [P] f32): row pos = q[perm[pos] // k] of q [T, H] int8 and its scale."""
    cp = _cupy()
    _check("q", q, dtype=np.int8, ndim=2)
    (T, H), P = q.shape, perm.size
    _check("scales", scales, dtype=np.float32, shape=(T,))
    _check("perm", perm, dtype=np.int32, ndim=1)
    if H % 16 or P > T * k:
        raise ValueError(f"q {tuple(q.shape)} with perm [{P}] and k={k}: H must be a multiple of 16, P <= T * k")
    o = _out("out", out, (P, H), cp.int8)
    os_ = _out("out_scales", out_scales, (P,), cp.float32)
    _glue_launch("gather_rows_int8", P * H // 16, (q, scales, perm, o, os_, np.int32(P), np.int32(H), np.int32(k)))
    return o, os_


def gemm_int8_experts(a, out, table: ExpertTable, blob_addresses, matrix: str, routed) -> None:
    """out[s:s+n] = a[s:s+n] @ W_e.T (exact int32 sums) for every routed (e, s, n), W_e expert e's int8 `matrix`
    ('gate_up' [2I, H] or 'down' [H, I]) read in place from its blob (blob_addresses: the host copy of
    table.blob_ptrs), on the current stream: a [P, K] int8 rows in the dispatch's sorted order, out [P, N] int32.
    One cuBLAS GemmEx an expert (`cublas_direct`: the handle's stream set once for all) and the arguments checked
    once: a GemmEx costs ~20 µs of host time by itself, and gemm_int8's checks and blob views as much again
    (docs/benchmarks.md, session 14)."""
    cp = _cupy()
    (N, K), off = expert_matrix(table, matrix, "gemm_int8_experts")
    _check("a", a, dtype=np.int8, ndim=2)
    _check("out", out, dtype=np.int32, shape=(a.shape[0], N))
    if a.shape[1] != K or K % 16:
        raise ValueError(f"a {tuple(a.shape)} must have K = {K} columns, a multiple of 16, for expert '{matrix}'")
    if len(blob_addresses) != table.num_experts:
        raise ValueError(f"{len(blob_addresses)} blob addresses for {table.num_experts} experts")
    if any(not 0 <= e < table.num_experts or s < 0 or n < 1 or s + n > a.shape[0] for e, s, n in routed):
        raise ValueError(f"routed rows {routed} do not fit {table.num_experts} experts and {a.shape[0]} rows")
    blas, stream = cublas_direct.handle(cp), cp.cuda.get_current_stream().ptr
    for e, s, n in routed:  # column-major view, as _gemm_ex: out^T [N, n] = W_e [N, K] (transposed) @ a^T
        blas.gemm_ex(stream, CUBLAS_OP_T, CUBLAS_OP_N, N, n, K, _ONE_I32_AT, int(blob_addresses[e]) + off, CUDA_R_8I,
                     K, a.data.ptr + s * K, CUDA_R_8I, K, _ZERO_I32_AT, out.data.ptr + s * N * 4, CUDA_R_32I, N,
                     CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT)


def _check_sorted_rows(name: str, a, dtype, shape, row_scales, offsets) -> None:
    _check(name, a, dtype=dtype, shape=shape)
    _check("row_scales", row_scales, dtype=np.float32, shape=shape[:1])
    _check("offsets", offsets, dtype=np.int32, ndim=1)


def gate_up_epilogue_int8(gu, row_scales, table: ExpertTable, offsets, *, out=None):
    """act [P, I] f32, act[pos, i] = silu((g rs) s[i]) ((u rs) s[I + i]) for g, u the int32 sums of sorted row pos in
    gu [P, 2I], rs = row_scales[pos] (the row's int8 scale) and s the row scales of its expert, found from the
    dispatch's offsets [E + 1]."""
    cp = _cupy()
    P, I = gu.shape[0], table.intermediate_size
    _check_sorted_rows("gu", gu, np.int32, (P, 2 * I), row_scales, offsets)
    act = _out("out", out, (P, I), cp.float32)
    _glue_launch("gate_up_epilogue_int8", P * I // 4, (gu, row_scales, offsets, np.int32(offsets.size - 1),
                                                       table.blob_ptrs, np.int64(table.off_gate_up_scale), act,
                                                       np.int32(P), np.int32(I)))
    return act


def down_epilogue_int8(yd, row_scales, table: ExpertTable, offsets, perm, weights, ypair):
    """ypair[perm[pos]] = (weights[perm[pos]] * (y rs)) * s for y row pos of yd [P, H] int32 (sorted order), rs =
    row_scales[pos] and s the row scales of its expert (from the dispatch's offsets [E + 1])."""
    P, H = yd.shape[0], table.hidden_size
    _check_sorted_rows("yd", yd, np.int32, (P, H), row_scales, offsets)
    _check("perm", perm, dtype=np.int32, shape=(P,))
    _check("weights", weights, dtype=np.float32)
    _check("ypair", ypair, dtype=np.float32, shape=(P, H))
    if weights.size != P:
        raise ValueError(f"weights has {weights.size} entries for {P} pairs")
    _glue_launch("down_epilogue_int8", P * H // 4, (yd, row_scales, offsets, np.int32(offsets.size - 1),
                                                    table.blob_ptrs, np.int64(table.off_down_scale), perm, weights,
                                                    ypair, np.int32(P), np.int32(H)))
    return ypair


def _experts_int8(xq, xs, weights, table: ExpertTable, disp: Dispatch, offsets, ypair) -> None:
    """moe_experts_cublas's W8A8 products into ypair from the pairs' rows of x rounded to int8 a row (xq, scales xs:
    sorted order): each pair's act rounded the same way, the blobs' int8 matrices multiplied in place (no widening),
    every expert's products into one array so that the epilogues and the act quantization are one launch each (the
    host makes two cuBLAS calls an expert besides)."""
    cp = _cupy()
    H, I, P = table.hidden_size, table.intermediate_size, disp.num_pairs
    addresses = cp.asnumpy(table.blob_ptrs)
    routed = _routed(offsets)
    gu = cp.empty((P, 2 * I), cp.int32)
    gemm_int8_experts(xq, gu, table, addresses, "gate_up", routed)
    aq, as_ = quantize_rows_int8(gate_up_epilogue_int8(gu, xs, table, disp.offsets))
    del gu
    yd = cp.empty((P, H), cp.int32)
    gemm_int8_experts(aq, yd, table, addresses, "down", routed)
    down_epilogue_int8(yd, as_, table, disp.offsets, disp.perm, weights.reshape(-1), ypair)


def _routed(offsets) -> list[tuple[int, int, int]]:
    """(expert, first sorted row, rows) of each expert with rows, from host offsets [E + 1]."""
    counts = np.diff(offsets)
    return [(int(e), int(offsets[e]), int(counts[e])) for e in np.flatnonzero(counts)]


def uses_cublas_gemm(num_pairs: int, table: ExpertTable, extras: ExpertExtras | None,
                     min_macs: int | None = None) -> bool:
    """Whether moe_experts' grouped GEMM runs on cuBLAS (`moe_experts_cublas`): int8 per-row experts without extras
    whose mean work a matrix, (P / E) H I multiply-adds, reaches min_macs (CUBLAS_MIN_EXPERT_MACS for the bf16
    products, CUBLAS_INT8_MIN_EXPERT_MACS for W8A8: below them the per-expert host calls cost more than the
    pipelined kernel saves: limits.py)."""
    work = num_pairs * table.hidden_size * table.intermediate_size
    return (extras is None and type(table) is ExpertTable and table.groups()[2] == "r"
            and work >= (CUBLAS_MIN_EXPERT_MACS if min_macs is None else min_macs) * table.num_experts)


def auto_activations(num_pairs: int, table: ExpertTable, extras: ExpertExtras | None) -> str:
    """fast_gemm 'auto' resolved for a pass: W8A8 ('int8') where an expert's mean work reaches W8A8_MIN_EXPERT_MACS
    (on cuBLAS from CUBLAS_INT8_MIN_EXPERT_MACS, the pipelined kernel's s8 MMAs below), else 'split'."""
    return "int8" if uses_cublas_gemm(num_pairs, table, extras, W8A8_MIN_EXPERT_MACS) else "split"


def moe_experts_cublas(x, ids, weights, table: ExpertTable, disp: Dispatch, *, activations: str = "split",
                       residual=None, alpha: float = 1.0, ypair=None, out=None):
    """`moe_experts` with its grouped GEMM on cuBLAS: each routed expert's int8 matrices widened to bf16, its rows'
    products by cublasGemmEx (fp32 accumulation; activations 'split': each row as hi and lo rows of one product,
    ~1e-5 relative, or 'bf16': hi only; 'int8': W8A8, `_experts_int8`), scales, SiLU and routing weights in
    moe_gemm_cublas.cu's epilogues, then the combine. disp: the dispatch of ids (tile size free). Reads the
    per-expert counts on the host: a synchronization, so eager passes only (never inside a graph capture)."""
    cp = _cupy()
    T, k = ids.shape
    H, I, P = table.hidden_size, table.intermediate_size, disp.num_pairs
    if activations not in CUBLAS_ACTIVATIONS:
        raise ValueError(f"activations must be one of {CUBLAS_ACTIVATIONS}, got {activations!r}")
    if P != T * k:
        raise ValueError(f"dispatch has {P} pairs, ids {tuple(ids.shape)}")
    _check_moe_inputs(x, table, disp, H, T)
    if cp.cuda.get_current_stream().is_capturing():
        raise RuntimeError("moe_experts_cublas synchronizes with the host: it cannot run inside a graph capture")
    ypair = _out("ypair", ypair, (P, H), cp.float32)
    # The launches that need no count are queued before the host waits for the counts: the device is idle from the
    # end of that wait until the first product is queued, and an eager pass pays that gap every layer.
    if activations == "int8":
        xq, xs = gather_rows_int8(*quantize_rows_int8(x), disp.perm, k)
        _experts_int8(xq, xs, weights, table, disp, cp.asnumpy(disp.offsets).astype(np.int64), ypair)
        return moe_combine(ypair, k, residual=residual, alpha=alpha, out=out)
    split = activations == "split"
    stack = 2 if split else 1                  # split: an expert's hi rows then its lo rows, one product
    xs = gather_bf16(x, disp.perm, k, offsets=disp.offsets if split else None)
    offsets = cp.asnumpy(disp.offsets).astype(np.int64)
    rows = stack * int(np.diff(offsets).max(initial=0))
    w_gu, w_dn = cp.empty((2 * I, H), cp.uint16), cp.empty((H, I), cp.uint16)
    gu, yd, act = cp.empty((rows, 2 * I), cp.float32), cp.empty((rows, H), cp.float32), cp.empty((rows, I), cp.uint16)
    pair_weights = weights.reshape(-1)
    for e, s, n in _routed(offsets):
        widen_expert_bf16(table, e, "gate_up", out=w_gu)
        gemm_bf16(xs[stack * s:stack * (s + n)], w_gu, gu[:stack * n])
        gate_up_epilogue(gu[:stack * n], table, e, split=split, out=act[:stack * n])
        widen_expert_bf16(table, e, "down", out=w_dn)
        gemm_bf16(act[:stack * n], w_dn, yd[:stack * n])
        down_epilogue(yd[:stack * n], table, e, disp.perm, s, pair_weights, ypair, split=split)
    return moe_combine(ypair, k, residual=residual, alpha=alpha, out=out)


def moe_combine(ypair, k: int, *, residual=None, alpha: float = 1.0, out=None):
    """y [T, H] = residual + alpha * sum_j ypair[t*k + j] (slots summed in order; out may be residual)."""
    cp = _cupy()
    _check("ypair", ypair, dtype=np.float32, ndim=2)
    P, H = ypair.shape
    if P % k or H % 4:
        raise ValueError(f"ypair {tuple(ypair.shape)} must be [T*{k}, H] with H % 4 == 0")
    T = P // k
    if residual is not None:
        _check("residual", residual, dtype=np.float32, shape=(T, H))
    y = _out("out", out, (T, H), cp.float32)
    kernel("moe_gemv", "moe_combine")(
        (_grid_stride_blocks(T * H // 4),), (256,),
        (ypair, _ptr(residual), y, np.int32(T), np.int32(H), np.int32(k), np.float32(alpha)))
    return y


def gemm_path(T: int, k: int, num_experts: int) -> bool:
    """Whether moe_experts runs T tokens on the grouped GEMM (which does not fill slots) rather than the GEMVs."""
    return T > 32 or T * k >= 8 * num_experts


def uses_fast_gemm(fast_gemm: str | None, table: ExpertTable, extras: ExpertExtras | None) -> bool:
    """Whether moe_experts' grouped GEMM runs fast_gemm's activations (on the pipelined kernel, or on cuBLAS where
    `uses_cublas_gemm` says so): asked for, and a model they compute (per-row scales, no gpt-oss extras); otherwise
    today's kernels run."""
    if fast_gemm is not None and fast_gemm not in CUBLAS_ACTIVATIONS:
        raise ValueError(f"fast_gemm must be None or one of {CUBLAS_ACTIVATIONS}, got {fast_gemm!r}")
    return fast_gemm is not None and extras is None and table.groups()[2] == "r"


def moe_experts(x, ids, weights, table: ExpertTable, *, residual=None, alpha: float = 1.0,
                gemm: bool | None = None, tensor_cores: bool | None = None, disp: Dispatch | None = None,
                act=None, ypair=None, extras: ExpertExtras | None = None, fast_gemm: str | None = None,
                staging: FastGemmStaging | None = None, cublas: bool | None = None,
                pairs: bool | None = None, out=None):
    """The whole routed-expert block: dispatch, gate/up + SiLU, down, weighted combine (+ residual); with extras,
    gpt-oss's biases and clamped SwiGLU (`ExpertExtras`).

    disp, act [P, I], ypair [P, H], staging and out [T, H] may be passed in (preallocated for graph capture; out may
    be residual). The grouped tensor-core GEMM replaces the GEMVs from about 8 pairs per expert or beyond 32 rows
    (measured on an H200, docs/benchmarks.md). fast_gemm ('split' or 'bf16', default None: today's kernel) runs that
    GEMM on the pipelined kernel with those activations, where `uses_fast_gemm` says it can. cublas: run that GEMM as `moe_experts_cublas` with fast_gemm's activations (None: where `uses_cublas_gemm` says
    so, from CUBLAS_INT8_MIN_EXPERT_MACS for 'int8'; an eager pass only). pairs: a GEMV pass by pair without a
    dispatch (`moe_gate_up_pairs`; None: where `pairs_path` says so).
    """
    T, k = ids.shape
    use_gemm = gemm if gemm is not None else gemm_path(T, k, table.num_experts)
    if not use_gemm and (pairs_path(T) if pairs is None else pairs):
        act = moe_gate_up_pairs(x, ids, table, extras=extras, out=act)
        ypair = moe_down_pairs(act, ids, weights, table, extras=extras, out=ypair)
        return moe_combine(ypair, k, residual=residual, alpha=alpha, out=out)
    disp = dispatch(ids, table.num_experts, tile_m=GEMM_BM, out=disp)
    fast = use_gemm and uses_fast_gemm(fast_gemm, table, extras)
    least = CUBLAS_INT8_MIN_EXPERT_MACS if fast_gemm == "int8" else None
    if fast and (uses_cublas_gemm(T * k, table, extras, least) if cublas is None else cublas):
        return moe_experts_cublas(x, ids, weights, table, disp, activations=fast_gemm, residual=residual,
                                  alpha=alpha, ypair=ypair, out=out)
    if fast:
        st = staging or FastGemmStaging(None, None, None, None)
        act = moe_gemm_gate_up_fast(x, table, disp, k, activations=fast_gemm, hi=st.x_hi, lo=st.x_lo, out=act)
        ypair = moe_gemm_down_fast(act, table, disp, weights, activations=fast_gemm, hi=st.act_hi, lo=st.act_lo,
                                   out=ypair)
    elif use_gemm:
        act = moe_gemm_gate_up(x, table, disp, k, tensor_cores=tensor_cores, extras=extras, out=act)
        ypair = moe_gemm_down(act, table, disp, weights, tensor_cores=tensor_cores, extras=extras, out=ypair)
    else:
        act = moe_gate_up(x, table, disp, k, extras=extras, out=act)
        ypair = moe_down(act, table, disp, weights, extras=extras, out=ypair)
    return moe_combine(ypair, k, residual=residual, alpha=alpha, out=out)


# ---- dense layers ---------------------------------------------------------------------------------------------
def rmsnorm(x, w, eps: float, *, out_dtype=None, w_offset: float = 0.0, out=None):
    """out = x * rsqrt(mean(x^2) + eps) * (w + w_offset) over the last axis; x f32/bf16, w f32/f16/bf16."""
    cp = _cupy()
    _check("x", x, codes=("f32", "bf16"))
    D = x.shape[-1]
    _check("w", w, shape=(D,), codes=("f32", "f16", "bf16"))
    odt = np.dtype(out_dtype) if out_dtype is not None else x.dtype
    o = _out("out", out, x.shape, odt)
    rows = x.size // D if D else 0
    if rows == 0:
        return o
    threads = 256 if D >= 256 else 128 if D >= 128 else 32
    kernel("layers", f"rmsnorm_{dtype_code(x)}_{dtype_code(o)}_{dtype_code(w)}")(
        (rows,), (threads,), (x, w, o, np.int32(D), np.float32(eps), np.float32(w_offset)))
    return o


def attention_splits(num_rows: int, kv_heads: int, group: int, max_len: int) -> int:
    """Context splits of the attention kernels: enough blocks for two waves, at least 64 keys a split (the split
    kernel) or ATT_DECODE_MIN_KEYS (the decode kernel, up to ATT_DECODE_MAX_ROWS query rows), at most
    ATT_MAX_SPLITS. (The decode kernel then gives each split at least ATT_DECODE_MIN_KEYS of the real length.)"""
    blocks = num_rows * kv_heads * -(-group // ATT_GMAX)
    min_keys = ATT_DECODE_MIN_KEYS if num_rows <= ATT_DECODE_MAX_ROWS else 64
    return max(1, min(-(-max_len // min_keys), -(-2 * _sm_count() // blocks), limits.ATT_MAX_SPLITS))


class AttentionWorkspace:
    """Partials of the split attention kernels and the decode kernel's merge tickets (zeroed; every launch leaves
    them zero), preallocated for CUDA-graph capture."""

    def __init__(self, num_rows: int, heads: int, head_dim: int, nsplit: int) -> None:
        cp = _cupy()
        self.shape = (num_rows, heads, head_dim, nsplit)
        self.ml = cp.empty(num_rows * heads * nsplit * 2, cp.float32)
        self.acc = cp.empty(num_rows * heads * nsplit * head_dim, cp.float32)
        self.tickets = cp.zeros(num_rows * heads, cp.int32)     # >= rows x kv heads x head chunks


def use_flash_prefill(q, k_cache) -> bool:
    """Whether `attention(..., flash_prefill=True)` runs `attention_prefill` for these rows and caches."""
    return (q.ndim == 3 and q.shape[0] > ATT_DECODE_MAX_ROWS and q.shape[2] in limits.FA_HEAD_DIMS
            and dtype_code(k_cache) in ("f32", "bf16"))


def _check_attention(q, k_cache, v_cache, q_seq, q_len, sinks, cache_codes: tuple[str, ...],
                     head_dims: tuple[int, ...], who: str) -> tuple[int, int, int, int]:
    """The inputs every attention kernel takes (q f32 [NQ, nh, hd], caches [S, cap, nkv, hd] of `cache_codes`,
    int32 q_seq / q_len [NQ], sinks f32 [nh] or None) checked; (NQ, nh, hd, nkv)."""
    _check("q", q, dtype=np.float32, ndim=3)
    NQ, nh, hd = q.shape
    _check("k_cache", k_cache, ndim=4, codes=cache_codes)
    _check("v_cache", v_cache, dtype=k_cache.dtype, shape=k_cache.shape)
    nkv = k_cache.shape[2]
    if k_cache.shape[3] != hd or nh % nkv:
        raise ValueError(f"cache {tuple(k_cache.shape)} incompatible with q {tuple(q.shape)}")
    if hd not in head_dims:
        raise ValueError(f"head_dim {hd} not supported by {who} {head_dims}")
    _check("q_seq", q_seq, dtype=np.int32, shape=(NQ,))
    _check("q_len", q_len, dtype=np.int32, shape=(NQ,))
    if sinks is not None:
        _check("sinks", sinks, dtype=np.float32, shape=(nh,))
    return NQ, nh, hd, nkv


def attention(q, k_cache, v_cache, q_seq, q_len, scale: float, *, window: int = 0, sinks=None, out=None,
              nsplit: int | None = None, max_len: int | None = None, workspace: AttentionWorkspace | None = None,
              flash_prefill: bool = False):
    """q [NQ, nh, hd] f32 against caches [S, cap, nkv, hd]: decode (q_len = length) or causal prefill rows.

    Row n attends to keys [max(0, q_len[n] - window), q_len[n]) of cache sequence q_seq[n] (window <= 0: all).
    sinks [nh] f32 (gpt-oss): one learned logit per head joins each softmax's denominator (`numpy_backend.attention`).
    The kernel cuts the keys into `nsplit` chunks (default from `max_len`, the longest q_len, which defaults to the
    cache capacity) and merges them. Up to ATT_DECODE_MAX_ROWS rows run `attention_decode` (lanes split the head
    dimension, keys in batches), more run `attention_split` (a lane per key): same contract and partials.
    flash_prefill (off by default): more than ATT_DECODE_MAX_ROWS rows over f32 or bf16 caches of a head size
    `attention_prefill` is built for run it instead (tensor cores, operands split into bf16 hi + lo).
    """
    if flash_prefill and use_flash_prefill(q, k_cache):
        return attention_prefill(q, k_cache, v_cache, q_seq, q_len, scale, window=window, sinks=sinks, out=out)
    cp = _cupy()
    NQ, nh, hd, nkv = _check_attention(q, k_cache, v_cache, q_seq, q_len, sinks, ("f32", "f16", "bf16"),
                                       ATTENTION_HEAD_DIMS, "attention")
    o = _out("out", out, q.shape, cp.float32)
    if NQ == 0:
        return o
    group = nh // nkv
    gchunks = -(-group // ATT_GMAX)
    cap = k_cache.shape[1]
    args_tail = (np.int32(nh), np.int32(nkv), np.int32(cap), np.int32(window), np.float32(scale))
    ns = nsplit or attention_splits(NQ, nkv, group, max_len or cap)
    if not 1 <= ns <= limits.ATT_MAX_SPLITS:
        raise ValueError(f"nsplit {ns} outside 1..{limits.ATT_MAX_SPLITS}")
    if ns > 1:
        ws = workspace or AttentionWorkspace(NQ, nh, hd, ns)
        if ws.shape != (NQ, nh, hd, ns):
            raise ValueError(f"attention workspace is {ws.shape}, needs {(NQ, nh, hd, ns)}")
        ml, acc, tickets = ws.ml, ws.acc, ws.tickets
    else:
        ml = acc = o  # unused
        tickets = None
    if NQ <= ATT_DECODE_MAX_ROWS:        # merges in its last block of each (row, kv head, head chunk)
        if not _aligned16(o):
            raise ValueError("out must start on a 16-byte boundary (attention_decode's merge stores float4)")
        if not (_aligned16(k_cache) and _aligned16(v_cache)):
            raise ValueError("k_cache and v_cache must start on 16-byte boundaries (attention_decode copies 16 bytes)")
        smem = limits.attention_decode_shared_bytes(k_cache.dtype.itemsize)
        fn = _opted_in(kernel("layers", f"attention_decode_{dtype_code(k_cache)}_hd{hd}"), smem)
        fn((NQ, nkv, gchunks * ns), (ATT_THREADS,),
           (q, k_cache, v_cache, q_seq, q_len, _ptr(sinks), ml, acc, _ptr(tickets), o) + args_tail + (np.int32(ns),),
           shared_mem=smem)
        return o
    kernel("layers", f"attention_split_{dtype_code(k_cache)}_hd{hd}")(
        (NQ, nkv, gchunks * ns), (ATT_THREADS,), (q, k_cache, v_cache, q_seq, q_len, _ptr(sinks), ml, acc, o)
        + args_tail + (np.int32(ns),))
    if ns > 1:
        kernel("layers", "attention_merge")((NQ * nh,), (hd,), (ml, acc, _ptr(sinks), o, np.int32(hd), np.int32(ns),
                                                               np.int32(nh)))
    return o


def prefill_attention_plan(q_seq, q_len, group: int, window: int = 0) -> np.ndarray:
    """The tiles of `attention_prefill` (host NumPy, from host copies of q_seq and q_len): int32
    [tiles, FA_PLAN_FIELDS] = first row of the span, first pair, pairs, first key, keys end.

    A span is a run of consecutive rows of one sequence; its pairs (row, query head of a kv head's group), numbered
    row-major from the span's first row, are cut into tiles of FA_BM, so no tile straddles two sequences. A tile's
    keys [first key, keys end) cover every key its pairs attend to (rows' windows and causal ends included). Tiles
    come longest key range first (blocks are scheduled about in grid order)."""
    seq = np.asarray(q_seq, np.int64).reshape(-1)
    lens = np.asarray(q_len, np.int64).reshape(-1)
    if seq.size == 0:
        return np.zeros((0, limits.FA_PLAN_FIELDS), np.int32)
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    pairs = (np.r_[starts[1:], seq.size] - starts) * group
    tiles = -(-pairs // limits.FA_BM)
    span = np.repeat(np.arange(starts.size), tiles)
    first_pair = (np.arange(span.size) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * limits.FA_BM
    npairs = np.minimum(limits.FA_BM, pairs[span] - first_pair)
    first_row = starts[span] + first_pair // group
    last_row = starts[span] + (first_pair + npairs - 1) // group
    rows = np.minimum(first_row[:, None] + np.arange(int((last_row - first_row).max()) + 1), last_row[:, None])
    lo = np.maximum(lens - window, 0) if window > 0 else np.zeros_like(lens)
    plan = np.stack([starts[span], first_pair, npairs, lo[rows].min(1), lens[rows].max(1)], 1).astype(np.int32)
    return plan[np.argsort(plan[:, 3] - plan[:, 4], kind="stable")]     # most keys first: a shorter last wave


def prefill_attention_plan_on_device(seq_h, len_h, group: int, window: int, k_cache):
    """`prefill_attention_plan` of host q_seq / q_len, checked against the caches the kernel will index (a row out
    of range would read outside them), as a device int32 array."""
    seq_h, len_h = np.asarray(seq_h), np.asarray(len_h)
    nseq, cap = k_cache.shape[0], k_cache.shape[1]
    if seq_h.size and (seq_h.min() < 0 or seq_h.max() >= nseq or len_h.min() < 0 or len_h.max() > cap):
        raise ValueError(f"q_seq or q_len out of range for caches of {nseq} sequences x {cap}")
    return _cupy().asarray(prefill_attention_plan(seq_h, len_h, group, window))


def attention_prefill(q, k_cache, v_cache, q_seq, q_len, scale: float, *, window: int = 0, sinks=None, out=None,
                      plan=None):
    """`attention`'s contract (numpy_backend.attention) on the tensor cores: flash attention over the host-planned
    tiles of `prefill_attention_plan` (computed here from q_seq and q_len, a device-to-host copy, unless `plan`,
    a device int32 array of it from `prefill_attention_plan_on_device`, is passed). Tensor cores with fp32
    operands split into bf16 hi + lo (about 16 significant bits), fp32 accumulation and softmax. Caches f32 or
    bf16, head_dim 64, 128 or 256."""
    cp = _cupy()
    NQ, nh, hd, nkv = _check_attention(q, k_cache, v_cache, q_seq, q_len, sinks, ("f32", "bf16"),
                                       limits.FA_HEAD_DIMS, "attention_prefill")
    cap = k_cache.shape[1]
    o = _out("out", out, q.shape, cp.float32)
    if NQ == 0:
        return o
    if plan is None:
        plan = prefill_attention_plan_on_device(q_seq.get(), q_len.get(), nh // nkv, window, k_cache)
    _check("plan", plan, dtype=np.int32, ndim=2)
    if plan.shape[1] != limits.FA_PLAN_FIELDS:
        raise ValueError(f"plan must be [tiles, {limits.FA_PLAN_FIELDS}], got {tuple(plan.shape)}")
    smem = limits.prefill_attention_shared_bytes(hd, dtype_code(k_cache))
    fn = _opted_in(kernel("attention_prefill", f"attention_prefill_{dtype_code(k_cache)}_hd{hd}"), smem)
    if plan.shape[0]:
        fn((plan.shape[0], nkv), (limits.FA_THREADS,),
           (q, k_cache, v_cache, q_seq, q_len, _ptr(sinks), plan, o, np.int32(nh), np.int32(nkv), np.int32(cap),
            np.int32(window), np.float32(scale)), shared_mem=smem)
    return o


def embedding(ids, table, *, mult: float = 1.0, out=None):
    """out [N, H] f32 = table[ids] * mult (an id out of range gives a NaN row)."""
    cp = _cupy()
    _check("ids", ids, dtype=np.int32, ndim=1)
    _check("table", table, ndim=2, codes=("f32", "f16", "bf16"))
    N, (V, H) = ids.size, table.shape
    o = _out("out", out, (N, H), cp.float32)
    if N:
        kernel("layers", f"embedding_{dtype_code(table)}")(
            (_grid_stride_blocks(N * H),), (256,), (ids, table, o, np.int32(N), np.int32(V), np.int32(H),
                                                    np.float32(mult)))
    return o


def residual_add(a, b, *, alpha: float = 1.0, out=None):
    """out = a + alpha * b (f32; out may be a)."""
    cp = _cupy()
    _check("a", a, dtype=np.float32)
    _check("b", b, dtype=np.float32, shape=a.shape)
    o = _out("out", out, a.shape, cp.float32)
    if a.size:
        kernel("layers", "residual_add_f32")(
            (_grid_stride_blocks(a.size),), (256,), (a, b, o, np.int64(a.size), np.float32(alpha)))
    return o


def silu_mul(gu, *, out=None):
    """gu [T, 2I] f32 -> silu(gu[:, :I]) * gu[:, I:]."""
    cp = _cupy()
    _check("gu", gu, dtype=np.float32, ndim=2)
    T, two_i = gu.shape
    if two_i % 2:
        raise ValueError("gu must have an even number of columns")
    o = _out("out", out, (T, two_i // 2), cp.float32)
    if o.size:
        kernel("layers", "silu_mul_f32")(
            (_grid_stride_blocks(o.size),), (256,), (gu, o, np.int32(T), np.int32(two_i // 2)))
    return o


def dense_gemv_splits(N: int, K: int, tokens: int, itemsize: int, sms: int) -> int:
    """How many warps share an item's K in `dense_gemv`: the most (a power of two up to `limits.DG_MAX_SPLITS`, at
    most one 16-byte load a lane per slice) that keep the launch within `limits.DG_WARPS_PER_SM` warps a
    multiprocessor. Few items (o_proj) take several warps each; many (lm_head) one, which splitting only slows."""
    return _k_splits(-(-N // DG_PLANS[tokens][0]), -(-K // (32 * (16 // itemsize))), sms)


def dense_gemv_tc_splits(N: int, K: int, sms: int) -> int:
    """`dense_gemv_splits` for `dense_gemv_tc`: items of 16 rows, chunks of 32 columns (a 16-byte load a lane)."""
    return _k_splits(-(-N // DG_TC_ROWS), K // 32, sms)


def _k_splits(items: int, chunks: int, sms: int) -> int:
    """The most warps (a power of two up to DG_MAX_SPLITS, at most `chunks`) an item's K is split over while
    `items` items stay within DG_WARPS_PER_SM warps a multiprocessor."""
    budget = limits.DG_WARPS_PER_SM * sms
    splits = 1
    while 2 * splits <= min(limits.DG_MAX_SPLITS, chunks) and 2 * splits * items <= budget:
        splits *= 2
    return splits


def dense_gemv(x, w, *, bias=None, out=None, splits: int | None = None):
    """y [T, N] f32 = x [T, K] f32 @ w[N, K].T (+ bias), w f32/f16/bf16; for T <= 8 (graph-capturable).

    One kernel per token count (1, 2, 4, 8: `limits.DG_PLANS`); beyond 8 tokens use cuBLAS (cupy.matmul). splits:
    warps sharing an item's K (1, 2, 4 or 8; None: `dense_gemv_splits`), for benchmarks that time the others.
    """
    return _dense_gemv_launch("dense_gemv", x, w, bias, out, splits, ())


def dense_gemv_normed(x, gamma, eps: float, w, *, x_out, bias=None, out=None, splits: int | None = None):
    """y [T, N] f32 = rmsnorm(x) @ w.T (+ bias) and x_out [T, K] f32 = rmsnorm(x) = x * rsqrt(mean(x^2) + eps) *
    gamma (gamma [K] f32: the norm weight, any offset added), in one launch: `rmsnorm` then `dense_gemv` (same
    shapes and plans), the norm's inverse applied to each output (layers.cu's NORM), ~1e-7 relative from them."""
    return _dense_gemv_launch("dense_gemv_normed", x, w, bias, out, splits, _norm_args(x, gamma, eps, x_out))


def _norm_args(x, gamma, eps: float, x_out) -> tuple:
    """A normed dense GEMV's norm arguments (gamma [K] f32, eps, x_out [T, K] f32 apart from x), checked."""
    _check("x", x, dtype=np.float32, ndim=2)
    K = x.shape[1]
    _check("gamma", gamma, dtype=np.float32, shape=(K,))
    _check("x_out", x_out, dtype=np.float32, shape=x.shape)
    if _overlaps(x_out, x):
        raise ValueError("x_out must not overlap x (the product reads x while the norm's rows are stored)")
    return gamma, np.float32(eps), x_out


def dense_gemv_tc(x, w, *, bias=None, out=None, splits: int | None = None):
    """y [T, N] f32 = x [T, K] f32 @ w[N, K].T (+ bias) for w bf16 bits (uint16) and 1 <= T <= 32, on the tensor
    cores in one launch (layers.cu's dense_gemv_tc_bf16_n<tiles>: x split into bf16 hi + lo, ~1e-5 relative, the
    NumPy twin `dense_gemv_tc_reference`); N >= 16, K % 32 == 0. Graph-capturable. splits: warps sharing an item's K
    (a power of two dividing DG_THREADS / 32; None: `dense_gemv_tc_splits`)."""
    return _dense_gemv_tc_launch("dense_gemv_tc", x, w, bias, out, splits, ())


def dense_gemv_tc_normed(x, gamma, eps: float, w, *, x_out, bias=None, out=None, splits: int | None = None):
    """`dense_gemv_normed` on the tensor cores: y [T, N] f32 = rmsnorm(x) @ w.T (+ bias) and x_out [T, K] f32 =
    rmsnorm(x) = x * rsqrt(mean(x^2) + eps) * gamma, in one launch (the MMAs take x * gamma split into bf16 hi + lo,
    the norm's inverse scales each output); shapes as `dense_gemv_tc`."""
    tail = _norm_args(x, gamma, eps, x_out)
    if not (_aligned16(gamma) and _aligned16(x_out)):
        raise ValueError("gamma and x_out must start on 16-byte boundaries (16-byte loads and stores)")
    return _dense_gemv_tc_launch("dense_gemv_tc_normed", x, w, bias, out, splits, tail)


def _dense_gemv_tc_launch(family: str, x, w, bias, out, splits: int | None, tail: tuple):
    """The checked launch of a `dense_gemv_tc` kernel family (`tail`: the family's arguments after the shared ones)."""
    cp = _cupy()
    _check("x", x, dtype=np.float32, ndim=2)
    _check("w", w, dtype=np.uint16, ndim=2)
    T, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w is {tuple(w.shape)}, expected [N, {K}]")
    tokens = 8 * max(DG_TC_TILES)
    if K % 32 or N < DG_TC_ROWS or not 1 <= T <= tokens:
        raise ValueError(f"dense_gemv_tc needs K % 32 == 0, N >= {DG_TC_ROWS} and 1 <= T <= {tokens} "
                         f"(K={K}, N={N}, T={T})")
    if not (_aligned16(x) and _aligned16(w)):
        raise ValueError("x and w must start on 16-byte boundaries (16-byte loads of their rows)")
    if bias is not None:
        _check("bias", bias, dtype=np.float32, shape=(N,))
    warps = _check_splits("dense_gemv_tc", splits)
    y = _out("out", out, (T, N), cp.float32)
    tiles = min(n for n in DG_TC_TILES if 8 * n >= T)
    splits = dense_gemv_tc_splits(N, K, _sm_count()) if splits is None else splits
    blocks = -(-N // DG_TC_ROWS // (warps // splits))
    kernel("layers", f"{family}_bf16_n{tiles}")(
        (blocks,), (DG_THREADS,),
        (x, w, _ptr(bias), y, np.int32(T), np.int32(N), np.int32(K), np.int32(splits)) + tail)
    return y


def dense_gemv_tc_reference(x, w_bits, bias=None) -> np.ndarray:
    """The NumPy twin of `dense_gemv_tc` (float64 sums): x rounded to bf16 hi + lo as the kernel splits it, times
    the bf16 weights. The kernel sums in fp32 in the tensor cores' order: ~1e-6 relative from this."""
    from colibri_format.dtypes import float32_to_bf16_bits, to_float32  # noqa: PLC0415

    x = np.asarray(x, np.float32)
    hi = to_float32(float32_to_bf16_bits(x))
    lo = to_float32(float32_to_bf16_bits(x - hi))
    y = (hi.astype(np.float64) + lo.astype(np.float64)) @ to_float32(np.asarray(w_bits)).astype(np.float64).T
    return y if bias is None else y + np.asarray(bias, np.float64)


def _check_splits(name: str, splits: int | None) -> int:
    """The warps of a dense GEMV block, after checking that `splits` (None: the wrapper picks) divides them."""
    warps = DG_THREADS // 32
    if splits is not None and (splits < 1 or warps % splits):
        raise ValueError(f"{name} splits must divide {warps}, got {splits}")
    return warps


def _overlaps(a, b) -> bool:
    """Whether two contiguous device arrays share bytes."""
    return bool(a.nbytes and b.nbytes and a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes)


def _dense_gemv_launch(family: str, x, w, bias, out, splits: int | None, tail: tuple):
    """The checked launch of a `dense_gemv` kernel family (`tail`: the family's arguments after the shared ones)."""
    cp = _cupy()
    _check("x", x, dtype=np.float32, ndim=2)
    _check("w", w, ndim=2, codes=("f32", "f16", "bf16"))
    T, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w is {tuple(w.shape)}, expected [N, {K}]")
    if K % 8 or N < DG_ROWS or T > max(DG_PLANS):
        raise ValueError(f"dense_gemv needs K % 8 == 0, N >= {DG_ROWS} and T <= {max(DG_PLANS)} (K={K}, N={N}, T={T})")
    if bias is not None:
        _check("bias", bias, dtype=np.float32, shape=(N,))
    warps = _check_splits("dense_gemv", splits)
    y = _out("out", out, (T, N), cp.float32)
    if T:
        tok = min(t for t in DG_PLANS if t >= T)
        splits = dense_gemv_splits(N, K, tok, w.dtype.itemsize, _sm_count()) if splits is None else splits
        blocks = -(-N // DG_PLANS[tok][0] // (warps // splits))           # `splits` warps per `rows` output rows
        kernel("layers", f"{family}_{dtype_code(w)}_t{tok}")(
            (blocks,), (DG_THREADS,),
            (x, w, _ptr(bias), y, np.int32(T), np.int32(N), np.int32(K), np.int32(splits)) + tail)
    return y


# ---- fused decode-layer kernels (fused.cu) -------------------------------------------------------------------------
def add_rmsnorm(h, b, w, eps: float, *, alpha: float = 1.0, out=None):
    """h += alpha * b (in place, h [R, D] f32), then out [R, D] f32 = rmsnorm(h) * w (w f32/f16/bf16); returns out.

    One launch for the residual add and the norm that follows it (`residual_add` then `rmsnorm`).
    """
    cp = _cupy()
    _check("h", h, dtype=np.float32)
    D = h.shape[-1] if h.ndim else 0
    _check("b", b, dtype=np.float32, shape=h.shape)
    _check("w", w, shape=(D,), codes=("f32", "f16", "bf16"))
    o = _out("out", out, h.shape, cp.float32)
    if o is h or o is b:
        raise ValueError("out must be a buffer of its own (not h or b)")
    rows = h.size // D if D else 0
    if rows:
        kernel("fused", f"add_rmsnorm_{dtype_code(w)}")(
            (rows,), (FUSED_THREADS,), (h, b, w, o, np.int32(D), np.float32(alpha), np.float32(eps)))
    return o


def qkv_rope_kv(qkv, heads: int, kv_heads: int, k_cache, v_cache, seq, pos, rpos, cos, sin, *,
                norm: str = "none", q_norm=None, k_norm=None, eps: float = 1e-6, clip: float | None = None,
                q_out=None):
    """From the fused projection qkv [N, (heads + 2 kv_heads) hd] f32: q/k norm, clip, RoPE, KV append, in one launch.

    norm: "none", "full" (q over all its heads with q_norm [heads*hd], k with k_norm [kv_heads*hd]) or "per_head"
    (q_norm, k_norm [hd]); clip (None: off) clamps q, k, v after a full norm and before a per-head norm. RoPE is
    rotate_half on the first 2*cos.shape[1] dims with cos/sin row rpos[n]. k and v go to the caches
    [S, capacity, kv_heads, hd] (f32/f16/bf16) at (seq[n], pos[n]); returns q_out [N, heads, hd] f32.
    """
    cp = _cupy()
    _check("qkv", qkv, dtype=np.float32, ndim=2)
    N, width = qkv.shape
    _check("k_cache", k_cache, ndim=4, codes=("f32", "f16", "bf16"))
    _check("v_cache", v_cache, dtype=k_cache.dtype, shape=k_cache.shape)
    hd = k_cache.shape[3]
    if k_cache.shape[2] != kv_heads or width != (heads + 2 * kv_heads) * hd:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {heads} + 2 x {kv_heads} heads of the cache's "
                         f"{tuple(k_cache.shape)}")
    for name, a in (("seq", seq), ("pos", pos), ("rpos", rpos)):
        _check(name, a, dtype=np.int32, shape=(N,))
    _check("cos", cos, dtype=np.float32, ndim=2)
    _check("sin", sin, dtype=np.float32, shape=cos.shape)
    half = cos.shape[1]
    if 2 * half > hd:
        raise ValueError(f"rotary dim {2 * half} exceeds head_dim {hd}")
    if norm not in QK_NORM_MODES:
        raise ValueError(f"norm must be one of {sorted(QK_NORM_MODES)}, got {norm!r}")
    if norm == "none":
        wq = wk = qkv                 # not read (no allocation: the call may be inside a graph capture)
    else:
        sizes = (heads * hd, kv_heads * hd) if norm == "full" else (hd, hd)
        _check("q_norm", q_norm, shape=(sizes[0],), codes=("f32", "f16", "bf16"))
        _check("k_norm", k_norm, shape=(sizes[1],), dtype=q_norm.dtype)
        wq, wk = q_norm, k_norm
    q = _out("q_out", q_out, (N, heads, hd), cp.float32)
    if N:
        kernel("fused", f"qkv_rope_kv_{dtype_code(k_cache)}_{dtype_code(wq)}")(
            (N, -(-(heads + kv_heads) // (QKV_THREADS // 32))), (QKV_THREADS,),
            (qkv, q, k_cache, v_cache, wq, wk, seq, pos, rpos, cos, sin, np.int32(heads), np.int32(kv_heads),
             np.int32(hd), np.int32(half), np.int32(k_cache.shape[1]), np.int32(QK_NORM_MODES[norm]),
             np.float32(eps), np.float32(clip if clip is not None else 0.0)))
    return q


def split_bf16(x, *, hi=None, lo=None):
    """x f32 -> (hi, lo) bf16 bits (uint16, x's shape): hi = bf16(x), lo = bf16(x - hi)."""
    cp = _cupy()
    _check("x", x, dtype=np.float32)
    h = _out("hi", hi, x.shape, cp.uint16)
    lw = _out("lo", lo, x.shape, cp.uint16)
    if x.size:
        kernel("fused", "split_bf16")((_grid_stride_blocks(x.size),), (256,), (x, h, lw, np.int64(x.size)))
    return h, lw


def round_bf16(x, *, out=None):
    """x f32 -> bf16(x) bits (uint16, x's shape), rounded to nearest even: `split_bf16`'s hi alone (no lo)."""
    cp = _cupy()
    _check("x", x, dtype=np.float32)
    h = _out("out", out, x.shape, cp.uint16)
    if x.size:
        kernel("fused", "split_bf16")((_grid_stride_blocks(x.size),), (256,), (x, h, _ptr(None), np.int64(x.size)))
    return h


# ---- multi-head latent attention (mla.cu) ----------------------------------------------------------------------------
class MlaWorkspace:
    """Scratch of `mla_attention` for `rows` rows of `heads` heads (preallocated for CUDA-graph capture): the roped q
    rope parts [rows, heads, rope_dim], q absorbed into the latent space and the latent output [rows, heads, rank]."""

    def __init__(self, rows: int, heads: int, rank: int, rope_dim: int) -> None:
        cp = _cupy()
        self.shape = (rows, heads, rank, rope_dim)
        self.qr = cp.empty((rows, heads, rope_dim), cp.float32)
        self.ql = cp.empty((rows, heads, rank), cp.float32)
        self.lat = cp.empty((rows, heads, rank), cp.float32)


def _check_rows_view(name: str, a, rows: int, cols: int) -> int:
    """A [rows, cols] f32 view whose rows may lie apart (a column slice); returns its row stride in floats."""
    cp = _cupy()
    if not isinstance(a, cp.ndarray) or a.dtype != np.float32 or a.shape != (rows, cols):
        raise ValueError(f"{name} must be a float32 cupy array of shape {(rows, cols)}")
    if a.strides[1] != 4 or a.strides[0] % 4 or a.strides[0] < 4 * cols:
        raise ValueError(f"{name} must have contiguous rows (strides {a.strides})")
    return a.strides[0] // 4


def mla_attention(q, c, k_rope, k_b, v_b, cache, seq, pos, rpos, q_len, cos, sin, *, scale: float, out=None,
                  workspace: MlaWorkspace | None = None):
    """Multi-head latent attention in the absorbed form (`numpy_backend.mla_attention`, its reference).

    q [N, nh, dn + dr] f32, c [N, r] f32, k_rope [N, dr] f32 (rows may be a column slice), k_b [nh dn, r] and
    v_b [nh dv, r] f32/f16/bf16, cache [S, capacity, r + dr] f32 (c and the roped key written at (seq[n], pos[n])),
    seq/pos/rpos/q_len [N] int32, cos/sin [*, half] f32 (rotate-half RoPE of the rope parts, row rpos[n]). Row n
    attends to the first q_len[n] tokens of its sequence. Returns out [N, nh dv] f32.
    """
    cp = _cupy()
    _check("q", q, dtype=np.float32, ndim=3)
    N, nh, dq = q.shape
    _check("cache", cache, dtype=np.float32, ndim=3)
    _check("c", c, dtype=np.float32, ndim=2)
    r = c.shape[1]
    dr = cache.shape[2] - r
    dn = dq - dr
    k_stride = _check_rows_view("k_rope", k_rope, N, dr)
    if c.shape[0] != N or dn < 1 or dr < 1 or r > limits.MLA_MAX_RANK:
        raise ValueError(f"q {tuple(q.shape)}, c {tuple(c.shape)} and cache {tuple(cache.shape)} do not fit "
                         f"(kv_lora_rank at most {limits.MLA_MAX_RANK})")
    _check("k_b", k_b, shape=(nh * dn, r), codes=("f32", "f16", "bf16"))
    _check("v_b", v_b, ndim=2, dtype=k_b.dtype)
    dv = v_b.shape[0] // nh
    if v_b.shape != (nh * dv, r) or dv < 1:
        raise ValueError(f"v_b {tuple(v_b.shape)} is not [{nh} x dv, {r}]")
    for name, a in (("seq", seq), ("pos", pos), ("rpos", rpos), ("q_len", q_len)):
        _check(name, a, dtype=np.int32, shape=(N,))
    _check("cos", cos, dtype=np.float32, ndim=2)
    _check("sin", sin, dtype=np.float32, shape=cos.shape)
    half = cos.shape[1]
    if 2 * half > dr:
        raise ValueError(f"rotary dim {2 * half} exceeds qk_rope_head_dim {dr}")
    ws = workspace or MlaWorkspace(N, nh, r, dr)
    if ws.shape != (N, nh, r, dr):
        raise ValueError(f"MLA workspace is {ws.shape}, needs {(N, nh, r, dr)}")
    o = _out("out", out, (N, nh * dv), cp.float32)
    if N == 0:
        return o
    shared = limits.mla_shared_bytes({"kv_lora_rank": r, "qk_rope_head_dim": dr, "qk_nope_head_dim": dn})
    w = dtype_code(k_b)
    row_blocks = -(-N // limits.MLA_ROWS)
    threads = (limits.MLA_THREADS,)
    kernel("mla", "mla_rope_append")(
        (N,), threads, (q, c, np.uint64(k_rope.data.ptr), np.int32(k_stride), seq, pos, rpos, cos, sin, cache, ws.qr,
                        np.int32(nh), np.int32(dn), np.int32(dr), np.int32(r), np.int32(half),
                        np.int32(cache.shape[1])))
    kernel("mla", f"mla_absorb_q_{w}")(
        (-(-r // limits.WARP), nh, row_blocks), threads,
        (q, k_b, ws.ql, np.int32(N), np.int32(nh), np.int32(dn), np.int32(dr), np.int32(r)),
        shared_mem=shared["absorb_q"])
    kernel("mla", "mla_attend")(
        (N, nh), threads, (ws.ql, ws.qr, cache, seq, q_len, ws.lat, np.int32(nh), np.int32(r), np.int32(dr),
                           np.int32(cache.shape[1]), np.float32(scale)),
        shared_mem=shared["attend"])
    kernel("mla", f"mla_absorb_v_{w}")(
        (-(-dv // (limits.MLA_THREADS // 32)), nh, row_blocks), threads,
        (ws.lat, v_b, o, np.int32(N), np.int32(nh), np.int32(dv), np.int32(r)), shared_mem=shared["absorb_v"])
    return o


# ---- Gated DeltaNet (deltanet.cu) ----------------------------------------------------------------------------------
# A pass's rows in spans (the consecutive rows of one sequence): plan [4, NS] int32 = first row, rows, sequence,
# fresh (1: start from zero states). The NumPy twins: numpy_backend.causal_conv, l2norm / softplus, delta_rule and
# rmsnorm * silu, composed by numpy_backend.gated_delta_net.
def _check_plan(plan, rows: int) -> int:
    _check("plan", plan, dtype=np.int32, ndim=2)
    if plan.shape[0] != 4 or plan.shape[1] > max(rows, 1):
        raise ValueError(f"plan must be [4, spans <= {rows}], got {tuple(plan.shape)}")
    return int(plan.shape[1])


def deltanet_decode_plan(seq, pos, lengths, *, out=None):
    """plan [4, T] of a decode step (row n: sequence seq[n]'s only row; fresh when pos[n] == 0 or lengths[seq[n]]
    != pos[n]), and lengths[seq[n]] = pos[n] + 1. seq, pos int32 [T] (distinct sequences); lengths int64 [S]."""
    cp = _cupy()
    _check("seq", seq, dtype=np.int32, ndim=1)
    T = seq.size
    _check("pos", pos, dtype=np.int32, shape=(T,))
    _check("lengths", lengths, dtype=np.int64, ndim=1)
    plan = _out("out", out, (4, T), cp.int32)
    if T:
        kernel("deltanet", "deltanet_decode_plan")((-(-T // limits.DELTANET_THREADS),), (limits.DELTANET_THREADS,),
                                                   (seq, pos, lengths, plan, np.int32(T)))
    return plan


def deltanet_conv(x, w, state, plan, *, out=None):
    """u [T, C] = silu(causal depthwise conv of each span's rows of x [T, C] with w [C, K] f32, after the K-1
    inputs in state [S, C, K-1] f32 (zeros for a fresh span)); the state of each span's sequence becomes its last K-1
    inputs."""
    cp = _cupy()
    _check("x", x, dtype=np.float32, ndim=2)
    T, C = x.shape
    _check("w", w, dtype=np.float32, ndim=2)
    K = w.shape[1]
    if w.shape[0] != C or K < 1:
        raise ValueError(f"conv weight {tuple(w.shape)} does not match {C} channels")
    _check("state", state, dtype=np.float32, ndim=3)
    if state.shape[1:] != (C, K - 1):
        raise ValueError(f"conv state {tuple(state.shape)} must be [S, {C}, {K - 1}]")
    ns = _check_plan(plan, T)
    u = _out("out", out, (T, C), cp.float32)
    if ns and C:
        kernel("deltanet", "deltanet_conv")(
            (_grid_stride_blocks(ns * C, limits.DELTANET_THREADS),), (limits.DELTANET_THREADS,),
            (x, w, state, plan, u, np.int32(ns), np.int32(C), np.int32(K)))
    return u


def deltanet_prepare(u, b, a, A_log, dt_bias, *, heads: tuple[int, int], dk: int, l2_eps: float = 1e-6,
                     q_out=None, k_out=None, beta_out=None, g_out=None):
    """From the conv output u [T, C] (q | k | v rows, nk key heads of dk): q, k [T, nk, dk] l2-normed (q also times
    dk^-1/2), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) [T, nv]; b, a [T, nv], A_log, dt_bias [nv] f32."""
    cp = _cupy()
    nk, nv = heads
    _check("u", u, dtype=np.float32, ndim=2)
    T, C = u.shape
    if C < 2 * nk * dk or nv % nk:
        raise ValueError(f"u {tuple(u.shape)} cannot hold q and k of {nk} heads of {dk} ({nv} value heads)")
    for name, t in (("b", b), ("a", a)):
        _check(name, t, dtype=np.float32, shape=(T, nv))
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        _check(name, t, dtype=np.float32, shape=(nv,))
    q = _out("q_out", q_out, (T, nk, dk), cp.float32)
    k = _out("k_out", k_out, (T, nk, dk), cp.float32)
    beta = _out("beta_out", beta_out, (T, nv), cp.float32)
    g = _out("g_out", g_out, (T, nv), cp.float32)
    if T:
        kernel("deltanet", "deltanet_prepare")(
            (T, nk), (32,), (u, b, a, A_log, dt_bias, q, k, beta, g, np.int32(C), np.int32(nk), np.int32(nv),
                             np.int32(dk), np.float32(l2_eps)))
    return q, k, beta, g


def deltanet_recurrent(q, k, u, g, beta, state, plan, *, value_heads: int, out=None):
    """The gated delta rule row by row over each span (`numpy_backend.delta_rule`): q, k [T, nk, dk] (key head
    h // (nv / nk) serves value head h), v the last nv dv columns of u [T, C], g, beta [T, nv], state
    [S, nv, dk, dv] f32 (zeros for a fresh span) updated in place; returns o [T, nv, dv]."""
    cp = _cupy()
    nv = value_heads
    _check("q", q, dtype=np.float32, ndim=3)
    T, nk, dk = q.shape
    _check("k", k, dtype=np.float32, shape=q.shape)
    _check("u", u, dtype=np.float32, ndim=2)
    for name, t in (("g", g), ("beta", beta)):
        _check(name, t, dtype=np.float32, shape=(T, nv))
    _check("state", state, dtype=np.float32, ndim=4)
    dv = state.shape[3]
    if state.shape[1:3] != (nv, dk) or nv % nk or u.shape[0] != T or u.shape[1] < nv * dv:
        raise ValueError(f"state {tuple(state.shape)}, u {tuple(u.shape)} do not match q {tuple(q.shape)} and "
                         f"{nv} value heads")
    if dv > limits.DELTANET_MAX_VALUE_DIM:
        raise ValueError(f"value head dim {dv} > {limits.DELTANET_MAX_VALUE_DIM}")
    ns = _check_plan(plan, T)
    o = _out("out", out, (T, nv, dv), cp.float32)
    if ns:
        C = u.shape[1]
        kernel("deltanet", "deltanet_recurrent")(
            (ns, nv), (-(-dv // 32) * 32,),
            (q, k, u, g, beta, state, plan, o, np.int32(ns), np.int32(C), np.int32(C - nv * dv), np.int32(nk),
             np.int32(nv), np.int32(dk), np.int32(dv)),
            shared_mem=2 * dk * 4)
    return o


def deltanet_gated_norm(o, z, w, eps: float, *, out=None):
    """y [T, nv dv] = rmsnorm(o [T, nv, dv] over dv) * w [dv] * silu(z [T, nv dv]), all f32."""
    cp = _cupy()
    _check("o", o, dtype=np.float32, ndim=3)
    T, nv, dv = o.shape
    _check("z", z, dtype=np.float32, shape=(T, nv * dv))
    _check("w", w, dtype=np.float32, shape=(dv,))
    y = _out("out", out, (T, nv * dv), cp.float32)
    if T:
        kernel("deltanet", "deltanet_gated_norm")((T, nv), (32,), (o, z, w, y, np.int32(nv), np.int32(dv),
                                                                   np.float32(eps)))
    return y


# ---- 4-bit experts (moe_gemv4.cu) ---------------------------------------------------------------------------------
PACKED_KERNEL_TAGS = {ExpertFormat.INT4_GROUP: "int4", ExpertFormat.MXFP4: "mxfp4"}   # kernel name part
PACKED_GROUPS = {ExpertFormat.INT4_GROUP: INT4_GROUP_SIZES, ExpertFormat.MXFP4: (MXFP4_GROUP_SIZE,)}


@dataclass(frozen=True)
class PackedExpertTable(ExpertTable):
    """An ExpertTable of 4-bit blobs (int4_group, mxfp4): two weights a byte, one scale per group of a row."""

    expert_format: int = ExpertFormat.INT4_GROUP

    @classmethod
    def from_layout(cls, blob_ptrs, layout, route_totals=None, fill_ptrs=None) -> "PackedExpertTable":
        base = ExpertTable.from_layout(blob_ptrs, layout, route_totals, fill_ptrs)
        return cls(**{f.name: getattr(base, f.name) for f in fields(ExpertTable)},
                   expert_format=int(layout.expert_format))

    @property
    def tag(self) -> str:
        return PACKED_KERNEL_TAGS[ExpertFormat(self.expert_format)]

    def check(self) -> None:
        super().check()
        if self.expert_format not in PACKED_KERNEL_TAGS:
            raise ValueError(f"expert format {self.expert_format} is not a 4-bit format {sorted(PACKED_KERNEL_TAGS)}")
        if self.group_size not in PACKED_GROUPS[self.expert_format]:
            raise ValueError(f"{self.tag} group size {self.group_size} not in {PACKED_GROUPS[self.expert_format]}")

    def weight_bytes(self) -> int:
        """Bytes of one expert's matrices and scales (what a GEMV pass reads of each active expert)."""
        weights = 3 * self.hidden_size * self.intermediate_size
        return weights // 2 + weights // self.group_size * (2 if self.tag == "int4" else 1)


def _gemv4_launch(name: str):
    fn = kernel("moe_gemv4", name)
    return fn, (_sm_count() * resident_blocks(fn, GEMV4_THREADS),)


def _tokens4(tokc: int | None, T: int, k: int, num_experts: int) -> int:
    tokc = tokc or tokens_per_pass(T, k, num_experts)
    if tokc not in GEMV4_TOKC:
        raise ValueError(f"tokens per pass must be one of {GEMV4_TOKC}")
    return tokc


def _gate_up4_passes(table: PackedExpertTable, disp: Dispatch, k: int, tokens_per_pass_: int | None):
    """(T, tokens per pass) of a 4-bit gate_up launch over `disp`'s T * k pairs (table and dispatch checked)."""
    _check_table_dispatch(table, disp)
    T = disp.num_pairs // k
    if T * k != disp.num_pairs:
        raise ValueError("dispatch pairs are not T * k")
    return T, _tokens4(tokens_per_pass_, T, k, table.num_experts)


def _down4_passes(table: PackedExpertTable, disp: Dispatch, weights, tokens_per_pass_: int | None) -> int:
    """Tokens per pass of a 4-bit down launch (table, dispatch and the routing weights, one a pair, checked)."""
    _check_table_dispatch(table, disp)
    P = disp.num_pairs
    _check_pair_weights(weights, P)
    k = weights.shape[-1] if weights.ndim == 2 else 1
    return _tokens4(tokens_per_pass_, P // k, k, table.num_experts)


def _check_gate_up4(x, table: PackedExpertTable, disp: Dispatch, k: int, tokens_per_pass_: int | None, out):
    """(tokens per pass, act) of a 4-bit gate_up launch on float inputs, after checking them."""
    T, tokc = _gate_up4_passes(table, disp, k, tokens_per_pass_)
    _check("input", x, dtype=np.float32, shape=(T, table.hidden_size))
    return tokc, _out("out", out, (disp.num_pairs, table.intermediate_size), _cupy().float32)


def _check_down4(act, table: PackedExpertTable, disp: Dispatch, weights, tokens_per_pass_: int | None, out):
    """(tokens per pass, ypair) of a 4-bit down launch on float inputs, after checking them."""
    tokc = _down4_passes(table, disp, weights, tokens_per_pass_)
    _check("input", act, dtype=np.float32, shape=(disp.num_pairs, table.intermediate_size))
    return tokc, _out("out", out, (disp.num_pairs, table.hidden_size), _cupy().float32)


def moe_gate_up_4bit(x, table: PackedExpertTable, disp: Dispatch, k: int, *, tokens_per_pass_: int | None = None,
                     out=None):
    """Decode GEMV over 4-bit experts: act [P, I] f32 in sorted (dispatch) order from x [T, H] f32 (`moe_gate_up`'s
    contract; fills `table.fill_ptrs` slots as it reads)."""
    H, I = table.hidden_size, table.intermediate_size
    tokc, act = _check_gate_up4(x, table, disp, k, tokens_per_pass_, out)
    fn, grid = _gemv4_launch(f"moe4_gate_up_{table.tag}_t{tokc}")
    fn(grid, (GEMV4_THREADS,),
       (x, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale),
        disp.perm, disp.offsets, disp.active, disp.meta, act, np.int32(H), np.int32(I), np.int32(k),
        np.int32(table.group_size)))
    return act


def moe_down_4bit(act, table: PackedExpertTable, disp: Dispatch, weights, *, tokens_per_pass_: int | None = None,
                  out=None):
    """Decode GEMV over 4-bit experts: ypair [P, H] f32 (pair order) = routing weight * (down @ act)."""
    H, I = table.hidden_size, table.intermediate_size
    tokc, y = _check_down4(act, table, disp, weights, tokens_per_pass_, out)
    fn, grid = _gemv4_launch(f"moe4_down_{table.tag}_t{tokc}")
    fn(grid, (GEMV4_THREADS,),
       (act, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
        disp.perm, disp.offsets, disp.active, disp.meta, weights, y, np.int32(H), np.int32(I),
        np.int32(table.group_size)))
    return y


def moe_gate_up_4bit_pairs(x, ids, table: PackedExpertTable, *, out=None):
    """`moe_gate_up_4bit` for `pairs_path` passes, without a dispatch: act [P, I] f32 in pair order (p = t * k + j)
    from x [T, H] f32 and the router's ids [T, k] int32; an id outside [0, E) gives a zero row (as
    `moe_gate_up_pairs`; fills `table.fill_ptrs` as it reads)."""
    H, I = table.hidden_size, table.intermediate_size
    T, k = _check_pairs(table, ids, x, H, False)
    act = _out("out", out, (T * k, I), _cupy().float32)
    fn, grid = _gemv4_launch(f"moe4_gate_up_pairs_{table.tag}")
    fn(grid, (GEMV4_THREADS,),
       (x, ids, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up), np.int64(table.off_gate_up_scale),
        act, np.int32(H), np.int32(I), np.int32(k), np.int32(table.group_size), np.int32(T * k),
        np.int32(table.num_experts)))
    return act


def moe_down_4bit_pairs(act, ids, weights, table: PackedExpertTable, *, out=None):
    """ypair [P, H] f32 = weights[p] * (down_{ids[p]} @ act[p]) for act [P, I] f32 in pair order
    (`moe_gate_up_4bit_pairs`); an id outside [0, E) gives a zero row."""
    H, I = table.hidden_size, table.intermediate_size
    T, k = _check_pairs(table, ids, act, I, True)
    _check("weights", weights, dtype=np.float32, shape=(T, k))
    y = _out("out", out, (T * k, H), _cupy().float32)
    fn, grid = _gemv4_launch(f"moe4_down_pairs_{table.tag}")
    fn(grid, (GEMV4_THREADS,),
       (act, ids, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
        weights, y, np.int32(H), np.int32(I), np.int32(table.group_size), np.int32(T * k),
        np.int32(table.num_experts)))
    return y


# ---- 4-bit experts on the tensor cores (moe_gemv4_tc.cu): int4_group decode passes ---------------------------------
TC4_FORMATS = (ExpertFormat.INT4_GROUP,)   # what moe_gemv4_tc.cu decodes


def _check_tc4_table(table: PackedExpertTable) -> None:
    if table.expert_format not in TC4_FORMATS:
        raise ValueError(f"the tensor-core 4-bit GEMVs take {[f.name for f in TC4_FORMATS]}, not {table.tag}")


def stage_activations_tc4(a, *, out=None):
    """a [rows, ncols] f32 -> [rows, 2, ncols // 2] uint32: bf16 hi and lo pairs in moe_gemv4_tc.cu's word order
    (the B operand of its MMAs; written once per launch, read by every block)."""
    cp = _cupy()
    _check("input", a, dtype=np.float32, ndim=2)
    rows, ncols = a.shape
    if ncols % 8:
        raise ValueError(f"{ncols} columns: the staging permutes words of 8")
    staged = _out("staged", out, (rows, 2, ncols // 2), cp.uint32)
    if a.size:
        kernel("moe_gemv4_tc", "moe4tc_stage")((_grid_stride_blocks(a.size, TC4_THREADS),), (TC4_THREADS,),
                                              (a, staged, np.int32(rows), np.int32(ncols)))
    return staged


def _tc4_launch(name: str):
    """(kernel, grid): the blocks the machine holds at once (a grid-stride loop over block items)."""
    fn = kernel("moe_gemv4_tc", name)
    return fn, (_sm_count() * resident_blocks(fn, TC4_THREADS),)


def moe_gate_up_4bit_tc(x, table: PackedExpertTable, disp: Dispatch, k: int, *, tokens_per_pass_: int | None = None,
                        staged=None, out=None):
    """`moe_gate_up_4bit` on the tensor cores (int4_group): the same act [P, I], fills included. staged: the
    [T, 2, H // 2] uint32 buffer `stage_activations_tc4` writes x into (preallocated for graph capture)."""
    H, I = table.hidden_size, table.intermediate_size
    tokc, act = _check_gate_up4(x, table, disp, k, tokens_per_pass_, out)
    _check_tc4_table(table)
    staged = stage_activations_tc4(x, out=staged)
    fn, grid = _tc4_launch(f"moe4tc_gate_up_{table.tag}_t{tokc}")
    fn(grid, (TC4_THREADS,),
       (staged, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up),
        np.int64(table.off_gate_up_scale), disp.perm, disp.offsets, disp.active, disp.meta, act, np.int32(H),
        np.int32(I), np.int32(k), np.int32(table.group_size)))
    return act


def moe_down_4bit_tc(act, table: PackedExpertTable, disp: Dispatch, weights, *, tokens_per_pass_: int | None = None,
                     staged=None, out=None):
    """`moe_down_4bit` on the tensor cores (int4_group): the same ypair [P, H]. staged: act's [P, 2, I // 2] uint32
    staging buffer (see `moe_gate_up_4bit_tc`)."""
    H, I = table.hidden_size, table.intermediate_size
    tokc, y = _check_down4(act, table, disp, weights, tokens_per_pass_, out)
    _check_tc4_table(table)
    staged = stage_activations_tc4(act, out=staged)
    fn, grid = _tc4_launch(f"moe4tc_down_{table.tag}_t{tokc}")
    fn(grid, (TC4_THREADS,),
       (staged, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
        disp.perm, disp.offsets, disp.active, disp.meta, weights, y, np.int32(H), np.int32(I),
        np.int32(table.group_size)))
    return y


def uses_tc4(tensor_cores: bool | None, table: PackedExpertTable, tokens: int) -> bool:
    """Whether a 4-bit decode pass of `tokens` runs moe_gemv4_tc.cu: asked for (None: the measured crossover,
    limits.TC4_MIN_TOKENS and TC4_MIN_INTERMEDIATE, read at the call) and a format it decodes; otherwise
    moe_gemv4.cu's kernels run."""
    if tensor_cores is None:
        tensor_cores = tokens >= limits.TC4_MIN_TOKENS and table.intermediate_size >= limits.TC4_MIN_INTERMEDIATE
    return tensor_cores and table.expert_format in TC4_FORMATS


# ---- 4-bit experts on int8 activations (moe_gemv4_dp4a.cu): int4_group decode passes --------------------------------
A8_STAGE_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])   # the staged bytes of each 8 inputs (moe_gemv4_dp4a.cu)


def uses_a8(int8_activations: bool, table: ExpertTable) -> bool:
    """Whether an expert table's products run on int8 activations: asked for (EngineConfig.int8_activations) and a
    format moe_gemv4_dp4a.cu decodes (A8_FORMATS); int8 / float experts keep their float-activation kernels."""
    return isinstance(table, PackedExpertTable) and limits.rounds_activations(int8_activations, table.expert_format)


def quantize_activations_a8_reference(a) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy twin of `quantize_activations_a8` (float32 arithmetic, bit for bit): (q int8 [rows, ncols] in the
    staged byte order, scales f32 [rows, ncols // A8_GROUP]) (`numpy_backend.quantize_int8_groups`)."""
    from colibri_format.runtime.numpy_backend import quantize_int8_groups  # noqa: PLC0415

    a = np.asarray(a, np.float32)
    q, s = quantize_int8_groups(a, A8_GROUP)
    rows, ncols = q.shape
    return np.ascontiguousarray(q.reshape(rows, ncols // 8, 8)[:, :, A8_STAGE_ORDER].reshape(rows, ncols)), s


def unstage_a8(q) -> np.ndarray:
    """Staged int8 activations (host array) back in column order."""
    q = np.asarray(q)
    rows, ncols = q.shape
    out = np.empty_like(q).reshape(rows, ncols // 8, 8)
    out[:, :, A8_STAGE_ORDER] = q.reshape(rows, ncols // 8, 8)
    return out.reshape(rows, ncols)


def _check_a8_input(a, name: str = "input"):
    _check(name, a, dtype=np.float32, ndim=2)
    if a.shape[1] % A8_GROUP:
        raise ValueError(f"{name} has {a.shape[1]} columns: not whole groups of {A8_GROUP}")
    return a.shape[0], a.shape[1]


def quantize_activations_a8(a, *, q=None, scales=None):
    """a [rows, ncols] f32 -> (q int8 [rows, ncols], scales f32 [rows, ncols // A8_GROUP]): each group of A8_GROUP
    inputs as rint(v / s), s = max|v| / 127 (moe4a8_quantize; q in the staged byte order the dp4a GEMVs read; twin:
    `quantize_activations_a8_reference`)."""
    cp = _cupy()
    rows, ncols = _check_a8_input(a)
    q = _out("q", q, (rows, ncols), cp.int8)
    scales = _out("scales", scales, (rows, ncols // A8_GROUP), cp.float32)
    groups = rows * ncols // A8_GROUP
    if groups:
        kernel("moe_gemv4_dp4a", "moe4a8_quantize")(
            (_grid_stride_blocks(groups * 32, A8_QUANT_THREADS),), (A8_QUANT_THREADS,),
            (a, q, scales, np.int64(groups)))
    return q, scales


def round_activations_a8(a, *, out=None):
    """a [rows, ncols] f32 rounded to int8 per group of A8_GROUP, as floats q * s (moe4a8_round; `out` may be a:
    in place; twin: `numpy_backend.round_int8_groups` on float32)."""
    cp = _cupy()
    rows, ncols = _check_a8_input(a)
    out = _out("out", out, (rows, ncols), cp.float32)
    groups = rows * ncols // A8_GROUP
    if groups:
        kernel("moe_gemv4_dp4a", "moe4a8_round")(
            (_grid_stride_blocks(groups * 32, A8_QUANT_THREADS),), (A8_QUANT_THREADS,), (a, out, np.int64(groups)))
    return out


def _check_a8_table(table: PackedExpertTable) -> None:
    if not isinstance(table, PackedExpertTable) or table.expert_format not in A8_FORMATS:
        raise ValueError(f"the dp4a 4-bit GEMVs take {[f.name for f in A8_FORMATS]} tables")


def _check_a8_pair(q, s, rows: int, cols: int) -> None:
    _check("q", q, dtype=np.int8, shape=(rows, cols))
    _check("scales", s, dtype=np.float32, shape=(rows, cols // A8_GROUP))


def _a8_launch(name: str):
    fn = kernel("moe_gemv4_dp4a", name)
    return fn, (_sm_count() * resident_blocks(fn, A8_THREADS),)


def moe_gate_up_4bit_a8(xq, xs, table: PackedExpertTable, disp: Dispatch, k: int, *,
                        tokens_per_pass_: int | None = None, out=None):
    """`moe_gate_up_4bit` on int8 activations (int4_group): act [P, I] f32 in sorted order from x's
    `quantize_activations_a8` (xq int8 [T, H], xs f32 [T, H // A8_GROUP]); fills `table.fill_ptrs` as it reads."""
    _check_a8_table(table)
    H, I = table.hidden_size, table.intermediate_size
    T, tokc = _gate_up4_passes(table, disp, k, tokens_per_pass_)
    _check_a8_pair(xq, xs, T, H)
    act = _out("out", out, (disp.num_pairs, I), _cupy().float32)
    fn, grid = _a8_launch(f"moe4a8_gate_up_{table.tag}_t{tokc}")
    fn(grid, (A8_THREADS,),
       (xq, xs, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up),
        np.int64(table.off_gate_up_scale), disp.perm, disp.offsets, disp.active, disp.meta, act, np.int32(H),
        np.int32(I), np.int32(k), np.int32(table.group_size)))
    return act


def moe_down_4bit_a8(aq, as_, table: PackedExpertTable, disp: Dispatch, weights, *,
                     tokens_per_pass_: int | None = None, out=None):
    """`moe_down_4bit` on int8 activations (int4_group): ypair [P, H] f32 (pair order) = routing weight *
    (down @ act) from act's `quantize_activations_a8` (aq int8 [P, I], as_ f32 [P, I // A8_GROUP])."""
    _check_a8_table(table)
    H, I = table.hidden_size, table.intermediate_size
    P = disp.num_pairs
    tokc = _down4_passes(table, disp, weights, tokens_per_pass_)
    _check_a8_pair(aq, as_, P, I)
    y = _out("out", out, (P, H), _cupy().float32)
    fn, grid = _a8_launch(f"moe4a8_down_{table.tag}_t{tokc}")
    fn(grid, (A8_THREADS,),
       (aq, as_, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
        disp.perm, disp.offsets, disp.active, disp.meta, weights, y, np.int32(H), np.int32(I),
        np.int32(table.group_size)))
    return y


def _check_a8_pairs(q, scales, ids, table: PackedExpertTable, a_row_per_pair: bool, cols: int) -> tuple[int, int]:
    """(T, k) of a by-pair dp4a launch: the table, the router's ids [T, k] int32 and the int8 inputs (a row a token,
    or a row a pair) [rows, cols] with their group scales checked."""
    _check_a8_table(table)
    T, k = _pair_ids(table, ids)
    _check_a8_pair(q, scales, T * k if a_row_per_pair else T, cols)
    return T, k


def moe_gate_up_4bit_a8_pairs(xq, xs, ids, table: PackedExpertTable, *, out=None):
    """`moe_gate_up_4bit_a8` for `pairs_path` passes, without a dispatch: act [P, I] f32 in pair order from x's
    `quantize_activations_a8` (xq int8 [T, H], xs f32 [T, H // A8_GROUP]) and the router's ids [T, k] int32; an id
    outside [0, E) gives a zero row."""
    H, I = table.hidden_size, table.intermediate_size
    T, k = _check_a8_pairs(xq, xs, ids, table, False, H)
    act = _out("out", out, (T * k, I), _cupy().float32)
    fn, grid = _a8_launch(f"moe4a8_gate_up_pairs_{table.tag}")
    fn(grid, (A8_THREADS,),
       (xq, xs, ids, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_gate_up),
        np.int64(table.off_gate_up_scale), act, np.int32(H), np.int32(I), np.int32(k), np.int32(table.group_size),
        np.int32(T * k), np.int32(table.num_experts)))
    return act


def moe_down_4bit_a8_pairs(aq, as_, ids, weights, table: PackedExpertTable, *, out=None):
    """ypair [P, H] f32 = weights[p] * (down_{ids[p]} @ act[p]) from act's `quantize_activations_a8` (aq int8 [P, I],
    as_ f32 [P, I // A8_GROUP], pair order); an id outside [0, E) gives a zero row."""
    H, I = table.hidden_size, table.intermediate_size
    T, k = _check_a8_pairs(aq, as_, ids, table, True, I)
    _check("weights", weights, dtype=np.float32, shape=(T, k))
    y = _out("out", out, (T * k, H), _cupy().float32)
    fn, grid = _a8_launch(f"moe4a8_down_pairs_{table.tag}")
    fn(grid, (A8_THREADS,),
       (aq, as_, ids, table.blob_ptrs, _ptr(table.fill_ptrs), np.int64(table.off_down), np.int64(table.off_down_scale),
        weights, y, np.int32(H), np.int32(I), np.int32(table.group_size), np.int32(T * k),
        np.int32(table.num_experts)))
    return y


class Int8Expansion:
    """Device int8_group blobs of the same shape and group size for every expert of a 4-bit table (the prefill
    GEMM's input, written by `expand_to_int8` for a pass's routed experts): num_experts x ~1.125 bytes a weight."""

    def __init__(self, table: PackedExpertTable) -> None:
        cp = _cupy()
        E, g = table.num_experts, table.group_size
        self.layout = blob_layout(table.hidden_size, table.intermediate_size, ExpertFormat.INT8_GROUP, g)
        self.buffer = cp.empty(E * self.layout.size, cp.uint8)   # every byte the GEMM reads is expanded first
        ptrs = np.array([self.buffer.data.ptr + e * self.layout.size for e in range(E)], np.uint64)
        self.table = ExpertTable.from_layout(cp.asarray(ptrs), self.layout)
        self.key = self.key_of(table)

    @staticmethod
    def key_of(table: PackedExpertTable) -> tuple:
        return ("int8_expansion", table.num_experts, table.hidden_size, table.intermediate_size, table.group_size)


def _expansion(table: PackedExpertTable, expansions: dict | None) -> Int8Expansion:
    key = Int8Expansion.key_of(table)
    if expansions is None:
        return Int8Expansion(table)
    if key not in expansions:
        expansions[key] = Int8Expansion(table)
    return expansions[key]


def expand_to_int8(table: PackedExpertTable, disp: Dispatch, expansion: Int8Expansion) -> ExpertTable:
    """Write the experts `disp` routes (its active list) into `expansion` as int8_group blobs; returns its table.
    The same weights exactly: int4 values, and twice the E2M1 values with half the E8M0 scale (moe_gemv4.cu)."""
    table.check()
    if disp.num_experts != table.num_experts or expansion.key != Int8Expansion.key_of(table):
        raise ValueError("the dispatch or the expansion workspace was made for another expert table")
    H, I, g = table.hidden_size, table.intermediate_size, table.group_size
    dst = expansion.layout
    gu_chunks, dn_chunks = 2 * I * H // 32, H * I // 32
    blocks = max(1, min(-(-(gu_chunks + dn_chunks) // EXPAND_THREADS), 4 * _sm_count() // table.num_experts))
    kernel("moe_gemv4", f"moe4_expand_{table.tag}")(
        (blocks, table.num_experts), (EXPAND_THREADS,),
        (table.blob_ptrs, disp.active, disp.meta, expansion.buffer, np.int64(dst.size),
         *(np.int64(getattr(table, name)) for name in ("off_gate_up", "off_gate_up_scale", "off_down",
                                                        "off_down_scale")),
         *(np.int64(dst.array(name).offset) for name in ("gate_up", "gate_up_scale", "down", "down_scale")),
         np.int64(gu_chunks), np.int64(dn_chunks), np.int64(2 * I * H // g), np.int64(H * I // g)))
    return expansion.table


def _moe_experts_4bit_pairs(x, ids, weights, table: PackedExpertTable, int8_activations: bool, bufs: dict, act,
                            ypair, *, residual, alpha: float, out):
    """`moe_experts_4bit`'s `pairs_path` passes: the by-pair GEMVs (dp4a on x and act rounded to int8 where
    int8_activations), then the combine; no dispatch."""
    if int8_activations:
        xq, xs = quantize_activations_a8(x, q=bufs.get("xq"), scales=bufs.get("xs"))
        act = moe_gate_up_4bit_a8_pairs(xq, xs, ids, table, out=act)
        aq, as_ = quantize_activations_a8(act, q=bufs.get("aq"), scales=bufs.get("as"))
        ypair = moe_down_4bit_a8_pairs(aq, as_, ids, weights, table, out=ypair)
    else:
        act = moe_gate_up_4bit_pairs(x, ids, table, out=act)
        ypair = moe_down_4bit_pairs(act, ids, weights, table, out=ypair)
    return moe_combine(ypair, ids.shape[1], residual=residual, alpha=alpha, out=out)


def moe_experts_4bit(x, ids, weights, table: PackedExpertTable, *, residual=None, alpha: float = 1.0,
                     gemm: bool | None = None, disp: Dispatch | None = None, act=None, ypair=None,
                     expansions: dict | None = None, tensor_cores: bool | None = None, staged=(None, None),
                     int8_activations: bool = False, a8_buffers: dict | None = None, pairs: bool | None = None,
                     out=None):
    """`moe_experts` over 4-bit experts: the moe_gemv4.cu GEMVs, or (gemm_path: prefill) the routed experts
    expanded to int8_group (`expand_to_int8`) and the grouped int8 GEMM (fp32 SIMT, group scales).

    expansions: a dict that keeps the Int8Expansion workspace between calls (the backend's workspace); None: a
    fresh one per GEMM call. tensor_cores: decode passes on moe_gemv4_tc.cu where `uses_tc4` says so (None: the
    measured crossover); staged: its (x, act) staging buffers, preallocated for graph capture.
    int8_activations (int4_group only, `uses_a8`): both products' inputs rounded to int8 per group of A8_GROUP;
    decode passes run moe_gemv4_dp4a.cu (tensor_cores ignored), prefill passes the same GEMM on the rounded inputs
    (`round_activations_a8`). a8_buffers: its buffers, preallocated for graph capture (keys xq, xs, aq, as for
    decode, x_rounded for prefill; missing ones are allocated). pairs: a GEMV pass off the tensor cores by pair
    without a dispatch (`moe_gate_up_4bit_pairs`, `moe_gate_up_4bit_a8_pairs`; None: where `pairs_path` says so)."""
    T, k = ids.shape
    use_gemm = gemm if gemm is not None else gemm_path(T, k, table.num_experts)
    if int8_activations and table.expert_format not in A8_FORMATS:
        raise ValueError(f"int8 activations are built for {[f.name for f in A8_FORMATS]}, not {table.tag}")
    bufs = a8_buffers or {}
    by_pair = pairs_path(T) if pairs is None else pairs
    if not use_gemm and by_pair and (int8_activations or not uses_tc4(tensor_cores, table, T)):
        return _moe_experts_4bit_pairs(x, ids, weights, table, int8_activations, bufs, act, ypair, residual=residual,
                                       alpha=alpha, out=out)
    a8_decode = int8_activations and not use_gemm
    if a8_decode:        # x rounded to int8 by the dispatch launch
        cp = _cupy()
        xq = _out("xq", bufs.get("xq"), x.shape, cp.int8)
        xs = _out("xs", bufs.get("xs"), (T, x.shape[1] // A8_GROUP), cp.float32)
    disp = dispatch(ids, table.num_experts, tile_m=GEMM_BM, out=disp, quantize=(x, xq, xs) if a8_decode else None)
    if use_gemm:
        # held until the GEMMs are queued: the returned table holds raw addresses only, and a workspace freed early
        # hands its memory to this call's next allocations (x rounded, act) while the GEMMs still read it
        expansion = _expansion(table, expansions)
        int8 = expand_to_int8(table, disp, expansion)
        if int8_activations:
            x = round_activations_a8(x, out=bufs.get("x_rounded"))
        act = moe_gemm_gate_up(x, int8, disp, k, tensor_cores=False, out=act)
        if int8_activations:
            act = round_activations_a8(act, out=act)
        ypair = moe_gemm_down(act, int8, disp, weights, tensor_cores=False, out=ypair)
    elif a8_decode:
        act = moe_gate_up_4bit_a8(xq, xs, table, disp, k, out=act)
        aq, as_ = quantize_activations_a8(act, q=bufs.get("aq"), scales=bufs.get("as"))
        ypair = moe_down_4bit_a8(aq, as_, table, disp, weights, out=ypair)
    elif uses_tc4(tensor_cores, table, T):
        act = moe_gate_up_4bit_tc(x, table, disp, k, staged=staged[0], out=act)
        ypair = moe_down_4bit_tc(act, table, disp, weights, staged=staged[1], out=ypair)
    else:
        act = moe_gate_up_4bit(x, table, disp, k, out=act)
        ypair = moe_down_4bit(act, table, disp, weights, out=ypair)
    return moe_combine(ypair, k, residual=residual, alpha=alpha, out=out)
