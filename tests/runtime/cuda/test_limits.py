"""`check_cuda_support` on the CPU: spec-valid models the kernels cannot run are refused at open, naming the field;
models they can run pass. Also: the kernel capabilities stay in step with the format and with ops.py."""

from __future__ import annotations

import pytest

from colibri_format import errors as E
from colibri_format import reader as colibri_reader
from colibri_format import spec as S
from colibri_format.runtime.cuda import limits as L
from colibri_format.runtime.cuda.kernels import ops
from colibri_format.synthetic import synthetic_model, write_synthetic

ROW, GROUP = S.ExpertFormat.INT8_ROW, S.ExpertFormat.INT8_GROUP


def model(**kw) -> dict:
    """A spec-valid `model` object (check_model accepts it)."""
    m = synthetic_model(**kw)
    S.check_model(m)
    return m


def layout(m: dict, fmt=ROW, group: int = 0) -> S.BlobLayout:
    return S.blob_layout(m["hidden_size"], m["expert_intermediate_size"], fmt, group)


def refused(m: dict, blob) -> E.UnsupportedModel:
    with pytest.raises(E.UnsupportedModel) as info:
        L.check_cuda_support(m, blob)
    return info.value


# ---- models the kernels run -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,fmt,group", [
    (dict(), ROW, 0),
    (dict(hidden=64, expert_inter=32, heads=1, kv_heads=1), GROUP, 16),
    (dict(hidden=128, expert_inter=64), GROUP, 64),
    (dict(hidden=64, expert_inter=64), GROUP, 64),                 # one group a row: the per-row kernels
    (dict(experts=L.MAX_EXPERTS, top_k=L.MAX_TOP_K), ROW, 0),       # at both caps
    (dict(experts=1, top_k=1), ROW, 0),
    (dict(hidden=48, heads=2, kv_heads=2), ROW, 0),                 # head_dim 24: the engine's array attention
    (dict(qk_norm="per_head"), ROW, 0),
    (dict(qk_norm="full"), ROW, 0),
])
def test_supported(kw, fmt, group):
    m = model(**kw)
    L.check_cuda_support(m, layout(m, fmt, group))


def test_sigmoid_router_and_topk_softmax_are_supported():
    m = model()
    m["router"].update(scoring="sigmoid", order="topk_softmax")
    S.check_model(m)
    L.check_cuda_support(m, layout(m))


def test_no_routed_experts_checks_the_dense_side_only():
    m = model(experts=4096, top_k=64)
    L.check_cuda_support(m, None)
    m["qk_norm"] = "rms_everything"
    assert refused(m, None).field == "model.qk_norm"


def test_head_dims_outside_the_kernel_set_are_not_refused():
    assert 24 not in L.ATTENTION_HEAD_DIMS
    m = model(hidden=48, heads=2, kv_heads=1)
    assert m["head_dim"] == 24
    L.check_cuda_support(m, layout(m))


# ---- spec-valid models the kernels cannot run --------------------------------------------------------------------
@pytest.mark.parametrize("kw,field,value", [
    (dict(experts=64, top_k=48), "model.top_k", 48),                         # spec: top_k <= 64
    (dict(experts=64, top_k=S.MAX_TOP_K), "model.top_k", S.MAX_TOP_K),
    (dict(experts=1024, top_k=8), "model.num_experts", 1024),                # spec: up to 4096 experts
    (dict(experts=S.MAX_EXPERTS, top_k=2), "model.num_experts", S.MAX_EXPERTS),
    (dict(experts=L.MAX_EXPERTS + 1, top_k=2), "model.num_experts", L.MAX_EXPERTS + 1),
    (dict(experts=L.MAX_TOP_K + 1, top_k=L.MAX_TOP_K + 1), "model.top_k", L.MAX_TOP_K + 1),
    (dict(hidden=40, heads=2, kv_heads=1), "model.hidden_size", 40),
    (dict(expert_inter=24), "model.expert_intermediate_size", 24),
])
def test_refused(kw, field, value):
    m = model(**kw)
    err = refused(m, layout(m))
    assert isinstance(err, ValueError)       # still a ValueError for callers that catch that
    assert (err.field, err.value) == (field, value)
    assert f"field={field}" in str(err) and "CUDA" in str(err)


