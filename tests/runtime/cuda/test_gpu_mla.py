"""DeepSeek-V3-family models on the CUDA engine (GPU only): multi-head latent attention on mla.cu (the latent cache,
absorbed for decode steps and prefills alike), the grouped sigmoid router, leading dense layers, shared experts.

Tiny transformers models (tests/hf_mla.py: deepseek_v3 with q LoRA on and off, interleaved rope pairs and rope halves,
groups > 1, one and two dense layers, YaRN; deepseek_v32 and glm_moe_dsa within their indexer's reach) are converted
with int8 experts; the CUDA engine must give the NumPy engine's greedy tokens over a prompt and 8 steps, logits close
to the float64 NumPy engine's (decode steps, ragged prefills, batched decoding), eager and in CUDA graphs. The kernels
are also checked against their NumPy twin (`numpy_backend.mla_attention`) at tiny and DeepSeek-V3 widths.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import UnsupportedModel
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.numpy_backend import mla_attention
from tests.hf_mla import build, convert_file

CONTEXT = 64        # the tiny models' max_position_embeddings, and the V3.2 / GLM-5 ones' index_topk
TOL = 5e-4          # relative logit error of the CUDA engine against the float64 NumPy engine (~1e-6 on NumPy)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2], [40, 41, 42], list(range(20, 37))]
# kv_lora_rank 80: the attention kernel's lanes hold 3 latent columns (the last one partly); 6 heads' q rows
WIDE = dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=80, qk_nope_head_dim=24,
            qk_rope_head_dim=16, v_head_dim=40, q_lora_rank=32)
RUN = {  # test id -> (tests/hf_mla.py config, overrides, dense dtype)
    "deepseek_v3": ("deepseek_v3", {}, "float32"),          # q LoRA, interleaved rope, 4 groups keep 2, 1 dense layer
    "deepseek_v3-bf16": ("deepseek_v3", {}, "bfloat16"),    # k_b / v_b and the dense layer read as bf16
    "deepseek_v3-plain": ("deepseek_v3-plain", {}, "float32"),   # plain q_proj, rope halves, 2 dense layers
    "deepseek_v3-wide": ("deepseek_v3", WIDE, "float32"),
    "deepseek_v32": ("deepseek_v32", {}, "float32"),
    "glm_moe_dsa": ("glm_moe_dsa", {}, "float32"),
}


def _file(tmp_path, name: str):
    key, overrides, dtype = RUN[name]
    return convert_file(build(key, **overrides), tmp_path, dtype=dtype, quantize="expert")


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _steps(engine, prompt, tokens) -> list[np.ndarray]:
    """Logits after the prompt (a prefill), then after each of `tokens` fed one at a time (decode steps); copies,
    since a runner's logits buffer is overwritten by its next step (and NumPy's to_host returns it as is)."""
    runner = engine.decode_runner(1, len(prompt) + len(tokens) + 1)
    out = [np.array(engine.be.to_host(engine.prefill_into(runner, [np.array(prompt)]))[0])]
    for i, t in enumerate(tokens):
        out.append(np.array(engine.be.to_host(runner.step(np.array([t]), np.array([len(prompt) + i])))[0]))
    return out


@pytest.mark.parametrize("name", sorted(RUN))
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_gives_the_numpy_engines_tokens(tmp_path, name, graphs):
    path = _file(tmp_path, name)
    cfg = EngineConfig(device="cuda", max_seq_len=CONTEXT, use_graphs=graphs)
    with Engine(path, cfg) as gpu, Engine(path, EngineConfig(precision="float64", max_seq_len=CONTEXT)) as ref, \
            Engine(path, EngineConfig(max_seq_len=CONTEXT)) as cpu:
        for got, exp in zip(gpu.logits(PROMPTS), ref.logits(PROMPTS)):        # a ragged prefill of every row
            assert _rel(got, exp) < TOL
        for prompt in PROMPTS:                                                  # a prompt and 8 greedy steps
            tokens = gpu.generate(prompt, max_new_tokens=8, stop_ids=[]).output_ids
            assert tokens == cpu.generate(prompt, max_new_tokens=8, stop_ids=[]).output_ids
            for step, (got, exp) in enumerate(zip(_steps(gpu, prompt, tokens[:-1]), _steps(ref, prompt, tokens[:-1]))):
                assert _rel(got, exp) < TOL, step
        assert gpu.generate_batch(PROMPTS, 8) == cpu.generate_batch(PROMPTS, 8)   # sequences of different lengths
        graph_states = set(gpu.stats()["graphs"].values())
        assert graph_states == ({"captured"} if graphs else {"graphs disabled"})


def test_contexts_beyond_the_indexers_reach_are_refused_on_cuda(tmp_path):
    path = _file(tmp_path, "glm_moe_dsa")
    with pytest.raises(UnsupportedModel) as info:
        Engine(path, EngineConfig(device="cuda", max_seq_len=CONTEXT + 1))
    assert info.value.field == "model.index_topk" and "\n" not in str(info.value)


# ---- the kernels against their NumPy twin ----------------------------------------------------------------------------
def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """bf16 bits (round to nearest even) of a float array."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# (heads, nope dim, rope dim, value dim, kv_lora_rank): the tiny models', one over several lanes, DeepSeek-V3's
WIDTHS = [(4, 8, 6, 10, 12), (6, 24, 16, 40, 80), (16, 128, 64, 128, 512)]
# a ragged pass over 3 sequences: 11 rows of a prefill from 0, one decode row at 200 (13 positions a warp), 3 rows
# continuing at 5
PASS = [(0, 0, 11), (2, 200, 1), (1, 5, 3)]      # (sequence, first position, rows)


