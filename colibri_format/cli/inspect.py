"""`colibri inspect FILE`: header, metadata, dense tensors and the expert table (reads the tables only)."""

from __future__ import annotations

from .common import FileArg, JsonOpt, out, print_json


def command(path: FileArg, as_json: JsonOpt = False) -> None:
    """Show header, metadata, dense tensors and the expert table (reads the tables only)."""
    from ..inspect import inspect_file
    from .render import render_inspect

    info = inspect_file(path)
    if as_json:
        print_json(info)
    else:
        render_inspect(out, info)
