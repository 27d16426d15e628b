"""What the CUDA kernels are built with and what they can run, declared once.

Tile and thread constants: `KERNEL_DEFINES[module]` reaches `kernels/<module>.cu` as `-DNAME=value` compile options
(`define_options`; kernels/ops.py passes them to NVRTC, tests/runtime/cuda/test_kernels_compile.py to nvcc). The
`.cu` files define none of them and stop with `#error` when one is missing; ops.py computes launch shapes from the
same names.

Capabilities (experts per layer, top_k, head sizes, alignment) follow from those constants and from the kernels'
instantiations. `check_cuda_support` refuses, when a file is opened, a spec-valid model that the kernels cannot
run, with an `UnsupportedModel` naming the field, instead of a ValueError at the first token.

No CuPy here: importable, and testable, on any machine.
"""

from __future__ import annotations

from typing import Any

from colibri_format.errors import UnsupportedModel
from colibri_format.spec.constants import EXPERT_FORMAT_NAMES, PACKED_FORMATS, QUANTIZED_FORMATS, ExpertFormat

WARP = 32

# ---- tile and thread constants (compiled into the kernels through -D) -------------------------------------------
# router.cu: a block computes the logits of ROUTER_TPB tokens x ROUTER_EPB experts with ROUTER_THREADS threads; the
# selecting warp of a token keeps one selected expert per lane (ROUTER_MAX_K) and holds ROUTER_MAX_E / 32 experts
# per lane in its widest instantiation.
ROUTER_THREADS = 256
ROUTER_TPB = 4
ROUTER_EPB = 8
ROUTER_WIDTHS = (32, 64, 128, 256, 512)     # kernels moe_router_<dtype>_e<width> and add_rmsnorm_route_<dtype>_e<width>
#                                             (width / 32 experts a lane)
ROUTER_MAX_E = ROUTER_WIDTHS[-1]
ROUTER_MAX_K = WARP
# router.cu's add_rmsnorm_route (the post-attention add + norm and the router in one launch) runs passes of up to
# this many rows; larger passes run add_rmsnorm then the router, as each of a token group's ceil(E / ROUTER_EPB)
# blocks re-reads the rows of h and o that add_rmsnorm reads once: on Qwen3-30B-A3B it saved ~27 us a step at one
# token and cost ~29 more at eight (docs/benchmarks.md, session 20). Its
# h and x equal add_rmsnorm's bit for bit while ROUTER_THREADS == FUSED_THREADS (the same sums in the same order).
NORM_ROUTE_MAX_ROWS = 1
# ops.router takes the logits of passes of at least this many rows (of routers of more than ROUTER_EPB experts:
# ops.router_by_gemm) from cuBLAS's fp32 product and launches the selection alone (router.cu's moe_router_select
# kernels); fewer rows run the fused kernel, whose blocks of ROUTER_TPB tokens x ROUTER_EPB experts re-read the rows
# of x and of the weight. H200, session 25 (benchmarks/router_prefill.py, µs, fused / GEMM route): Qwen3-30B-A3B 64
# rows 10.0 / 14.7, 128 16.0 / 15.4, 256 27.0 / 17.6, 512 48.7 / 21.6; OLMoE 128 9.5 / 13.7, 256 15.4 / 13.9;
# gpt-oss 128 19.6 / 19.6, 256 35.0 / 22.4; DeepSeek-V3 128 52.9 / 52.2, 256 95.6 / 62.3: the GEMM route wins from 256
ROUTER_GEMM_MIN_ROWS = 256
# DeviceDense.normed_linear folds the input norm into the q|k|v product (dense_gemv_normed) for passes of up to this
# many rows: at one token it saves ~16 us a Qwen3-30B-A3B step; at eight it took 1158.5 us against ~733 for the plain
# product, ~322 us more than the product and the rmsnorm launches (103.4 us) it replaced (docs/benchmarks.md,
# session 20)
NORMED_GEMV_MAX_ROWS = 1
# dispatch.cu: one block; per-warp expert counts in shared memory
DISPATCH_THREADS = 512
DISPATCH_MAX_E = 512
# ops.dispatch ranks passes of at least this many pairs over several blocks (dispatch.cu's moe_dispatch_ranks /
# _groups / _scatter: three launches) instead of one block (moe_dispatch, one launch); 0: never. On the H200
# (benchmarks/dispatch_spread.py, session 26) the spread form won at 4,096 pairs on every shape timed (Qwen3-30B-A3B
# 17.1 -> 7.2 µs, OLMoE 15.4 -> 7.2, Mixtral 9.5 -> 6.7) and lost at 1,024 (5.7 -> 6.9, 5.3 -> 7.0, 4.1 -> 6.5).
DISPATCH_SPREAD_MIN_PAIRS = 4096
# moe_gemv.cu
GEMV_THREADS = 128
GEMV_TOKC = (1, 2, 4, 8)                    # tokens per pass of the moe_{gate_up,down}_t<TOKC> kernels
GEMV_WIDE = ("w2", "w4")                    # one token per pass, 2 / 4 chunks of loads a lane issued at once
# the w4 kernels' plan (the one-token default): (rows a warp item, 16-byte chunks of each row a lane loads at once)
# of gate_up (half its rows gate, half up: even) and of down; benchmarks/gemv_sweep.py times others against it
# (H200, 2026-12-02: (4, 1) beat the earlier (4, 4) on both stages of Mixtral and Qwen3 experts, docs/benchmarks.md)
GEMV_W4_PLAN = ((4, 1), (4, 1))
# moe_gemm.cu: GEMM_BM x GEMM_BN output tiles over GEMM_BK-column steps (fp32 SIMT and tensor-core variants)
GEMM_THREADS = 256
GEMM_BM = 64
GEMM_BN = 64
GEMM_BK = 32
GEMM_PAD = 4
TC_THREADS = 128
# moe_gemm_fast.cu: the pipelined tensor-core grouped GEMM (opt-in, ops.moe_gemm_*_fast): FAST_BM rows (the
# dispatch's tile_m) x FAST_BN weight rows a block of 8 warps, FAST_BK columns a step, FAST_STAGES cp.async stages
# in dynamic shared memory (24 KB a stage with bf16 activations, 32 KB with hi + lo), FAST_MIN_BLOCKS blocks a
# multiprocessor asked of the register allocator (2: at most 128 registers a thread)
FAST_THREADS = 256
FAST_BM = GEMM_BM
FAST_BN = 256
FAST_BK = 64
FAST_STAGES = 3
FAST_MIN_BLOCKS = 2
# 1: a block's warps skip the MMAs (and A fragment loads) of m16 row tiles past its expert's rows, which are zeros
# and never stored (the same results bit for bit): Qwen3-30B-A3B's 512-token prefill routes ~32 rows to an expert,
# so about a third of a 64-row tile's MMAs are such. 0 until prefill_gemm.py --sweep has timed it on a GPU.
FAST_SKIP_EMPTY_M = 0
# K steps of FAST_BK columns a pipeline stage holds, a row's bytes of all of them copied by consecutive lanes: with
# int8 weights one step asks 64 bytes of each weight row (a warp's copy instruction: 8 rows x 64 bytes). At the
# 512-token shapes of Qwen3-30B-A3B and OLMoE (~32-64 rows an expert, memory-bound) the s8 kernel read its weights at
# ~2 TB/s, about half the HBM rate (docs/benchmarks.md, session 13); 2 asks whole 128-byte lines (4 rows x 128 bytes
# an instruction, half the requests). 1 until prefill_gemm.py --sweep has timed it on a GPU.
FAST_STAGE_STEPS = 1
# Bytes around each copy's source that moe_gemm_fast.cu's cp.async brings into L2 (0, 128, 256: PTX's L2::128B /
# L2::256B prefetch sizes), so that a step's 64-byte read of a weight row brings the next step's bytes from DRAM with
# it. H200, session 25 (prefill_gemm.py --sweep, the s8 kernels alone by CUPTI, µs): Qwen3-30B-A3B 512 tokens gate_up
# 183.7 -> 127.0 (2.19 -> 3.17 TB/s of weights), down 107.4 -> 80.8; OLMoE 138.7 -> 122.0, 83.5 -> 72.7; 256 the same
# within 2.2 %. The short runs of a weight row (64 bytes a K step) were what held the kernel at half the HBM rate.
FAST_L2_PREFETCH = 128
# 1: moe_gemm_fast.cu's blocks take several work items (ops._fast_launch launches as many blocks as run at once, when an
# item spans at least FAST_STAGES stages) and run their copies on from one item into the next, instead of a block an
# item filling and draining the cp.async pipeline each (Qwen3-30B-A3B's down: 12 K steps a block at 512 tokens).
# 0 until prefill_gemm.py --sweep has timed it on a GPU.
FAST_PERSISTENT = 0
# moe_gemm_cublas.cu + cuBLAS (ops.moe_experts_cublas): the prefill grouped expert GEMM as bf16 cublasGemmEx products
# of each routed expert's widened int8 matrices, taken when an expert's mean work, (P / E) H I multiply-adds a
# matrix, reaches this: each routed expert costs a widening and ~6 launches from the host, which only large products
# repay. On the H200 (benchmarks/prefill_gemm.py, docs/benchmarks.md, session 12) cuBLAS ran Mixtral's block 1.04x
# (split) / 0.82x (bf16) as fast at 128 pairs an expert, 1.37x / 1.20x at 256, 1.90x / 2.15x at 1024 (crossovers:
# split below 128, bf16 ~185 pairs); Qwen3 and OLMoE (<= 1.1e9 at 4096 tokens) ran 3.5-40x slower on it.
CUBLAS_MIN_EXPERT_MACS = 12_000_000_000
# The W8A8 route (EngineConfig.fast_expert_gemm 'auto' / 'int8': int8 products on cuBLAS, two calls an expert) from
# this mean work: full-depth Mixtral-8x7B prefill on the H200 (benchmarks/prefill_engine.py, docs/benchmarks.md,
# session 13) took 66.0 / 44.9 / 67.5 / 53.7 / 264.5 ms at 128 / 256 / 1024 / 512 / 4096 tokens on it against the
# 'split' defaults' 49.6 / 74.4 / 155.5 / 120.1 / 490.4: the crossover lies between 32 and 64 pairs an expert, and
# 64 x 4096 x 14336 = 3.76e9. Qwen3-30B-A3B's 128 small experts never reach it (512 tokens took 503 ms on it); an
# 'int8' pass below it runs moe_gemm_fast.cu's s8 MMAs (Qwen3 512 tokens: 31.9 ms; not yet placed against them).
CUBLAS_INT8_MIN_EXPERT_MACS = 3_700_000_000
# 'auto' rounds a pass to W8A8 (below CUBLAS_INT8_MIN_EXPERT_MACS: the pipelined kernel's s8 MMAs) from this mean
# work an expert matrix. Full-depth prefill on the H200 (docs/benchmarks.md): session 15, 'int8' against 'split', ms:
# Mixtral 128 tokens (1.9e9 a matrix) 27.8 vs 49.7; Qwen3 4096 (4.0e8) 211.0 vs 283.4; OLMoE 4096 (1.1e9) 76.4 vs
# 107.1. Below ~3e8 those walls showed no gain because the host, not the device, set them; session 21 timed the
# device alone (benchmarks/prefill_host.py): Qwen3 512 tokens (5.0e7) 27.3 vs 40.5 ms (wall 33.6 vs 43.2), OLMoE 512
# (1.3e8) 7.5 vs 12.8 (wall 15.5 vs 15.1: host-bound either way). Smaller passes are not timed: kept on 'split'.
# Tiny test models (H I ~ 1e4) never reach it, so their float parity tests keep 'split' (W8A8 has its own tests).
W8A8_MIN_EXPERT_MACS = 40_000_000
GLUE_THREADS = 256      # its element-wise kernels' blocks (grid-stride)
# moe_gemm_cublas.cu's quantize_rows_int8 (the W8A8 routes' row rounding): a row of whole float4s, up to 32 x
# QUANT_WARP_VECS of them, is a warp's (read once into its registers); longer rows a block's, read once up to
# GLUE_THREADS x QUANT_ROW_VECS float4s, else twice. H200, session 25: a block a row took 18 µs a call at Qwen3's 512
# tokens and 137 at 4,096 (1.7 and 13.1 ms of those prefills), walking its rows one after another.
QUANT_WARP_VECS = 16
QUANT_ROW_VECS = 16
# layers.cu: attention blocks of ATT_THREADS threads for up to ATT_GMAX query heads of a kv head. dense_gemv: a
# kernel per token count (tokens a pass) -> (output rows a warp computes, 16-byte loads per row a lane issues at
# once); measured on the H200 at the decode shapes of Qwen3/OLMoE/Mixtral (benchmarks/decode_profile.py): eight
# tokens want rows that share each x load (4 x 1). One token wanted loads in flight (2 rows x 4) while an item ran on
# one warp; with its K split over warps (DG_MAX_SPLITS) 2 x 2 is faster (benchmarks/dense_gemv_sweep.py, session 17:
# Qwen3 q/k/v 8.37 -> 7.42 us, o_proj 6.56 -> 6.11, Mixtral q/k/v 16.17 -> 14.82, lm_head 138.8 -> 139.9).
ATT_THREADS = 128
ATT_GMAX = 8
# attention_decode (query rows <= ATT_DECODE_MAX_ROWS): K and V values a lane takes from each key tile, and the fewest
# keys a split is planned with (more splits, shorter serial chains: decode is latency-bound, not bandwidth-bound)
ATT_LANE_FLOATS = 32
ATT_DECODE_MAX_ROWS = 32
ATT_DECODE_MIN_KEYS = 16
# the most context splits an attention launch takes (attention_splits' cap; attention_decode's merge holds a weight
# per split and head in shared memory)
ATT_MAX_SPLITS = 64
# attention_decode's last-block merge: splits whose partial outputs a thread loads before it adds any (one L2 round
# trip for up to this many splits; the sum's order, and so its bits, do not depend on it). H200, session 31
# (benchmarks/attention_decode.py --define ATT_MERGE_LOADS=16|32, f32 caches, 17/512/4096 keys): 16 was faster than 8
# on all 12 Qwen3 and OLMoE cases (Qwen3 b1 4096 keys 16.37 against 18.65 us, b8 81.40 against 85.66; OLMoE b1 17
# keys 4.76 against 5.39); 32 gave back most of it (Qwen3 b1 4096 17.99)
ATT_MERGE_LOADS = 16
# attention_decode's key tiles in flight: a tile is ATT_LANE_FLOATS x 32 values of K and as many of V (8 KiB of f32,
# 4 KiB of 16-bit values), copied into shared memory ATT_DECODE_STAGES - 1 tiles ahead of the one computed on. H100,
# session 30 (benchmarks/attention_decode.py --define ATT_DECODE_STAGES=2|3|4|8): 2 was fastest or tied on every
# Qwen3 and OLMoE case (Qwen3 b1 f32 4096 keys 29.1 against 30.1 us with 4); a split's time follows its tiles'
# arithmetic, not the copies (8 splits of 512 keys: 141 us, 64 of 64: 30 us)
ATT_DECODE_STAGES = 2
# attention_prefill.cu (flash attention, prefill): blocks of FA_THREADS threads, 16 (query row, head) pairs a warp,
# over key tiles of FA_BN keys for bf16 caches, FA_BN_F32 for fp32 caches (their tiles are kept as bf16 hi and lo
# parts: twice the shared memory a key) and FA_BN_HD256 for head_dim 256 (more keys spilled registers with nvcc 13)
FA_THREADS = 128
FA_BN = 64
FA_BN_F32 = 32
FA_BN_HD256 = 16
FA_BM = FA_THREADS // WARP * 16             # (row, head) pairs a block
FA_PAD = 8                                  # bf16 elements of padding a shared row: conflict-free ldmatrix rows
FA_PLAN_FIELDS = 5                          # a tile of the host plan: first row of its span, first pair, pairs,
#                                             first key, keys end
FA_HEAD_DIMS = (64, 128, 256)               # kernels attention_prefill_<f32|bf16>_hd<D>
DG_THREADS = 256
DG_PLANS = {1: (2, 2), 2: (2, 4), 4: (4, 1), 8: (4, 1)}
DG_ROWS = max(rows for rows, _ in DG_PLANS.values())      # the fewest output rows dense_gemv takes
# dense_gemv splits an item's K over up to DG_MAX_SPLITS warps of a block (a power of two dividing DG_THREADS / 32;
# 1: the unsplit kernel of sessions 6-15), as many as keep a launch within DG_WARPS_PER_SM warps a multiprocessor
# (ops.dense_gemv_splits). Measured on the H200 (benchmarks/decode_profile.py, docs/benchmarks.md session 16), the
# best split of each decode shape put 2048-4224 warps on its 132 SMs: one token, Qwen3's o_proj 8.50 -> 6.96 us
# (4 warps an item); eight tokens, o_proj 37.9 -> 14.5 (8) and q/k/v 22.4 -> 16.0 (2); lm_head (38k-76k items)
# is best unsplit (8 splits: 264 -> 431 us at eight tokens).
DG_MAX_SPLITS = 8
DG_WARPS_PER_SM = 32
# layers.cu's dense_gemv_tc (and dense_gemv_tc_normed, the input rmsnorm folded in): bf16 products of up to 32
# tokens on mma.sync m16n8k16 (16 output rows a warp item, the tokens as n8 tiles: kernels for DG_TC_TILES tiles, x
# split into bf16 hi + lo in registers), DG_TC_UNROLL 32-column slices of a warp's rows loaded before it multiplies.
# It reads a weight once for every token of a pass where
# dense_gemv re-reads it every 8 tokens and, at 8 tokens, runs at a third of the copy rate on FMAs (Qwen3's q/k/v
# 15.4 us against 7.0 at one token; session 17). Passes of DG_TC_MIN_ROWS rows or more (at most ATT_DECODE_MAX_ROWS,
# bf16 weights, K % 32 == 0) take it: the backend's `dense_tc_min_rows`; 0 (the default until it is timed on a GPU
# against dense_gemv: benchmarks/dense_gemv_sweep.py --tc, decode_profile.py --dense-tc-ab) leaves every pass on
# dense_gemv.
DG_TC_ROWS = 16             # output rows a warp item: the M of m16n8k16
DG_TC_UNROLL = 4
DG_TC_TILES = (1, 2, 4)
DG_TC_MIN_ROWS = 0
# layers.cu's rmsnorm and fused.cu's add_rmsnorm hold a row in registers, NORM_VECS 4-element vectors a thread (rows of
# up to 4 * NORM_VECS * threads elements: 8192 with 256 threads), so a decode step's norms pay one memory latency
NORM_VECS = 8
# fused.cu
FUSED_THREADS = 256
QKV_THREADS = 128
# mla.cu: a block of MLA_THREADS threads attends one (row, head) over the latent cache, each warp's lanes holding
# MLA_MAX_RANK / 32 columns of the latent accumulator (kv_lora_rank up to MLA_MAX_RANK); many warps a block, as a
# decode step has only rows x heads blocks (16 for Moonlight at batch 1); the absorption kernels take MLA_ROWS rows
# a block, so each weight load serves them all
MLA_THREADS = 512
MLA_MAX_RANK = 512
MLA_ROWS = 8
# moe_gemv4.cu: 4-bit expert GEMVs (kernels moe4_{gate_up,down}_<int4|mxfp4>_t<TOKC>) and the expansion of a
# pass's routed 4-bit experts into int8_group blobs for the grouped GEMM (prefill)
GEMV4_THREADS = 128
GEMV4_TOKC = (1, 2, 4, 8)                   # tokens per pass
EXPAND_THREADS = 256
# moe_gemv4_tc.cu: the int4_group decode GEMVs on the tensor cores (kernels moe4tc_{gate_up,down}_int4_t<TOKC>, the
# same GEMV4_TOKC): blocks of TC4_THREADS share an item and split its k-blocks, TC4_KSTEP k-blocks (of 128 columns)
# loaded by a warp before they are used. ops.moe_experts_4bit runs them by default for int4_group decode passes of at
# least TC4_MIN_TOKENS tokens on experts of at least TC4_MIN_INTERMEDIATE rows: the crossover benchmarks/gemv4_tc.py
# measured on an H200 (2026-12-02): Mixtral's 14336-row experts at 8 tokens 1.41-1.72x the SIMT kernels, every
# smaller case (Qwen3 768, gpt-oss 2880 rows; 1-4 tokens) 0.48-0.90x
TC4_THREADS = 128
TC4_KSTEP = 2
TC4_MIN_TOKENS = 8
TC4_MIN_INTERMEDIATE = 8192
# moe_gemv4_dp4a.cu: the int4_group decode GEMVs on int8 activations (EngineConfig.int8_activations; kernels
# moe4a8_{gate_up,down}_int4_t<TOKC>, the same GEMV4_TOKC, blocks of A8_THREADS) and the activations' rounding to
# int8 per group of A8_GROUP inputs (moe4a8_quantize, moe4a8_round: a warp a group, blocks of A8_QUANT_THREADS).
# A8_FORMATS: the expert formats whose products round their inputs when the switch is on (both engines read it)
A8_THREADS = 128
A8_QUANT_THREADS = 256
# tokens a pass -> ((gate_up rows a warp item, 16-byte chunks of each row a lane loads at once), (down: the same));
# gate_up items take half their rows from the gate and half from the up matrix (even). benchmarks/gemv_sweep.py
# times other plans against these (H200, 2026-12-02, docs/benchmarks.md: one token a pass and four were swept, two
# and eight were not; at one token down (8, 1) tied (4, 2) on Mixtral there and took 731 µs against 663 a step in
# the engine, so (4, 2) stays).
A8_PLANS = {1: ((4, 2), (4, 2)), 2: ((4, 2), (4, 2)), 4: ((8, 1), (4, 1)), 8: ((2, 2), (2, 2))}
A8_GROUP = 32
A8_FORMATS = (ExpertFormat.INT4_GROUP,)


