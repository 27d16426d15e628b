"""The two forms of the gated delta rule (Qwen3-Next / Qwen3.5 Gated DeltaNet layers) on the NumPy engine: the chunked
form (64-row chunks through a triangular solve, run for a sequence with several new rows: a prefill) and the recurrent
form (token by token, run for a single new row: a decode step) give the same outputs and leave the same state, in
float32 (the engine) and float64 (the oracle): op by op over lengths below, at and above a chunk, ragged batches and
continued states, and through the whole decoder (a prefill in either form then greedy decoding)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import numpy_backend as nb
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.runtime.numpy_backend import DELTA_CHUNK, delta_rule, delta_rule_chunked, gated_delta_net, l2norm
from tests.hf_hybrid import build, convert_file
from tests.runtime.hf_tiny import prompts, rel_err
from tests.runtime.tiny_weights import decoder_pass, kv_buffers

# float32: outputs and states of unit scale agree within 1e-5 (measured <= 1e-6); float64 to rounding
TOL = {np.float32: 1e-5, np.float64: 1e-12}
LENGTHS = [1, 2, 17, DELTA_CHUNK - 1, DELTA_CHUNK, DELTA_CHUNK + 1, 2 * DELTA_CHUNK, 3 * DELTA_CHUNK + 13]


def rule_inputs(rng, n: int, heads: int, dk: int, dv: int, dtype, strong: bool = False):
    """q, k, v, g, beta of the layer's shapes and ranges: l2-normed q (times dk^-1/2) and k, g = -exp(A) softplus(.)
    (`strong`: decays down to e^-30 a row, so whole chunks underflow to zero in float32), beta in (0, 1)."""
    q = l2norm(rng.standard_normal((n, heads, dk))) * dk ** -0.5
    k = l2norm(rng.standard_normal((n, heads, dk)))
    v = rng.standard_normal((n, heads, dv))
    g = -np.exp(rng.uniform(-3, 3.4 if strong else 0.5, (n, heads))) * np.log1p(np.exp(rng.standard_normal((n, heads))))
    beta = 1 / (1 + np.exp(-2 * rng.standard_normal((n, heads))))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_chunked_equals_recurrent_from_a_given_state(dtype, n):
    rng = np.random.default_rng(n)
    q, k, v, g, beta = rule_inputs(rng, n, 3, 8, 12, dtype)
    state0 = rng.standard_normal((3, 8, 12)).astype(dtype)                # a state carried over from earlier rows
    s_rec, s_chk = state0.copy(), state0.copy()
    o_rec = delta_rule(q, k, v, g, beta, s_rec)
    o_chk = delta_rule_chunked(q, k, v, g, beta, s_chk)
    assert o_chk.dtype == dtype and s_chk.dtype == dtype
    np.testing.assert_allclose(o_chk, o_rec, rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(s_chk, s_rec, rtol=0, atol=TOL[dtype])
    assert np.abs(s_rec - state0).max() > 0.1                              # the state did move


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunk_sizes_groups_and_strong_decays_change_only_rounding(dtype):
    # against the float64 recurrent form: the float32 chunked form is as close as the float32 recurrent one (both
    # measured <= 4e-7) even where decays of up to e^-90 a row put a chunk's cumulative log decay near -1000 (the
    # gaps between rows are taken in float64: in float32 they cost 4e-6 here)
    rng = np.random.default_rng(7)
    n = 5 * DELTA_CHUNK + 9
    inputs = rule_inputs(rng, n, 4, 16, 8, np.float64, strong=True)
    ref_state = np.zeros((4, 16, 8))
    ref = delta_rule(*inputs, ref_state)
    tol = {np.float32: 2e-6, np.float64: 1e-12}[dtype]
    for chunk, group in [(DELTA_CHUNK, None), (DELTA_CHUNK, 1), (DELTA_CHUNK, 2), (16, 3), (1, None), (n, None)]:
        state = np.zeros((4, 16, 8), dtype)
        out = delta_rule_chunked(*(x.astype(dtype) for x in inputs), state, chunk=chunk, group=group)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=0, atol=tol, err_msg=f"chunk {chunk} group {group}")
        np.testing.assert_allclose(state, ref_state, rtol=0, atol=tol, err_msg=f"chunk {chunk} group {group}")


def layer(rng, nk: int, nv: int, dk: int, dv: int, kernel: int, dtype):
    """The weights of one Gated DeltaNet layer (conv, A_log, dt_bias, norm) as the op takes them."""
    channels = 2 * nk * dk + nv * dv
    return dict(conv_w=(0.5 * rng.standard_normal((channels, kernel))).astype(dtype),
                A_log=rng.uniform(-1, 1, nv).astype(dtype), dt_bias=(1 + 0.2 * rng.standard_normal(nv)).astype(dtype),
                norm_w=(1 + 0.2 * rng.standard_normal(dv)).astype(dtype))


def run_layer(w, rows, seqs: list[int], starts: list[int], states, form: str, heads, dims):
    """One packed pass of gated_delta_net over the chunks (rows [n, ...] inputs of each) of sequences `seqs`."""
    qkv, z, b, a = (np.concatenate([r[i] for r in rows]) for i in range(4))
    seq = np.concatenate([np.full(len(r[0]), s) for r, s in zip(rows, seqs)])
    pos = np.concatenate([p + np.arange(len(r[0])) for r, p in zip(rows, starts)])
    conv, delta, lengths = states
    return gated_delta_net(qkv, z, b, a, w["conv_w"], w["A_log"], w["dt_bias"], w["norm_w"], seq, pos, conv, delta,
                           lengths, heads=heads, dims=dims, eps=1e-6, form=form)


def layer_rows(rng, n: int, nk: int, nv: int, dk: int, dv: int, dtype):
    return tuple((s * rng.standard_normal((n, c))).astype(dtype)
                 for s, c in ((1.0, 2 * nk * dk + nv * dv), (1.0, nv * dv), (1.0, nv), (1.0, nv)))


def fresh_states(seqs: int, nk: int, nv: int, dk: int, dv: int, kernel: int, dtype):
    return (np.zeros((seqs, 2 * nk * dk + nv * dv, kernel - 1), dtype), np.zeros((seqs, nv, dk, dv), dtype),
            np.zeros(seqs, np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ragged_batch_and_a_continued_prefill_agree_in_both_forms(dtype):
    # four sequences of lengths below, at and above a chunk (and one row) in one pass, then a second pass that
    # continues three of them (the second chunk of a long prompt, a one-row step, a continuation of 64 rows)
    nk, nv, dk, dv, kernel = 2, 4, 8, 12, 4
    heads, dims = (nk, nv), (dk, dv)
    rng = np.random.default_rng(3)
    w = layer(rng, nk, nv, dk, dv, kernel, dtype)
    first = [layer_rows(rng, n, nk, nv, dk, dv, dtype) for n in (70, 1, DELTA_CHUNK, 150)]
    second = [layer_rows(rng, n, nk, nv, dk, dv, dtype) for n in (100, 1, DELTA_CHUNK)]
    got = {}
    for form in ("recurrent", "chunked", "auto"):
        states = fresh_states(5, nk, nv, dk, dv, kernel, dtype)
        y1 = run_layer(w, first, [0, 1, 2, 4], [0, 0, 0, 0], states, form, heads, dims)
        y2 = run_layer(w, second, [4, 1, 0], [150, 1, 70], states, form, heads, dims)
        got[form] = y1, y2, states
        assert list(states[2]) == [134, 2, 64, 0, 250]
    for form in ("chunked", "auto"):
        for mine, ref in zip(got[form], got["recurrent"]):
            for m, r in zip(mine if isinstance(mine, tuple) else (mine,), ref if isinstance(ref, tuple) else (ref,)):
                assert m.dtype == r.dtype
                np.testing.assert_allclose(m, r, rtol=0, atol=TOL[dtype], err_msg=form)
    # a sequence continued in a second pass equals the same rows in one pass
    whole = [tuple(np.concatenate([a, b]) for a, b in zip(first[3], second[0]))]
    states = fresh_states(5, nk, nv, dk, dv, kernel, dtype)
    y = run_layer(w, whole, [4], [0], states, "chunked", heads, dims)
    y1, y2, parted = got["chunked"]
    np.testing.assert_allclose(y, np.concatenate([y1[-150:], y2[:100]]), rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(states[1][4], parted[1][4], rtol=0, atol=TOL[dtype])
    np.testing.assert_array_equal(states[0][4], parted[0][4])           # conv state: the last inputs, exactly


def test_auto_runs_a_prefill_chunked_and_a_decode_step_recurrent(monkeypatch):
    calls = []
    for name in ("delta_rule", "delta_rule_chunked"):
        real = getattr(nb, name)
        monkeypatch.setattr(nb, name, lambda *a, _real=real, _name=name, **kw: calls.append((_name, len(a[0])))
                            or _real(*a, **kw))
    nk, nv, dk, dv, kernel = 1, 2, 8, 8, 4
    rng = np.random.default_rng(5)
    w = layer(rng, nk, nv, dk, dv, kernel, np.float32)
    states = fresh_states(2, nk, nv, dk, dv, kernel, np.float32)
    rows = [layer_rows(rng, n, nk, nv, dk, dv, np.float32) for n in (40, 1)]
    run_layer(w, rows, [0, 1], [0, 0], states, "auto", (nk, nv), (dk, dv))
    assert calls == [("delta_rule_chunked", 40), ("delta_rule", 1)]
    calls.clear()
    run_layer(w, [rows[1]], [0], [40], states, "auto", (nk, nv), (dk, dv))
    run_layer(w, [rows[0]], [1], [1], states, "recurrent", (nk, nv), (dk, dv))
    run_layer(w, [rows[1]], [1], [41], states, "chunked", (nk, nv), (dk, dv))
    assert calls == [("delta_rule", 1), ("delta_rule", 40), ("delta_rule_chunked", 1)]
    with pytest.raises(ValueError, match="unknown Gated DeltaNet form"):
        run_layer(w, [rows[1]], [0], [0], states, "parallel", (nk, nv), (dk, dv))


# ---- through the decoder ------------------------------------------------------------------------------------------
CONTEXT = 128         # the tiny models' max_position_embeddings


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return {name: convert_file(build(name), tmp_path_factory.mktemp(name)) for name in ("qwen3_next", "qwen3_next-mixed")}


def forms_pass(engine, chunks, seqs, starts, kv=None):
    """Logits of every row of one packed pass in each form (fresh buffers unless `kv` {form: buffers} is given)."""
    out = {}
    try:
        for form in ("recurrent", "chunked"):
            engine.decoder.delta_form = form
            buffers = kv[form] if kv else kv_buffers(engine, max(seqs) + 1, CONTEXT)
            out[form] = decoder_pass(engine, buffers, chunks, seqs, starts, all_logits=True), buffers
    finally:
        engine.decoder.delta_form = "auto"
    return out


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_next-mixed"])
def test_the_decoder_gives_the_same_logits_and_states_in_both_forms(files, name):
    with Engine(files[name], EngineConfig(max_seq_len=CONTEXT)) as engine:
        batch = prompts(engine.vocab_size, [100, 3, DELTA_CHUNK, 1], seed=9)
        first = forms_pass(engine, [b[:70] if len(b) > 70 else b for b in batch], [0, 1, 2, 3], [0, 0, 0, 0])
        kv = {form: first[form][1] for form in first}
        second = forms_pass(engine, [batch[0][70:]], [0], [70], kv)           # the second chunk of a long prompt
        for got in (first, second):
            assert rel_err(got["chunked"][0], got["recurrent"][0]) < 1e-5
        rec, chk = kv["recurrent"].state, kv["chunked"].state
        for i in rec.delta:
            np.testing.assert_allclose(chk.delta[i], rec.delta[i], rtol=0, atol=1e-5)
            np.testing.assert_allclose(chk.conv[i], rec.conv[i], rtol=0, atol=1e-5)
            assert list(chk.lengths[i]) == list(rec.lengths[i]) == [100, 3, DELTA_CHUNK, 1]
        first = min(rec.conv)                        # the conv inputs of the first such layer do not depend on the form
        np.testing.assert_array_equal(chk.conv[first], rec.conv[first])


def test_a_chunked_prefill_then_recurrent_decoding_gives_the_tokens_of_an_all_recurrent_run(files):
    with Engine(files["qwen3_next"], EngineConfig(max_seq_len=CONTEXT)) as engine:
        prompt = prompts(engine.vocab_size, [90], seed=11)[0]
        runs = {}
        try:
            for form in ("recurrent", "auto"):
                engine.decoder.delta_form = form
                runner = engine.decode_runner(1, CONTEXT)
                logits = engine.be.to_host(engine.prefill_into(runner, [np.array(prompt)]))[0]
                tokens, rows = [], [logits]
                for step in range(16):
                    tokens.append(int(logits.argmax()))
                    logits = engine.be.to_host(runner.step(np.array([tokens[-1]]), np.array([90 + step])))[0]
                    rows.append(logits)
                runs[form] = tokens, np.stack(rows)
        finally:
            engine.decoder.delta_form = "auto"
        assert runs["auto"][0] == runs["recurrent"][0]
        assert rel_err(runs["auto"][1], runs["recurrent"][1]) < 1e-5


def test_the_float64_oracle_agrees_to_rounding(files):
    with Engine(files["qwen3_next"], EngineConfig(max_seq_len=CONTEXT, precision="float64")) as engine:
        batch = prompts(engine.vocab_size, [DELTA_CHUNK + 45, 20], seed=13)
        got = forms_pass(engine, batch, [0, 1], [0, 0])
        rec, chk = got["recurrent"][1].state, got["chunked"][1].state
        for i in rec.delta:
            assert chk.delta[i].dtype == np.float64
            np.testing.assert_allclose(chk.delta[i], rec.delta[i], rtol=0, atol=1e-12)
        assert rel_err(got["chunked"][0], got["recurrent"][0]) < 1e-6     # logits come back as float32
