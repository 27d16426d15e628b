"""The NumPy engine against transformers' fp32 eager forward, for every supported architecture.

Each tiny model is random and seeded, saved with `save_pretrained` and read back through the converter's
checkpoint reader and architecture adapters; the engine sees it only through canonical tensors and the
metadata `model` object, so a pass means the format carries everything the architecture needs.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime.engine import Engine
from tests.runtime.hf_tiny import ARCHS, build_hf, checkpoint_weights, hf_logits, prompts, rel_err, to_canonical

TOL = 1e-4  # relative: |got - ref| / |ref| per sequence


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    hf = build_hf(request.param)
    engine = Engine(checkpoint_weights(hf, tmp_path_factory.mktemp(request.param)))
    yield hf, engine
    engine.close()


def test_converter_agrees_with_an_independent_mapping(pair, tmp_path):
    # the converter's canonical form (legacy and v5-fused checkpoints) vs a direct state-dict mapping
    hf, engine = pair
    arch = engine.weights.metadata["architecture"]
    mine, fused = to_canonical(arch, hf), checkpoint_weights(hf, tmp_path, fused=True)
    for theirs in (engine.weights, fused):
        assert theirs.model == mine.model
        assert sorted(theirs._dense) == sorted(mine._dense)
        for name in mine._dense:
            np.testing.assert_array_equal(theirs.dense(name), mine.dense(name))
        for key in mine._experts:
            for a, b in zip(theirs.expert(*key), mine.expert(*key)):
                np.testing.assert_array_equal(a, b)


def test_ragged_batch_prefill_matches_transformers(pair):
    hf, engine = pair
    batch = prompts(engine.vocab_size, [9, 3, 14, 1], seed=1)   # 14 > Mixtral's sliding window of 5
    for ids, logits in zip(batch, engine.logits(batch)):
        assert rel_err(logits, hf_logits(hf, ids)) < TOL


def test_incremental_decoding_matches_full_forward(pair):
    hf, engine = pair
    seqs = prompts(engine.vocab_size, [12, 7], seed=2)
    model = engine.model
    caches = [model.new_cache(), model.new_cache()]
    prefill = [np.array(seqs[0][:5]), np.array(seqs[1][:2])]      # ragged prefill, then ragged decoding
    got = [list(rows) for rows in model.forward(prefill, caches, all_logits=True)]
    while any(c.length < len(s) for c, s in zip(caches, seqs)):   # one token per live sequence per step
        live = [i for i, (c, s) in enumerate(zip(caches, seqs)) if c.length < len(s)]
        rows = model.forward([np.array([seqs[i][caches[i].length]]) for i in live], [caches[i] for i in live])
        for i, row in zip(live, rows):
            got[i].append(row)
    for seq, rows in zip(seqs, got):
        assert rel_err(np.stack(rows), hf_logits(hf, seq)) < TOL


def test_infer_and_greedy_generation_agree_with_transformers(pair):
    hf, engine = pair
    batch = prompts(engine.vocab_size, [6, 2], seed=3)
    assert engine.infer(batch) == [int(hf_logits(hf, ids)[-1].argmax()) for ids in batch]
    ids, expected = list(batch[0]), []
    for _ in range(8):
        expected.append(int(hf_logits(hf, ids)[-1].argmax()))
        ids.append(expected[-1])
    assert engine.generate(batch[0], max_new_tokens=8, stop_ids=[]).output_ids == expected