# DeviceDense (runtime/cuda/dense.py): from this many rows bf16-stored matrices multiply on the tensor cores (x split
# into bf16 hi + lo, fp32 accumulation: ~1e-5 relative, or rounded to bf16 alone with EngineConfig.dense_gemm 'bf16')
# instead of f32 cuBLAS, where dense_gemv does not take the pass (more than ATT_DECODE_MAX_ROWS rows)
BF16_SPLIT_MIN_ROWS = 9
DENSE_GEMMS = ("split", "bf16")      # EngineConfig.dense_gemm


def dense_gemv_takes(rows: int, ncols: int, nrows: int) -> bool:
    """Whether DeviceDense multiplies a pass of `rows` rows by an [nrows, ncols] matrix through dense_gemv (decode-
    sized passes, graph-capturable: at most ATT_DECODE_MAX_ROWS rows, 16-byte loads) rather than cuBLAS."""
    return rows <= ATT_DECODE_MAX_ROWS and ncols % 8 == 0 and nrows >= 4


def bf16_products(bf16_tensor_cores: bool, rows: int, ncols: int, nrows: int, stored_bf16: bool) -> bool:
    """Whether DeviceDense multiplies a bf16-stored matrix by bf16 tensor-core products on cuBLAS (x split into hi +
    lo, or rounded where EngineConfig.dense_gemm says 'bf16'): a pass dense_gemv does not take, of at least
    BF16_SPLIT_MIN_ROWS rows, with bf16_tensor_cores; else f32 cuBLAS."""
    return (bf16_tensor_cores and stored_bf16 and not dense_gemv_takes(rows, ncols, nrows)
            and rows >= BF16_SPLIT_MIN_ROWS)


