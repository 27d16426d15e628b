"""`colibri serve FILE`: an OpenAI-compatible HTTP server over the engine, with continuous batching.

Thin: the options become an EngineConfig and `serve.server.serve` runs the scheduler, the app and uvicorn until
Ctrl-C (a graceful shutdown, then the engine closes). fastapi and uvicorn are the `serve` extra; without them the
command stops with one line naming the install command. See docs/serve.md.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .common import (ActivationsOpt, DeviceOpt, FileArg, GpuMemoryOpt, KvCacheDtypeOpt, MaxCachedExpertsOpt, err,
                     need_cupy)
from .errors import MissingDependency, on_interrupt

SERVE_INSTALL = "pip install 'colibri-format[serve]'"


def command(path: FileArg,
            host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
            port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8000,
            device: DeviceOpt = "cpu",
            max_batch_size: Annotated[int, typer.Option(
                "--max-batch-size", min=1, help="Requests decoded together (slots of the running batch).")] = 8,
            max_queue: Annotated[int, typer.Option(
                "--max-queue", min=0, help="Requests waiting for a slot beyond which a request gets 429.")] = 64,
            max_seq_len: Annotated[int, typer.Option(
                "--max-seq-len", min=1, help="Prompt + max_tokens of one request (KV positions per slot).")] = 2048,
            max_cached_experts: MaxCachedExpertsOpt = None,
            gpu_memory: GpuMemoryOpt = None,
            int8_activations: ActivationsOpt = True,
            kv_cache_dtype: KvCacheDtypeOpt = "auto") -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)."""
    need_serve_packages()
    if device == "cuda":
        need_cupy("--device cuda")
    from ..runtime.engine import EngineConfig
    from ..serve.server import serve

    config = EngineConfig(device=device, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                          max_cached_experts=max_cached_experts, gpu_memory=gpu_memory,
                          int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype)
    serve(str(path), config, host=host, port=port, max_queue=max_queue, announce=_announce)


def need_serve_packages() -> None:
    """MissingDependency, naming the install command, unless fastapi and uvicorn are installed."""
    from importlib.util import find_spec

    missing = [name for name in ("fastapi", "uvicorn") if find_spec(name) is None]
    if missing:
        raise MissingDependency(f"colibri serve needs {' and '.join(missing)}, which "
                                f"{'is' if len(missing) == 1 else 'are'} not installed; install with {SERVE_INSTALL}",
                                field="serve")


def _announce(scheduler: Any, info: Any, url: str) -> None:
    err.print(f"serving [bold]{info.id}[/] at {url}/v1 ({scheduler.backend} engine, {scheduler.max_batch_size} "
              f"slots, {scheduler.decode_mode} decode, context {info.max_seq_len} tokens); Ctrl-C stops",
              soft_wrap=True, markup=True, highlight=False)


on_interrupt("serve", lambda params: "the server stopped; nothing was written")
