"""The engine's scenarios on every backend: device="cpu" (NumPy, float32) everywhere, device="cuda" on a GPU
(skipped with a visible reason elsewhere). The reference is the NumPy backend in float64 on the same file.

Tiny transformers checkpoints of every supported architecture (head_dim 64 so the CUDA attention kernel runs;
one model with head_dim 8 for the array-operation fallback) are converted with int8 experts by the real
pipeline, so every engine reads the same int8 blobs. Scenarios: logits and greedy tokens on every architecture,
graphs, bf16 dense weights, batched decoding, paging (outputs, hits, misses, evictions, several passes a
layer), prefetch, the staging fallback, checksums on page-in, the memory budget error, long prefills and a closed
engine. Fidelity against transformers itself is tests/runtime/test_fidelity.py and test_file_engine.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import colibri_format
from colibri_format.convert.pipeline import convert
from colibri_format.errors import CorruptExpert, InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.expert_pool import MEMORY_RESERVE
from colibri_format.runtime.runner import CHAIN_STEPS

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "glm4_moe", "minimax_m2")
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)   # head_dim 64
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42]]
TOLERANCE = {"cpu": 1e-5, "cuda": 2e-3}        # relative logit error against the float64 reference
# the same with W8A8 prefill passes (fast_expert_gemm='int8') on both sides: where float32 and float64 inputs fall on either side
# of an int8 rounding step the logits move by more (2.8e-5 measured on the CPU, test_long_prefill)
W8A8_TOLERANCE = {"cpu": 2e-4, "cuda": 5e-3}
# with values rounded to bf16 on both sides (a bf16 KV cache, dense_gemm='bf16'): a value whose two computations
# (float32 and float64, or passes of other sizes) straddle a bf16 rounding midpoint lands one bf16 step (2^-8
# relative) apart, which moves logits by up to ~5e-5 on these models; a side that did not round is ~2e-3 away
BF16_ROUNDED_TOLERANCE = {"cpu": 2e-4, "cuda": 2e-3}


@functools.lru_cache(maxsize=1)
def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- any import or driver failure means "no GPU here"
        return False


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    if request.param == "cuda" and not _gpu():
        pytest.skip("no CUDA GPU / CuPy available")
    return request.param


def make_file(tmp_path_factory, arch: str, dtype: str = "float32", **overrides):
    from tests.hf_models import make_tiny_checkpoint

    out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
    if arch in ("qwen3_moe", "glm4_moe", "minimax_m2") and "hidden_size" in overrides:   # explicit head_dim
        overrides = {**overrides, "head_dim": overrides["hidden_size"] // overrides["num_attention_heads"]}
    make_tiny_checkpoint(arch, out / "hf", **overrides)
    path = out / "model.colibri"
    convert(out / "hf", path, dtype=dtype, quantize="expert", workers=1, verify=False)
    return path


@pytest.fixture(scope="module", params=ARCHS)
def arch_file(request, tmp_path_factory):
    return make_file(tmp_path_factory, request.param, **WIDE)


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory):
    return make_file(tmp_path_factory, "mixtral", num_hidden_layers=3, **WIDE)


def reference(path, **cfg) -> Engine:
    return Engine(path, EngineConfig(precision="float64", **cfg))


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def assert_same_as_reference(eng: Engine, ref: Engine, prompts, new_tokens: int, tol: float | None = None) -> None:
    tol = tol or TOLERANCE[eng.config.device]
    for got, exp in zip(eng.logits(prompts), ref.logits(prompts)):
        assert got.shape == exp.shape and got.dtype == np.float32 and rel(got, exp) < tol
    assert eng.infer(prompts) == ref.infer(prompts)
    for prompt in prompts[:2]:
        assert eng.generate(prompt, max_new_tokens=new_tokens, stop_ids=[]).output_ids == \
            ref.generate(prompt, max_new_tokens=new_tokens, stop_ids=[]).output_ids


def test_every_architecture(arch_file, device):
    with Engine(arch_file, EngineConfig(device=device, max_seq_len=64)) as eng, reference(arch_file) as ref:
        assert_same_as_reference(eng, ref, PROMPTS, 10)
        graphs = eng.stats()["graphs"]
        assert graphs == ({"1x64": "captured"} if device == "cuda" else {"1x64": "the numpy backend has no graphs"})


def test_bf16_dense_weights(tmp_path_factory, device):
    path = make_file(tmp_path_factory, "qwen3_moe", dtype="bfloat16", **WIDE)
    with Engine(path, EngineConfig(device=device)) as eng, reference(path) as ref:
        assert_same_as_reference(eng, ref, PROMPTS, 6)


def test_bf16_dense_products_of_decode_batches_on_the_tensor_cores(tmp_path_factory, device, monkeypatch):
    """With the backend's dense_tc_min_rows switched on, batches of 3 take dense_gemv_tc_normed (the normed q/k/v)
    and dense_gemv_tc (o_proj, lm_head), captured in the decode graph, and keep the reference's greedy tokens."""
    if device == "cpu":
        pytest.skip("dense_gemv_tc is a CUDA kernel: the NumPy backend has no such switch")
    from colibri_format.runtime.cuda.kernels import ops

    calls = []
    for name in ("dense_gemv_tc", "dense_gemv_tc_normed"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, name=name, real=real, **kw: calls.append((name, a[0].shape[0]))
                            or real(*a, **kw))
    path = make_file(tmp_path_factory, "qwen3_moe", dtype="bfloat16", **WIDE)
    with Engine(path, EngineConfig(device=device)) as eng, reference(path) as ref:
        eng.be.dense_tc_min_rows = 2
        for prompt, got in zip(PROMPTS, eng.generate_batch(PROMPTS, 6)):
            assert got == ref.generate(prompt, max_new_tokens=6, stop_ids=[]).output_ids
        # the decode steps' passes of 3 rows (the packed prompts' 12 rows too)
        assert {("dense_gemv_tc", 3), ("dense_gemv_tc_normed", 3)} <= set(calls)