def _pass(rng, widths, weights: str, rows) -> dict:
    """Host inputs of one pass of `rows` [(sequence, first position, rows)]: f32 activations, stored weights."""
    nh, dn, dr, dv, r = widths
    seq = np.concatenate([np.full(n, s) for s, _, n in rows]).astype(np.int32)
    pos = np.concatenate([p + np.arange(n) for _, p, n in rows]).astype(np.int32)
    N = len(seq)
    stored = _bf16_bits if weights == "bf16" else (lambda a: a.astype(np.float32))
    angles = rng.uniform(0, 6.3, (N, dr // 2))
    return {"q": rng.standard_normal((N, nh, dn + dr)).astype(np.float32),
            "kva": rng.standard_normal((N, r + dr)).astype(np.float32),      # [c | k_rope], as kv_a_proj writes it
            "k_b": stored(rng.standard_normal((nh * dn, r)) / np.sqrt(r)),
            "v_b": stored(rng.standard_normal((nh * dv, r)) / np.sqrt(r)),
            "seq": seq, "pos": pos, "rpos": rng.permutation(N).astype(np.int32),    # table rows in any order
            "q_len": pos + np.int32(1), "cos": np.cos(angles).astype(np.float32),
            "sin": np.sin(angles).astype(np.float32), "scale": 1.0 / np.sqrt(dn + dr)}


def _reference(h: dict, cache: np.ndarray, r: int) -> np.ndarray:
    """numpy_backend.mla_attention in float64 (absorbed), appending to `cache` (float64) in place."""
    f64 = {k: np.asarray(h[k], np.float64) for k in ("q", "kva", "cos", "sin")}
    return mla_attention(f64["q"], f64["kva"][:, :r].copy(), f64["kva"][:, r:], h["k_b"], h["v_b"], cache, h["seq"],
                         h["pos"], h["rpos"], h["q_len"], f64["cos"], f64["sin"], scale=h["scale"], form="absorbed")


def _on_device(h: dict, r: int) -> dict:
    import cupy as cp

    dev = {k: cp.asarray(v) for k, v in h.items() if k != "scale"}
    dev["c"] = cp.ascontiguousarray(dev["kva"][:, :r])
    return dev


def _run(ops, dev: dict, cache, r: int, scale: float, **buffers):
    return ops.mla_attention(dev["q"], dev["c"], dev["kva"][:, r:], dev["k_b"], dev["v_b"], cache, dev["seq"],
                             dev["pos"], dev["rpos"], dev["q_len"], dev["cos"], dev["sin"], scale=scale, **buffers)


@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: f"h{w[0]}-r{w[4]}")
@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_mla_kernels_match_the_numpy_twin(widths, weights):
    import cupy as cp

    from colibri_format.runtime.cuda.kernels import ops

    r, rng = widths[4], np.random.default_rng(sum(widths))
    h = _pass(rng, widths, weights, PASS)
    cache = rng.standard_normal((3, 256, r + widths[2])).astype(np.float32)   # earlier tokens of every sequence
    ref_cache = cache.astype(np.float64)
    ref = _reference(h, ref_cache, r)
    dev, dev_cache = _on_device(h, r), cp.asarray(cache)
    got = _run(ops, dev, dev_cache, r, h["scale"])
    assert got.shape == (len(h["seq"]), widths[0] * widths[3])
    assert _rel(got.get(), ref) < 1e-5
    np.testing.assert_allclose(dev_cache.get(), ref_cache, rtol=1e-6, atol=1e-6)   # c and the roped key appended
    np.testing.assert_array_equal(h["q"], dev["q"].get())                        # q is left as it was


def test_mla_kernels_replay_from_a_cuda_graph():
    # captured once, replayed over new inputs copied into the same buffers: the next rows of the same sequences
    import cupy as cp

    from colibri_format.runtime.cuda.kernels import ops

    widths = WIDTHS[1]
    r, rng = widths[4], np.random.default_rng(7)
    first, second = (_pass(rng, widths, "f32", rows) for rows in (PASS, [(0, 11, 11), (2, 201, 1), (1, 8, 3)]))
    second.update(k_b=first["k_b"], v_b=first["v_b"])
    cache = rng.standard_normal((3, 256, r + widths[2])).astype(np.float32)
    ref_cache = cache.astype(np.float64)
    _reference(first, ref_cache, r)
    ref = _reference(second, ref_cache, r)
    dev, dev_cache = _on_device(first, r), cp.asarray(cache)
    buffers = {"out": cp.empty((len(first["seq"]), widths[0] * widths[3]), cp.float32),
               "workspace": ops.MlaWorkspace(len(first["seq"]), widths[0], r, widths[2])}
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _run(ops, dev, dev_cache, r, first["scale"], **buffers)                  # the first pass, eager
        stream.begin_capture()
        _run(ops, dev, dev_cache, r, first["scale"], **buffers)
        graph = stream.end_capture()
        for name, array in _on_device(second, r).items():
            dev[name][...] = array
        graph.launch(stream)
    stream.synchronize()
    assert _rel(buffers["out"].get(), ref) < 1e-5
    np.testing.assert_allclose(dev_cache.get(), ref_cache, rtol=1e-6, atol=1e-6)


def test_mla_kernels_refuse_mismatched_inputs():
    import cupy as cp

    from colibri_format.runtime.cuda.kernels import ops

    nh, dn, dr, dv, r, N = 2, 8, 4, 8, 16, 3
    z = {"q": cp.zeros((N, nh, dn + dr), cp.float32), "c": cp.zeros((N, r), cp.float32),
         "k_rope": cp.zeros((N, dr), cp.float32), "k_b": cp.zeros((nh * dn, r), cp.float32),
         "v_b": cp.zeros((nh * dv, r), cp.float32), "cache": cp.zeros((2, 8, r + dr), cp.float32),
         "seq": cp.zeros(N, cp.int32), "pos": cp.zeros(N, cp.int32), "rpos": cp.zeros(N, cp.int32),
         "q_len": cp.ones(N, cp.int32), "cos": cp.ones((N, dr // 2), cp.float32),
         "sin": cp.zeros((N, dr // 2), cp.float32)}
    ops.mla_attention(*z.values(), scale=1.0)
    for name, bad in (("k_b", cp.zeros((nh * dn + 1, r), cp.float32)), ("v_b", cp.zeros((nh * dv, r + 1), cp.float32)),
                      ("cache", cp.zeros((2, 8, r + dr), cp.float16)), ("seq", cp.zeros(N, cp.int64)),
                      ("k_rope", cp.zeros((N, dr + 1), cp.float32)[:, :dr][:, ::-1])):
        with pytest.raises((TypeError, ValueError)):
            ops.mla_attention(*{**z, name: bad}.values(), scale=1.0)