def rounds_dense_bf16(dense_gemm: str, bf16_tensor_cores: bool, rows: int, ncols: int, nrows: int,
                      stored_bf16: bool) -> bool:
    """Whether a dense product's input is rounded to bf16 (one bf16 product: EngineConfig.dense_gemm 'bf16'): the
    passes `bf16_products` sends to the tensor cores. The one rule of both engines (DeviceDense.linear,
    NumpyDense.linear)."""
    return dense_gemm == "bf16" and bf16_products(bf16_tensor_cores, rows, ncols, nrows, stored_bf16)


def rounds_rows_int8(fast_expert_gemm: str | None, rows: int, pairs: int, num_experts: int, layout,
                     extras: bool) -> bool:
    """Whether a pass's routed-expert products round their inputs to int8 a row (W8A8: x a token, the activation a
    pair): EngineConfig.fast_expert_gemm 'int8', or 'auto' where an expert's mean work, pairs H I / E multiply-adds a
    matrix, reaches W8A8_MIN_EXPERT_MACS; on passes of more than ATT_DECODE_MAX_ROWS rows (decode passes
    keep float inputs) over int8 experts with one scale a row and no gpt-oss extras (the kernels' "r" form). The one
    rule of both engines (the CUDA routes: CupyBackend._expert_gemm and ops.moe_experts; tests/runtime/cuda/
    test_backend_routes.py checks they agree)."""
    H, I, E = layout.hidden_size, layout.intermediate_size, num_experts     # layout: the experts' BlobLayout
    int8_rows = (layout.expert_format in (ExpertFormat.INT8_ROW, ExpertFormat.INT8_GROUP)
                 and (scale_groups(H, I, int(layout.group_size or 0)) or "  ")[2] == "r")
    if rows <= ATT_DECODE_MAX_ROWS or extras or not int8_rows:
        return False
    return fast_expert_gemm == "int8" or (fast_expert_gemm == "auto"
                                          and pairs * H * I >= W8A8_MIN_EXPERT_MACS * E)


