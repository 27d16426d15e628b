"""The CLI's one error map: every failure that leaves a command becomes one line and an exit code.

    0    success (validate: the file is valid)
    1    an invalid file or a bad input (every ColibriFormatError not listed in EXIT_CODES), a missing optional
         package, an operating-system error (disk full, file size limit, permission)
    2    a usage error (unknown option or command, missing argument, bad option value); also unreadable: not a
         regular file (validate: could not be read at all)
    130  interrupted (Ctrl-C): the line says what was kept and how to resume

The line is `error: <message>` (`interrupted: <what was kept>` for Ctrl-C) on standard error. Library and
operating-system errors add one hint line, `set COLIBRI_DEBUG=1 for a full traceback` (with it set they are
re-raised instead); usage errors, missing packages and interrupts have nothing to trace and add none. With `--json`
the error is one JSON object on standard output instead, `{"error": {"type", "message", "field", "value",
"offset"}}`, under the same exit code. Anything else is a bug and keeps its traceback.

click exceptions are recognised by the name of their class and module, never by identity: older typer releases
raise click's own classes, recent ones (0.2x) a copy of click vendored as `typer._click`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import typer

from ..errors import ColibriFormatError, NotARegularFile

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_UNREADABLE = 2
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# The ColibriFormatError subclasses with an exit code of their own; the first match wins, the rest get 1.
EXIT_CODES: tuple[tuple[type[ColibriFormatError], int], ...] = (
    (NotARegularFile, EXIT_UNREADABLE),
)

DEBUG_ENV = "COLIBRI_DEBUG"
DEBUG_HINT = f"set {DEBUG_ENV}=1 for a full traceback"


class MissingDependency(ColibriFormatError):
    """An optional package the command needs is not installed; the message names the install command."""


class Interrupted(Exception):
    """Ctrl-C, once the command has tidied up; `note` says what was kept and how to resume.

    A plain Exception on purpose: click and typer swallow KeyboardInterrupt (typer 0.2x turns it into a silent
    exit 130, click into "Aborted!"), so the app's group turns it into this before they see it."""

    def __init__(self, note: str = "") -> None:
        super().__init__(note)
        self.note = note


# What an interrupted command kept, from its parsed parameters. A command module may register its own note.
InterruptNote = Callable[[dict[str, Any]], str]


def _convert_note(params: dict[str, Any]) -> str:
    out = params.get("output_path")
    name = Path(str(out)).name if out else "OUTPUT"        # a str under typer releases that convert late
    return (f"the pieces converted so far are kept (.{name}.part and its journal .{name}.journal); run the same "
            "command again to resume, or add --restart to start over")


def _infer_note(params: dict[str, Any]) -> str:
    trace = params.get("trace")
    return f"the routing trace so far is kept in {trace}" if trace else "nothing was written"


INTERRUPT_NOTES: dict[str, InterruptNote] = {
    "convert": _convert_note,
    "infer": _infer_note,
    "chat": lambda params: "nothing was written",
    "inspect": lambda params: "nothing was written",
    "validate": lambda params: "nothing was written; run it again to check the file",
    "cache-sim": lambda params: "nothing was written",
    "bench": lambda params: "nothing was written",
}


def on_interrupt(command: str, note: InterruptNote) -> None:
    """Register what an interrupted `command` says it kept: `note(params)` (the command's parsed parameters)."""
    INTERRUPT_NOTES[command] = note


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def exit_code_for(exc: ColibriFormatError) -> int:
    for kind, code in EXIT_CODES:
        if isinstance(exc, kind):
            return code
    return EXIT_INVALID


def message_for(exc: ColibriFormatError) -> str:
    """The one line shown for `exc` (the library's messages already name the field, value and offset)."""
    return str(exc)


# --- one failure, ready to print ----------------------------------------------------------------------------
class Failure(NamedTuple):
    code: int
    kind: str                    # the exception's class name (JSON "type")
    message: str                 # the human line, after "error: "
    field: str | None = None
    value: Any = None
    offset: int | None = None
    hint: bool = False           # add the COLIBRI_DEBUG hint line
    detail: str | None = None    # JSON "message" when it differs from the human line (usage errors)
    prefix: str = "error"


def report(exc: BaseException, argv: list[str] | None = None, app=None) -> int:
    """The exit code for an exception that left the app, after telling the user (as JSON when `argv` asks for
    --json); re-raises what is not ours to map (a bug keeps its traceback), and library and OS errors under
    COLIBRI_DEBUG=1. `app` (the typer app) lets the command line be parsed for --json and the notes."""
    exit_code = _exit_code(exc)
    if exit_code is not None:
        return exit_code
    command, params = invocation(argv, app)
    failure = describe(exc, command, params)
    if failure is None:
        raise exc
    if failure.code != EXIT_INTERRUPTED and failure.hint and debugging():
        raise exc
    if params.get("as_json"):
        _print_json(failure)
    else:
        _print_line(failure)
    return failure.code


