"""Human views for the CLI (rich tables, progress bars). Every string from a file is escaped."""

from __future__ import annotations

import contextlib
import re

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe(text) -> str:
    """Escape rich markup and replace control characters in untrusted text."""
    return escape(_CONTROL.sub("?", str(text)))


def _kv_table(title: str, rows: dict) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("field", style="cyan")
    t.add_column("value")
    for k, v in rows.items():
        t.add_row(safe(k), safe(v))
    return t


def render_inspect(out: Console, info: dict, max_expert_rows: int = 64) -> None:
    h = info["header"]
    out.print(f"[bold]{safe(info['path'])}[/]  {info['file_size']:,} bytes")
    out.print(_kv_table("Header", h))
    meta = info["metadata"]
    summary = {"architecture": meta["architecture"], "spec_version": meta["spec_version"],
               "quantization": meta["quantization"], "tokenizer": meta["tokenizer"],
               "provenance": {k: v for k, v in (meta.get("provenance") or {}).items() if k != "source_files"}}
    out.print(_kv_table("Metadata", summary))
    out.print(_kv_table("Model", meta["model"]))
    t = Table(title=f"Dense tensors ({len(info['dense_tensors'])})", title_justify="left")
    for col in ("name", "dtype", "shape", "offset", "size", "checksum"):
        t.add_column(col, justify="right" if col in ("offset", "size") else "left")
    for d in info["dense_tensors"]:
        t.add_row(safe(d["name"]), d["dtype"], "x".join(map(str, d["shape"])), f"{d['offset']:,}",
                  f"{d['size']:,}", d["checksum"])
    out.print(t)
    _render_experts(out, info["experts"], max_expert_rows)


def _render_experts(out: Console, ex: dict, max_rows: int) -> None:
    arrays = ", ".join(f"{a['name']} {a['dtype']} {'x'.join(map(str, a['shape']))} @{a['offset']}" for a in ex["arrays"])
    out.print(f"[bold]Expert blobs[/]: {len(ex['entries'])} x {ex['blob_size']:,} bytes  ({arrays})")
    t = Table(title_justify="left")
    for col in ("layer", "expert", "offset", "size", "checksum"):
        t.add_column(col, justify="right" if col != "checksum" else "left")
    entries = ex["entries"]
    for e in entries[:max_rows]:
        t.add_row(str(e["layer"]), str(e["expert"]), f"{e['offset']:,}", f"{e['size']:,}", e["checksum"])
    out.print(t)
    if len(entries) > max_rows:
        out.print(f"[dim]... {len(entries) - max_rows} more entries (use --json for all)[/]")


def render_validation(out: Console, err: Console, report) -> None:
    if report.valid:
        mode = "structure" if report.quick else f"{report.bytes_checked:,} bytes"
        rate = ""
        if not report.quick and report.seconds > 0:
            rate = f", {report.bytes_checked / report.seconds / 1e9:.2f} GB/s"
        out.print(f"[bold green]valid[/]: {safe(report.path)} ({mode} checked in {report.seconds:.3f} s{rate})")
        return
    for f in report.faults:
        err.print(f"[bold red]{safe(f.error)}[/]: {safe(f.message)}")
    err.print(f"[bold red]invalid[/]: {safe(report.path)} ({len(report.faults)} fault(s))")


@contextlib.contextmanager
def progress_bar(console: Console, label: str, unit_bytes: bool = True):
    """Yield an `update(done, total)` callback drawing a transfer-style progress bar."""
    columns = [TextColumn(f"[bold]{escape(label)}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
        yield update