def rounds_activations(int8_activations: bool, expert_format) -> bool:
    """Whether experts of `expert_format` round their products' inputs to int8 (EngineConfig.int8_activations on
    and the format in A8_FORMATS): the one rule every engine and benchmark follows."""
    return bool(int8_activations) and expert_format in A8_FORMATS
# deltanet.cu: conv and plan blocks of DELTANET_THREADS; the delta rule runs a thread per value column of a head
# (value_head_dim up to DELTANET_MAX_VALUE_DIM, one block) with the row's q and k in shared memory
DELTANET_THREADS = 128
DELTANET_MAX_VALUE_DIM = 1024

def plan_defines(prefix: str, plans: dict[str, tuple]) -> dict[str, int]:
    """-D constants <prefix>_{GU,DN}_<key>_{ROWS,CPL} of GEMV plans {key: ((gate_up rows, chunks), (down ...))}."""
    return {f"{prefix}_{stage}_{key}_{name}": v for key, stages in plans.items()
            for stage, plan in zip(("GU", "DN"), stages) for name, v in zip(("ROWS", "CPL"), plan)}


def a8_plan_defines(plans: dict) -> dict[str, int]:
    """The dp4a GEMVs' plans (A8_PLANS' form, by tokens a pass) as A8_{GU,DN}_T<tokens>_{ROWS,CPL}."""
    return plan_defines("A8", {f"T{tok}": stages for tok, stages in plans.items()})


