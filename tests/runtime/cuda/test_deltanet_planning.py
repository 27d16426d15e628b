"""The CUDA engine's Gated DeltaNet op (runtime/cuda/deltanet.py) on the CPU: its planning (spans, fresh states,
lengths, continuations refused as on the NumPy engine, prefill spans chunked or recurrent, decode steps planned on the
device) over the NumPy twins of its kernels (deltanet_reference.py), against numpy_backend.gated_delta_net in
float32: ragged prefills in every form, a continued prefill, decode steps with a restarting filler slot."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime.cuda.deltanet import DeltaNet
from colibri_format.runtime.numpy_backend import DELTA_CHUNK, gated_delta_net
from tests.runtime.cuda.deltanet_reference import HostBackend
from tests.runtime.test_gated_delta_forms import fresh_states, layer, layer_rows

NK, NV, DK, DV, KERNEL = 2, 4, 8, 12, 4
SHAPE = dict(heads=(NK, NV), dims=(DK, DV), eps=1e-6)
TOL = 1e-5


def packed(rows, seqs, starts):
    """qkv, z, b, a of the chunks `rows`, and the seq, pos of their rows (int32, as StepInputs holds them)."""
    qkv, z, b, a = (np.concatenate([r[i] for r in rows]) for i in range(4))
    seq = np.concatenate([np.full(len(r[0]), s) for r, s in zip(rows, seqs)]).astype(np.int32)
    pos = np.concatenate([p + np.arange(len(r[0])) for r, p in zip(rows, starts)]).astype(np.int32)
    return (qkv, z, b, a), seq, pos


def both(op, w, rows, seqs, starts, states, form="auto", strict=True):
    """The op's output and NumPy's on the same pass; each side advances its own states ({"op": ..., "np": ...})."""
    inputs, seq, pos = packed(rows, seqs, starts)
    w_args = (w["conv_w"], w["A_log"], w["dt_bias"], w["norm_w"])
    got = op(*inputs, *w_args, seq, pos, *states["op"], form=form, strict=strict, **SHAPE)
    ref = gated_delta_net(*inputs, *w_args, seq, pos, *states["np"], form=form, strict=strict, **SHAPE)
    return got.copy(), ref


def assert_same_states(states) -> None:
    for mine, ref in zip(states["op"], states["np"]):
        np.testing.assert_allclose(mine, ref, rtol=0, atol=TOL)


@pytest.fixture
def setup():
    rng = np.random.default_rng(4)
    w = layer(rng, NK, NV, DK, DV, KERNEL, np.float32)
    states = {side: fresh_states(5, NK, NV, DK, DV, KERNEL, np.float32) for side in ("op", "np")}
    return rng, w, states, DeltaNet(HostBackend(np.float32))


@pytest.mark.parametrize("form", ["auto", "chunked", "recurrent"])
def test_a_ragged_prefill_and_its_continuation_match_numpy(setup, form):
    rng, w, states, op = setup
    first = [layer_rows(rng, n, NK, NV, DK, DV, np.float32) for n in (70, 1, DELTA_CHUNK, 150)]
    got, ref = both(op, w, first, [0, 1, 2, 4], [0, 0, 0, 0], states, form)
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOL)
    second = [layer_rows(rng, n, NK, NV, DK, DV, np.float32) for n in (100, 1, 3)]
    got, ref = both(op, w, second, [4, 1, 0], [150, 1, 70], states, form)
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOL)
    assert_same_states(states)
    assert list(states["op"][2]) == [73, 2, DELTA_CHUNK, 0, 250]


def test_decode_steps_match_numpy_and_a_filler_slot_restarts(setup):
    rng, w, states, op = setup
    prompts = [layer_rows(rng, n, NK, NV, DK, DV, np.float32) for n in (9, 3, 20)]
    both(op, w, prompts, [0, 1, 2], [0, 0, 0], states)
    pos = [9, 3, 20, 5]                   # slot 3 holds nothing: position 5 restarts it (strict false, as a step)
    for step in range(4):
        rows = [layer_rows(rng, 1, NK, NV, DK, DV, np.float32) for _ in pos]
        got, ref = both(op, w, rows, [0, 1, 2, 3], pos, states, strict=False)
        np.testing.assert_allclose(got, ref, rtol=0, atol=TOL, err_msg=f"step {step}")
        pos = [p + 1 for p in pos]
    assert_same_states(states)
    assert list(states["op"][2]) == [13, 7, 24, 9, 0]


def test_a_rewind_is_refused_and_scattered_rows_are_a_bug(setup):
    rng, w, states, op = setup
    both(op, w, [layer_rows(rng, 10, NK, NV, DK, DV, np.float32)], [0], [0], states)
    with pytest.raises(InvalidInput, match="cannot be rewound"):
        both(op, w, [layer_rows(rng, 4, NK, NV, DK, DV, np.float32)], [0], [8], states)
    (inputs, seq, pos) = packed([layer_rows(rng, 3, NK, NV, DK, DV, np.float32)] * 2, [1, 2], [0, 0])
    seq[:] = [1, 2, 1, 2, 1, 2]
    with pytest.raises(ValueError, match="not consecutive"):
        op(*inputs, w["conv_w"], w["A_log"], w["dt_bias"], w["norm_w"], seq, pos, *states["op"], **SHAPE)
    with pytest.raises(ValueError, match="unknown Gated DeltaNet form"):
        op(*inputs, w["conv_w"], w["A_log"], w["dt_bias"], w["norm_w"], seq, pos, *states["op"], form="x", **SHAPE)


def test_through_the_engine_the_op_gives_the_numpy_engines_tokens(tmp_path):
    # the NumPy engine with its gated_delta_net replaced by the CUDA op over the twins: prefills (host plans, chunked
    # and recurrent spans), decode steps (device plans), a batch, against the plain NumPy engine
    from colibri_format.runtime import Engine, EngineConfig
    from tests.hf_hybrid import build, convert_file
    from tests.runtime.hf_tiny import prompts, rel_err

    path = convert_file(build("qwen3_next-mixed", seed=2), tmp_path)
    with Engine(path, EngineConfig(max_seq_len=128)) as ref, Engine(path, EngineConfig(max_seq_len=128)) as eng:
        eng.be.gated_delta_net = DeltaNet(HostBackend(np.float32))
        batch = prompts(eng.vocab_size, [40, 1, 70], seed=3)
        for got, want in zip(eng.logits(batch), ref.logits(batch)):
            assert rel_err(got, want) < 1e-5
        assert eng.generate(batch[0], max_new_tokens=16, stop_ids=[]).output_ids == \
            ref.generate(batch[0], max_new_tokens=16, stop_ids=[]).output_ids
        assert eng.generate_batch(batch, 8) == ref.generate_batch(batch, 8)
