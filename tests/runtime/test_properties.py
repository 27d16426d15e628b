"""Invariants of the reference engine over random inputs: packing and KV caching never change the numbers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_format.runtime import Engine
from tests.runtime.numpy_tiny import random_weights

ENGINE = Engine(random_weights(sliding_window=3, qkv_bias=False))
VOCAB = ENGINE.vocab_size
sequences = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9)


@settings(max_examples=25, deadline=None)
@given(st.lists(sequences, min_size=1, max_size=4))
def test_a_sequence_gets_the_same_logits_alone_or_in_any_batch(batch):
    together = ENGINE.logits(batch)
    for ids, logits in zip(batch, together):
        np.testing.assert_allclose(logits, ENGINE.logits([ids])[0], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(sequences, st.data())
def test_any_split_into_cached_chunks_matches_one_pass(ids, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=3)))) if len(ids) > 1 else []
    model, cache = ENGINE.model, ENGINE.model.new_cache()
    rows = []
    for start, stop in zip([0, *cuts], [*cuts, len(ids)]):
        if stop > start:
            rows.extend(model.forward([np.array(ids[start:stop])], [cache], all_logits=True)[0])
    np.testing.assert_allclose(np.stack(rows), ENGINE.logits([ids])[0], rtol=1e-5, atol=1e-5)