def test_bf16_kv_cache(tmp_path_factory, device):
    """kv_cache_dtype="bfloat16": the kernels (CUDA) and the NumPy twin round keys and values to bf16 alike, so the
    float64 engine with the same cache is the reference (BF16_ROUNDED_TOLERANCE: the float32 cache is ~2e-3 away on these
    models, so a side that did not round would show), on every attention path: the kernels (head_dim 64), flash
    prefill (40 rows) and the array-operation fallback (head_dim 8)."""
    for path in (make_file(tmp_path_factory, "qwen3_moe", **WIDE), make_file(tmp_path_factory, "mixtral")):
        cfg = dict(kv_cache_dtype="bfloat16", max_seq_len=64)
        with Engine(path, EngineConfig(device=device, **cfg)) as eng, reference(path, **cfg) as ref:
            assert eng.stats()["kv_cache_dtype"] == "bfloat16"
            assert_same_as_reference(eng, ref, PROMPTS + [list(range(3, 43))], 6, tol=BF16_ROUNDED_TOLERANCE[device])


def test_dense_gemm_bf16(tmp_path_factory, device):
    """dense_gemm="bf16": a 40-row pass's bf16 dense products take x rounded to bf16 (one tensor-core product on
    CUDA, `ops.round_bf16`); the float64 engine with the same option rounds alike (limits.rounds_dense_bf16)."""
    path = make_file(tmp_path_factory, "qwen3_moe", dtype="bfloat16", **WIDE)
    cfg = dict(dense_gemm="bf16", max_seq_len=64)
    with Engine(path, EngineConfig(device=device, **cfg)) as eng, reference(path, **cfg) as ref:
        # 4 greedy tokens: this model's fifth after PROMPTS[0] is a near-tie (top two logits 2.0e-4 apart on a scale
        # of 0.55), which the CUDA engine's float32 decode flipped on the H200 (session 25)
        assert_same_as_reference(eng, ref, PROMPTS + [list(range(3, 43))], 4, tol=BF16_ROUNDED_TOLERANCE[device])


