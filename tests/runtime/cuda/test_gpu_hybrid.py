"""Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated attention layers) on the CUDA engine (GPU only).

Engine: tiny transformers-built qwen3_next / qwen3_5_moe models (several configs, mixed layer patterns, attention heads
of 64 or 128 so the attention kernels run, four value heads or more so every product is a graph-capturable GEMV),
converted with int8 experts: the CUDA engine gives the NumPy engine's greedy tokens over a 40-token prompt and 16
steps (the recurrent path) and logits close to the float64 NumPy engine, for ragged batches, prefill forms, a
continuation after graph-replayed steps and a restarting filler slot, with graphs on (captured) and off.
Kernels: each deltanet.cu kernel against its NumPy twin (deltanet_reference.py) in float64, over several spans with
fresh and carried states; the decode op replayed from a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime import numpy_backend as nb
from tests.hf_hybrid import build, convert_file
from tests.runtime.cuda import deltanet_reference as ref
from tests.runtime.hf_tiny import prompts, rel_err

TOL = 2e-3          # relative logit error of the CUDA engine against the float64 NumPy engine
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, intermediate_size=32, max_position_embeddings=256)
RUN = {  # test id -> (hf_hybrid config, overrides, dense dtype)
    "qwen3_next": ("qwen3_next", dict(WIDE, linear_key_head_dim=16, linear_value_head_dim=32), "float32"),
    "qwen3_next-mixed-bf16": ("qwen3_next-mixed", dict(WIDE, linear_num_value_heads=4, linear_key_head_dim=32,
                                                       linear_value_head_dim=16), "bfloat16"),
    "qwen3_5_moe_text-hd128": ("qwen3_5_moe_text", dict(WIDE, hidden_size=256, head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [6, 5, 5],
        "mrope_interleaved": True}), "float32"),
    "qwen3_5_moe": ("qwen3_5_moe", dict(WIDE, linear_num_value_heads=4, linear_key_head_dim=16,
                                        linear_value_head_dim=16), "bfloat16"),
}


@pytest.fixture(scope="module", params=sorted(RUN))
def path(request, tmp_path_factory):
    name, overrides, dtype = RUN[request.param]
    return convert_file(build(name, seed=1, **overrides), tmp_path_factory.mktemp(request.param), dtype=dtype,
                        quantize="expert")


def engines(path, graphs: bool):
    """(the CUDA engine, the float64 NumPy engine, the float32 NumPy engine) of one file."""
    return (Engine(path, EngineConfig(device="cuda", max_seq_len=128, use_graphs=graphs)),
            Engine(path, EngineConfig(precision="float64", max_seq_len=128)),
            Engine(path, EngineConfig(max_seq_len=128)))


def assert_graphs(gpu, graphs: bool) -> None:
    states = set(gpu.stats()["graphs"].values())
    assert states == ({"captured"} if graphs else {"graphs disabled"}), states


@pytest.mark.parametrize("graphs", [True, False])
def test_prompt_and_16_greedy_steps_match_the_numpy_engine(path, graphs):
    gpu, f64, cpu = engines(path, graphs)
    with gpu, f64, cpu:
        prompt = prompts(gpu.vocab_size, [40], seed=3)[0]
        tokens = gpu.generate(prompt, max_new_tokens=16, stop_ids=[]).output_ids
        assert tokens == cpu.generate(prompt, max_new_tokens=16, stop_ids=[]).output_ids
        oracle = f64.logits([prompt + tokens[:-1]])[0]               # row 39 + i: the logits of step i
        runner = gpu.decode_runner(1, 56)
        logits = gpu.be.to_host(gpu.prefill_into(runner, [np.array(prompt)]))[0]
        for step in range(16):
            assert rel_err(logits, oracle[39 + step]) < TOL, step
            if step < 15:
                logits = gpu.be.to_host(runner.step(np.array([tokens[step]]), np.array([40 + step])))[0]
        assert_graphs(gpu, graphs)


@pytest.mark.parametrize("graphs", [True, False])
def test_ragged_batches_match_the_numpy_engine(path, graphs):
    gpu, f64, cpu = engines(path, graphs)
    with gpu, f64, cpu:
        batch = prompts(gpu.vocab_size, [40, 7, 23, 1], seed=5)
        for got, exp in zip(gpu.logits(batch), f64.logits(batch)):
            assert rel_err(got, exp) < TOL
        assert gpu.generate_batch(batch, 16) == cpu.generate_batch(batch, 16)
        assert_graphs(gpu, graphs)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_each_prefill_form_matches_the_numpy_engine(path, form):
    gpu, f64, _ = engines(path, True)
    with gpu, f64:
        batch = prompts(gpu.vocab_size, [100, 3, nb.DELTA_CHUNK], seed=7)
        gpu.decoder.delta_form = form
        for got, exp in zip(gpu.logits(batch), f64.logits(batch)):
            assert rel_err(got, exp) < TOL


def test_a_continuation_after_graph_steps_and_a_filler_slot(path):
    # the device lengths advanced by replayed steps let a later prefill continue the state; an idle slot fed the
    # other slot's token and position restarts its own state and leaves the live one exact
    gpu, f64, _ = engines(path, True)
    with gpu, f64:
        seq = prompts(gpu.vocab_size, [34], seed=9)[0]
        oracle = f64.logits([seq])[0]
        runner = gpu.decode_runner(2, 64)
        gpu.prefill_into(runner, [np.array(seq[:20])], seqs=[0])
        for p in range(20, 30):
            logits = gpu.be.to_host(runner.step(np.array([seq[p]] * 2), np.array([p] * 2)))
            assert rel_err(logits[0], oracle[p]) < TOL, p
        assert runner.graph is not None
        last = gpu.be.to_host(gpu.prefill_into(runner, [np.array(seq[30:])], seqs=[0], starts=[30]))[0]
        assert rel_err(last, oracle[-1]) < TOL


# ---- kernels against their NumPy twins -----------------------------------------------------------------------------
SHAPES = [(2, 4, 16, 12, 4), (1, 2, 128, 128, 4), (2, 2, 32, 200, 3)]    # nk, nv, dk, dv, conv kernel
SPANS = [(0, 5, 2, 1), (5, 1, 0, 0), (6, 9, 3, 0), (15, 1, 1, 1)]        # first row, rows, sequence, fresh
T, S = 16, 4


def random_pass(rng, nk, nv, dk, dv, K):
    C = 2 * nk * dk + nv * dv
    return dict(x=rng.standard_normal((T, C)), w=0.5 * rng.standard_normal((C, K)),
                conv=rng.standard_normal((S, C, K - 1)), delta=rng.standard_normal((S, nv, dk, dv)),
                b=rng.standard_normal((T, nv)), a=rng.standard_normal((T, nv)), A_log=rng.uniform(-1, 1, nv),
                dt_bias=1 + 0.2 * rng.standard_normal(nv), z=rng.standard_normal((T, nv * dv)),
                norm=1 + 0.2 * rng.standard_normal(dv))


def on_device(cp, arrays: dict) -> dict:
    """float32 device copies, and the same values in float64 on the host (the twins' inputs)."""
    f32 = {k: v.astype(np.float32) for k, v in arrays.items()}
    return {k: cp.asarray(v) for k, v in f32.items()}, {k: v.astype(np.float64) for k, v in f32.items()}


def close(got, want, tol: float = 2e-5) -> None:
    got = got.get() if hasattr(got, "get") else got
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("shape", SHAPES)
def test_conv_prepare_recurrent_and_gated_norm_match_their_twins(shape):
    import cupy as cp

    from colibri_format.runtime.cuda.kernels import ops

    nk, nv, dk, dv, K = shape
    dev, host = on_device(cp, random_pass(np.random.default_rng(dk + dv), nk, nv, dk, dv, K))
    plan = np.array(SPANS, np.int32).T.copy()
    u = ops.deltanet_conv(dev["x"], dev["w"], dev["conv"], cp.asarray(plan))
    u_ref = ref.conv(host["x"], host["w"], host["conv"], plan)
    close(u, u_ref)
    close(dev["conv"], host["conv"])
    u_h = u.get().astype(np.float64)                          # each kernel from the same inputs as its twin
    q, k, beta, g = ops.deltanet_prepare(u, dev["b"], dev["a"], dev["A_log"], dev["dt_bias"], heads=(nk, nv), dk=dk)
    for got, want in zip((q, k, beta, g), ref.prepare(u_h, host["b"], host["a"], host["A_log"], host["dt_bias"],
                                                        (nk, nv), dk)):
        close(got, want)
    inputs = [t.get().astype(np.float64) for t in (q, k, g, beta)]
    o = ops.deltanet_recurrent(q, k, u, g, beta, dev["delta"], cp.asarray(plan), value_heads=nv)
    o_ref = ref.recurrent(inputs[0], inputs[1], u_h, inputs[2], inputs[3], host["delta"], plan, nv)
    close(o, o_ref, 1e-4)
    close(dev["delta"], host["delta"], 1e-4)
    y = ops.deltanet_gated_norm(o, dev["z"], dev["norm"], 1e-6)
    close(y, ref.gated_norm(o.get().astype(np.float64), host["z"], host["norm"], 1e-6))


def test_the_decode_plan_marks_fresh_rows_and_advances_lengths():
    import cupy as cp

    from colibri_format.runtime.cuda.kernels import ops

    seq, pos = np.array([3, 0, 2, 1], np.int32), np.array([7, 0, 4, 9], np.int32)
    lengths = np.array([5, 9, 4, 6, 0], np.int64)              # sequence 3 holds 6 tokens, not 7: fresh
    dev_lengths = cp.asarray(lengths)
    plan = ops.deltanet_decode_plan(cp.asarray(seq), cp.asarray(pos), dev_lengths)
    np.testing.assert_array_equal(plan.get(), ref.decode_plan(seq, pos, lengths))
    np.testing.assert_array_equal(dev_lengths.get(), lengths)
    assert plan.get()[3].tolist() == [1, 1, 0, 0]


def test_the_decode_op_replays_from_a_graph():
    import cupy as cp

    from colibri_format.runtime.cuda.backend import CupyBackend

    be = CupyBackend()
    nk, nv, dk, dv, K = 2, 4, 32, 64, 4
    rng = np.random.default_rng(2)
    p = random_pass(rng, nk, nv, dk, dv, K)
    rows = 3
    steps = [{k: rng.standard_normal((rows,) + p[k].shape[1:]).astype(np.float32) for k in ("x", "z", "b", "a")}
             for _ in range(4)]
    w = {k: cp.asarray(p[k].astype(np.float32)) for k in ("w", "A_log", "dt_bias", "norm")}
    host_states = [p[k][:rows].astype(np.float32).astype(np.float64) for k in ("conv", "delta")]
    host_states.append(np.array([5, 0, 3], np.int64))
    dev_states = [cp.asarray(t.astype(np.float32) if t.dtype != np.int64 else t) for t in host_states]
    buffers = {k: cp.zeros(v.shape, cp.float32) for k, v in steps[0].items()}
    seq, pos = cp.asarray(np.arange(rows, dtype=np.int32)), cp.zeros(rows, cp.int32)
    out = cp.zeros((rows, nv * dv), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def step():
        be.gated_delta_net(buffers["x"], buffers["z"], buffers["b"], buffers["a"], w["w"], w["A_log"], w["dt_bias"],
                           w["norm"], seq, pos, *dev_states, heads=(nk, nv), dims=(dk, dv), eps=1e-6, strict=False,
                           out=out)

    positions = [np.array([5, 9, 3]) + i for i in range(4)]     # slot 1 holds no tokens at 9: it restarts
    graph = None
    with stream:
        for i, s in enumerate(steps):
            for k, v in s.items():
                buffers[k].set(v, stream=stream)
            pos.set(positions[i].astype(np.int32), stream=stream)
            if graph is None:
                step()                                           # eager first: buffers and f32 weights are made
                graph = be.capture(stream, step)
            else:
                be.launch(graph, stream)
            want = nb.gated_delta_net(s["x"].astype(np.float64), s["z"].astype(np.float64), s["b"].astype(np.float64),
                                      s["a"].astype(np.float64), *(p[k].astype(np.float32).astype(np.float64)
                                                                   for k in ("w", "A_log", "dt_bias", "norm")),
                                      np.arange(rows), positions[i], *host_states, heads=(nk, nv), dims=(dk, dv),
                                      eps=1e-6, strict=False)
            stream.synchronize()
            close(out, want, 1e-4)
    np.testing.assert_array_equal(dev_states[2].get(), host_states[2])
