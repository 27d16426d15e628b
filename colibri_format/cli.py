"""`colibri`: a thin typer layer over the library, with one error-to-message map.

Heavy modules (the converter, the engines, CuPy) are imported inside the commands that need them, so
`colibri inspect` starts fast on any machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .errors import ColibriFormatError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="Convert, inspect, validate and run Mixture-of-Experts models in the .colibri format.")
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)

FileArg = Annotated[Path, typer.Argument(help="A .colibri file.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]

EXIT_INVALID = 1
EXIT_UNREADABLE = 2


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _fail(message: str, code: int = EXIT_INVALID) -> None:
    from rich.markup import escape
    err.print(f"[bold red]error:[/] {escape(message)}")
    if os.environ.get("COLIBRI_DEBUG") != "1":
        err.print("[dim]set COLIBRI_DEBUG=1 for a full traceback[/]")
    raise typer.Exit(code)


def _version_callback(value: bool) -> None:
    if value:
        from . import __version__
        out.print(f"colibri-format {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback,
                                                           is_eager=True, help="Show the version.")] = None) -> None:
    """colibri: the .colibri toolkit."""


@app.command()
def inspect(path: FileArg, as_json: JsonOpt = False) -> None:
    """Show header, metadata, dense tensors and the expert table (reads the tables only)."""
    from .inspect import inspect_file
    from .render import render_inspect
    info = inspect_file(path)
    if as_json:
        _print_json(info)
    else:
        render_inspect(out, info)


@app.command()
def validate(path: FileArg,
             quick: Annotated[bool, typer.Option("--quick", help="Structure only: skip data checksums.")] = False,
             as_json: JsonOpt = False) -> None:
    """Verify a file: structure, every checksum, every must-be-zero byte. Exit 0 valid, 1 invalid, 2 unreadable."""
    from .inspect import validate_file
    from .render import progress_bar, render_validation
    if as_json or quick:
        report = validate_file(path, quick=quick)
    else:
        with progress_bar(err, "validating") as update:
            report = validate_file(path, quick=quick, progress=update)
    if as_json:
        _print_json(report.to_dict())
    else:
        render_validation(out, err, report)
    if not report.readable:
        raise typer.Exit(EXIT_UNREADABLE)
    raise typer.Exit(0 if report.valid else EXIT_INVALID)


def _register_optional_commands() -> None:
    """Commands whose implementation lives in other modules (registered here to keep one app)."""
    from . import cli_commands, cli_run  # noqa: F401
    from .runtime.cuda import bench  # noqa: F401  (add convert, infer, cache-sim, bench to `app`)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, turning known errors into one clear line; returns the exit code."""
    _register_optional_commands()
    try:
        rc = app(args=argv, standalone_mode=False, prog_name="colibri")
        return rc if isinstance(rc, int) else 0
    except typer.Exit as exc:
        return exc.exit_code
    except ColibriFormatError as exc:
        if os.environ.get("COLIBRI_DEBUG") == "1":
            raise
        try:
            _fail(str(exc), _exit_code_for(exc))
        except typer.Exit as done:
            return done.exit_code
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return 130
    except Exception as exc:  # click usage errors and the like
        import click
        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            err.print("[yellow]aborted[/]")
            return 130
        raise
    return EXIT_INVALID


def _exit_code_for(exc: ColibriFormatError) -> int:
    from .errors import NotARegularFile
    return EXIT_UNREADABLE if isinstance(exc, NotARegularFile) else EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