def test_small_heads_use_the_fallback_attention(tmp_path_factory, device):
    path = make_file(tmp_path_factory, "mixtral")                                  # head_dim 8
    with Engine(path, EngineConfig(device=device, max_seq_len=64)) as eng, reference(path) as ref:
        assert_same_as_reference(eng, ref, PROMPTS, 5)
        if device == "cuda":
            assert "fallback" in eng.stats()["graphs"]["1x64"]


def test_graph_replay_equals_eager(mixtral_file, device):
    with Engine(mixtral_file, EngineConfig(device=device)) as g, \
            Engine(mixtral_file, EngineConfig(device=device, use_graphs=False)) as e:
        prompts = [[1, 2, 3], [9, 8], [4], [7, 7, 7, 7]]
        assert g.generate_batch(prompts, 12) == e.generate_batch(prompts, 12)
        assert e.stats()["graphs"]["4x64"] in ("graphs disabled", "the numpy backend has no graphs")
        assert g.stats()["graphs"]["4x64"] == ("captured" if device == "cuda" else "the numpy backend has no graphs")
        ra, rb = g.decode_runner(4, 64), e.decode_runner(4, 64)
        la = g.be.to_host(ra.step(np.array([1, 2, 3, 4]), np.array([20, 21, 22, 23]))).copy()
        lb = e.be.to_host(rb.step(np.array([1, 2, 3, 4]), np.array([20, 21, 22, 23])))
        assert np.array_equal(la, lb)                   # same kernels, same order: bit-identical


def test_prefill_graphs_replay_the_padded_pass(mixtral_file, device, monkeypatch):
    """A fresh prompt's prefill runs padded to its bucket of rows: eager on its first use, captured as a graph on
    the second (CUDA) and replayed after, into KV of its own (infer) or a decode runner's (generate); the padding
    changes none of the prompt's logits. The NumPy backend, which has no graphs, is told it could take them so that
    it runs the padded pass (its capture fails, and it stays eager)."""
    prompt = [(5 * i + 1) % 128 for i in range(37)]
    with Engine(mixtral_file, EngineConfig(device=device)) as g, \
            Engine(mixtral_file, EngineConfig(device=device, use_graphs=False)) as e:
        if device == "cpu":
            monkeypatch.setattr(g, "graph_blocker", lambda batch: None)
        want = e.logits([prompt])[0][-1]                # every row's logits: never padded
        for _ in range(3):
            got = g.be.to_host(g._prefill_fresh([np.asarray(prompt)]))[0]
            assert rel(got, want) < TOLERANCE[device]
        other = prompt[::-1][:30]                       # another prompt of the bucket: only its ids change
        got = g.be.to_host(g._prefill_fresh([np.asarray(other)]))[0]
        assert rel(got, e.logits([other])[0][-1]) < TOLERANCE[device]
        status = g.stats()["prefill_graphs"]["64"]
        assert status == "captured" if device == "cuda" else status.startswith("capture failed")
        assert g.infer([prompt]) == e.infer([prompt])
        for _ in range(2):
            assert g.generate(prompt, max_new_tokens=6, stop_ids=[]).output_ids == \
                e.generate(prompt, max_new_tokens=6, stop_ids=[]).output_ids
        assert "64 into a decode runner" in g.stats()["prefill_graphs"]
        assert e.stats()["prefill_graphs"] == {}


def test_prefill_graphs_take_one_fresh_sequence_of_resident_experts(mixtral_file, device, monkeypatch):
    with Engine(mixtral_file, EngineConfig(device=device)) as eng, \
            Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=4)) as paged, \
            Engine(mixtral_file, EngineConfig(device=device, max_prefill_rows=32)) as narrow, \
            Engine(mixtral_file, EngineConfig(device=device, max_seq_len=50)) as short:
        for engine in (eng, paged, narrow, short):
            monkeypatch.setattr(engine, "graph_blocker", lambda batch: None)
        eng.infer([[1, 2, 3], [4, 5]])          # two sequences
        eng.logits([[1, 2, 3]])                 # every row's logits
        paged.infer([[1, 2, 3]])                # experts paged
        narrow.infer([list(range(40))])         # 64 padded rows > max_prefill_rows
        short.infer([list(range(40))])          # 64 padded positions > max_seq_len
        runner = eng.decode_runner(1, 64)
        eng.prefill_into(runner, [np.arange(3)], seqs=[0], starts=[5])     # a continuation
        assert [x.stats()["prefill_graphs"] for x in (eng, paged, narrow, short)] == [{}, {}, {}, {}]
        eng.infer([[1, 2, 3]])
        assert list(eng.stats()["prefill_graphs"]) == ["64"]


