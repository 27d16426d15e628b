"""The NumPy engine on DeepSeek-V3-family files (multi-head latent attention with a latent-only cache, grouped sigmoid
routing, leading dense layers, shared experts; V3.2 / GLM-5 within their indexer's reach) against transformers' fp32
eager forward: a prompt and 8 greedy steps, the expanded and absorbed attention forms, ragged batches, batched
decoding, int8 experts, and the context limit of an indexer-less DSA file."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import UnsupportedModel
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.runtime.numpy_backend import mla_attention
from tests.hf_mla import CONFIGS, build, convert_file
from tests.runtime.hf_tiny import greedy_walk_within, hf_logits, prompts, rel_err
from tests.runtime.tiny_weights import decoder_pass, kv_buffers

TOL = 1e-4
CONTEXT = 64          # the tiny models' max_position_embeddings, and the V3.2 / GLM-5 ones' index_topk


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    hf = build(request.param)
    engine = Engine(convert_file(hf, tmp_path_factory.mktemp(request.param)), EngineConfig(max_seq_len=CONTEXT))
    yield hf, engine
    engine.close()


def test_prompt_and_8_greedy_steps_match_transformers(pair):
    hf, engine = pair      # the prompt takes the expanded attention form, the one-token steps the absorbed one
    greedy_walk_within(hf, engine, prompts(engine.vocab_size, [24], seed=3)[0], 8, TOL)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_both_attention_forms_match_transformers_and_each_other(pair, form):
    # a ragged prefill then one-token passes, every pass in one form: both meet the bound, and agree to rounding
    hf, engine = pair
    seqs = prompts(engine.vocab_size, [12, 7], seed=2)
    got = {}
    try:
        for f in ("expanded", "absorbed"):
            engine.decoder.mla_form = f
            kv = kv_buffers(engine, 2, 12)
            rows = [list(r) for r in np.split(decoder_pass(engine, kv, [seqs[0][:6], seqs[1][:3]], [0, 1], [0, 0],
                                                           all_logits=True), [6])]
            lengths = [6, 3]
            while any(n < len(s) for n, s in zip(lengths, seqs)):
                live = [i for i, (n, s) in enumerate(zip(lengths, seqs)) if n < len(s)]
                for i, row in zip(live, decoder_pass(engine, kv, [[seqs[i][lengths[i]]] for i in live], live,
                                                     [lengths[i] for i in live])):
                    rows[i].append(row)
                    lengths[i] += 1
            got[f] = [np.stack(r) for r in rows]
    finally:
        engine.decoder.mla_form = "auto"
    for seq, mine in zip(seqs, got[form]):
        assert rel_err(mine, hf_logits(hf, seq)) < TOL
    for a, b in zip(got["expanded"], got["absorbed"]):
        assert rel_err(a, b) < 2e-6


def test_the_two_forms_of_the_op_agree_in_float64():
    rng = np.random.default_rng(0)
    nh, dn, dr, dv, r, S, cap = 3, 5, 4, 7, 6, 2, 9
    k_b, v_b = rng.standard_normal((nh * dn, r)), rng.standard_normal((nh * dv, r))
    seq, pos = np.array([0, 0, 0, 1, 1]), np.array([0, 1, 2, 0, 1])
    q, c, kr = rng.standard_normal((5, nh, dn + dr)), rng.standard_normal((5, r)), rng.standard_normal((5, dr))
    cos, sin = np.cos(rng.standard_normal((5, dr // 2))), np.sin(rng.standard_normal((5, dr // 2)))
    outs = []
    for form in ("expanded", "absorbed"):
        cache = np.zeros((S, cap, r + dr))
        outs.append(mla_attention(q, c, kr, k_b, v_b, cache, seq, pos, np.arange(5), pos + 1, cos, sin, scale=0.3,
                                  form=form))
        np.testing.assert_array_equal(cache[0, :3, :r], c[:3])           # the cache holds c and the roped key
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)


def test_the_cache_holds_only_the_latent_and_the_rope_key(pair):
    _, engine = pair
    m, a = engine.reader.model["mla"], engine.args
    runner = engine.decode_runner(2, 32)
    latent = m["kv_lora_rank"] + m["qk_rope_head_dim"]
    assert all(k.shape == (2, runner.capacity, latent) for k in runner.kv.keys) and runner.kv.values == [None] * a.num_layers
    assert a.kv_values_per_token == a.num_layers * latent


def test_ragged_batch_prefill_and_batched_decoding(pair):
    hf, engine = pair
    batch = prompts(engine.vocab_size, [9, 3, 14, 1], seed=1)
    for ids, logits in zip(batch, engine.logits(batch)):
        assert rel_err(logits, hf_logits(hf, ids)) < TOL
    outs = engine.generate_batch(batch[:3], 5)
    for ids, got in zip(batch[:3], outs):
        assert got == engine.generate(ids, max_new_tokens=5, stop_ids=[]).output_ids


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
@pytest.mark.parametrize("group", [None, 16])
def test_int8_experts_stay_within_the_documented_bound(tmp_path, name, group):
    # docs/runtime.md "Fidelity": 2e-2 for int8 experts with float32 dense tensors
    hf = build(name, seed=1)
    path = convert_file(hf, tmp_path, quantize="expert", group_size=group)
    with Engine(path, EngineConfig(max_seq_len=CONTEXT)) as engine:
        for ids in prompts(engine.vocab_size, [30, 7], seed=5):
            assert rel_err(engine.logits([ids])[0], hf_logits(hf, ids)) < 2e-2


def test_a_context_past_index_topk_is_refused_in_one_line(pair):
    _, engine = pair
    path, topk = engine.reader.path, engine.reader.model.get("index_topk")
    if topk is None:                                    # DeepSeek-V3: no indexer, no limit beyond max_seq_len
        Engine(path, EngineConfig(max_seq_len=4 * CONTEXT)).close()
        return
    with pytest.raises(UnsupportedModel) as info:
        Engine(path, EngineConfig(max_seq_len=topk + 1))
    assert info.value.field == "model.index_topk" and "index_topk" in str(info.value) and "\n" not in str(info.value)


def test_the_float64_oracle_runs_mla_and_the_engine_agrees_with_it(tmp_path):
    # the CUDA kernels' future oracle: the same decoder in float64 over an int8 file
    path = convert_file(build("deepseek_v3", seed=2), tmp_path, quantize="expert", group_size=16)
    batch = prompts(96, [13, 5], seed=7)
    with Engine(path, EngineConfig(max_seq_len=CONTEXT)) as f32, \
            Engine(path, EngineConfig(max_seq_len=CONTEXT, precision="float64")) as f64:
        assert f64.decode_runner(1, 16).kv.keys[0].dtype == np.float64          # the latent cache too
        for a, b in zip(f32.logits(batch), f64.logits(batch)):
            assert rel_err(a, b) < 1e-5
        assert f32.generate_batch(batch, 6) == f64.generate_batch(batch, 6)
