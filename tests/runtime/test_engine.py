"""Engine behaviour: input errors, generation controls, lazy expert paging, the cache, traces, C-style API."""

from __future__ import annotations

import pytest

from colibri_format.errors import (BatchTooLarge, ColibriFormatError, EmptyInput, InvalidInput, SequenceTooLong,
                                   TokenIdOutOfRange, UnsupportedModel)
from colibri_format.runtime import Engine, EngineConfig, colibri_free, colibri_infer, colibri_init
from colibri_format.runtime.cache.trace import access_sequence, read_trace
from tests.runtime.numpy_tiny import CountingWeights, random_weights


@pytest.fixture
def engine():
    with Engine(random_weights(), EngineConfig(max_batch_size=3, max_seq_len=12)) as eng:
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


@pytest.mark.parametrize("field, value", [("max_batch_size", 0), ("max_seq_len", -1), ("device", "tpu")])
def test_bad_config_is_refused(field, value):
    with pytest.raises(InvalidInput, match=field):
        EngineConfig(**{field: value})


def test_unsupported_model_features_are_refused():
    with pytest.raises(UnsupportedModel, match="hidden_act"):
        Engine(random_weights(hidden_act="gelu_pytorch_tanh"))


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


def test_sampling_is_seeded_and_top_p_small_is_greedy(engine):
    a = engine.generate([5, 6], max_new_tokens=6, temperature=1.5, seed=7, stop_ids=[]).output_ids
    b = engine.generate([5, 6], max_new_tokens=6, temperature=1.5, seed=7, stop_ids=[]).output_ids
    greedy = engine.generate([5, 6], max_new_tokens=6, stop_ids=[]).output_ids
    assert a == b
    assert engine.generate([5, 6], max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=1,
                           stop_ids=[]).output_ids == greedy


def test_stats_are_reported(engine):
    stats = engine.generate([1, 2, 3, 4], max_new_tokens=4, stop_ids=[]).stats
    assert stats.prompt_tokens == 4 and stats.generated_tokens == 4
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert 2 <= stats.experts_touched <= 16
    assert stats.cache_misses == stats.expert_loads == stats.experts_touched   # unbounded cache: one load each
    assert stats.cache_hits > 0 and stats.bytes_paged == stats.expert_loads * (2 * 16 * 16 + 16 * 16) * 4


# --- lazy experts, cache, trace ------------------------------------------------------------------------

def test_only_routed_experts_are_ever_read(tmp_path):
    weights = CountingWeights(random_weights())
    trace = tmp_path / "trace.jsonl"
    with Engine(weights, EngineConfig(trace_path=str(trace))) as eng:
        eng.infer([[1, 2], [3]])
    routed = {(layer, e) for layer, e in access_sequence(read_trace(trace)).pairs()}
    assert set(weights.reads) == routed and len(weights.reads) == len(routed)
    assert len(routed) < 16  # some expert was never routed, and never read


def test_trace_has_one_record_per_token_and_layer(tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Engine(random_weights(), EngineConfig(trace_path=str(trace))) as eng:
        eng.infer([[1, 2, 3], [4]])
        eng.generate([5, 6], max_new_tokens=3, stop_ids=[])
    t = read_trace(trace)
    assert t.header.moe_layers == (0, 1) and t.header.top_k == 2
    assert [(r.t, r.seq, r.pos) for r in t.records] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0),
                                                       (1, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)]
    assert all(len(r.experts) == 2 and all(len(es) == 2 for _, es in r.experts) for r in t.records)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu"])
def test_a_small_cache_changes_paging_not_results(policy):
    weights = random_weights()
    with Engine(weights) as big, Engine(weights, EngineConfig(max_cached_experts=2, cache_policy=policy)) as small:
        a = big.generate([1, 2, 3], max_new_tokens=6, stop_ids=[])
        b = small.generate([1, 2, 3], max_new_tokens=6, stop_ids=[])
    assert a.output_ids == b.output_ids
    assert b.stats.cache_misses > a.stats.cache_misses and b.stats.bytes_paged > a.stats.bytes_paged


def test_static_cache_pins_experts():
    pinned = ((0, 0), (1, 0))
    with Engine(random_weights(), EngineConfig(max_cached_experts=2, cache_policy="static",
                                               pinned_experts=pinned)) as eng:
        eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[])
        assert all(eng.cache.contains(*p) for p in pinned if p in eng.experts.stats.touched)


def test_c_style_aliases_and_close():
    eng = colibri_init(random_weights(), max_batch_size=2, max_seq_len=16, verbose=False)
    assert eng.config.max_batch_size == 2
    assert colibri_infer(eng, [[1, 2]]) == eng.infer([[1, 2]])
    colibri_free(eng)
    with pytest.raises(InvalidInput, match="closed"):
        eng.infer([[1]])
