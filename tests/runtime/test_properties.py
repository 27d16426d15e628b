"""Invariants of the NumPy engine over random inputs: packing and KV caching never change the numbers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_format.runtime import Engine
from tests.runtime.numpy_tiny import MODEL, tiny_file
from tests.runtime.tiny_weights import decoder_pass, kv_buffers

VOCAB = MODEL["vocab_size"]
sequences = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_file(tmp_path_factory.mktemp("props") / "tiny.colibri", sliding_window=3, qkv_bias=False)
    with Engine(path) as eng:
        assert eng.vocab_size == VOCAB and eng.args.sliding_window == 3
        yield eng


@settings(max_examples=25, deadline=None)
@given(batch=st.lists(sequences, min_size=1, max_size=4))
def test_a_sequence_gets_the_same_logits_alone_or_in_any_batch(engine, batch):
    together = engine.logits(batch)
    for ids, logits in zip(batch, together):
        np.testing.assert_allclose(logits, engine.logits([ids])[0], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(ids=sequences, data=st.data())
def test_any_split_into_cached_chunks_matches_one_pass(engine, ids, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=3)))) if len(ids) > 1 else []
    kv = kv_buffers(engine, 1, len(ids))
    rows = []
    for start, stop in zip([0, *cuts], [*cuts, len(ids)]):
        if stop > start:
            rows.extend(decoder_pass(engine, kv, [ids[start:stop]], [0], [start], all_logits=True))
    np.testing.assert_allclose(np.stack(rows), engine.logits([ids])[0], rtol=1e-5, atol=1e-5)
