"""What every command shares: the two consoles, the common option types (the generation options of `infer` and
`chat` among them, each checked as it is parsed), JSON printing, the checks of optional packages and output
paths, Ctrl-C during a generation, and the command line that reproduces an invocation (for the worker processes of
`colibri infer --devices`).

Light on purpose (typer and rich only): every command module imports it at start-up.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import InvalidInput
from .console import err, out  # noqa: F401 (re-exported: the commands print through common)
from .errors import MissingDependency


FileArg = Annotated[Path, typer.Argument(help="A .colibri file.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


# --- generation options (infer, chat): ranges checked at parse time, a bad value is a usage error (exit 2) ------
def _temperature(value: float) -> float:
    if not (math.isfinite(value) and value >= 0.0):
        raise typer.BadParameter(f"{value} is not a finite number >= 0 (0 = greedy)")
    return value


def _top_p(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter(f"{value} is not in (0, 1] (1 = off)")
    return value


def _min_p(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise typer.BadParameter(f"{value} is not in [0, 1] (0 = off)")
    return value


def _penalty(value: float) -> float:
    if not (math.isfinite(value) and value > 0.0):
        raise typer.BadParameter(f"{value} is not a finite number > 0 (1 = off)")
    return value


def _device(value: str) -> str:
    if value not in ("cpu", "cuda"):
        raise typer.BadParameter(f"{value!r} is not cpu or cuda")
    return value


MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", "--max_new_tokens", min=1,
                                              help="Tokens to generate at most.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "--temp", callback=_temperature,
                                               help="Sampling temperature, a finite number >= 0; 0 = greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", "--top_k", min=0,
                                      help="Sample from the k most probable tokens only; 0 = off.")]
TopPOpt = Annotated[float, typer.Option("--top-p", "--top_p", callback=_top_p,
                                        help="Nucleus sampling: the most probable tokens up to this total "
                                             "probability, in (0, 1]; 1 = off.")]
MinPOpt = Annotated[float, typer.Option("--min-p", "--min_p", callback=_min_p,
                                        help="Drop tokens less probable than this fraction of the most probable "
                                             "one, in [0, 1]; 0 = off.")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", "--repetition-penalty", callback=_penalty,
                                                 help="Penalise tokens already in the prompt or the output "
                                                      "(> 1 repeats less), a finite number > 0; 1 = off.")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", show_default=False,
                                                      help="Stop once the output holds this text (repeatable); "
                                                           "the text is not printed.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", show_default=False,
                                                  help="System prompt, through the embedded chat template.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", min=0, help="Random seed for sampling.")]
DeviceOpt = Annotated[str, typer.Option("--device", callback=_device, help="cpu or cuda.")]
MaxCachedExpertsOpt = Annotated[Optional[int], typer.Option(
    "--max-cached-experts", "--max_cached_experts", min=1,
    help="Expert cache capacity in experts (default: every expert resident).")]
ActivationsOpt = Annotated[bool, typer.Option(
    "--int8-activations/--float-activations",
    help="int4_group experts: round each expert product's input to int8 per group of 32 (dp4a kernels on CUDA; "
         "+0.05% perplexity on the bundled model), or keep it in float (exact, slower).")]


def engine_choice(field: str):
    """An option callback refusing a value EngineConfig's `field` does not take (`runtime.engine.CONFIG_CHOICES`,
    imported only when a command parses the option) as a usage error (exit 2), before the engine opens."""
    def check(value: str) -> str:
        from ..runtime.engine import CONFIG_CHOICES

        if value not in CONFIG_CHOICES[field]:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(CONFIG_CHOICES[field])}")
        return value
    return check


KvCacheDtypeOpt = Annotated[str, typer.Option(
    "--kv-cache-dtype", callback=engine_choice("kv_cache_dtype"),
    help="Keys and values cached as computed (auto: float32) or as bfloat16: half the KV memory, +0.01% perplexity "
         "on the bundled model (docs/quality.md).")]
CachePolicyOpt = Annotated[str, typer.Option("--cache-policy", "--cache_policy", callback=engine_choice("cache_policy"),
                                            help="lru, lfu, lrfu, static or random.")]
CacheScopeOpt = Annotated[str, typer.Option("--cache-scope", callback=engine_choice("cache_scope"),
                                           help="global or per_layer capacity.")]
GpuMemoryOpt = Annotated[Optional[str], typer.Option(
    "--gpu-memory", show_default=False,
    help="Device memory budget, e.g. 20GiB: the expert cache gets what the dense weights, KV cache and workspace "
         "leave (instead of --max-cached-experts).")]


def stop_strings(stop: Optional[list[str]]) -> Optional[list[str]]:
    """--stop's values, a usage error when one is empty (checked in the command: a callback on a list option
    breaks older typer releases)."""
    if stop and not all(stop):
        raise typer.BadParameter("a stop string cannot be empty", param_hint="'--stop'")
    return list(stop) if stop else None


# --- what a command needs before it starts ---------------------------------------------------------------------
def gpu_install_command() -> str:
    """The pip command that installs CuPy with colibri-format (the extra that carries it, from the installed
    package's metadata)."""
    extra = "gpu-cuda13"
    try:
        from importlib.metadata import distribution

        for req in distribution("colibri-format").requires or []:
            if req.startswith("cupy") and "extra ==" in req:
                extra = req.split("extra ==", 1)[1].split(";")[0].strip().strip("'\"")
                break
    except Exception:            # noqa: BLE001 - not installed as a distribution: the default extra
        pass
    return f"pip install 'colibri-format[{extra}]'"


def need_cupy(what: str) -> None:
    """MissingDependency, naming the install command, unless CuPy imports."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:     # noqa: BLE001 - ImportError, or a CuPy that cannot load its CUDA libraries
        reason = " ".join(str(exc).split())[:120]
        raise MissingDependency(f"{what} needs CuPy, which does not import here ({reason}); install it with "
                                f"{gpu_install_command()}", field="device", value="cuda") from None


def need_jinja2(what: str) -> None:
    """MissingDependency unless jinja2 (the chat-template renderer, an optional package) imports."""
    try:
        import jinja2.sandbox  # noqa: F401
    except ImportError:
        install = "pip install jinja2"
        try:                     # the tokenizer names the version it accepts
            from ..runtime.tokenizer import JINJA2_INSTALL as install  # type: ignore[no-redef]
        except ImportError:
            pass
        raise MissingDependency(f"{what} renders the file's chat template with jinja2, which is not installed; "
                                f"install it with {install}", field="chat") from None


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output path that is a folder or lies in a folder that does not exist (before any work)."""
    field = option.lstrip("-").replace("-", "_")
    if path.is_dir():
        raise InvalidInput(f"{option} is a folder; give a file name", field=field, value=str(path))
    if not path.absolute().parent.is_dir():
        raise InvalidInput(f"the folder of {option} does not exist", field=field, value=str(path.parent))


@contextlib.contextmanager
def soft_interrupt(request: Any):
    """Inside: a Ctrl-C during a generation (`request.armed`) sets `request.requested`, so the generation ends
    at its next token with its stats and trace complete; a Ctrl-C at any other time, or a second one, raises
    KeyboardInterrupt as usual. Outside the main thread (no signal handlers there) nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, frame: Any) -> None:
        if request.armed and not request.requested:
            request.requested = True
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def print_json(obj: Any) -> None:
    """One JSON document on standard output (the --json view of every command), written in pieces as it is
    encoded: the memory it takes stays that of `obj` (the whole text of a million WSIT entries, built at once,
    took about 2 KB an entry in small pieces)."""
    pieces: list[str] = []
    size = 0
    for piece in json.JSONEncoder(indent=2).iterencode(obj):
        pieces.append(piece)
        size += len(piece)
        if size >= 1 << 16:
            sys.stdout.write("".join(pieces))
            pieces, size = [], 0
    sys.stdout.write("".join(pieces) + "\n")


def write_text(piece: str) -> None:
    """Write text to standard output as it comes (streamed generation), unformatted."""
    sys.stdout.write(piece)
    sys.stdout.flush()


def command_line(ctx: typer.Context, overrides: dict[str, Any] | None = None) -> list[str]:
    """The arguments that reproduce this command's invocation: its name, then every parameter spelled out.

    Arguments in order, then options by their first name (flags as themselves, or their negative form when
    off and they have one; a repeatable option once per value); options left unset (None) are omitted so they
    keep their defaults. `overrides` replaces parsed values by parameter name (e.g. a prompt read from standard
    input, which the workers cannot read again). No colibri option uses `count` or `nargs`.
    """
    args = [ctx.info_name or ctx.command.name or ""]
    values = {**ctx.params, **(overrides or {})}
    for param in ctx.command.params:
        if param.name is None or param.expose_value is False:
            continue
        value = values.get(param.name)
        kind = param.param_type_name                 # by name: typer may ship its own copy of click
        if kind == "argument":
            args.append(str(value))
        elif kind == "option" and value is not None:
            if param.is_flag:
                if value:
                    args.append(param.opts[0])
                elif param.secondary_opts:
                    args.append(param.secondary_opts[0])
            elif getattr(param, "multiple", False):
                for item in value:
                    args += [param.opts[0], str(item)]
            else:
                args += [param.opts[0], str(value)]
    return args