@pytest.mark.parametrize("fmt", [S.ExpertFormat.F32, S.ExpertFormat.F16, S.ExpertFormat.BF16])
def test_unquantized_experts_refused(fmt):
    m = model()
    err = refused(m, layout(m, fmt))
    assert (err.field, err.value) == ("expert_format", int(fmt))
    assert S.EXPERT_FORMAT_NAMES[fmt] in str(err) and "--quantize expert" in str(err)


@pytest.mark.parametrize("fmt, group", [(S.ExpertFormat.INT4_GROUP, 32), (S.ExpertFormat.INT4_GROUP, 64),
                                        (S.ExpertFormat.INT4_GROUP, 128), (S.ExpertFormat.MXFP4, 32)])
def test_4bit_experts_run(fmt, group):
    """int4_group / mxfp4 (v1.1) run on the moe_gemv4.cu kernels."""
    m = model(hidden=128, expert_inter=256)
    L.check_cuda_support(m, layout(m, fmt, group))


@pytest.mark.parametrize("fmt", [S.ExpertFormat.INT4_GROUP, S.ExpertFormat.MXFP4])
@pytest.mark.parametrize("field, value", [("expert_act", {"alpha": 1.702, "limit": 7.0, "up_offset": 1.0}),
                                          ("expert_bias", True)])
def test_4bit_experts_with_extras_refused_in_one_line(fmt, field, value):
    """gpt-oss's clamped SwiGLU and expert biases run on the int8 kernels only: refused, naming the field."""
    m = dict(model(hidden=64, expert_inter=64), **{field: value})
    err = refused(m, layout(m, fmt, 32))
    assert err.field == f"model.{field}" and "\n" not in str(err)
    assert S.EXPERT_FORMAT_NAMES[fmt] in str(err) and "--quant-bits 8" in str(err)


@pytest.mark.parametrize("fmt, group", [(S.ExpertFormat.INT4_GROUP, 32), (S.ExpertFormat.INT4_GROUP, 128),
                                        (S.ExpertFormat.MXFP4, 32)])
def test_packed_expert_table_reads_the_blob_layout(fmt, group):
    """The 4-bit table the CUDA backend builds: the spec's array offsets, the format, and (the benchmark's bytes
    a pass reads of an expert) exactly the bytes of the blob's arrays."""
    import numpy as np

    blob = S.blob_layout(4096, 14336, fmt, group)
    table = ops.PackedExpertTable.from_layout(np.zeros(8, np.uint64), blob)
    assert (table.off_gate_up, table.off_gate_up_scale, table.off_down, table.off_down_scale) == \
        tuple(blob.array(n).offset for n in ("gate_up", "gate_up_scale", "down", "down_scale"))
    assert (table.expert_format, table.group_size, table.tag) == (fmt, group, ops.PACKED_KERNEL_TAGS[fmt])
    assert table.weight_bytes() == sum(a.nbytes for a in blob.arrays)


def test_group_size_the_kernels_cannot_split():
    m = model(hidden=64, expert_inter=48)
    blob = S.BlobLayout(64, 48, GROUP, 24, layout(m).arrays, layout(m).size)   # 24: not a multiple of 16
    assert refused(m, blob).field == "quantization.group_size"


def test_misaligned_blob_array_refused():
    m = model()
    good = layout(m)
    arrays = (good.arrays[0], S.BlobArray("gate_up_scale", good.arrays[1].offset + 4, good.arrays[1].shape,
                                          good.arrays[1].dtype)) + good.arrays[2:]
    blob = S.BlobLayout(good.hidden_size, good.intermediate_size, ROW, 0, arrays, good.size)
    assert refused(m, blob).field == "blob_layout"


