"""`colibri bench FILE`: the CUDA engine's speed on one file (the measuring is `runtime.cuda.bench.run_bench`)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import (ActivationsOpt, CachePolicyOpt, FileArg, GpuMemoryOpt, JsonOpt, KvCacheDtypeOpt,
                     MaxCachedExpertsOpt, need_cupy, out, print_json)


def command(path: FileArg,
            batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Sequences decoded at once.")] = 1,
            seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="Prefill length.")] = 512,
            num_iters: Annotated[int, typer.Option("--num-iters", min=1, help="Timed decode steps.")] = 32,
            warmup_iters: Annotated[int, typer.Option("--warmup-iters", min=0)] = 4,
            context: Annotated[int, typer.Option(
                "--context", min=1, help="Prompt tokens a sequence before the timed decode steps.")] = 16,
            max_cached_experts: MaxCachedExpertsOpt = None,
            gpu_memory: GpuMemoryOpt = None,
            int8_activations: ActivationsOpt = True,
            kv_cache_dtype: KvCacheDtypeOpt = "auto",
            cache_policy: CachePolicyOpt = "lrfu",
            prefetch: Annotated[bool, typer.Option("--prefetch", help="Next-layer router prefetch.")] = False,
            as_json: JsonOpt = False) -> None:
    """Benchmark the CUDA engine: prefill/decode tokens/s, per-kernel GPU time and GB/s, share of roofline."""
    need_cupy("colibri bench")
    from ..runtime.cuda.bench import render, run_bench

    result = run_bench(path, batch_size=batch_size, seq_len=seq_len, num_iters=num_iters,
                       warmup_iters=warmup_iters, context=context, max_cached_experts=max_cached_experts,
                       gpu_memory=gpu_memory, cache_policy=cache_policy, prefetch=prefetch,
                       int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype)
    if as_json:
        print_json(result)
    else:
        out.print(render(result), markup=False)
