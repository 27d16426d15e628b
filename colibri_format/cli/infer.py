"""`colibri infer FILE`: generate text (or token ids) from a .colibri file; text streams as it is generated.

The generation is `runtime.infer.run_infer` (one process) or `runtime.parallel.run.run_infer_parallel` (one rank
of `--devices`); with several devices the parent process only launches the ranks and exits with their status.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from .common import FileArg, JsonOpt, command_line, err, out, print_json, write_text


def command(ctx: typer.Context, path: FileArg,
            prompt: Annotated[Optional[str], typer.Option(
                "--prompt", help="Text prompt (uses the embedded tokenizer).")] = None,
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
            max_cached_experts: Annotated[Optional[int], typer.Option(
                "--max-cached-experts", "--max_cached_experts", help="Expert cache capacity (default: unbounded).")]
            = None,
            cache_policy: Annotated[str, typer.Option("--cache-policy", "--cache_policy",
                                                      help="lru, lfu, lrfu or static.")] = "lrfu",
            cache_scope: Annotated[str, typer.Option("--cache-scope", help="global or per_layer capacity.")] = "global",
            pin_from_trace: Annotated[Optional[Path], typer.Option(
                "--pin-from-trace", help="For --cache-policy static: pin the most used experts of this trace.")] = None,
            stats: Annotated[bool, typer.Option("--stats",
                                                help="Print tokens/s, experts touched, cache hits/misses.")] = False,
            trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the routing trace (JSON Lines) here.")]
            = None,
            as_json: JsonOpt = False) -> None:
    """Generate text from a .colibri file; text streams as it is generated."""
    run = _runner(ctx, path, devices, device)         # before any output: the parent of several ranks exits here
    pinned = static_pins(cache_policy, pin_from_trace, max_cached_experts, cache_scope)
    prompt_ids = parse_ids(ids)
    stream = None if as_json else write_text
    if stream is not None and prompt is not None and not chat:
        write_text(prompt)
    result = run(path, prompt, ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                 temperature=temperature, top_p=top_p, seed=seed, stream=stream, device=device,
                 max_cached_experts=max_cached_experts, cache_policy=cache_policy, cache_scope=cache_scope,
                 pinned_experts=pinned, trace_path=str(trace) if trace else None)
    if result is None:                                # a rank other than 0 of --devices: rank 0 prints
        return
    if as_json:
        print_json(result)
        return
    if not result["text"]:
        out.print(" ".join(map(str, result["output_ids"])))
    sys.stdout.write("\n")
    if stats:
        from .render import render_infer_stats
        render_infer_stats(err, result)


def _runner(ctx: typer.Context, path: Path, devices_text: str | None, device: str) -> Callable[..., Any]:
    """The generation call for this process; with several devices in the parent, launch the ranks and exit."""
    if devices_text is None:
        from ..runtime.infer import run_infer
        return run_infer
    from ..runtime.parallel import launch
    from ..runtime.parallel.dist import parse_devices

    device_ids = parse_devices(devices_text)
    run = launch.infer_runner(device_ids, device)
    if run is not None:
        return run
    launch.check_world_fits(path, len(device_ids))
    worker = launch.colibri_command(command_line(ctx))   # each rank runs this very `colibri infer` command
    raise typer.Exit(launch.launch(worker, device_ids, device))


def parse_ids(text: str | None) -> list[int] | None:
    """--ids 1,2,3 -> [1, 2, 3]."""
    from ..errors import InvalidInput

    if text is None:
        return None
    try:
        return [int(tok) for tok in text.replace(" ", "").split(",") if tok]
    except ValueError:
        raise InvalidInput("--ids must be comma-separated integers", field="ids", value=text[:40]) from None


def static_pins(policy: str, trace: Path | None, capacity: int | None, scope: str) -> tuple | None:
    """The experts --cache-policy static pins (the most used of --pin-from-trace), after checking the options
    agree; None for the other policies."""
    from ..errors import InvalidInput

    if policy != "static":
        if trace is not None:
            raise InvalidInput("--pin-from-trace only applies to --cache-policy static", field="pin_from_trace")
        return None
    if trace is None or capacity is None:
        raise InvalidInput("--cache-policy static needs --pin-from-trace TRACE and --max-cached-experts N",
                           field="cache_policy", value=policy)
    from ..runtime.cache.cachesim import pins_from_trace
    return tuple(pins_from_trace(trace, capacity, scope))
