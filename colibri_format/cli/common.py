"""What every command shares: the two consoles, the common option types, JSON printing, and the command line
that reproduces an invocation (for the worker processes of `colibri infer --devices`).

Light on purpose (typer and rich only): every command module imports it at start-up.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

out = Console(highlight=False, soft_wrap=True)       # results: tables, generated text
err = Console(stderr=True, highlight=False)          # errors, progress bars, statistics

FileArg = Annotated[Path, typer.Argument(help="A .colibri file.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


def print_json(obj: Any) -> None:
    """One JSON document on standard output (the --json view of every command)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text(piece: str) -> None:
    """Write text to standard output as it comes (streamed generation), unformatted."""
    sys.stdout.write(piece)
    sys.stdout.flush()


def command_line(ctx: typer.Context) -> list[str]:
    """The arguments that reproduce this command's invocation: its name, then every parameter spelled out.

    Arguments in order, then options by their first name (flags as themselves, or their negative form when
    off and they have one); options left unset (None) are omitted so they keep their defaults. Options take one
    value each (no `multiple`, `count` or `nargs`), as in every colibri command.
    """
    args = [ctx.info_name or ctx.command.name or ""]
    for param in ctx.command.params:
        if param.name is None or param.expose_value is False:
            continue
        value = ctx.params.get(param.name)
        kind = param.param_type_name                 # by name: typer may ship its own copy of click
        if kind == "argument":
            args.append(str(value))
        elif kind == "option" and value is not None:
            if param.is_flag:
                if value:
                    args.append(param.opts[0])
                elif param.secondary_opts:
                    args.append(param.secondary_opts[0])
            else:
                args += [param.opts[0], str(value)]
    return args