@pytest.mark.parametrize("where,key,value,field", [
    ("router", "scoring", "sparsemax", "model.router.scoring"),
    ("router", "order", "topk_then_bias", "model.router.order"),
    (None, "hidden_act", "gelu", "model.hidden_act"),
    (None, "qk_norm", "layer", "model.qk_norm"),
])
def test_features_the_kernels_lack(where, key, value, field):
    m = model()
    (m[where] if where else m)[key] = value
    err = refused(m, layout(m))
    assert (err.field, err.value) == (field, value)


@pytest.mark.parametrize("experts,top_k,field,value", [(64, 48, "model.top_k", 48),
                                                        (1024, 8, "model.num_experts", 1024)])
def test_spec_valid_files_refused_when_opened(tmp_path, experts, top_k, field, value):
    """Through a real file: the reader accepts it, check_cuda_support refuses it before any token."""
    path = write_synthetic(tmp_path / "m.colibri", synthetic_model(hidden=16, heads=2, kv_heads=1, layers=1,
                                                                   experts=experts, top_k=top_k, expert_inter=16),
                           reuse_expert=True)
    with colibri_reader.open(path) as f:
        err = refused(f.model, f.blob_layout)
    assert (err.field, err.value) == (field, value)


# ---- consistency ---------------------------------------------------------------------------------------------------
def test_kernel_caps_are_inside_the_format_limits():
    assert 1 <= L.MAX_TOP_K <= L.MAX_EXPERTS <= S.MAX_EXPERTS
    assert L.MAX_TOP_K <= S.MAX_TOP_K
    assert L.MAX_EXPERTS == min(L.ROUTER_MAX_E, L.DISPATCH_MAX_E)
    assert L.ROUTER_WIDTHS == tuple(sorted(L.ROUTER_WIDTHS)) and L.ROUTER_MAX_E == L.ROUTER_WIDTHS[-1]
    assert all(w % L.WARP == 0 for w in L.ROUTER_WIDTHS)


def test_spec_layout_meets_the_kernels_alignment():
    assert S.ARRAY_ALIGNMENT % L.BLOB_ARRAY_ALIGNMENT == 0
    assert S.DIM_MULTIPLE % L.DIM_MULTIPLE == 0 and S.MIN_GROUP_SIZE % L.GROUP_MULTIPLE == 0


def test_ops_uses_the_declared_constants():
    for name in ("GEMM_BM", "GEMM_BN", "GEMM_THREADS", "GEMV_THREADS", "ROUTER_TPB", "ROUTER_EPB", "ATT_GMAX",
                 "ATT_THREADS", "DISPATCH_MAX_E", "ROUTER_MAX_E", "FUSED_THREADS", "QKV_THREADS", "TC_THREADS",
                 "FAST_BN", "FAST_THREADS"):
        assert getattr(ops, name) is getattr(L, name), name
    assert ops.SCORING is L.ROUTER_SCORING and ops.ORDER is L.ROUTER_ORDER and ops.QK_NORM_MODES is L.QK_NORM_MODES
    assert ops.MODULES == tuple(L.KERNEL_DEFINES)


HOPPER_BLOCK_SHARED = 227 * 1024   # the most dynamic shared memory a block can opt into (sm_90)
HOPPER_SM_SHARED = 228 * 1024      # a multiprocessor's shared memory, 1 KB of it reserved per resident block


@pytest.mark.parametrize("activations,a_bytes", [("bf16", 2), ("split", 4), ("int8", 1)])
def test_fast_gemm_stages_fit_the_blocks_asked_for(activations, a_bytes):
    """moe_gemm_fast.cu's stages fit a block, and FAST_MIN_BLOCKS blocks (the register bound it compiles for) fit
    a multiprocessor; its tiles are the dispatch's rows."""
    nbytes = L.fast_gemm_shared_bytes(activations)
    assert nbytes == L.FAST_STAGES * L.FAST_STAGE_STEPS * (a_bytes * L.FAST_BM * L.FAST_BK + L.FAST_BN * L.FAST_BK)
    static = L.FAST_STATIC_SHARED_BYTES
    assert static == 2 * 4 * (L.FAST_BM + L.FAST_BN + L.FAST_BM + 4)   # two FastSlots: row, wrow, rs, FastItem
    assert nbytes + static <= HOPPER_BLOCK_SHARED
    assert L.FAST_MIN_BLOCKS * (nbytes + static + 1024) <= HOPPER_SM_SHARED
    assert L.fast_gemm_blocks_per_sm(activations) >= L.FAST_MIN_BLOCKS
    assert L.MULTIPROCESSOR_SHARED_BYTES == HOPPER_SM_SHARED
    assert L.FAST_BM == L.GEMM_BM


