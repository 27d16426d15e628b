"""The CLI's one error map: every failure that leaves a command becomes one clear line and an exit code.

    0    success (validate: the file is valid)
    1    an invalid file or a bad input: every ColibriFormatError not listed in EXIT_CODES
    2    unreadable: not a regular file (validate: could not be read at all); also a usage error (bad option)
    130  interrupted (Ctrl-C) or aborted

A ColibriFormatError prints `error: <message>` on standard error and no traceback (COLIBRI_DEBUG=1 re-raises
it instead). Anything else that is not a click exit or usage error is a bug and keeps its traceback.
"""

from __future__ import annotations

import os

import typer

from ..errors import ColibriFormatError, NotARegularFile

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_UNREADABLE = 2
EXIT_INTERRUPTED = 130

# The ColibriFormatError subclasses with an exit code of their own; the first match wins, the rest get 1.
EXIT_CODES: tuple[tuple[type[ColibriFormatError], int], ...] = (
    (NotARegularFile, EXIT_UNREADABLE),
)

DEBUG_ENV = "COLIBRI_DEBUG"


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


def report(exc: BaseException) -> int:
    """The exit code for an exception that left the app, after telling the user; re-raises what is not
    ours to map (a bug keeps its traceback) and every ColibriFormatError under COLIBRI_DEBUG=1."""
    from .common import err

    if isinstance(exc, typer.Exit):                             # a command's own exit code
        return exc.exit_code
    if isinstance(exc, ColibriFormatError):
        if debugging():
            raise exc
        from rich.markup import escape
        err.print(f"[bold red]error:[/] {escape(message_for(exc))}")
        err.print(f"[dim]set {DEBUG_ENV}=1 for a full traceback[/]")
        return exit_code_for(exc)
    if isinstance(exc, (KeyboardInterrupt, typer.Abort)):
        err.print("[yellow]interrupted[/]" if isinstance(exc, KeyboardInterrupt) else "[yellow]aborted[/]")
        return EXIT_INTERRUPTED
    if _is_click_error(exc):                                    # usage errors: click's own message and code
        exc.show()
        return exc.exit_code
    raise exc


def _is_click_error(exc: BaseException) -> bool:
    """click's ClickException family (usage errors and the like). Recognised by shape: older typer releases
    raise click's own classes, recent ones a copy of click shipped inside typer, so no one class covers both."""
    return isinstance(getattr(exc, "exit_code", None), int) and callable(getattr(exc, "show", None))
