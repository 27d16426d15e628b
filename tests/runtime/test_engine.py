"""Engine behaviour: input errors, generation controls, lazy expert paging, the cache, traces, C-style API.

Experts are resident (read in place from the file mapping, no cache, paging counters at zero) unless
max_cached_experts is below the model's 16 experts; then they are paged through the expert cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import (BatchTooLarge, ColibriFormatError, EmptyInput, InvalidInput, InvalidMetadata,
                                   SequenceTooLong, TokenIdOutOfRange, UnsupportedModel)
from colibri_format.reader import ColibriFile
from colibri_format.runtime import Engine, EngineConfig, colibri_free, colibri_infer, colibri_init, numpy_backend
from colibri_format.runtime.cache.trace import access_sequence, read_trace
from colibri_format.runtime.numpy_backend import NumpyBackend
from tests.runtime.numpy_tiny import tiny_file

ALL_EXPERTS = 16          # 2 MoE layers x 8 experts


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_file(tmp_path_factory.mktemp("tiny") / "tiny.colibri")


@pytest.fixture
def engine(path):
    with Engine(path, EngineConfig(max_batch_size=3, max_seq_len=12)) as eng:
        yield eng


# --- bad input: one error class each ---------------------------------------------------------------

@pytest.mark.parametrize("batch, error, message", [
    ([], EmptyInput, "no sequences"),
    ([[1, 2], []], EmptyInput, "sequence 1 has no token ids"),
    ([[1, 50]], TokenIdOutOfRange, "position 1 of sequence 0 is outside [0, 50)"),
    ([[-1]], TokenIdOutOfRange, "outside [0, 50)"),
    ([[1.5, 2.0]], TokenIdOutOfRange, "integer token ids"),
    ([[True, False]], TokenIdOutOfRange, "integer token ids"),
    ([list(range(13))], SequenceTooLong, "13 tokens, over max_seq_len=12"),
    ([[1]] * 4, BatchTooLarge, "4 sequences, over max_batch_size=3"),
    ([1, 2, 3], InvalidInput, "not one flat list"),
    ("hello", InvalidInput, "list of token id lists"),
])
def test_bad_input_raises_one_clear_error(engine, batch, error, message):
    with pytest.raises(error) as info:
        engine.infer(batch)
    assert message in str(info.value)
    assert isinstance(info.value, ColibriFormatError)


def test_bad_generation_arguments(engine):
    with pytest.raises(InvalidInput, match="temperature"):
        engine.generate([1], temperature=-1.0)
    with pytest.raises(InvalidInput, match="top_p"):
        engine.generate([1], top_p=0.0)
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        engine.generate([1], max_new_tokens=-2)
    with pytest.raises(InvalidInput, match="needs a tokenizer"):
        engine.generate("hello")


@pytest.mark.parametrize("field, value", [("max_batch_size", 0), ("max_seq_len", -1), ("device", "tpu"),
                                          ("fast_expert_gemm", "fp8"), ("kv_cache_dtype", "float8"),
                                          ("kv_cache_dtype", "float32"), ("cache_policy", "belady"),
                                          ("cache_policy", "fifo"), ("cache_scope", "layer"), ("cache_clock", "wall"),
                                          ("decay_factor", 0.0), ("decay_factor", float("nan")),
                                          ("decay_factor", True),
                                          ("cublas_expert_gemm", "yes"), ("cublas_expert_gemm", 1)])
def test_bad_config_is_refused(field, value):
    with pytest.raises(InvalidInput, match=field):
        EngineConfig(**{field: value})


def test_unsupported_model_features_are_refused(path, tmp_path, monkeypatch):
    # the spec admits no activation but silu, so such a file cannot be written ...
    with pytest.raises(InvalidMetadata, match="hidden_act"):
        tiny_file(tmp_path / "gelu.colibri", hidden_act="gelu_pytorch_tanh")
    # ... and the engine refuses one anyway (a reader that accepted it, e.g. of a later spec version)
    monkeypatch.setattr(ColibriFile, "model",
                        property(lambda self: {**self.metadata["model"], "hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(UnsupportedModel, match="hidden_act"):
        Engine(path)


def test_an_engine_reads_a_file_path_only():
    with pytest.raises(InvalidInput, match="file path"):
        Engine({"model": {}})


# --- results ----------------------------------------------------------------------------------------

def test_batched_infer_equals_one_by_one(engine):
    batch = [[3, 4, 5, 6], [7], [8, 9]]
    assert engine.infer(batch) == [engine.infer([ids])[0] for ids in batch]
    logits = engine.logits(batch)
    assert [x.shape for x in logits] == [(4, 50), (1, 50), (2, 50)]
    assert engine.infer(batch) == [int(x[-1].argmax()) for x in logits]


def test_generate_is_greedy_incremental_and_stops(engine):
    full = engine.generate([1, 2, 3], max_new_tokens=5, stop_ids=[])
    ids, expected = [1, 2, 3], []
    for _ in range(5):
        expected.append(engine.infer([ids])[0])
        ids.append(expected[-1])
    assert full.output_ids == expected and full.stats.finish_reason == "length"
    stopped = engine.generate([1, 2, 3], max_new_tokens=5, stop_ids=[expected[1]])
    assert stopped.output_ids == expected[:2] and stopped.stats.finish_reason == "stop"
    seen = []
    held = engine.generate([1, 2, 3], max_new_tokens=5, stop_ids=[], callback=lambda t: seen.append(t) or len(seen) < 3)
    assert held.output_ids == expected[:3] == seen and held.stats.finish_reason == "callback"


def test_generation_never_exceeds_max_seq_len(engine):
    out = engine.generate(list(range(10)), max_new_tokens=50, stop_ids=[])
    assert len(out.output_ids) == 2 and out.stats.finish_reason == "max_seq_len"


def test_generate_batch_is_greedy_generation_of_each_prompt(engine):
    prompts = [[3, 4, 5, 6], [7], [8, 9]]                 # ragged: one decode runner, a position per row
    assert engine.generate_batch(prompts, 5) == [engine.generate(p, max_new_tokens=5, stop_ids=[]).output_ids
                                                 for p in prompts]
    with pytest.raises(InvalidInput, match="max_seq_len"):
        engine.generate_batch(prompts, 9)


def test_generate_batch_max_new_tokens_like_generate(engine):
    assert engine.generate_batch([[1, 2], [3]], 0) == [[], []]
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        engine.generate_batch([[1, 2]], -1)


def test_sampling_is_seeded_and_top_p_small_is_greedy(engine):
    a = engine.generate([5, 6], max_new_tokens=6, temperature=1.5, seed=7, stop_ids=[]).output_ids
    b = engine.generate([5, 6], max_new_tokens=6, temperature=1.5, seed=7, stop_ids=[]).output_ids
    greedy = engine.generate([5, 6], max_new_tokens=6, stop_ids=[]).output_ids
    assert a == b
    assert engine.generate([5, 6], max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=1,
                           stop_ids=[]).output_ids == greedy


def test_stats_are_reported(path):
    passes = []
    with Engine(path) as engine:
        engine.routes.observers.append(lambda step, seq, layer, ids, pos: passes.append((layer, ids.copy())))
        stats = engine.generate([1, 2, 3, 4], max_new_tokens=4, stop_ids=[]).stats
        assert stats.prompt_tokens == 4 and stats.generated_tokens == 4
        assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
        # all experts resident (max_cached_experts=None): no cache, nothing paged, the paging counters stay at zero;
        # the NumPy backend's routing is on the host, so the experts it touched are counted all the same
        assert engine.cache is None and engine.stats()["resident"] and engine.stats()["expert_bytes_on_device"] == 0
        assert (stats.cache_hits, stats.cache_misses, stats.expert_loads, stats.bytes_paged) == (0, 0, 0, 0)
    assert stats.experts_touched == len({(layer, int(e)) for layer, ids in passes for e in ids.ravel()}) > 0


def test_paged_stats_count_every_access_and_whole_blobs(path):
    # one demand access per routed expert per MoE layer per pass; a pool of 15 slots never evicts here (the
    # run touches fewer experts), so each touched expert is admitted once; it is read from the host (a miss) until
    # a pass after its admission routes it again and fills its slot as it reads it (the cache runs a pass behind)
    passes = []
    with Engine(path, EngineConfig(max_cached_experts=ALL_EXPERTS - 1)) as eng:
        eng.routes.observers.append(lambda step, seq, layer, ids, pos: passes.append((step, layer, ids.copy())))
        stats = eng.generate([1, 2, 3, 4], max_new_tokens=8, stop_ids=[]).stats
        blob = eng.experts.blob_size
        assert not eng.stats()["resident"] and eng.cache is not None
    touched = {(layer, int(e)) for _, layer, ids in passes for e in ids.ravel()}
    accesses = sum(len(np.unique(ids)) for _, _, ids in passes)
    assert {step for step, _, _ in passes} == set(range(8)) and 2 <= len(touched) < ALL_EXPERTS
    assert stats.experts_touched == len(touched)
    assert 0 < stats.expert_loads <= stats.experts_touched     # at most once each: filled when routed again
    assert stats.cache_misses >= stats.expert_loads and stats.cache_hits == accesses - stats.cache_misses > 0
    assert blob % 4096 == 0 and blob >= (2 * 16 * 16 + 16 * 16) * 4             # a whole, aligned f32 blob
    assert stats.bytes_paged == 0 and stats.bytes_zero_copy == stats.cache_misses * blob    # filled on read


# --- lazy experts, cache, trace ------------------------------------------------------------------------

@pytest.mark.parametrize("max_cached", [None, 12, 3])     # resident, paged, paged with evictions
def test_only_routed_experts_are_ever_read(path, tmp_path, monkeypatch, max_cached):
    # every way the engine reaches an expert's bytes is recorded: the reader's blob view (its checksum check,
    # and the source of every copy), the expert arrays the NumPy MoE computes with, and every host-to-device copy
    opened, computed, copied = [], [], []
    blob_view = ColibriFile.expert_blob
    monkeypatch.setattr(ColibriFile, "expert_blob",
                        lambda self, layer, e: opened.append((layer, e)) or blob_view(self, layer, e))
    arrays = numpy_backend.blob_arrays
    monkeypatch.setattr(numpy_backend, "blob_arrays", lambda ptr, *a: computed.append(ptr) or arrays(ptr, *a))
    copy = NumpyBackend.copy_htod
    monkeypatch.setattr(NumpyBackend, "copy_htod",
                        lambda self, dst, src, n, stream: copied.append((src, n)) or copy(self, dst, src, n, stream))
    trace = tmp_path / "trace.jsonl"
    with Engine(path, EngineConfig(trace_path=str(trace), max_cached_experts=max_cached)) as eng:
        ex = eng.experts
        blobs = {ex.source.base + eng.reader.blob_offset(layer, e): (layer, e) for layer in (0, 1) for e in range(8)}
        slots = (ex.base, ex.base + ex.slots * ex.blob_size)
        eng.infer([[1, 2], [3]])
        eng.generate([4, 5], max_new_tokens=3, stop_ids=[])
        ex.flush()                        # the cache runs one pass behind: account for the last one
        counters = ex.counters
    routed = set(access_sequence(read_trace(trace)).pairs())
    assert len(routed) < ALL_EXPERTS      # some expert was never routed, and is never read
    assert set(opened) == routed
    blob_copies = [(src, n) for src, n in copied if src in blobs]       # the others: expert-table uploads
    assert all(n == ex.blob_size for _, n in blob_copies)
    assert all(n == 2 * 2 * 8 * 8 for src, n in copied if src not in blobs)  # tables [2, 2 layers, 8] uint64
    if max_cached is None:                # in place: the MoE reads the file's blobs, nothing is copied
        assert not copied and {blobs[p] for p in computed} == routed
        assert counters.loads == counters.misses == counters.hits == 0 and counters.touched == routed
    else:                                 # paged: the MoE reads pool slots, or routed blobs in the mapping
        assert {blobs[p] for p in computed if p in blobs} <= routed
        assert all(slots[0] <= p < slots[1] for p in computed if p not in blobs)
        assert {blobs[src] for src, _ in blob_copies} <= routed == counters.touched
        assert counters.loads == counters.fills + len(blob_copies) <= counters.misses     # decode passes fill
        if max_cached == 12:              # no eviction: a routed expert is admitted at most once
            assert 0 < counters.loads <= len(routed)
        else:                             # 3 slots: some routed experts are only ever read from the host
            assert counters.misses > counters.loads


def test_trace_has_one_record_per_token_and_layer(path, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Engine(path, EngineConfig(trace_path=str(trace))) as eng:
        eng.infer([[1, 2, 3], [4]])
        eng.generate([5, 6], max_new_tokens=3, stop_ids=[])
    t = read_trace(trace)
    assert t.header.moe_layers == (0, 1) and t.header.top_k == 2
    assert [(r.t, r.seq, r.pos) for r in t.records] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0),
                                                       (1, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)]
    assert all(len(r.experts) == 2 and all(len(es) == 2 for _, es in r.experts) for r in t.records)


def test_generate_batch_decode_steps_reach_the_trace(path, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Engine(path, EngineConfig(trace_path=str(trace))) as eng:
        eng.generate_batch([[1, 2], [3]], 3)
    assert [(r.t, r.seq, r.pos) for r in read_trace(trace).records] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 2), (1, 1, 1), (2, 0, 3), (2, 1, 2)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu"])
def test_a_small_cache_changes_paging_not_results(path, policy):
    with Engine(path) as resident, \
            Engine(path, EngineConfig(max_cached_experts=ALL_EXPERTS - 1, cache_policy=policy)) as big, \
            Engine(path, EngineConfig(max_cached_experts=2, cache_policy=policy)) as small:
        a, b, c = (e.generate([1, 2, 3], max_new_tokens=6, stop_ids=[]) for e in (resident, big, small))
    assert a.output_ids == b.output_ids == c.output_ids
    assert a.stats.cache_misses == a.stats.bytes_paged == 0                     # resident: nothing paged
    assert c.stats.cache_misses > b.stats.cache_misses > 0
    assert c.stats.bytes_zero_copy + c.stats.bytes_paged > b.stats.bytes_zero_copy + b.stats.bytes_paged
    assert b.stats.experts_touched == c.stats.experts_touched


def test_static_cache_pins_experts(path):
    pinned = ((0, 0), (1, 0))
    with Engine(path, EngineConfig(max_cached_experts=2, cache_policy="static", pinned_experts=pinned)) as eng:
        eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[])
        touched = eng.experts.counters.touched
        assert touched and all(eng.cache.contains(*p) for p in pinned if p in touched)


def test_c_style_aliases_and_close(path, monkeypatch):
    eng = colibri_init(path, max_batch_size=2, max_seq_len=16, verbose=False)
    assert eng.config.max_batch_size == 2
    assert colibri_infer(eng, [[1, 2]]) == eng.infer([[1, 2]])
    released = []
    monkeypatch.setattr(eng.be, "release_stream", released.append)
    colibri_free(eng)
    assert released == [eng.stream]         # what the stream holds (CUDA: its cuBLAS workspace) is freed
    with pytest.raises(InvalidInput, match="closed"):
        eng.infer([[1]])


# --- sampling: the chain against hand-computed distributions, and generate's new controls -------------------

from colibri_format.runtime import sampling as S                                      # noqa: E402

P4 = np.array([0.5, 0.25, 0.15, 0.1])
LOGITS4 = np.log(P4)                          # softmax(LOGITS4) == P4: every step below is exact by hand


@pytest.mark.parametrize("kwargs, expected", [
    ({}, P4),
    ({"top_k": 2}, [2 / 3, 1 / 3, 0, 0]),
    ({"top_k": 4}, P4),
    ({"top_p": 0.7}, [2 / 3, 1 / 3, 0, 0]),                  # mass before the 3rd is 0.75 >= 0.7: it goes
    ({"top_p": 0.76}, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
    ({"min_p": 0.3}, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),   # keep p >= 0.3 * 0.5
    ({"min_p": 1.0}, [1, 0, 0, 0]),
    ({"temperature": 2.0}, np.sqrt(P4) / np.sqrt(P4).sum()),  # p ** (1/T), renormalised
    ({"temperature": 0.5}, P4 ** 2 / (P4 ** 2).sum()),
    ({"top_k": 3, "top_p": 0.6, "min_p": 0.0}, [2 / 3, 1 / 3, 0, 0]),   # top-p on the top-k renormalised mass
])
def test_distribution_matches_hand_computed(kwargs, expected):
    kwargs = {"temperature": 1.0, **kwargs}
    got = S.distribution(LOGITS4, kwargs.pop("temperature"), **kwargs)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    np.testing.assert_allclose(S.penalize(logits, [0, 1, 1], 2.0), [1.0, -2.0, 0.5, 3.0])
    assert S.penalize(logits, [0, 1], 1.0) is logits                      # 1 = off: untouched
    probs = S.distribution(logits, 1.0, repetition_penalty=2.0, context=[3])
    e = np.exp([2.0, -1.0, 0.5, 1.5])
    np.testing.assert_allclose(probs, e / e.sum(), rtol=1e-12)
    assert S.sample(logits, 0.0, 1.0, None, repetition_penalty=4.0, context=[3]) == 0    # greedy sees it too


def test_chain_order_penalty_temperature_top_k_top_p_min_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    # penalty 2 on token 0: logit ln(0.4) < 0 is multiplied -> ln(0.4) * 2 = ln(0.16)
    # temperature 1: probs prop. to [0.16, 0.3, 0.2, 0.1]; top_k=3 keeps [.3, .2, .16] (sum .66);
    # top_p=0.7: masses before: 0, .3/.66, .5/.66=.758 -> keeps .3 and .2; min_p 0.5: .2 >= .5 * .3 stays
    got = S.distribution(logits, 1.0, 0.7, top_k=3, min_p=0.5, repetition_penalty=2.0, context=[0])
    np.testing.assert_allclose(got, [0, 0.6, 0.4, 0], rtol=1e-12)
    got = S.distribution(logits, 1.0, 0.7, top_k=3, min_p=0.7, repetition_penalty=2.0, context=[0])
    np.testing.assert_allclose(got, [0, 1, 0, 0], rtol=1e-12)           # .2 < .7 * .3


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-30])
def test_a_tiny_temperature_acts_greedy_without_overflow(temperature):
    logits = np.array([1.5, 30.0, -2.0, 29.999, 0.0], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):     # no overflow / NaN warning escapes
        probs = S.distribution(logits, temperature)
        picks = {S.sample(logits, temperature, 1.0, np.random.default_rng(seed)) for seed in range(20)}
    assert picks == {1} and probs[1] == 1.0 and np.isfinite(probs).all()


def test_default_filters_draw_exactly_what_plain_temperature_sampling_drew():
    logits = np.random.default_rng(0).standard_normal(64).astype(np.float32) * 3

    def before(rng, temperature, top_p):             # sampling.sample before top-k/min-p/penalty existed
        z = logits.astype(np.float64) / temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if top_p < 1.0:
            probs = S.nucleus(probs, top_p)
        return int(rng.choice(len(probs), p=probs))

    for seed in range(10):
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.5, 0.5)):
            old_rng, pick = np.random.default_rng(seed), S.Sampler(temperature, top_p, seed)
            assert [before(old_rng, temperature, top_p) for _ in range(5)] == [pick(logits) for _ in range(5)]


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1e-9}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": float("nan")}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": float("nan")}, "min_p"), ({"min_p": 1.01}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
])
def test_bad_sampling_values_are_refused(engine, kwargs, field):
    with pytest.raises(InvalidInput) as info:
        engine.generate([1], **kwargs)
    assert info.value.field == field


def test_top_k_1_and_min_p_1_sample_the_greedy_tokens(engine):
    greedy = engine.generate([5, 6], max_new_tokens=6, stop_ids=[]).output_ids
    for kwargs in ({"top_k": 1}, {"min_p": 1.0}):
        assert engine.generate([5, 6], max_new_tokens=6, temperature=1.7, seed=3, stop_ids=[],
                               **kwargs).output_ids == greedy


def test_repetition_penalty_in_generate_follows_the_logits(engine):
    changed = False
    for prompt in ([5, 6, 5], [1, 2, 1, 2], [7, 7, 7], [3, 9, 3, 9]):
        ids, expected = list(prompt), []
        for _ in range(5):
            row = engine.logits([ids])[0][-1]
            expected.append(int(np.argmax(S.penalize(row, ids, 50.0))))
            ids.append(expected[-1])
        got = engine.generate(prompt, max_new_tokens=5, stop_ids=[], repetition_penalty=50.0).output_ids
        assert got == expected
        changed |= got != engine.generate(prompt, max_new_tokens=5, stop_ids=[]).output_ids
    assert changed                                             # the penalty did change some greedy choice


class _Letters:
    """A stand-in tokenizer: token i is the letter chr(97 + i % 26), no stop tokens."""
    stop_ids: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_stop_on_text_and_cut_it(engine):
    engine._tokenizer = _Letters()
    full = engine.generate([1, 2, 3], max_new_tokens=8, stop_ids=[])
    assert full.text == _Letters().decode(full.output_ids) and full.stats.finish_reason == "length"
    stop = full.text[2:4]                                     # completed by the 4th token
    first = full.text.find(stop)
    hit = engine.generate([1, 2, 3], max_new_tokens=8, stop_ids=[], stop_strings=["zzz-never", stop])
    assert hit.output_ids == full.output_ids[:first + 2] and hit.stats.finish_reason == "stop"
    assert hit.text == full.text[:first]                       # the text ends before the stop string
    with pytest.raises(InvalidInput, match="stop"):
        engine.generate([1], stop_strings=[""])
    engine._tokenizer = False                                  # back to no tokenizer: stop strings need one
    with pytest.raises(InvalidInput, match="need a tokenizer"):
        engine.generate([1], stop_strings=["x"])


def test_stop_string_helpers():
    assert S.find_stop("hello world", ["wor", "lo"]) == 3 and S.find_stop("abc", ["x"]) == -1
    assert S.partial_stop("the end<", ["<|im_end|>"]) == 1 and S.partial_stop("the end<|im", ["<|im_end|>"]) == 4
    assert S.partial_stop("abc", ["xyz"]) == 0
