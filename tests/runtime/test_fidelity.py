"""The NumPy engine against transformers' fp32 eager forward, for every supported architecture.

Each tiny model is random and seeded, saved with `save_pretrained` and converted by the real pipeline
(`convert.pipeline.convert`: checkpoint reader, architecture adapters, writer) to a float32 `.colibri` file; the
engine sees it only through that file (canonical tensors and the metadata `model` object), so a pass means the
format carries everything the architecture needs.
"""

from __future__ import annotations

import numpy as np
import pytest

import colibri_format
from colibri_format.runtime.engine import Engine
from tests.runtime.hf_tiny import ARCHS, build_hf, converted_file, hf_logits, prompts, rel_err, to_canonical
from tests.runtime.tiny_weights import decoder_pass, kv_buffers

TOL = 1e-4  # relative: |got - ref| / |ref| per sequence


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    hf = build_hf(request.param)
    engine = Engine(converted_file(hf, tmp_path_factory.mktemp(request.param)))
    yield hf, engine
    engine.close()


def test_converter_agrees_with_an_independent_mapping(pair, tmp_path):
    # the converter's file (from legacy and v5-fused checkpoints) vs a direct state-dict mapping
    hf, engine = pair
    arch = engine.metadata["architecture"]
    mine = to_canonical(arch, hf)
    assert arch == hf.config.model_type
    for path in (engine.reader.path, converted_file(hf, tmp_path, fused=True)):
        with colibri_format.open(path, verify="always") as theirs:
            assert theirs.model == mine.model
            assert sorted(theirs.dense_names()) == sorted(mine.dense)
            for name, tensor in mine.dense.items():
                np.testing.assert_array_equal(theirs.dense_f32(name), tensor)
            plan = theirs.tables.plan
            assert {(layer, e) for layer in plan.moe_layers for e in range(plan.num_experts)} == set(mine.experts)
            for key, arrays in mine.experts.items():
                for a, b in zip(theirs.expert_f32(*key), arrays):
                    np.testing.assert_array_equal(a, b)


def test_ragged_batch_prefill_matches_transformers(pair):
    hf, engine = pair
    batch = prompts(engine.vocab_size, [9, 3, 14, 1], seed=1)   # 14 > Mixtral's sliding window of 5
    for ids, logits in zip(batch, engine.logits(batch)):
        assert rel_err(logits, hf_logits(hf, ids)) < TOL


def test_incremental_decoding_matches_full_forward(pair):
    # the engine's decoder over one set of KV buffers: a ragged prefill of two sequences, then one token per
    # live sequence per pass (the pass holds only the sequences still decoding)
    hf, engine = pair
    seqs = prompts(engine.vocab_size, [12, 7], seed=2)
    kv = kv_buffers(engine, 2, max(len(s) for s in seqs))
    lengths = [5, 2]
    got = [list(rows) for rows in np.split(
        decoder_pass(engine, kv, [seqs[0][:5], seqs[1][:2]], [0, 1], [0, 0], all_logits=True), [5])]
    while any(n < len(s) for n, s in zip(lengths, seqs)):
        live = [i for i, (n, s) in enumerate(zip(lengths, seqs)) if n < len(s)]
        rows = decoder_pass(engine, kv, [[seqs[i][lengths[i]]] for i in live], live, [lengths[i] for i in live])
        for i, row in zip(live, rows):
            got[i].append(row)
            lengths[i] += 1
    for seq, rows in zip(seqs, got):
        assert rel_err(np.stack(rows), hf_logits(hf, seq)) < TOL


def greedy_reference(hf, prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(hf_logits(hf, ids)[-1].argmax()))
        ids.append(out[-1])
    return out


def test_infer_and_greedy_generation_agree_with_transformers(pair):
    hf, engine = pair
    batch = prompts(engine.vocab_size, [6, 2], seed=3)
    assert engine.infer(batch) == [int(hf_logits(hf, ids)[-1].argmax()) for ids in batch]
    expected = greedy_reference(hf, batch[0], 8)
    assert engine.generate(batch[0], max_new_tokens=8, stop_ids=[]).output_ids == expected
    # the batched decode runner (ragged prompts, one step for both) gives each prompt its own greedy tokens
    assert engine.generate_batch(batch, 4) == [expected[:4], greedy_reference(hf, batch[1], 4)]