def test_kept_graphs_follow_the_backends_kernel_choices(mixtral_file, device, monkeypatch):
    """Runners (and their graphs) are kept per `be.kernel_choices()`: a kernel switched on the open backend, as the
    prefill benchmarks do between variants, gets runners of its own instead of replaying a graph captured under the
    old choice; switching back finds the old ones."""
    prompt = [(7 * i + 3) % 128 for i in range(37)]
    with Engine(mixtral_file, EngineConfig(device=device)) as g:
        if device == "cpu":
            monkeypatch.setattr(g, "graph_blocker", lambda batch: None)
        choices = g.be.kernel_choices()
        for _ in range(3):
            g._prefill_fresh([np.asarray(prompt)])
        (before,) = g._prefill_runners.values()
        decode = g.decode_runner(1, 64)
        monkeypatch.setattr(g.be, "kernel_choices", lambda: (*choices, "switched"))
        g._prefill_fresh([np.asarray(prompt)])
        assert len(g._prefill_runners) == 2 and list(g._prefill_runners.values())[-1] is not before
        assert list(g._prefill_runners.values())[-1].graph is None      # eager: its first use under these choices
        assert list(g.stats()["prefill_graphs"]) == ["64", "64 #2"]     # both shown
        assert g.decode_runner(1, 64) is not decode
        assert list(g.stats()["graphs"]) == ["1x64", "1x64 #2"]
        monkeypatch.setattr(g.be, "kernel_choices", lambda: choices)
        assert g.decode_runner(1, 64) is decode


def test_a_prefill_that_reads_counts_on_the_host_stays_eager(mixtral_file, device):
    if device == "cpu":
        pytest.skip("the cuBLAS expert route (host-read counts) is the CUDA backend's")
    prompt = [(3 * i + 2) % 128 for i in range(40)]
    cfg = dict(device=device, cublas_expert_gemm=True)
    with Engine(mixtral_file, EngineConfig(**cfg)) as g, Engine(mixtral_file, EngineConfig(use_graphs=False, **cfg)) as e:
        want = e.infer([prompt])
        assert [g.infer([prompt]) for _ in range(3)] == [want] * 3
        assert "synchronizes with the host" in g.stats()["prefill_graphs"]["64"]


def test_decode_steps_of_up_to_32_rows_are_graphs(mixtral_file, device):
    # 20 rows: the dense products run dense_gemv in passes of 8 + 8 + 4 rows, so the CUDA step is captured
    prompts = [[1 + (5 * i + j) % 30 for j in range(1 + i % 4)] for i in range(20)]
    with Engine(mixtral_file, EngineConfig(device=device, max_seq_len=64)) as eng, reference(mixtral_file) as ref:
        assert eng.generate_batch(prompts, 5) == ref.generate_batch(prompts, 5)
        wide = {status for key, status in eng.stats()["graphs"].items() if key.startswith("20x")}
        assert wide == ({"captured"} if device == "cuda" else {"the numpy backend has no graphs"})
        if device == "cuda":
            assert "cuBLAS" in eng.graph_blocker(33)


def test_route_observers_added_after_capture_see_every_step(mixtral_file, device):
    with Engine(mixtral_file, EngineConfig(device=device)) as eng:
        first = eng.generate([3, 4, 5], max_new_tokens=6, stop_ids=[]).output_ids      # captures on CUDA
        seen = []
        eng.routes.observers.append(lambda step, seq, layer, ids, pos: seen.append((step, layer)))
        assert eng.generate([3, 4, 5], max_new_tokens=6, stop_ids=[]).output_ids == first
        steps = {step for step, _ in seen}
        assert len(steps) == 6 and all(sum(1 for s, _ in seen if s == step) == 3 for step in steps)   # 3 layers


