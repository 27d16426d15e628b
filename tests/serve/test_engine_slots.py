"""Engine.prefill_into with `seqs` and `starts`: write chunks into chosen slots of a decode runner from chosen
positions (what the serving loop does to admit a request into a free slot, and to decode only the running ones)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig

PROMPTS = [[1, 300, 301, 302, 17], [1, 40, 41], [1, 900, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def engine(demo_file):
    with Engine(demo_file, EngineConfig(max_batch_size=4, max_seq_len=256)) as eng:
        yield eng


def greedy(engine, prompt, n):
    return engine.generate(prompt, max_new_tokens=n, stop_ids=[]).output_ids


def test_slots_extended_one_token_at_a_time_match_generate(engine):
    runner = engine.decode_runner(4, 256)
    slots = [3, 0, 2]                                      # any slots, in any order
    outs = [[t] for t in engine.argmax(engine.prefill_into(runner, [np.array(p) for p in PROMPTS], seqs=slots))]
    for step in range(7):
        live = [i for i in range(3) if not (i == 1 and step >= 3)]    # one sequence leaves early
        logits = engine.prefill_into(runner, [np.array(outs[i][-1:]) for i in live], seqs=[slots[i] for i in live],
                                     starts=[len(PROMPTS[i]) + len(outs[i]) - 1 for i in live])
        for i, token in zip(live, engine.argmax(logits)):
            outs[i].append(token)
    for prompt, out in zip(PROMPTS, outs):
        assert out == greedy(engine, prompt, len(out))
    assert [len(o) for o in outs] == [8, 4, 8]


def test_a_reused_slot_reads_nothing_of_its_previous_sequence(engine):
    runner = engine.decode_runner(4, 256)
    engine.prefill_into(runner, [np.arange(1, 60)], seqs=[1])           # a long sequence leaves stale rows
    short = PROMPTS[1]
    out = engine.argmax(engine.prefill_into(runner, [np.array(short)], seqs=[1]))
    for _ in range(5):
        out += engine.argmax(engine.prefill_into(runner, [np.array(out[-1:])], seqs=[1],
                                                 starts=[len(short) + len(out) - 1]))
    assert out == greedy(engine, short, 6)


@pytest.mark.parametrize("kwargs, field", [
    ({"seqs": [4]}, "seqs"),                                   # outside the runner
    ({"seqs": [-1]}, "seqs"),
    ({"chunks": [np.array([1]), np.array([2])], "seqs": [0, 0]}, "seqs"),     # a slot twice
    ({"seqs": [0, 1]}, "seqs"),                                # not one slot per chunk
    ({"starts": [250]}, "starts"),                             # 250 + 10 > capacity 256
    ({"starts": [-1]}, "starts"),
    ({"chunks": [np.array([], np.int64)]}, "chunks"),
])
def test_bad_slots_and_positions_are_refused(engine, kwargs, field):
    runner = engine.decode_runner(4, 256)
    chunks = kwargs.pop("chunks", [np.arange(1, 11)])
    with pytest.raises(InvalidInput) as info:
        engine.prefill_into(runner, chunks, **kwargs)
    assert info.value.field == field