def w4_plan_defines(plan: tuple) -> dict[str, int]:
    """The w4 GEMVs' plan (GEMV_W4_PLAN's form) as WIDE_{GU,DN}_W4_{ROWS,CPL}."""
    return plan_defines("WIDE", {"W4": plan})


KERNEL_DEFINES: dict[str, dict[str, int]] = {
    "router": {"ROUTER_THREADS": ROUTER_THREADS, "ROUTER_TPB": ROUTER_TPB, "ROUTER_EPB": ROUTER_EPB,
               "ROUTER_MAX_E": ROUTER_MAX_E, "ROUTER_MAX_K": ROUTER_MAX_K},
    "dispatch": {"DISPATCH_THREADS": DISPATCH_THREADS, "DISPATCH_MAX_E": DISPATCH_MAX_E},
    "moe_gemv": {"GEMV_THREADS": GEMV_THREADS, **w4_plan_defines(GEMV_W4_PLAN)},
    "moe_gemm": {"GEMM_THREADS": GEMM_THREADS, "GEMM_BM": GEMM_BM, "GEMM_BN": GEMM_BN, "GEMM_BK": GEMM_BK,
                 "GEMM_PAD": GEMM_PAD, "TC_THREADS": TC_THREADS},
    "moe_gemm_fast": {"FAST_THREADS": FAST_THREADS, "FAST_BM": FAST_BM, "FAST_BN": FAST_BN, "FAST_BK": FAST_BK,
                      "FAST_STAGES": FAST_STAGES, "FAST_MIN_BLOCKS": FAST_MIN_BLOCKS,
                      "FAST_SKIP_EMPTY_M": FAST_SKIP_EMPTY_M, "FAST_STAGE_STEPS": FAST_STAGE_STEPS,
                      "FAST_L2_PREFETCH": FAST_L2_PREFETCH, "FAST_PERSISTENT": FAST_PERSISTENT},
    "moe_gemm_cublas": {"GLUE_THREADS": GLUE_THREADS, "QUANT_WARP_VECS": QUANT_WARP_VECS,
                        "QUANT_ROW_VECS": QUANT_ROW_VECS},
    "layers": {"ATT_THREADS": ATT_THREADS, "ATT_GMAX": ATT_GMAX, "ATT_LANE_FLOATS": ATT_LANE_FLOATS,
               "ATT_DECODE_MIN_KEYS": ATT_DECODE_MIN_KEYS, "ATT_MAX_SPLITS": ATT_MAX_SPLITS,
               "ATT_MERGE_LOADS": ATT_MERGE_LOADS, "ATT_DECODE_STAGES": ATT_DECODE_STAGES,
               "DG_THREADS": DG_THREADS, "NORM_VECS": NORM_VECS, "DG_TC_ROWS": DG_TC_ROWS,
               "DG_TC_UNROLL": DG_TC_UNROLL,
               **{f"DG_T{tok}_ROWS": rows for tok, (rows, _) in DG_PLANS.items()},
               **{f"DG_T{tok}_UNROLL": unroll for tok, (_, unroll) in DG_PLANS.items()}},
    "fused": {"FUSED_THREADS": FUSED_THREADS, "QKV_THREADS": QKV_THREADS, "NORM_VECS": NORM_VECS},
    "mla": {"MLA_THREADS": MLA_THREADS, "MLA_MAX_RANK": MLA_MAX_RANK, "MLA_ROWS": MLA_ROWS},
    "moe_gemv4": {"GEMV4_THREADS": GEMV4_THREADS, "EXPAND_THREADS": EXPAND_THREADS},
    "moe_gemv4_tc": {"TC4_THREADS": TC4_THREADS, "TC4_KSTEP": TC4_KSTEP},
    "moe_gemv4_dp4a": {"A8_THREADS": A8_THREADS, "A8_QUANT_THREADS": A8_QUANT_THREADS,
                       **a8_plan_defines(A8_PLANS)},
    "attention_prefill": {"FA_THREADS": FA_THREADS, "FA_BN": FA_BN, "FA_BN_F32": FA_BN_F32, "FA_BN_HD256": FA_BN_HD256,
                          "FA_PAD": FA_PAD, "FA_PLAN_FIELDS": FA_PLAN_FIELDS},
    "deltanet": {"DELTANET_THREADS": DELTANET_THREADS, "DELTANET_MAX_VALUE_DIM": DELTANET_MAX_VALUE_DIM},
}