def test_batch_generation_matches_single_sequences(mixtral_file, device):
    with Engine(mixtral_file, EngineConfig(device=device)) as eng, reference(mixtral_file) as ref:
        for prompt, got in zip(PROMPTS, eng.generate_batch(PROMPTS, 6)):
            assert got == ref.generate(prompt, max_new_tokens=6, stop_ids=[]).output_ids


def _stepwise(eng: Engine, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy tokens a step at a time through the host (`DecodeRunner.step`, the engine's path before chains)."""
    runner = eng.decode_runner(len(prompts), max(map(len, prompts)) + new_tokens)
    outs = [[t] for t in eng.argmax(eng.prefill_into(runner, [np.array(p) for p in prompts]))]
    pos = np.array([len(p) for p in prompts])
    for j in range(new_tokens - 1):
        for o, t in zip(outs, eng.argmax(runner.step(np.array([o[-1] for o in outs]), pos + j))):
            o.append(t)
    return outs


def test_chained_steps_equal_single_steps(mixtral_file, device):
    """Tokens fed back on the device (generate, generate_batch: chains of CHAIN_STEPS) are the tokens of single
    steps through the host, across chain boundaries, for one sequence and for a batch."""
    n = CHAIN_STEPS + 5
    with Engine(mixtral_file, EngineConfig(device=device)) as eng, \
            Engine(mixtral_file, EngineConfig(device=device)) as ref:
        assert eng.chain_steps == (CHAIN_STEPS if device == "cuda" else 1)
        eng.chain_steps = CHAIN_STEPS          # the NumPy engine steps one at a time by default: chain it here too
        want = _stepwise(ref, PROMPTS, n)
        assert eng.generate_batch(PROMPTS, n) == want
        assert eng.generate(PROMPTS[0], max_new_tokens=n, stop_ids=[]).output_ids == want[0]
        runner = eng.decode_runner(1, 64)
        first = eng.argmax(eng.prefill_into(runner, [np.array(PROMPTS[1])]))
        chained = runner.chain(np.array(first), np.array([len(PROMPTS[1])]), 6)
        assert chained.shape == (6, 1) and [first[0], *chained[:5, 0]] == want[1][:6]
        seq, qlen = runner.inp.host_rows(1)     # the host rows of the last step (wide passes plan attention on them)
        assert seq.tolist() == [0] and qlen.tolist() == [len(PROMPTS[1]) + 6]
        with pytest.raises(ValueError, match="at least one step"):
            runner.chain(np.array(first), np.array([len(PROMPTS[1])]), 0)
        if device == "cuda":
            assert eng.stats()["graphs"]["1x64"] == "captured"


def test_a_stop_inside_a_chain_ends_the_output_there(mixtral_file, device):
    with Engine(mixtral_file, EngineConfig(device=device)) as eng:
        eng.chain_steps = CHAIN_STEPS
        free = eng.generate(PROMPTS[0], max_new_tokens=CHAIN_STEPS + 8, stop_ids=[]).output_ids
        k = next(i for i in range(3, len(free)) if free[i] not in free[:i])      # a token's first appearance
        stopped = eng.generate(PROMPTS[0], max_new_tokens=CHAIN_STEPS + 8, stop_ids=[free[k]])
        assert stopped.output_ids == free[:k + 1] and stopped.stats.finish_reason == "stop"
        seen = []
        cut = eng.generate(PROMPTS[0], max_new_tokens=CHAIN_STEPS + 8, stop_ids=[],
                           callback=lambda t: seen.append(t) or len(seen) < 3)
        assert cut.output_ids == free[:3] == seen and cut.stats.finish_reason == "callback"


def test_paged_chains_decide_as_single_steps(mixtral_file, device):
    """Paged experts: a chain's passes run the cache's bookkeeping pass by pass as single steps do (same tokens,
    hits, misses, bytes)."""
    cfg = EngineConfig(device=device, max_cached_experts=3, cache_policy="lru", cache_scope="global")
    runs = []
    for steps in (1, CHAIN_STEPS):
        with Engine(mixtral_file, cfg) as eng:
            eng.chain_steps = steps
            r = eng.generate([3, 4, 5], max_new_tokens=CHAIN_STEPS + 4, stop_ids=[])
            runs.append((r.output_ids, r.stats.cache_hits, r.stats.cache_misses, r.stats.bytes_paged,
                         r.stats.bytes_zero_copy))
    assert runs[0] == runs[1] and runs[0][2] > 0


@pytest.mark.parametrize("policy,scope,capacity", [("lru", "global", 3), ("lrfu", "global", 5),
                                                   ("lru", "per_layer", 2), ("lfu", "per_layer", 1)])
def test_paging(mixtral_file, device, policy, scope, capacity):
    """Paged outputs equal the resident reference; the cache decides alike on every backend (equal counters)."""
    cfg = dict(max_cached_experts=capacity, cache_policy=policy, cache_scope=scope)
    with Engine(mixtral_file, EngineConfig(device=device, **cfg)) as eng, \
            Engine(mixtral_file, EngineConfig(**cfg)) as cpu, reference(mixtral_file) as ref:
        assert not eng.experts.resident and eng.stats()["host_source"] == "registered"
        for got, same, exp in zip(eng.logits(PROMPTS), cpu.logits(PROMPTS), ref.logits(PROMPTS)):
            assert rel(got, exp) < TOLERANCE[device] and rel(same, exp) < TOLERANCE["cpu"]
        a = eng.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        b = cpu.generate([3, 4, 5], max_new_tokens=8, stop_ids=[])
        assert a.output_ids == b.output_ids == ref.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids
        assert (a.stats.cache_hits, a.stats.cache_misses, a.stats.bytes_paged) == \
            (b.stats.cache_hits, b.stats.cache_misses, b.stats.bytes_paged)
        assert a.stats.bytes_zero_copy == b.stats.bytes_zero_copy == a.stats.cache_misses * eng.experts.blob_size
        fills = eng.experts.counters.fills          # admissions the GEMV kernels filled as they read (no copy)
        assert a.stats.cache_misses > 0 and fills > 0 and fills == cpu.experts.counters.fills
        assert a.stats.bytes_paged == (eng.experts.counters.loads - fills) * eng.experts.blob_size
        assert eng.cache.stats().evictions == cpu.cache.stats().evictions > 0
        assert eng.stats()["graphs"]["1x64"] == "captured" or device == "cpu"     # paged steps are graphs too
        if capacity == 1:       # top-2 routing, one slot a layer: every layer reads at least one expert from the host
            paging = eng.stats()["paging"]
            assert paging["misses"] >= paging["hits"]


def test_prefetch_keeps_outputs(mixtral_file, device):
    cfg = dict(max_cached_experts=8, cache_policy="lrfu")
    with Engine(mixtral_file, EngineConfig(device=device, prefetch=True, **cfg)) as eng, \
            reference(mixtral_file) as ref:
        assert eng.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids == \
            ref.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids
        paging = eng.stats()["paging"]
        assert paging["prefetch_loads"] > 0 and paging["predicted"] > 0 and 0.0 <= paging["prefetch_recall"] <= 1.0


def test_pinned_copy_when_registration_fails(mixtral_file, device, monkeypatch):
    def refuse(self, addr, nbytes):
        raise RuntimeError("refused (test)")

    with Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=3)) as probe:
        monkeypatch.setattr(type(probe.be), "register_host", refuse)
    with Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=3)) as eng, \
            reference(mixtral_file) as ref:
        assert eng.stats()["host_source"] == "pinned copy"
        assert eng.infer(PROMPTS) == ref.infer(PROMPTS)
        assert eng.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids == \
            ref.generate([3, 4, 5], max_new_tokens=8, stop_ids=[]).output_ids


