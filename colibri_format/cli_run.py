"""`colibri infer` and `colibri cache-sim`: CLI views over the engine and the cache simulator."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli import FileArg, JsonOpt, _print_json, app, err, out
from .errors import InvalidInput


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(tok) for tok in text.replace(" ", "").split(",") if tok]
    except ValueError:
        raise InvalidInput("--ids must be comma-separated integers", field="ids", value=text[:40]) from None


def _static_pins(policy: str, trace: Path | None, capacity: int | None, scope: str):
    if policy != "static":
        if trace is not None:
            raise InvalidInput("--pin-from-trace only applies to --cache-policy static", field="pin_from_trace")
        return None
    if trace is None or capacity is None:
        raise InvalidInput("--cache-policy static needs --pin-from-trace TRACE and --max-cached-experts N",
                           field="cache_policy", value=policy)
    from .runtime.cache.cachesim import pins_from_trace
    return tuple(pins_from_trace(trace, capacity, scope))


def _render_stats(result: dict) -> None:
    from rich.table import Table
    t = Table(title="stats", show_header=False, title_justify="left")
    for key, value in result["stats"].items():
        t.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    t.add_row("finish_reason", str(result["finish_reason"]))
    err.print(t)


@app.command()
def infer(path: FileArg,
          prompt: Annotated[Optional[str], typer.Option("--prompt", help="Text prompt (uses the embedded tokenizer).")] = None,
          ids: Annotated[Optional[str], typer.Option("--ids", help="Prompt as token ids: 1,2,3.")] = None,
          chat: Annotated[bool, typer.Option("--chat", help="Apply the embedded chat template.")] = False,
          max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "--max_new_tokens", min=1)] = 32,
          temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = 0.0,
          top_p: Annotated[float, typer.Option("--top-p", "--top_p", min=0.0, max=1.0)] = 1.0,
          seed: Annotated[Optional[int], typer.Option("--seed")] = None,
          device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
          devices: Annotated[Optional[str], typer.Option(
              "--devices", help="Expert parallelism: one process per device, e.g. 0,1 (gloo on cpu, NCCL on cuda)."
          )] = None,
          max_cached_experts: Annotated[Optional[int], typer.Option("--max-cached-experts", "--max_cached_experts",
                                                                    help="Expert cache capacity (default: unbounded).")] = None,
          cache_policy: Annotated[str, typer.Option("--cache-policy", "--cache_policy",
                                                    help="lru, lfu, lrfu or static.")] = "lrfu",
          cache_scope: Annotated[str, typer.Option("--cache-scope", help="global or per_layer capacity.")] = "global",
          pin_from_trace: Annotated[Optional[Path], typer.Option(
              "--pin-from-trace", help="For --cache-policy static: pin the most used experts of this trace.")] = None,
          stats: Annotated[bool, typer.Option("--stats", help="Print tokens/s, experts touched, cache hits/misses.")] = False,
          trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the routing trace (JSON Lines) here.")] = None,
          as_json: JsonOpt = False) -> None:
    """Generate text from a .colibri file; text streams as it is generated."""
    from .runtime.infer_cli import run_infer
    if devices is not None:                        # before any output: the parent only starts the ranks
        from .runtime.parallel.launch import infer_runner
        run_infer = infer_runner(devices, device, path)
    pinned = _static_pins(cache_policy, pin_from_trace, max_cached_experts, cache_scope)
    stream = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    if stream is not None and prompt is not None and not chat:
        sys.stdout.write(prompt)
    result = run_infer(path, prompt, ids=_parse_ids(ids), chat=chat, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, seed=seed, stream=stream, device=device,
                       max_cached_experts=max_cached_experts, cache_policy=cache_policy, cache_scope=cache_scope,
                       pinned_experts=pinned,
                       trace_path=str(trace) if trace else None)
    if result is None:                             # a rank other than 0 of --devices: rank 0 prints
        return
    if as_json:
        _print_json(result)
        return
    if not result["text"]:
        out.print(" ".join(map(str, result["output_ids"])))
    sys.stdout.write("\n")
    if stats:
        _render_stats(result)


@app.command("cache-sim")
def cache_sim(trace: Annotated[Path, typer.Argument(help="Routing trace written by `colibri infer --trace`.")],
              capacity: Annotated[str, typer.Option("--capacity", help="Comma list: percentages or counts.")] = "10%,25%,40%,60%",
              policy: Annotated[str, typer.Option("--policy", help="all, or a comma list of policies.")] = "all",
              scope: Annotated[str, typer.Option("--scope", help="global or per_layer.")] = "global",
              blob_bytes: Annotated[Optional[int], typer.Option("--blob-bytes", help="Bytes per expert blob.")] = None,
              as_json: JsonOpt = False) -> None:
    """Replay a routing trace under every cache policy and Belady's optimum; print miss rates."""
    from .runtime.cache.cachesim import render_table, run_cache_sim
    result = run_cache_sim(trace, capacity, policy, scope, blob_bytes=blob_bytes)
    if as_json:
        _print_json(result)
    else:
        out.print(render_table(result))
