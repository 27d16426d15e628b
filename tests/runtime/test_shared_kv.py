"""Decode runners over shared KV buffers, and sequence moves: what colibri serve's batch buckets and slot compaction
rest on. A runner of B rows over buffers of S >= B sequences steps sequences 0..B-1 and leaves the others as they
are; a sequence moved to another index (its KV rows in every layer and its Gated DeltaNet state) continues as if it
had stayed. Checked on a Qwen3-MoE file and a Qwen3-Next file (recurrent state): each step's logits against a fresh
prefill of the whole sequence, and the greedy tokens against Engine.generate alone."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.runner import DecodeRunner
from tests.hf_hybrid import build, convert_file
from tests.runtime.hf_tiny import build_hf, converted_file, prompts, rel_err

TOL = 1e-4
CAP = 64


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def engine(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_next":
        path = convert_file(build("qwen3_next"), out)
    else:
        path = converted_file(build_hf("qwen3_moe"), out)
    with Engine(path, EngineConfig(max_seq_len=CAP)) as eng:
        yield eng


class Seq:
    """One sequence decoded by hand: its tokens so far, its logits checked against a fresh prefill."""

    def __init__(self, engine, prompt: list[int], first_logits) -> None:
        self.engine, self.ids = engine, list(prompt)
        self.prompt_len = len(prompt)
        self.take(first_logits)

    def take(self, logits) -> None:
        """Check the logits after `ids` against a fresh prefill of `ids`, then append their greedy token."""
        logits = np.asarray(logits, np.float64)
        ref = self.engine.logits([self.ids])[0][-1]
        assert rel_err(logits, ref) < TOL, (len(self.ids), rel_err(logits, ref))
        self.ids.append(int(np.argmax(logits)))

    @property
    def pos(self) -> int:            # position of the last token (the next step's input)
        return len(self.ids) - 1

    @property
    def out(self) -> list[int]:
        return self.ids[self.prompt_len:]


def alone(engine, prompt, n: int) -> list[int]:
    return engine.generate(prompt, max_new_tokens=n, stop_ids=[]).output_ids


def test_runners_of_every_size_over_one_set_of_buffers_step_their_lowest_sequences(engine):
    big = engine.decode_runner(4, CAP)
    kv = big.kv
    small = {b: engine.decode_runner(b, CAP, kv=kv) for b in (1, 2)}
    assert all(r.kv is kv and r.batch == b for b, r in small.items())
    assert engine.decode_runner(4, CAP) is big            # the engine keeps its own runner, not the shared ones
    runners = {4: big, **small}
    batch = prompts(engine.vocab_size, [5, 9, 3, 12], seed=11)
    logits = engine.be.to_host(engine.prefill_into(big, [np.array(p) for p in batch]))
    seqs = [Seq(engine, p, row) for p, row in zip(batch, logits)]
    for b in (4, 1, 2, 1, 4, 2, 2, 1, 4):                  # sequences >= b wait; each goes on from its own position
        r = runners[b]
        out = engine.be.to_host(r.step(np.array([s.ids[-1] for s in seqs[:b]]), np.array([s.pos for s in seqs[:b]])))
        assert out.shape[0] == b
        for s, row in zip(seqs[:b], out):
            s.take(row)
    assert [len(s.out) for s in seqs] == [10, 7, 4, 4]
    for p, s in zip(batch, seqs):
        assert s.out == alone(engine, p, len(s.out))


def test_a_moved_sequence_continues_as_if_it_had_stayed(engine):
    big = engine.decode_runner(4, CAP)
    kv = big.kv
    one = engine.decode_runner(1, CAP, kv=kv)
    prompt, junk, other = prompts(engine.vocab_size, [7, 20, 4], seed=12)
    # the destinations hold other, longer sequences first: a move must overwrite their rows and states
    engine.prefill_into(big, [np.array(junk), np.array(junk[::-1])], seqs=[0, 2])
    logits = engine.be.to_host(engine.prefill_into(big, [np.array(prompt), np.array(other)], seqs=[3, 1]))
    a, b = Seq(engine, prompt, logits[0]), Seq(engine, other, logits[1])
    for _ in range(2):                                       # both go on in slots 3 and 1 (packed steps)
        out = engine.be.to_host(engine.prefill_into(big, [np.array(a.ids[-1:]), np.array(b.ids[-1:])], seqs=[3, 1],
                                                    starts=[a.pos, b.pos]))
        a.take(out[0])
        b.take(out[1])
    kv.move(3, 0, a.pos)                 # positions 0..pos-1: what the cache holds (the next step writes pos)
    for _ in range(3):                   # slot 0 through the 1-row runner (a decode step: lenient states)
        a.take(engine.be.to_host(one.step(np.array([a.ids[-1]]), np.array([a.pos])))[0])
    kv.move(0, 2)                        # every position; then packed steps (strict states: a wrong count raises)
    kv.move(1, 0, b.pos)
    for _ in range(3):
        out = engine.be.to_host(engine.prefill_into(big, [np.array(a.ids[-1:]), np.array(b.ids[-1:])], seqs=[2, 0],
                                                    starts=[a.pos, b.pos]))
        a.take(out[0])
        b.take(out[1])
    for _ in range(2):                   # the 4-row runner: slot 0 is b, slot 2 is a, slots 1 and 3 idle fillers
        ids, pos = np.array([b.ids[-1], b.ids[-1], a.ids[-1], b.ids[-1]]), np.array([b.pos, b.pos, a.pos, b.pos])
        out = engine.be.to_host(big.step(ids, pos))
        b.take(out[0])
        a.take(out[2])
    assert a.out == alone(engine, prompt, len(a.out)) and len(a.out) == 11
    assert b.out == alone(engine, other, len(b.out)) and len(b.out) == 8


def test_shared_runners_and_moves_refuse_what_does_not_fit(engine):
    kv = engine.decode_runner(4, CAP).kv
    with pytest.raises(InvalidInput) as info:
        engine.decode_runner(5, CAP, kv=kv)                  # more rows than sequences
    assert info.value.field == "batch"
    with pytest.raises(InvalidInput):
        engine.decode_runner(1, CAP + 1, kv=kv)              # longer than the buffers
    with pytest.raises(ValueError):
        DecodeRunner(engine, 2, CAP // 2, kv)                # another capacity
    for src, dst, n in ((1, 1, 3), (4, 0, 3), (0, -1, 3), (0, 1, CAP + 1)):
        with pytest.raises(ValueError):
            kv.move(src, dst, n)
    one = engine.decode_runner(1, CAP, kv=kv)
    engine.prefill_into(one, [np.array([1, 2, 3])], seqs=[3])          # any sequence of the shared buffers
    with pytest.raises(InvalidInput) as info:
        engine.prefill_into(one, [np.array([1, 2, 3])], seqs=[4])
    assert info.value.field == "seqs"