def test_the_persistent_grid_needs_its_build_and_items_of_enough_stages(monkeypatch):
    """moe_gemm_fast.cu's persistent grid: only when built for it, and only for items of at least FAST_STAGES K
    stages (a block's two item slots then hold its copies' item and its MMAs')."""
    cols = L.FAST_BK * L.FAST_STAGE_STEPS
    assert L.fast_gemm_stages(cols) == 1 and L.fast_gemm_stages(cols + 16) == 2
    monkeypatch.setattr(L, "FAST_PERSISTENT", 0)
    assert not L.fast_gemm_persistent(100 * cols)
    monkeypatch.setattr(L, "FAST_PERSISTENT", 1)
    assert L.fast_gemm_persistent(L.FAST_STAGES * cols)
    assert L.fast_gemm_persistent(L.FAST_STAGES * cols - 16)       # a partial last stage counts
    assert not L.fast_gemm_persistent((L.FAST_STAGES - 1) * cols)
    monkeypatch.setattr(L, "FAST_STAGE_STEPS", 2 * L.FAST_STAGE_STEPS)   # longer stages: fewer an item
    assert not L.fast_gemm_persistent(L.FAST_STAGES * cols)


@pytest.mark.parametrize("hidden,inter,group,expected", [
    (64, 32, 0, (64, 32, "r")), (64, 64, 64, (64, 64, "r")), (64, 32, 16, (16, 16, "g")),
    (64, 32, 32, (32, 32, "g")), (64, 48, 24, None), (64, 48, 32, None), (64, 32, -16, None)])
def test_scale_groups(hidden, inter, group, expected):
    assert L.scale_groups(hidden, inter, group) == expected


def test_quantize_rows_takes_a_warp_a_row_up_to_its_registers():
    """quantize_rows_int8's grid: a warp a row for rows of whole float4s up to 32 x QUANT_WARP_VECS (8 rows a block),
    a block a row beyond, never more than 8 blocks a multiprocessor."""
    widest = L.WARP * 4 * L.QUANT_WARP_VECS
    assert L.quantize_rows_by_warp(768) and L.quantize_rows_by_warp(widest)
    assert not L.quantize_rows_by_warp(widest + 4) and not L.quantize_rows_by_warp(302)
    per_block = L.GLUE_THREADS // L.WARP
    assert L.quantize_rows_blocks(4096, 768, 132) == 4096 // per_block
    assert L.quantize_rows_blocks(4096, 14336, 132) == 132 * 8
    assert L.quantize_rows_blocks(3, 768, 132) == 1


def test_a_long_dispatch_spreads_over_blocks_of_whole_rounds(monkeypatch):
    """limits.dispatch_blocks: None (one block) below DISPATCH_SPREAD_MIN_PAIRS or when it is 0; else chunks of whole
    DISPATCH_THREADS rounds, at most a block a multiprocessor, covering every pair."""
    assert L.dispatch_blocks(10 ** 6, 132, min_pairs=0) is None
    assert L.dispatch_blocks(100, 132, min_pairs=101) is None
    for pairs in (1, L.DISPATCH_THREADS, 4096, 32768, 10 ** 6 + 3):
        blocks, chunk = L.dispatch_blocks(pairs, 132, min_pairs=1)
        assert chunk % L.DISPATCH_THREADS == 0 and 1 <= blocks <= 132
        assert (blocks - 1) * chunk < pairs <= blocks * chunk
    monkeypatch.setattr(L, "DISPATCH_SPREAD_MIN_PAIRS", 0)
    assert L.dispatch_blocks(32768, 132) is None