def test_corrupt_expert_is_caught_before_use(tmp_path_factory, device):
    path = make_file(tmp_path_factory, "mixtral", **WIDE)
    with colibri_format.open(path, verify="never") as f:
        offset = f.blob_offset(1, 2)
    with open(path, "r+b") as fh:
        fh.seek(offset + 7)
        b = fh.read(1)
        fh.seek(offset + 7)
        fh.write(bytes([b[0] ^ 0x5A]))
    prompts = [[start % 128, (start + 1) % 128, (start + 2) % 128] for start in range(0, 60, 3)]
    with pytest.raises(CorruptExpert):      # resident: CUDA checks every blob before its upload, NumPy on first read
        with Engine(path, EngineConfig(device=device)) as eng:
            for prompt in prompts:
                eng.infer([prompt])
    with pytest.raises(CorruptExpert):      # paged: CUDA checks every blob at open (kernels read the mapping
        with Engine(path, EngineConfig(device=device, max_cached_experts=2)) as eng:   # directly), NumPy on read
            for prompt in prompts:
                eng.infer([prompt])
    with Engine(path, EngineConfig(device=device, verify="never")) as eng:
        eng.infer(prompts[:3])              # the user asked not to check


def track_registrations(path, device: str, monkeypatch) -> list:
    """The addresses registered with the device and not yet unregistered, kept up to date by the backend's calls
    (the NumPy backend is made to use a host source too)."""
    with Engine(path, EngineConfig(device=device, verify="never")) as probe:
        backend = type(probe.be)
    live: list = []
    register, unregister = backend.register_host, backend.unregister_host
    monkeypatch.setattr(backend, "register_host", lambda self, a, n: (register(self, a, n), live.append(a)))
    monkeypatch.setattr(backend, "unregister_host", lambda self, a: (unregister(self, a), live.remove(a)))
    monkeypatch.setattr(backend, "host_is_device", False)      # the NumPy backend copies into a pool too
    return live


