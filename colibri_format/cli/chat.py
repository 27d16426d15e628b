"""`colibri chat FILE`: a conversation through the file's chat template, each reply streamed as it is generated.

One message per line of standard input (UTF-8), so a script can pipe a conversation in; each reply goes to
standard output and ends with a newline. `/exit` or the end of input (Ctrl-D) leaves. Ctrl-C during a reply ends
that reply (what was shown stays in the history) and prints its timings; Ctrl-C while typing drops the line; a
second Ctrl-C during a reply leaves at once (exit 130). A message that cannot be answered (not UTF-8, longer than
the model's context, found on its size before it is tokenized, a line over 64 MiB) prints one error line and the
conversation goes on.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from .common import (ActivationsOpt, DeviceOpt, FileArg, GpuMemoryOpt, KvCacheDtypeOpt, MaxCachedExpertsOpt,
                     MaxNewTokensOpt, MinPOpt, RepeatPenaltyOpt, SeedOpt, StopOpt, SystemOpt, TemperatureOpt, TopKOpt,
                     TopPOpt, err, need_cupy, need_jinja2, soft_interrupt, stop_strings, write_text)
from .errors import print_error

EXIT_WORDS = ("/exit", "/quit")


def command(path: FileArg,
            system: SystemOpt = None,
            max_new_tokens: MaxNewTokensOpt = 256,
            temperature: TemperatureOpt = 0.0,
            top_k: TopKOpt = 0,
            top_p: TopPOpt = 1.0,
            min_p: MinPOpt = 0.0,
            repetition_penalty: RepeatPenaltyOpt = 1.0,
            stop: StopOpt = None,
            seed: SeedOpt = None,
            device: DeviceOpt = "cpu",
            max_cached_experts: MaxCachedExpertsOpt = None,
            gpu_memory: GpuMemoryOpt = None,
            int8_activations: ActivationsOpt = True,
            kv_cache_dtype: KvCacheDtypeOpt = "auto") -> None:
    """Chat with a model through its embedded chat template; /exit or Ctrl-D leaves, Ctrl-C ends a reply."""
    stops = stop_strings(stop)
    if device == "cuda":
        need_cupy("--device cuda")
    need_jinja2("chat")
    from ..errors import ColibriFormatError, InvalidInput
    from ..runtime import Engine, EngineConfig
    from ..runtime.inputs import MAX_PROMPT_BYTES
    from ..runtime.infer import ChatSession, StopRequest

    interactive = sys.stdin.isatty()
    config = EngineConfig(device=device, max_cached_experts=max_cached_experts, gpu_memory=gpu_memory,
                          int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype)
    with Engine(path, config) as engine:
        session = ChatSession(engine, system, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                              stop_strings=stops, seed=seed)
        if interactive:
            err.print("[dim]type a message; /exit or Ctrl-D leaves, Ctrl-C ends a reply[/]")
        request = StopRequest()
        with soft_interrupt(request):
            while True:
                line = _read_line(interactive)
                if line is None:
                    break
                if line is TOO_LONG:
                    print_error(InvalidInput(f"the message is over {MAX_PROMPT_BYTES:,} bytes; it was skipped",
                                             field="message"))
                    continue
                text = line.rstrip(b"\r\n")
                if text.strip() in (w.encode() for w in EXIT_WORDS):
                    break
                if not text.strip():
                    continue
                request.requested = False
                try:
                    result = session.reply(text, stream=write_text, stop_request=request)
                except ColibriFormatError as exc:
                    print_error(exc)
                    continue
                write_text("\n")
                if result["finish_reason"] == "interrupted":
                    s = result["stats"]
                    err.print(f"[yellow]reply stopped[/] after {s['generated_tokens']} tokens "
                              f"({s['decode_tokens_per_s']:.1f} tokens/s)", soft_wrap=True)


TOO_LONG = b"<a line over MAX_PROMPT_BYTES>"   # _read_line's answer for a line it skipped (compared by identity)


def _read_line(interactive: bool) -> bytes | None:
    """The next line of standard input (None at its end, TOO_LONG for a line over MAX_PROMPT_BYTES, read past
    in bounded pieces); a Ctrl-C while typing drops the line."""
    from ..runtime.inputs import MAX_PROMPT_BYTES

    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.buffer.readline(MAX_PROMPT_BYTES + 1)
            if len(line) > MAX_PROMPT_BYTES and not line.endswith(b"\n"):
                while (rest := sys.stdin.buffer.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                return TOO_LONG
        except KeyboardInterrupt:
            if interactive:
                sys.stderr.write("\n")
            continue
        if not line:
            if interactive:
                sys.stderr.write("\n")
            return None
        return line
