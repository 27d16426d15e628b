"""`colibri cache-sim TRACE`: replay a routing trace under every cache policy and Belady's optimum."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import JsonOpt, out, print_json


def command(trace: Annotated[Path, typer.Argument(help="Routing trace written by `colibri infer --trace`.")],
            capacity: Annotated[str, typer.Option("--capacity", help="Comma list: percentages or counts.")]
            = "10%,25%,40%,60%",
            policy: Annotated[str, typer.Option("--policy", help="all, or a comma list of policies.")] = "all",
            scope: Annotated[str, typer.Option("--scope", help="global or per_layer.")] = "global",
            blob_bytes: Annotated[Optional[int], typer.Option("--blob-bytes", help="Bytes per expert blob.")] = None,
            admission: Annotated[str, typer.Option("--admission", help="always, or frequency (lfu/lrfu +hist).")]
            = "always",
            lag: Annotated[str, typer.Option("--lag", help="Comma list of publication lags: passes, or fill.")]
            = "0",
            warmup: Annotated[int, typer.Option("--warmup", help="Passes replayed before counting.")] = 0,
            as_json: JsonOpt = False) -> None:
    """Replay a routing trace under every cache policy and Belady's optimum; print miss rates."""
    from ..runtime.cache.cachesim import run_cache_sim
    from .render import cache_sim_table

    result = run_cache_sim(trace, capacity, policy, scope, blob_bytes=blob_bytes, admission=admission, lag=lag,
                           warmup=warmup)
    if as_json:
        print_json(result)
    else:
        out.print(cache_sim_table(result))