def prefill_attention_keys(head_dim: int, cache: str) -> int:
    """Keys a tile of attention_prefill_<cache>_hd<head_dim> (its instantiations in attention_prefill.cu)."""
    return FA_BN_HD256 if head_dim > 128 else FA_BN_F32 if cache == "f32" else FA_BN


def prefill_attention_shared_bytes(head_dim: int, cache: str) -> int:
    """Dynamic shared memory of an attention_prefill launch (cache 'f32' or 'bf16'), bf16 elements: the queries as
    hi and lo, and two buffers of K and V tiles (hi and lo for an fp32 cache)."""
    parts = 2 if cache == "f32" else 1
    return (2 * FA_BM + 4 * parts * prefill_attention_keys(head_dim, cache)) * (head_dim + FA_PAD) * 2


def define_options(module: str) -> tuple[str, ...]:
    """The `-DNAME=value` compile options of kernel module `module` (NVRTC and nvcc alike)."""
    return tuple(f"-D{name}={value}" for name, value in KERNEL_DEFINES[module].items())


# ---- capabilities --------------------------------------------------------------------------------------------------
MAX_EXPERTS = min(ROUTER_MAX_E, DISPATCH_MAX_E)   # routed experts per MoE layer (router and dispatch)
MAX_TOP_K = ROUTER_MAX_K                          # experts selected per token (router)
ATTENTION_HEAD_DIMS = (64, 128, 256)              # attention kernels attention_split_<dtype>_hd<D>; another head
#                                                   size is not refused: the engine then runs attention with array ops
DIM_MULTIPLE = 16            # hidden and expert intermediate sizes: 16-byte int8 loads (moe_gemv.cu, moe_gemm.cu)
GROUP_MULTIPLE = 16          # int8_group group size: a 16-byte chunk of a row never straddles two groups
BLOB_ARRAY_ALIGNMENT = 256   # offset of each array inside an expert blob
SHARED_MEMORY_BYTES = 48 * 1024   # dynamic shared memory a launch may take without opting in
EXPERT_FORMATS = QUANTIZED_FORMATS   # int8 (moe_gemv.cu, moe_gemm.cu); int4_group and mxfp4 (moe_gemv4.cu)
PACKED_EXPERT_EXTRAS = ("expert_act", "expert_bias")   # what moe_gemv4.cu does not compute (the int8 kernels do)
ACTIVATIONS = frozenset({"silu"})
ROUTER_SCORING = {"softmax": 0, "sigmoid": 1}     # codes passed to router.cu
ROUTER_ORDER = {"softmax_topk": 0, "topk_softmax": 1}
QK_NORM_MODES = {"none": 0, "full": 1, "per_head": 2}   # codes passed to fused.cu


