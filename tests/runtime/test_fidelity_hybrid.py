"""The NumPy engine on Qwen3-Next and Qwen3.5 files (Gated DeltaNet layers with a per-sequence recurrent state, gated full
attention) against transformers' fp32 eager forward: a 40-token prompt and 16 greedy steps (the recurrent decode
path), ragged batches, batched decoding, int8 experts, and a continuation the state cannot serve."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime.engine import Engine, EngineConfig
from tests.hf_hybrid import CONFIGS, build, convert_file
from tests.runtime.hf_tiny import greedy_walk_within, hf_logits, prompts, rel_err

TOL = 1e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    hf = build(request.param)
    engine = Engine(convert_file(hf, tmp_path_factory.mktemp(request.param)))
    yield hf, engine
    engine.close()


def test_prompt_and_16_greedy_steps_match_transformers(pair):
    hf, engine = pair      # the prompt takes the chunked form of the delta rule, the steps the recurrent one
    greedy_walk_within(hf, engine, prompts(engine.vocab_size, [40], seed=3)[0], 16, TOL)


def test_ragged_batch_prefill_and_batched_decoding(pair):
    hf, engine = pair
    batch = prompts(engine.vocab_size, [9, 3, 14, 1], seed=1)
    for ids, logits in zip(batch, engine.logits(batch)):
        assert rel_err(logits, hf_logits(hf, ids)) < TOL
    outs = engine.generate_batch(batch[:3], 5)
    for ids, got in zip(batch[:3], outs):
        assert got == engine.generate(ids, max_new_tokens=5, stop_ids=[]).output_ids


def test_a_continuation_resumes_the_state_and_a_rewind_is_refused(pair):
    hf, engine = pair
    seq = prompts(engine.vocab_size, [16], seed=4)[0]
    runner = engine.decode_runner(1, 16)
    engine.prefill_into(runner, [np.array(seq[:10])])
    with pytest.raises(InvalidInput) as info:
        engine.prefill_into(runner, [np.array(seq[8:12])], starts=[8])
    assert "cannot be rewound" in str(info.value) and "\n" not in str(info.value)
    last = engine.be.to_host(engine.prefill_into(runner, [np.array(seq[10:])], starts=[10]))[0]
    assert rel_err(last, hf_logits(hf, seq)[-1]) < TOL
    again = engine.be.to_host(engine.prefill_into(runner, [np.array(seq)]))[0]     # position 0: a fresh state
    assert rel_err(again, hf_logits(hf, seq)[-1]) < TOL


@pytest.mark.parametrize("group", [None, 16])
def test_int8_experts_stay_within_the_documented_bound(tmp_path, group):
    # docs/runtime.md "Fidelity": 3e-2 for these four MoE layers with shared experts (measured <= 2.1e-2 on seeds
    # 1 and 2; seed 0 flips a routing near-tie, 0.24 at one position, which is the caveat documented there)
    hf = build("qwen3_next", seed=1)
    path = convert_file(hf, tmp_path, quantize="expert", group_size=group)
    # the bound of int8 weights: float activations (W8A8, fast_expert_gemm='int8', rounds the 40-row pass's inputs
    # too: 7.0e-2 on this random model; its quality on a trained model is in docs/quality.md)
    with Engine(path, EngineConfig(fast_expert_gemm="split")) as engine:
        for ids in prompts(engine.vocab_size, [40, 7], seed=5):
            assert rel_err(engine.logits([ids])[0], hf_logits(hf, ids)) < 3e-2


def test_a_decode_step_with_a_filler_slot_leaves_the_other_slots_exact(pair):
    # colibri serve's graph mode feeds an idle slot the first job's token and position: that slot's state does not
    # hold those tokens, so it restarts (junk, like its KV rows); the live slot is untouched
    hf, engine = pair
    seq = prompts(engine.vocab_size, [12], seed=6)[0]
    runner = engine.decode_runner(2, 16)
    engine.prefill_into(runner, [np.array(seq[:11])], seqs=[0])
    logits = engine.be.to_host(runner.step(np.array([seq[11], seq[11]]), np.array([11, 11])))
    assert rel_err(logits[0], hf_logits(hf, seq)[-1]) < TOL
