"""`colibri validate FILE`: structure, every checksum, every must-be-zero byte; the verdict is the exit code."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import FileArg, JsonOpt, err, out, print_json
from .errors import EXIT_INVALID, EXIT_OK

QuickOpt = Annotated[bool, typer.Option("--quick", help="Structure only: skip data checksums.")]


def command(path: FileArg, quick: QuickOpt = False, as_json: JsonOpt = False) -> None:
    """Verify a file: structure, every checksum, every must-be-zero byte. Exit 0 valid, 1 invalid, 2 unreadable."""
    from ..inspect import validate_file
    from .render import progress_bar, render_validation

    if as_json or quick:
        report = validate_file(path, quick=quick)
    else:
        with progress_bar(err, "validating") as update:
            report = validate_file(path, quick=quick, progress=update)
    if as_json:
        print_json(report.to_dict())
    else:
        render_validation(out, err, report)
    raise typer.Exit(EXIT_OK if report.valid else EXIT_INVALID)