FAST_ACTIVATION_BYTES = {"bf16": 2, "split": 4, "int8": 1}   # moe_gemm_fast.cu: bytes an activation takes a stage


MULTIPROCESSOR_SHARED_BYTES = 228 * 1024   # an sm_90 multiprocessor's shared memory (1 KB of it reserved a block)
FAST_STATIC_SHARED_BYTES = 2 * 4 * (2 * FAST_BM + FAST_BN + 4)   # moe_gemm_fast.cu's two FastSlot tables


def dispatch_blocks(pairs: int, multiprocessors: int, min_pairs: int | None = None) -> tuple[int, int] | None:
    """(blocks, pairs a block) of a dispatch over several blocks, or None for the one-block kernel: passes of at
    least `min_pairs` (default DISPATCH_SPREAD_MIN_PAIRS; 0: never) pairs, chunks of whole DISPATCH_THREADS rounds,
    at most a block a multiprocessor."""
    least = DISPATCH_SPREAD_MIN_PAIRS if min_pairs is None else min_pairs
    if least <= 0 or pairs < least:
        return None
    rounds = -(-pairs // DISPATCH_THREADS)
    blocks = max(1, min(rounds, multiprocessors))
    chunk = -(-rounds // blocks) * DISPATCH_THREADS
    return -(-pairs // chunk), chunk


def quantize_rows_by_warp(cols: int) -> bool:
    """Whether quantize_rows_int8 gives a row of `cols` values a warp (else a block)."""
    return cols % 4 == 0 and cols <= WARP * 4 * QUANT_WARP_VECS


def quantize_rows_blocks(rows: int, cols: int, multiprocessors: int) -> int:
    """quantize_rows_int8's grid: a block for each row or each GLUE_THREADS / WARP rows, at most 8 blocks a
    multiprocessor (grid-stride beyond)."""
    per_block = GLUE_THREADS // WARP if quantize_rows_by_warp(cols) else 1
    return max(1, min(-(-rows // per_block), multiprocessors * 8))


def fast_gemm_stages(ncols: int) -> int:
    """K stages of a moe_gemm_fast.cu work item over `ncols` input columns."""
    return -(-ncols // (FAST_BK * FAST_STAGE_STEPS))


def fast_gemm_persistent(ncols: int) -> bool:
    """Whether a moe_gemm_fast.cu launch over `ncols` input columns takes the persistent grid: built for it
    (FAST_PERSISTENT), with items of at least FAST_STAGES stages (the two item slots of a block hold its copies'
    item and its MMAs' only then)."""
    return bool(FAST_PERSISTENT) and fast_gemm_stages(ncols) >= FAST_STAGES


def fast_gemm_blocks_per_sm(activations: str) -> int:
    """moe_gemm_fast.cu blocks a multiprocessor holds at once by shared memory."""
    per_block = fast_gemm_shared_bytes(activations) + FAST_STATIC_SHARED_BYTES + 1024
    return max(1, MULTIPROCESSOR_SHARED_BYTES // per_block)


def attention_decode_shared_bytes(cache_itemsize: int, stages: int | None = None) -> int:
    """Dynamic shared memory of an attention_decode launch over caches of `cache_itemsize`-byte values: its
    `stages` (default ATT_DECODE_STAGES) tiles of K and V rows."""
    return (stages or ATT_DECODE_STAGES) * 2 * ATT_LANE_FLOATS * 32 * cache_itemsize


def fast_gemm_shared_bytes(activations: str) -> int:
    """Dynamic shared memory of a moe_gemm_fast.cu launch: its stages of activation (bf16 hi; hi and lo when
    'split'; int8) and int8 weight tiles, FAST_STAGE_STEPS of each a stage."""
    step = FAST_ACTIVATION_BYTES[activations] * FAST_BM * FAST_BK + FAST_BN * FAST_BK
    return FAST_STAGES * FAST_STAGE_STEPS * step


def scale_groups(hidden: int, inter: int, group: int) -> tuple[int, int, str] | None:
    """(group over H, group over I, kernel suffix: 'r' per-row | 'g' grouped) of the int8 expert kernels for a
    group size (0: one scale per row), or None when they cannot run it."""
    if group in (0, hidden) and group in (0, inter):
        return hidden, inter, "r"
    if group < 0 or group % GROUP_MULTIPLE or hidden % group or inter % group:
        return None
    return group, group, "g"


def _refuse(message: str, field: str, value: Any) -> UnsupportedModel:
    return UnsupportedModel(f"the CUDA kernels cannot run this model: {message}", field=field, value=value)


def check_cuda_support(model: dict, blob_layout) -> None:
    """Raise `UnsupportedModel` naming the field for anything in the file that the CUDA kernels cannot run.

    model: the metadata's `model` object (already spec-checked); blob_layout: the reader's `blob_layout`
    (`colibri_format.spec.BlobLayout`), or None for a model without routed experts (then only the dense side is
    checked). Meant for the moment a file is opened, before any device work.
    """
    act = model.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _refuse(f"activation {act!r}; the kernels compute {sorted(ACTIVATIONS)}", "model.hidden_act", act)
    norm = model.get("qk_norm", "none")
    if norm not in QK_NORM_MODES:
        raise _refuse(f"qk_norm {norm!r}; the kernels implement {sorted(QK_NORM_MODES)}", "model.qk_norm", norm)
    _check_semantics(model)
    if blob_layout is not None:
        _check_experts(model, blob_layout)


def _check_semantics(model: dict) -> None:
    """Model features the NumPy engine computes and these kernels do not yet (each names what the kernel lacks).

    Grouped top-k (router.n_group), a router bias on the logits (topk_softmax), attention sinks (router.cu,
    layers.cu) and gpt-oss's expert biases and clamped SwiGLU (expert_bias, expert_act: the `*_extras` kernels of
    moe_gemv.cu / moe_gemm.cu) run."""
    if model.get("linear_attention") is not None:
        _check_linear_attention(model["linear_attention"])
    if model.get("mla") is not None:
        _check_mla(model["mla"])


def _check_linear_attention(lin: dict) -> None:
    """Gated DeltaNet layers run on deltanet.cu: a thread per value column (a row's q and k in shared memory: 32 KB
    at the spec's widest key_head_dim, 4096). Gated attention runs on the attention kernels and array operations."""
    if lin["value_head_dim"] > DELTANET_MAX_VALUE_DIM:
        raise _refuse(f"linear_attention.value_head_dim {lin['value_head_dim']}; the delta-rule kernel runs at most "
                      f"{DELTANET_MAX_VALUE_DIM} value columns a head", "model.linear_attention.value_head_dim",
                      lin["value_head_dim"])


def mla_shared_bytes(mla: dict) -> dict[str, int]:
    """Dynamic shared memory of each mla.cu launch for a model's `mla` widths."""
    r, dr, dn = mla["kv_lora_rank"], mla["qk_rope_head_dim"], mla["qk_nope_head_dim"]
    warps = MLA_THREADS // WARP
    return {"attend": 4 * (r + dr + warps * r + 2 * warps), "absorb_q": 4 * MLA_ROWS * (dn + warps * WARP),
            "absorb_v": 4 * MLA_ROWS * r}


def _check_mla(mla: dict) -> None:
    """Multi-head latent attention runs on mla.cu within its latent accumulator and shared memory."""
    if mla["kv_lora_rank"] > MLA_MAX_RANK:
        raise _refuse(f"kv_lora_rank {mla['kv_lora_rank']}; the MLA attention kernel holds at most {MLA_MAX_RANK} "
                      "latent values a head", "model.mla.kv_lora_rank", mla["kv_lora_rank"])
    for kernel, nbytes in mla_shared_bytes(mla).items():
        if nbytes > SHARED_MEMORY_BYTES:
            raise _refuse(f"the MLA {kernel} kernel would need {nbytes} bytes of shared memory (at most "
                          f"{SHARED_MEMORY_BYTES})", "model.mla", kernel)


def _check_experts(model: dict, blob_layout) -> None:
    fmt = ExpertFormat(blob_layout.expert_format)
    if fmt not in EXPERT_FORMATS:
        raise _refuse(f"experts are stored as {EXPERT_FORMAT_NAMES[fmt]}; the expert kernels read quantized experts "
                      "only (int8, int4_group, mxfp4: convert with --quantize expert)", "expert_format", int(fmt))
    if fmt in PACKED_FORMATS:
        _check_packed_experts(model, EXPERT_FORMAT_NAMES[fmt])
    experts, top_k = model["num_experts"], model["top_k"]
    if not 1 <= experts <= MAX_EXPERTS:
        raise _refuse(f"{experts} experts per layer; the router and dispatch kernels take 1 to {MAX_EXPERTS}",
                      "model.num_experts", experts)
    if not 1 <= top_k <= min(experts, MAX_TOP_K):
        raise _refuse(f"top_k {top_k}; the router selects 1 to min(num_experts, {MAX_TOP_K}) experts a token",
                      "model.top_k", top_k)
    hidden, inter = blob_layout.hidden_size, blob_layout.intermediate_size
    for field, value in (("model.hidden_size", hidden), ("model.expert_intermediate_size", inter)):
        if value < DIM_MULTIPLE or value % DIM_MULTIPLE:
            raise _refuse(f"{field.split('.')[-1]} {value} is not a multiple of {DIM_MULTIPLE} (16-byte loads)",
                          field, value)
    if scale_groups(hidden, inter, blob_layout.group_size) is None:
        raise _refuse(f"group size {blob_layout.group_size} is not a multiple of {GROUP_MULTIPLE} dividing "
                      f"hidden_size {hidden} and expert_intermediate_size {inter}", "quantization.group_size",
                      blob_layout.group_size)
    for arr in blob_layout.arrays:
        if arr.offset % BLOB_ARRAY_ALIGNMENT:
            raise _refuse(f"expert blob array {arr.name} at offset {arr.offset} is not {BLOB_ARRAY_ALIGNMENT}-byte "
                          "aligned", "blob_layout", arr.name)
    router = model.get("router") or {}
    for key, known in (("scoring", ROUTER_SCORING), ("order", ROUTER_ORDER)):
        value = router.get(key, next(iter(known)))
        if value not in known:
            raise _refuse(f"router {key} {value!r}; the router kernel implements {sorted(known)}",
                          f"model.router.{key}", value)


def _check_packed_experts(model: dict, name: str) -> None:
    for field in PACKED_EXPERT_EXTRAS:
        if model.get(field):
            raise _refuse(f"{field} with {name} experts: the 4-bit expert kernels (moe_gemv4.cu) compute silu(gate) * "
                          "up without biases (convert with --quant-bits 8)", f"model.{field}", model[field])