def test_a_failed_open_unregisters_the_file_mapping(tmp_path_factory, device, monkeypatch):
    """A corrupt blob found while loading resident experts: the registration of the mapping is undone (a mapping
    left registered pins pages of a file that is gone, and the next file mapped there is refused)."""
    path = make_file(tmp_path_factory, "mixtral", **WIDE)
    with colibri_format.open(path, verify="never") as f:
        offset = f.blob_offset(0, 1)
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        fh.write(b"\x7f")
    live = track_registrations(path, device, monkeypatch)
    with pytest.raises(CorruptExpert):
        Engine(path, EngineConfig(device=device))
    assert live == []


def test_an_engine_dropped_without_close_unregisters_the_file_mapping(mixtral_file, device, monkeypatch):
    import gc

    live = track_registrations(mixtral_file, device, monkeypatch)
    eng = Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=4))
    eng.infer([[1, 2, 3]])
    assert len(live) == 1
    del eng
    gc.collect()
    assert live == []


def test_over_budget_names_the_largest_that_fits(mixtral_file, device, monkeypatch):
    with colibri_format.open(mixtral_file) as f:
        blob = len(f.expert_blob(0, 0))
    with Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=3)) as probe:
        monkeypatch.setattr(type(probe.be), "free_memory", lambda self: MEMORY_RESERVE + 3 * blob)
    with pytest.raises(InvalidInput, match="largest max_cached_experts that fits is 3"):
        Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=4))
    with Engine(mixtral_file, EngineConfig(device=device, max_cached_experts=3)) as eng:
        eng.infer([[1, 2, 3]])


@pytest.mark.parametrize("gemm", ["split", "int8"])
def test_long_prefill(mixtral_file, device, gemm):
    """48 rows: the grouped GEMM experts and cuBLAS dense products on CUDA, with float activations ('split') and
    W8A8 ('int8'), whose float64 reference rounds the same rows (W8A8_TOLERANCE)."""
    prompt = [(7 * i + 3) % 128 for i in range(48)]
    config = {"fast_expert_gemm": gemm}
    with Engine(mixtral_file, EngineConfig(device=device, **config)) as eng, reference(mixtral_file, **config) as ref:
        assert_same_as_reference(eng, ref, [prompt, prompt[:5]], 4,
                                 tol=None if gemm == "split" else W8A8_TOLERANCE[device])


def test_closed_engine_refuses(mixtral_file, device):
    eng = Engine(mixtral_file, EngineConfig(device=device))
    eng.close()
    eng.close()
    for call in (lambda: eng.infer([[1]]), lambda: eng.generate([1]), lambda: eng.logits([[1]])):
        with pytest.raises(InvalidInput, match="closed"):
            call()
