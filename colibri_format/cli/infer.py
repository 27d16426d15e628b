"""`colibri infer FILE`: generate text (or token ids) from a .colibri file; text streams as it is generated.

Every input is checked before anything is printed: the prompt (from --prompt, --file, standard input with
`--prompt -`, or --ids; valid UTF-8), the sampling values (at parse time), the --trace path (a new regular file,
or with --force an existing one; never the model itself, a link, a FIFO or a device), the pinning trace's shape,
the packages --device cuda and the chat template need. Ctrl-C during the generation stops it at the next token
and exits 130 with one line of what was done so far; a second Ctrl-C stops at once.

The generation is `runtime.infer.run_infer` (one process) or `runtime.parallel.run.run_infer_parallel` (one rank
of `--devices`); with several devices the parent process only launches the ranks and exits with their status.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from .common import (ActivationsOpt, CachePolicyOpt, CacheScopeOpt, DeviceOpt, FileArg, GpuMemoryOpt, JsonOpt,
                     KvCacheDtypeOpt, MaxCachedExpertsOpt, MaxNewTokensOpt, MinPOpt, RepeatPenaltyOpt, SeedOpt, StopOpt,
                     SystemOpt, TemperatureOpt, TopKOpt, TopPOpt, check_output_file, command_line, err, need_cupy,
                     need_jinja2, out, print_json, soft_interrupt, stop_strings, write_text)
from .errors import Interrupted

# Options the ranks of several --devices do not take yet (runtime/parallel/run.py): run_infer's name, the flag,
# the default.
SINGLE_PROCESS_ONLY = (("system", "--system", None), ("top_k", "--top-k", 0), ("min_p", "--min-p", 0.0),
                       ("repetition_penalty", "--repeat-penalty", 1.0), ("stop_strings", "--stop", None),
                       ("max_seq_len", "--max-seq-len", None))


def command(ctx: typer.Context, path: FileArg,
            prompt: Annotated[Optional[str], typer.Option(
                "--prompt", help="Text prompt (uses the embedded tokenizer); '-' reads it from standard input.")]
            = None,
            file: Annotated[Optional[Path], typer.Option(
                "--file", help="Read the text prompt from this file (UTF-8).", show_default=False)] = None,
            ids: Annotated[Optional[str], typer.Option("--ids", help="Prompt as token ids: 1,2,3.")] = None,
            chat: Annotated[bool, typer.Option("--chat", help="Apply the embedded chat template.")] = False,
            system: SystemOpt = None,
            max_new_tokens: MaxNewTokensOpt = 32,
            temperature: TemperatureOpt = 0.0,
            top_k: TopKOpt = 0,
            top_p: TopPOpt = 1.0,
            min_p: MinPOpt = 0.0,
            repetition_penalty: RepeatPenaltyOpt = 1.0,
            stop: StopOpt = None,
            seed: SeedOpt = None,
            device: DeviceOpt = "cpu",
            devices: Annotated[Optional[str], typer.Option(
                "--devices", help="Expert parallelism: one process per device, e.g. 0,1 (gloo on cpu, NCCL on cuda)."
            )] = None,
            max_cached_experts: MaxCachedExpertsOpt = None,
            max_seq_len: Annotated[Optional[int], typer.Option(
                "--max-seq-len", min=1, help="Longest sequence the engine holds, prompt and generated tokens "
                                             "(default 2048; a DSA checkpoint's index_topk may ask for less).",
                show_default=False)] = None,
            gpu_memory: GpuMemoryOpt = None,
            int8_activations: ActivationsOpt = True,
            kv_cache_dtype: KvCacheDtypeOpt = "auto",
            cache_policy: CachePolicyOpt = "lrfu",
            cache_scope: CacheScopeOpt = "global",
            pin_from_trace: Annotated[Optional[Path], typer.Option(
                "--pin-from-trace", help="For --cache-policy static: pin the most used experts of this trace.")] = None,
            stats: Annotated[bool, typer.Option("--stats",
                                                help="Print tokens/s, experts touched, cache hits/misses.")] = False,
            trace: Annotated[Optional[Path], typer.Option(
                "--trace", help="Write the routing trace (JSON Lines) to this new file.")] = None,
            force: Annotated[bool, typer.Option(
                "--force", help="Let --trace replace an existing file (never the model, a link or a FIFO).")]
            = False,
            as_json: JsonOpt = False) -> None:
    """Generate text from a .colibri file; text streams as it is generated."""
    stops = stop_strings(stop)
    text = read_prompt(prompt, file, ids)
    prompt_ids = parse_ids(ids)
    chat = chat or system is not None
    extra = {"system": system, "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty,
             "stop_strings": stops, "max_seq_len": max_seq_len}
    worker = devices is not None and _is_worker()      # a rank of --devices: the parent checked --trace
    if trace is not None and not worker:
        check_trace(trace, path, force)
    if device == "cuda":
        need_cupy("--device cuda")
    if chat:
        need_jinja2("--chat" if system is None else "--system")
    pinned = static_pins(path, cache_policy, pin_from_trace, max_cached_experts, cache_scope)
    if trace is not None and force and not worker:    # the old trace goes once every input is checked
        from ..runtime.cache.trace import clear_trace_path
        clear_trace_path(trace, protect=[path], option="--trace")
    run, ranks = _runner(ctx, path, devices, device, extra, prompt_override=text if prompt == "-" else None)
    stream = None if as_json else _Stream()
    if ranks:                                         # a rank of several devices: the old contract, echo first
        extra = {}
        if stream is not None and text is not None and not chat:
            stream(text)
    else:
        extra["echo"] = stream is not None
        if max_seq_len is None:                       # the engine's default
            del extra["max_seq_len"]
    request = _stop_request()
    try:
        with soft_interrupt(request):
            result = run(path, text, ids=prompt_ids, chat=chat, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, seed=seed, stream=stream, device=device,
                         max_cached_experts=max_cached_experts, gpu_memory=gpu_memory, cache_policy=cache_policy,
                         int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype,
                         cache_scope=cache_scope,
                         pinned_experts=pinned, trace_path=str(trace) if trace else None,
                         **extra, **({"stop_request": request} if not ranks else {}))
    except BaseException as exc:
        if stream is not None and stream.used:         # end the streamed text's line before the error line
            write_text("\n")
        if not isinstance(exc, OSError) or trace is None or exc.filename is not None or exc.errno is None:
            raise
        from ..errors import WriteError                # the engine writes nothing else: the trace failed
        raise WriteError(f"cannot write the routing trace: {exc.strerror}", field="trace", value=str(trace)) from None
    if result is None:                                # a rank other than 0 of --devices: rank 0 prints
        return
    interrupted = result["finish_reason"] == "interrupted"
    if as_json and not interrupted:
        print_json(result)
        return
    if not as_json:
        if not result["text"] and result["output_ids"]:
            out.print(" ".join(map(str, result["output_ids"])))
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stats:
            from .render import render_infer_stats
            render_infer_stats(err, result)
    if interrupted:
        raise Interrupted(interrupted_note(result, trace))


def check_trace(trace: Path, model: Path, force: bool) -> None:
    """Refuse a --trace path before any work: the model itself (also through a link), a link, a FIFO, a device,
    a folder, a missing folder, or an existing file without --force (runtime/cache/trace.py)."""
    from ..runtime.cache.trace import check_trace_path

    check_trace_path(trace, overwrite=force, protect=[model], option="--trace",
                     replace_hint="pass --force to replace it")
    check_output_file(trace, "--trace")


def _is_worker() -> bool:
    from ..runtime.parallel.dist import is_worker
    return is_worker()


class _Stream:
    """write_text that remembers whether it wrote anything."""

    def __init__(self) -> None:
        self.used = False

    def __call__(self, piece: str) -> None:
        self.used = True
        write_text(piece)


def _stop_request():
    from ..runtime.infer import StopRequest
    return StopRequest()


def interrupted_note(result: dict[str, Any], trace: Path | None) -> str:
    """One line: what the interrupted generation did, and what it kept."""
    s = result["stats"]
    line = (f"stopped after {s['generated_tokens']} new tokens; prefill {s['prompt_tokens']} tokens in "
            f"{s['prefill_seconds']:.2f} s ({s['prefill_tokens_per_s']:.1f} tokens/s), decode "
            f"{s['decode_tokens_per_s']:.1f} tokens/s")
    return line + (f"; the routing trace so far is kept in {trace}" if trace is not None else "")


def read_prompt(prompt: str | None, file: Path | None, ids: str | None) -> str | None:
    """The text prompt, from exactly one of --prompt TEXT, --prompt - (standard input) or --file, checked as
    UTF-8; None with --ids."""
    from ..errors import InvalidInput

    given = [name for name, value in (("--prompt", prompt), ("--file", file), ("--ids", ids)) if value is not None]
    if len(given) != 1:
        raise InvalidInput("give exactly one of --prompt, --file or --ids" if given
                           else "give a prompt: --prompt TEXT, --prompt - (standard input), --file PATH or --ids",
                           field="prompt", value=" ".join(given) or None)
    from ..runtime.inputs import read_text, utf8_text

    if file is not None:
        return read_text(file, "file", "the prompt file")
    if prompt == "-":
        return read_text(sys.stdin.buffer, "prompt", "the prompt on standard input")
    return None if prompt is None else utf8_text(prompt, "prompt")


def _runner(ctx: typer.Context, path: Path, devices_text: str | None, device: str, extra: dict[str, Any],
            prompt_override: str | None) -> tuple[Callable[..., Any], bool]:
    """The generation call for this process and whether it is a rank of several devices; with several devices
    in the parent, launch the ranks and exit with their status."""
    if devices_text is None:
        from ..runtime.infer import run_infer
        return run_infer, False
    from ..errors import InvalidInput
    from ..runtime.parallel import launch
    from ..runtime.parallel.dist import parse_devices

    device_ids = parse_devices(devices_text)
    if len(device_ids) > 1:
        unsupported = [flag for name, flag, default in SINGLE_PROCESS_ONLY if extra[name] != default]
        if unsupported:
            raise InvalidInput("not available with several --devices yet: " + ", ".join(unsupported),
                               field="devices", value=devices_text)
    run = launch.infer_runner(device_ids, device)
    if run is not None:
        return run, len(device_ids) > 1
    launch.check_world_fits(path, len(device_ids))
    overrides = {"prompt": prompt_override} if prompt_override is not None else None
    worker = launch.colibri_command(command_line(ctx, overrides))   # each rank runs this very command
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


def static_pins(path: Path, policy: str, trace: Path | None, capacity: int | None, scope: str) -> tuple | None:
    """The experts --cache-policy static pins (the most used of --pin-from-trace, a trace of this file's model
    shape), after checking the options agree; None for the other policies."""
    from ..errors import InvalidInput

    if policy != "static":
        if trace is not None:
            raise InvalidInput("--pin-from-trace only applies to --cache-policy static", field="pin_from_trace")
        return None
    if trace is None or capacity is None:
        raise InvalidInput("--cache-policy static needs --pin-from-trace TRACE and --max-cached-experts N",
                           field="cache_policy", value=policy)
    import colibri_format
    from ..runtime.cache.cachesim import pins_from_trace

    with colibri_format.open(path, verify="never") as f:
        model = f.model
    return tuple(pins_from_trace(trace, capacity, scope, model=model))
