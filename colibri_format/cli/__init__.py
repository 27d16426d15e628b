"""`colibri`: a thin typer layer over the library.

One module per command (`command` is its typer function), registered here and only here; what they share is in
`common` (consoles, option types, JSON), the human views in `render`, and the one error-to-exit-code map in
`errors`. Command modules import typer and rich only: the library modules they call (the converter, the
engines, torch, CuPy) are imported inside the command, so `colibri inspect` starts fast on any machine.
The library never imports this package.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from . import bench, cache_sim, chat, convert, infer, inspect, serve, validate
from .common import out
from .errors import Interrupted, report


class _Group(TyperGroup):
    """The app's group: a Ctrl-C inside a command becomes `Interrupted` before click or typer see it (they would
    print "Aborted!" or exit 130 silently), so errors.report can say what was kept."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise Interrupted() from exc


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="Convert, inspect, validate and run Mixture-of-Experts models in the .colibri format.")

# --- every command, in `colibri --help` order --------------------------------------------------------------
app.command("convert")(convert.command)
app.command("inspect")(inspect.command)
app.command("validate")(validate.command)
app.command("infer")(infer.command)
app.command("chat")(chat.command)
app.command("cache-sim")(cache_sim.command)
app.command("bench")(bench.command)
app.command("serve")(serve.command)


def _version_callback(value: bool) -> None:
    if value:
        from .. import __version__
        out.print(f"colibri-format {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback,
                                                           is_eager=True, help="Show the version.")] = None) -> None:
    """colibri: the .colibri toolkit."""


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app on `argv` (default: the process's arguments); returns the exit
    code, known errors turned into one clear line (errors.py), as JSON when the command was given --json."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        rc = app(args=args, standalone_mode=False, prog_name="colibri")
    except BaseException as exc:  # noqa: BLE001 - errors.report re-raises what it does not map
        return report(exc, args, app)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
