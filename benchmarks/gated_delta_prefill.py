"""Prefill on the CPU engine of a small Qwen3-Next-shaped model with the gated delta rule in its chunked form (64-row
chunks: what a prefill runs) against its recurrent form (token by token: what a decode step runs), and the op alone
at Qwen3-Next-80B's layer shape.

    PYTHONPATH=. [OPENBLAS_NUM_THREADS=1] python benchmarks/gated_delta_prefill.py [--tokens 512] [--repeats 3]

The model (made by transformers with random weights, converted once to a float32 file under /tmp): hidden 512,
8 layers in the published pattern (three Gated DeltaNet layers, then gated full attention), 4 key heads and 8 value
heads of 128 per Gated DeltaNet layer, 16 experts top-4 (FFN 256) with a shared expert, vocabulary 2048.
`Engine.logits` of one prompt runs with `Decoder.delta_form` forced to each form, the forms interleaved (best of
--repeats, after a warm-up round); the logits of the two forms are compared. The op alone: `delta_rule` and
`delta_rule_chunked` over --tokens rows of 32 value heads of 128 x 128 (16 key heads), float32, from a zero state.
On a machine that other processes load, OpenBLAS's threads make the many small products of either form erratic
(seconds instead of hundreds of ms); OPENBLAS_NUM_THREADS=1 gives repeatable figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

PATH = Path("/tmp/colibri_gated_delta_prefill")
CONFIG = dict(vocab_size=2048, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
              linear_value_head_dim=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, intermediate_size=1024, max_position_embeddings=4096)


def model_file() -> Path:
    dest = PATH / "model.colibri"
    if not dest.exists():
        import torch
        import transformers as tf

        from colibri_format.convert.pipeline import convert

        torch.manual_seed(0)
        hf = tf.AutoModelForCausalLM.from_config(tf.Qwen3NextConfig(**CONFIG)).float().eval()
        hf.save_pretrained(PATH / "hf")
        convert(PATH / "hf", dest, workers=1, dtype="float32", quantize="none")
    return dest


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def engine_prefill(tokens: int, repeats: int) -> None:
    from colibri_format.runtime.engine import Engine, EngineConfig

    with Engine(model_file(), EngineConfig(max_seq_len=tokens)) as engine:
        prompt = np.random.default_rng(0).integers(3, engine.vocab_size, tokens).tolist()
        forms = ("recurrent", "chunked", "auto")
        out, secs = {}, {form: float("inf") for form in forms}
        for r in range(repeats + 1):                                          # the forms interleaved; round 0 warms up
            for form in forms:
                engine.decoder.delta_form = form
                t0 = time.perf_counter()
                out[form] = engine.logits([prompt])[0]
                if r:
                    secs[form] = min(secs[form], time.perf_counter() - t0)
        engine.decoder.delta_form = "auto"
    err = np.linalg.norm(out["chunked"] - out["recurrent"]) / np.linalg.norm(out["recurrent"])
    print(f"engine prefill of {tokens} tokens (8 layers, 6 Gated DeltaNet):")
    for form, s in secs.items():
        print(f"  {form:9s} {s * 1e3:9.1f} ms  {tokens / s:8.0f} tokens/s")
    print(f"  speed-up chunked / recurrent: {secs['recurrent'] / secs['chunked']:.2f}x; "
          f"logits chunked vs recurrent: relative {err:.1e}")


def op_alone(tokens: int, repeats: int) -> None:
    from colibri_format.runtime.numpy_backend import delta_rule, delta_rule_chunked, l2norm

    rng = np.random.default_rng(1)
    H, d = 32, 128
    q = (l2norm(rng.standard_normal((tokens, H, d))) * d ** -0.5).astype(np.float32)
    k = l2norm(rng.standard_normal((tokens, H, d))).astype(np.float32)
    v = rng.standard_normal((tokens, H, d)).astype(np.float32)
    g = (-np.exp(rng.uniform(-3, 1, (tokens, H)))).astype(np.float32)
    beta = rng.uniform(0, 1, (tokens, H)).astype(np.float32)
    secs, states = {}, {}
    for name, fn in (("recurrent", delta_rule), ("chunked", delta_rule_chunked)):
        def run(fn=fn, name=name):
            states[name] = np.zeros((H, d, d), np.float32)
            return fn(q, k, v, g, beta, states[name])
        run()
        secs[name] = best(run, repeats)
    diff = np.abs(states["chunked"] - states["recurrent"]).max()
    print(f"delta rule alone, {tokens} rows x 32 value heads of 128 x 128 (Qwen3-Next-80B's layer), float32:")
    for name, s in secs.items():
        print(f"  {name:9s} {s * 1e3:9.1f} ms")
    print(f"  speed-up: {secs['recurrent'] / secs['chunked']:.2f}x; final states differ by at most {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, NumPy {np.__version__}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    engine_prefill(args.tokens, args.repeats)
    op_alone(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