def describe(exc: BaseException, command: str | None = None, params: dict[str, Any] | None = None) -> Failure | None:
    """The Failure for `exc`, or None when it is not ours to map."""
    params = params or {}
    if isinstance(exc, ColibriFormatError):
        return Failure(exit_code_for(exc), type(exc).__name__, message_for(exc), exc.field, exc.value, exc.offset,
                       hint=not isinstance(exc, MissingDependency), detail=_bare_message(exc))
    if isinstance(exc, (Interrupted, KeyboardInterrupt)) or "Abort" in _click_names(exc):
        note = getattr(exc, "note", "") or _note(command, params)
        return Failure(EXIT_INTERRUPTED, "Interrupted", note or "stopped", prefix="interrupted")
    names = _click_names(exc)
    if "UsageError" in names:
        return _usage_failure(exc)
    if "ClickException" in names:
        return Failure(int(getattr(exc, "exit_code", EXIT_INVALID)), type(exc).__name__, _one_line(exc.format_message()))
    if isinstance(exc, OSError) and exc.errno is not None:
        where = exc.filename
        text = exc.strerror or os.strerror(exc.errno)
        message = f"{text}: {where}" if where is not None else text
        return Failure(EXIT_INVALID, type(exc).__name__, message, "path" if where is not None else None,
                       None if where is None else str(where), hint=True)
    return None


def _exit_code(exc: BaseException) -> int | None:
    """The code of a command's own exit (typer.Exit, click's Exit of either flavour), else None."""
    if isinstance(exc, typer.Exit) or "Exit" in _click_names(exc):
        return int(getattr(exc, "exit_code", 0))
    return None


def _click_names(exc: BaseException) -> set[str]:
    """Names of the click exception classes `exc` is an instance of, whichever copy of click raised it."""
    return {c.__name__ for c in type(exc).__mro__
            if c.__module__.endswith("click.exceptions") or c.__module__.startswith("typer.")}


def _usage_failure(exc: Any) -> Failure:
    if "NoArgsIsHelpError" in _click_names(exc):           # `colibri` alone: the help, as click intends
        exc.show()
        return Failure(int(exc.exit_code), "NoArgsIsHelpError", "", prefix="")
    message = _one_line(exc.format_message())
    ctx = getattr(exc, "ctx", None)
    command_path = getattr(ctx, "command_path", None) or "colibri"
    param = getattr(exc, "param", None)
    field = getattr(param, "name", None) or getattr(exc, "option_name", None) or getattr(exc, "param_hint", None)
    return Failure(int(getattr(exc, "exit_code", EXIT_USAGE)), type(exc).__name__,
                   f"{message} (see '{command_path} --help')", field=field if isinstance(field, str) else None,
                   detail=message)


def _note(command: str | None, params: dict[str, Any]) -> str:
    note = INTERRUPT_NOTES.get(command or "")
    try:
        return note(params) if note is not None else ""
    except Exception:            # noqa: BLE001 - a note must never hide the interrupt
        return ""


def _bare_message(exc: ColibriFormatError) -> str:
    """The message without the `(field=..., value=..., offset=...)` tail (JSON gives those their own keys)."""
    text, tail = str(exc), exc._render("").strip()
    return text[: -len(tail)].rstrip() if tail and text.endswith(tail) else text


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def safe_line(text: str) -> str:
    """One printable line: line breaks become spaces, other control characters '?'."""
    return "".join(" " if ch in "\r\n\t" else "?" if ord(ch) < 32 or 127 <= ord(ch) < 160 else ch
                   for ch in str(text))


# --- printing -------------------------------------------------------------------------------------------------
def print_error(exc: ColibriFormatError) -> None:
    """The one error line for `exc`, without the hint: for a command that carries on (chat)."""
    failure = describe(exc)
    if failure is not None:
        _print_line(failure._replace(hint=False))


def _print_line(failure: Failure) -> None:
    if not failure.prefix:
        return
    from rich.markup import escape

    from .console import err

    colour = "yellow" if failure.code == EXIT_INTERRUPTED else "bold red"
    err.print(f"[{colour}]{failure.prefix}:[/] {escape(safe_line(failure.message))}", soft_wrap=True)
    if failure.hint:
        err.print(f"[dim]{DEBUG_HINT}[/]", soft_wrap=True)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def error_json(failure: Failure) -> dict[str, Any]:
    message = failure.detail if failure.detail is not None else failure.message
    return {"error": {"type": failure.kind, "message": message, "field": failure.field,
                      "value": _jsonable(failure.value), "offset": failure.offset}}


def _print_json(failure: Failure) -> None:
    if not failure.prefix:
        return
    sys.stdout.write(json.dumps(error_json(failure)) + "\n")
    sys.stdout.flush()


# --- what was asked ------------------------------------------------------------------------------------------
def invocation(argv: list[str] | None, app=None) -> tuple[str | None, dict[str, Any]]:
    """The command name and its parameters as far as `argv` parses (never raises): what --json and the
    interrupt notes need, also after a usage error."""
    if argv is None:
        return None, {}
    args = [str(a) for a in argv]
    name = next((a for a in args if not a.startswith("-")), None)
    cut = args.index("--") if "--" in args else len(args)
    fallback = {"as_json": "--json" in args[:cut]}
    if name is None or app is None:
        return name, fallback
    try:
        from typer.main import get_command

        group = get_command(app)
        root = group.context_class(group, info_name="colibri", resilient_parsing=True)
        command = group.get_command(root, name)
        if command is None:
            return name, fallback
        rest = args[args.index(name) + 1:]
        with command.make_context(name, rest, parent=root, resilient_parsing=True) as ctx:
            params = dict(ctx.params)
    except Exception:            # noqa: BLE001 - a best effort: the scan above stands in
        return name, fallback
    # a usage error stops the parse early, leaving defaults: then --json counts unless it was an option's value
    taken = {str(v) for value in params.values() for v in (value if isinstance(value, (list, tuple)) else [value])}
    params["as_json"] = bool(params.get("as_json")) or (fallback["as_json"] and "--json" not in taken)
    return name, params
