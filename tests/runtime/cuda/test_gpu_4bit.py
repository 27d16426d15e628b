"""4-bit experts (int4_group, mxfp4) on the CUDA engine (GPU only).

Kernel level: the moe_gemv4.cu GEMVs (every tokens-per-pass variant), their fill on read, and the expansion to
int8_group feeding the grouped GEMM, against `numpy_backend` in float64 on the same blob bytes (`blob_arrays`:
colibri_format/dequant.py), for int4 groups of 32/64/128 and mxfp4. Engine level: a tiny Mixtral converted with
`--quant-bits 4` and synthetic mxfp4 files give the NumPy engine's greedy tokens and logits close to the float64
engine, eager and in graphs, prefill and decode, with float activations (`EngineConfig(int8_activations=False)`;
the default int8 activations of int4_group experts: test_gpu_4bit_dp4a.py); paged experts (a small cache) compute what
resident ones do (with the default: the dp4a kernels for int4_group).
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format import spec as S
from colibri_format.convert.pipeline import convert
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.cuda.bench import numpy_experts
from colibri_format.runtime.cuda.kernels import ops
from colibri_format.synthetic import synthetic_model, write_synthetic
from tests.runtime.cuda import kernel_expectations as expect
from tests.runtime.cuda.synthetic_experts import packed_experts
from tests.runtime.hf_tiny import build_hf

F32_TOL = 2e-5     # fp32 accumulation vs float64 on the same weights
ENGINE_TOL = 2e-3  # relative logit error of the CUDA engine against the float64 NumPy engine
FORMATS = {"int4-g32": (S.ExpertFormat.INT4_GROUP, 32), "int4-g64": (S.ExpertFormat.INT4_GROUP, 64),
           "int4-g128": (S.ExpertFormat.INT4_GROUP, 128), "mxfp4": (S.ExpertFormat.MXFP4, 32)}


def rel(out, expected) -> float:
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    assert out.shape == expected.shape and np.isfinite(out).all(), "unwritten or non-finite output"
    return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def packed_blobs(rng, fmt, group: int, E: int, H: int, I: int):
    """(layout, experts(e) -> float64 (gate_up, down), host blobs uint8 [E * size]) (synthetic_experts)."""
    return packed_experts(rng, fmt, group, E, H, I)


def upload(cp, blobs, E: int, layout):
    buf = cp.asarray(blobs)
    ptrs = cp.asarray(np.array([buf.data.ptr + e * layout.size for e in range(E)], np.uint64))
    return buf, ops.PackedExpertTable.from_layout(ptrs, layout)


def routes(rng, T: int, E: int, k: int, skew: bool):
    if skew:   # expert 0 in every token: several passes of tokens per expert
        ids = [np.concatenate([[0], rng.choice(np.arange(1, E), k - 1, replace=False)]) for _ in range(T)]
    else:
        ids = [rng.choice(E, k, replace=False) for _ in range(T)]
    return np.stack(ids).astype(np.int32), rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)


CASES = [  # T, E, k, H, I, skew
    (1, 8, 2, 256, 128, False), (2, 8, 2, 512, 256, False), (3, 16, 4, 256, 384, False),
    (5, 64, 8, 256, 128, False), (32, 8, 2, 128, 256, True), (17, 4, 4, 128, 128, False),
    (2, 4, 2, 4224, 2176, False)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokc", [None, 1, 2, 4, 8])
def test_gemv_4bit_matches_numpy(cp, rng, fmt, case, tokc):
    T, E, k, H, I, skew = case
    layout, experts, blobs = packed_blobs(rng, *FORMATS[fmt], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, skew)
    x = rng.standard_normal((T, H)).astype(np.float32)
    d = ops.dispatch(cp.asarray(ids), E)
    act = ops.moe_gate_up_4bit(cp.asarray(x), table, d, k, tokens_per_pass_=tokc,
                               out=cp.full((T * k, I), np.nan, cp.float32))
    act_pairs = act.get()[d.inv.get()]                        # sorted order -> pair order
    assert rel(act_pairs, expect.pair_act(f64(x), ids, experts)) < F32_TOL
    ypair = ops.moe_down_4bit(act, table, d, cp.asarray(w), tokens_per_pass_=tokc,
                              out=cp.full((T * k, H), np.nan, cp.float32))
    assert rel(ypair.get(), expect.pair_down(f64(act_pairs), ids, f64(w), experts)) < F32_TOL


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("gemm", [False, True])
@pytest.mark.parametrize("T", [1, 6, 70])
def test_moe_experts_4bit_end_to_end(cp, rng, fmt, gemm, T):
    E, k, H, I = 16, 4, 256, 128
    layout, experts, blobs = packed_blobs(rng, *FORMATS[fmt], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    resid = rng.standard_normal((T, H)).astype(np.float32)
    expansions: dict = {}
    for _ in range(2):        # the second call reuses the expansion workspace
        y = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(ids), cp.asarray(w), table, residual=cp.asarray(resid),
                                 alpha=0.5, gemm=gemm, expansions=expansions)
        want = nb.moe(f64(x), ids, f64(w), experts, residual=f64(resid).copy(), alpha=0.5)
        assert rel(y.get(), want) < F32_TOL
    assert len(expansions) == int(gemm)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_one_token_passes_run_by_pair_alike_to_the_bit(cp, rng, fmt):
    """A one-token GEMV pass over 4-bit experts runs by pair, without a dispatch (ops.pairs_path): the same bits as
    the dispatch path, with and without a residual; a pass naming an id outside [0, E) adds nothing for it."""
    E, k, H, I = 16, 4, 256, 128
    layout, experts, blobs = packed_blobs(rng, *FORMATS[fmt], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, 1, E, k, False)
    x = rng.standard_normal((1, H)).astype(np.float32)
    resid = rng.standard_normal((1, H)).astype(np.float32)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    for residual in (None, resid):
        kw = {"residual": cp.asarray(residual), "alpha": 1.5} if residual is not None else {}
        by_pair = ops.moe_experts_4bit(*args, gemm=False, **kw).get()
        np.testing.assert_array_equal(by_pair, ops.moe_experts_4bit(*args, gemm=False, pairs=False, **kw).get())
        base = np.zeros((1, H)) if residual is None else f64(residual).copy()
        want = nb.moe(f64(x), ids, f64(w), experts, residual=base, alpha=kw.get("alpha", 1.0))
        assert rel(by_pair, want) < F32_TOL
    bad = ids.copy()
    bad[0, 1] = E + 3
    kept_w = w.copy()
    kept_w[0, 1] = 0.0
    got = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(bad), cp.asarray(w), table, gemm=False).get()
    assert rel(got, nb.moe(f64(x), np.where(bad < E, bad, ids[0, 0]), f64(kept_w), experts,
                           residual=np.zeros((1, H)))) < F32_TOL
    with pytest.raises(ValueError, match="weights"):
        ops.moe_down_4bit_pairs(cp.zeros((k, I), cp.float32), cp.asarray(ids), cp.zeros((1, k + 1), cp.float32),
                                table)


@pytest.mark.parametrize("fmt,int8_activations", [(f, False) for f in sorted(FORMATS)] + [("int4-g32", True)])
def test_prefill_without_an_expansion_workspace_keeps_its_own_alive(cp, rng, fmt, int8_activations):
    """expansions=None: the call's own expansion must outlive its GEMMs. With an empty memory pool, memory freed
    early is the first that the call's next allocations (x rounded, act) get, so the GEMMs would read overwritten
    weights (a row off by ~1e8 when the expansion was a temporary)."""
    E, k, H, I, T = 16, 4, 256, 128, 70
    layout, experts, blobs = packed_blobs(rng, *FORMATS[fmt], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(w), table)
    cp.cuda.get_current_stream().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    y = ops.moe_experts_4bit(*args, gemm=True, int8_activations=int8_activations).get()
    rounding = {"round_input": nb.round_int8_groups} if int8_activations else {}
    want = nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros((T, H)), **rounding)
    assert rel(y, want) < (2e-2 if int8_activations else F32_TOL)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_expansion_holds_the_same_weights_exactly(cp, rng, fmt):
    """The routed experts' int8_group expansion dequantizes to the 4-bit weights bit for bit; others untouched."""
    E, H, I = 8, 256, 128
    layout, experts, blobs = packed_blobs(rng, *FORMATS[fmt], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    ids = np.array([[1, 5], [5, 6]], np.int32)
    d = ops.dispatch(cp.asarray(ids), E)
    expansion = ops.Int8Expansion(table)
    expansion.buffer.fill(0)
    ops.expand_to_int8(table, d, expansion)
    int8 = numpy_experts(expansion.buffer.get(), expansion.layout)
    for e in range(E):
        for got, want in zip(int8(e), experts(e)):
            if e in (1, 5, 6):
                np.testing.assert_array_equal(got, want)
            else:
                assert not got.any()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("T", [1, 5])
def test_gemv_4bit_fills_admitted_slots_as_it_reads(cp, rng, fmt, T):
    """fill_ptrs: each routed expert with a slot gets its matrices and scales copied there by one gate_up + down
    pass; experts without a slot (0) or not routed are not written."""
    E, k, H, I = 8, 2, 256, 384
    layout, experts, blobs = packed_blobs(rng, *FORMATS[fmt], E, H, I)
    buf, table = upload(cp, blobs, E, layout)
    slots = cp.zeros(E * layout.size, cp.uint8)
    fills = np.array([slots.data.ptr + e * layout.size if e % 2 == 0 else 0 for e in range(E)], np.uint64)
    filled = ops.PackedExpertTable.from_layout(table.blob_ptrs, layout, fill_ptrs=cp.asarray(fills))
    ids, w = routes(rng, T, E, k, False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    y = ops.moe_experts_4bit(cp.asarray(x), cp.asarray(ids), cp.asarray(w), filled, gemm=False)
    assert rel(y.get(), nb.moe(f64(x), ids, f64(w), experts, residual=np.zeros((T, H)))) < F32_TOL
    got = slots.get()
    for e in range(E):
        for a in layout.arrays:
            lo = e * layout.size + a.offset
            region = got[lo:lo + a.nbytes]
            if e % 2 == 0 and e in ids:
                np.testing.assert_array_equal(region, blobs[lo:lo + a.nbytes], err_msg=f"expert {e} {a.name}")
            else:
                assert not region.any(), f"expert {e} {a.name} written without a routed slot"


def test_4bit_wrappers_reject_bad_inputs(cp, rng):
    layout, experts, blobs = packed_blobs(rng, S.ExpertFormat.INT4_GROUP, 32, 4, 128, 64)
    buf, table = upload(cp, blobs, 4, layout)
    ids, w = routes(rng, 2, 4, 2, False)
    d = ops.dispatch(cp.asarray(ids), 4)
    with pytest.raises(TypeError):
        ops.moe_gate_up_4bit(cp.zeros((2, 128), cp.float64), table, d, 2)
    with pytest.raises(ValueError, match="tokens per pass"):
        ops.moe_gate_up_4bit(cp.zeros((2, 128), cp.float32), table, d, 2, tokens_per_pass_=3)
    bad = ops.PackedExpertTable(**{**table.__dict__, "group_size": 16})
    with pytest.raises(ValueError, match="group size"):
        ops.moe_gate_up_4bit(cp.zeros((2, 128), cp.float32), bad, d, 2)
    other = ops.Int8Expansion(ops.PackedExpertTable(**{**table.__dict__, "group_size": 64}))
    with pytest.raises(ValueError, match="another expert table"):
        ops.expand_to_int8(table, d, other)


# ---- engine ---------------------------------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2], [40, 41, 42]]
LONG = list(range(3, 83))      # 80 rows: the prefill takes the grouped GEMM (expansion) path


def _int4_file(tmp_path, group: int):
    hf = build_hf("mixtral", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  intermediate_size=128, max_position_embeddings=256)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"int4-g{group}.colibri"
    convert(tmp_path / "hf", path, dtype="float32", quantize="expert", quant_bits=4, group_size=group, workers=1,
            verify=False)
    return path


def _mxfp4_file(tmp_path):
    model = synthetic_model(vocab=96, hidden=128, layers=2, heads=2, kv_heads=1, experts=4, top_k=2,
                            expert_inter=128)
    return write_synthetic(tmp_path / "mxfp4.colibri", model, expert_format=S.ExpertFormat.MXFP4, group_size=32,
                           seed=5)


def _file(tmp_path, name: str):
    fmt, group = FORMATS[name]
    return _mxfp4_file(tmp_path) if fmt == S.ExpertFormat.MXFP4 else _int4_file(tmp_path, group)


def _rel_logits(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_gives_the_numpy_engines_tokens(tmp_path, name, graphs):
    path = _file(tmp_path, name)
    cfg = EngineConfig(device="cuda", max_seq_len=128, use_graphs=graphs, int8_activations=False)
    flt = EngineConfig(int8_activations=False)    # float activations (int8 ones: test_gpu_4bit_dp4a.py)
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64", int8_activations=False)) as ref, \
            Engine(path, flt) as cpu:
        assert S.ExpertFormat(gpu.reader.blob_layout.expert_format) == FORMATS[name][0]
        for got, exp in zip(gpu.logits(PROMPTS + [LONG]), ref.logits(PROMPTS + [LONG])):
            assert _rel_logits(got, exp) < ENGINE_TOL
        for prompt in PROMPTS:
            tokens = gpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
            assert tokens == cpu.generate(prompt, max_new_tokens=10, stop_ids=[]).output_ids
        assert gpu.generate_batch(PROMPTS, 6) == cpu.generate_batch(PROMPTS, 6)


@pytest.mark.parametrize("name", ["int4-g32", "mxfp4"])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_4bit_prefill_graphs_replay_the_eager_padded_pass(tmp_path, name, int8_activations):
    """A fresh prompt's padded prefill over 4-bit experts (the expansion to int8 and the grouped GEMM): its graph
    replays give the eager padded pass's logits bit for bit, for a second prompt of the bucket too, and those are the
    bare prompt's (an engine without graphs) up to rounding: the padded pass runs the GEMM where the bare one may run
    the GEMVs."""
    if int8_activations and name == "mxfp4":
        pytest.skip("int8 activations are built for int4_group experts")
    path = _file(tmp_path, name)
    cfg = dict(device="cuda", max_seq_len=128, int8_activations=int8_activations)
    with Engine(path, EngineConfig(**cfg)) as g, Engine(path, EngineConfig(**cfg, use_graphs=False)) as e:
        for prompt in (PROMPTS[0], PROMPTS[2]):
            runs = [g.be.to_host(g._prefill_fresh([np.asarray(prompt)]))[0].copy() for _ in range(3)]
            np.testing.assert_array_equal(runs[1], runs[0])
            np.testing.assert_array_equal(runs[2], runs[0])
            assert rel(runs[0], e.logits([prompt])[0][-1]) < ENGINE_TOL
        assert g.stats()["prefill_graphs"]["64"] == "captured"


@pytest.mark.parametrize("name", ["int4-g32", "mxfp4"])
@pytest.mark.parametrize("graphs", [True, False])
def test_paged_4bit_experts_compute_what_resident_ones_do(tmp_path, name, graphs):
    """A cache of 3 of the 8 experts: misses read blobs over PCIe, admissions fill on read (decode) or copy
    (prefill); tokens and logits equal the resident run's."""
    path = _file(tmp_path, name)
    # passes of at most 48 rows on both (LONG: 48 + 32, the first on the grouped GEMM): a padded prefill graph of
    # 64 rows on the resident engine would run the GEMM where the paged one runs a short prompt on the GEMVs
    base = dict(device="cuda", max_seq_len=128, use_graphs=graphs, max_prefill_rows=48)
    with Engine(path, EngineConfig(**base)) as resident, \
            Engine(path, EngineConfig(**base, max_cached_experts=3)) as paged:
        assert paged.experts.resident is False
        for _ in range(2):            # the second round runs on what the first admitted
            for a, b in zip(paged.logits(PROMPTS + [LONG]), resident.logits(PROMPTS + [LONG])):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            for prompt in PROMPTS:
                assert paged.generate(prompt, max_new_tokens=12, stop_ids=[]).output_ids == \
                    resident.generate(prompt, max_new_tokens=12, stop_ids=[]).output_ids
        assert paged.stats()["paging"]["misses"] > 0
