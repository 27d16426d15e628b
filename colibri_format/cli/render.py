"""Human views of the commands' results (rich tables, progress bars). Every string from a file is escaped.

Each function takes a result the library returned (a dict, a report, a summary) and only formats it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe(text) -> str:
    """Escape rich markup and replace control characters in untrusted text."""
    return escape(_CONTROL.sub("?", str(text)))


# A file's metadata may hold up to MAX_METADATA_BYTES of free-form JSON (provenance above all): the human view
# shows each value cut to BRIEF_CHARS characters with the size of the whole, and at most MAX_ROWS rows of a table
# with a count of the rest, so rendering costs the same whatever the file holds (--json prints everything).
BRIEF_CHARS = 160
MAX_ROWS = 64


def brief(value: Any, limit: int = BRIEF_CHARS) -> str:
    """`value` as one escaped table cell: cut to `limit` characters, then the size of the whole in bytes."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return safe(text)
    size = len(text.encode("utf-8", "surrogatepass"))
    return f"{safe(text[:limit])}[dim]... ({size:,} bytes in all)[/]"


def _kv_table(title: str, rows: dict, max_rows: int = MAX_ROWS) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("field", style="cyan")
    t.add_column("value")
    for i, (k, v) in enumerate(rows.items()):
        if i == max_rows:
            break
        t.add_row(brief(k, 64), brief(v))
    if len(rows) > max_rows:
        t.add_row("...", f"[dim]{len(rows) - max_rows:,} more (use --json for all)[/]")
    return t


def render_inspect(out: Console, info: dict, max_expert_rows: int = 64, max_dense_rows: int = 256) -> None:
    h = info["header"]
    out.print(f"[bold]{brief(info['path'], 1024)}[/]  {info['file_size']:,} bytes")
    out.print(_kv_table("Header", h))
    meta = info["metadata"]
    summary = {"architecture": meta["architecture"], "spec_version": meta["spec_version"],
               "quantization": meta["quantization"], "tokenizer": meta["tokenizer"]}
    out.print(_kv_table("Metadata", summary))
    provenance = meta.get("provenance")
    out.print(_kv_table("Provenance", provenance if isinstance(provenance, dict) else {"value": provenance}))
    out.print(_kv_table("Model", meta["model"]))
    dense = info["dense_tensors"]
    t = Table(title=f"Dense tensors ({len(dense)})", title_justify="left")
    for col in ("name", "dtype", "shape", "offset", "size", "checksum"):
        t.add_column(col, justify="right" if col in ("offset", "size") else "left")
    for d in dense[:max_dense_rows]:
        t.add_row(safe(d["name"]), d["dtype"], "x".join(map(str, d["shape"])), f"{d['offset']:,}",
                  f"{d['size']:,}", d["checksum"])
    out.print(t)
    if len(dense) > max_dense_rows:
        out.print(f"[dim]... {len(dense) - max_dense_rows} more dense tensors (use --json for all)[/]")
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
    """Yield an `update(done, total)` callback drawing a transfer-style progress bar (on a terminal only: a
    transient bar still leaves a blank line in a file or a pipe)."""
    if not console.is_terminal:
        yield lambda done, total: None
        return
    columns = [TextColumn(f"[bold]{escape(label)}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
        yield update


# --- convert ------------------------------------------------------------------------------------------
def convert_progress(console: Console, quiet: bool):
    """A context manager yielding the converter's progress callback (a rich bar on `console`; it draws nothing
    when `console` is not a terminal, where a transient bar still leaves a blank line), or None when quiet."""
    if quiet:
        return contextlib.nullcontext(None)
    if not console.is_terminal:
        return contextlib.nullcontext(lambda done, total, done_bytes, total_bytes: None)
    return _convert_bar(console)


@contextlib.contextmanager
def _convert_bar(console: Console):
    columns = [TextColumn("[bold]converting"), BarColumn(), TextColumn("{task.fields[pieces]} pieces"),
               DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("convert", total=None, pieces="0/?")

        def update(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
            # the bar and the speed follow source bytes; pieces = dense tensors + expert blobs
            progress.update(task, completed=done_bytes, total=total_bytes or None, pieces=f"{done}/{total}")
        yield update


def render_convert_summary(out: Console, summary: dict) -> None:
    """`summary`: ConvertSummary.to_dict()."""
    d = summary
    rows = [("output", safe(d["output_path"])), ("architecture", safe(d["architecture"])),
            ("experts / dense dtype", f"{d['expert_format']} / {d['dense_dtype']}"),
            ("dense tensors", f"{d['dense_tensors']:,}"), ("expert blobs", f"{d['experts']:,}"),
            ("resumed pieces", f"{d['pieces_resumed']:,}"),
            ("bytes in (this run)", f"{d['bytes_in']:,}"), ("bytes out", f"{d['bytes_out']:,}"),
            ("time", f"{d['seconds']:.2f} s"), ("throughput", f"{d['gb_per_s']:.2f} GB/s of source"),
            ("read back", "yes: every piece re-hashed from the file" if d["read_back"]
             else "no: colibri validate FILE re-hashes it (or --verify)")]
    if d["quant_error_max"] is not None:
        rows.append(("quant. error (rel.)", f"max {d['quant_error_max']:.3e}, mean {d['quant_error_mean']:.3e}"))
    t = Table(title="colibri convert", show_header=False, title_justify="left")
    t.add_column("field", style="cyan")
    t.add_column("value")
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


# --- infer --------------------------------------------------------------------------------------------
def render_infer_stats(console: Console, result: dict) -> None:
    """The --stats table of `colibri infer` (`result`: what run_infer returned)."""
    t = Table(title="stats", show_header=False, title_justify="left")
    for key, value in result["stats"].items():
        t.add_row(safe(key), f"{value:.4g}" if isinstance(value, float) else safe(value))
    t.add_row("finish_reason", safe(result["finish_reason"]))
    console.print(t)


# --- cache-sim ----------------------------------------------------------------------------------------
def cache_sim_grid(result: dict[str, Any]) -> tuple[list[tuple[str, int]], list[str], dict[tuple[str, int], str]]:
    """(capacities as (spec, experts), policy labels, {(label, capacity): cell}) of run_cache_sim's rows, in their
    order; a cell is the miss rate, and the GiB paged when the row has it."""
    caps: list[tuple[str, int]] = []
    labels: list[str] = []
    cells: dict[tuple[str, int], str] = {}
    for row in result["rows"]:
        if (row["capacity_spec"], row["capacity"]) not in caps:
            caps.append((row["capacity_spec"], row["capacity"]))
        if row["label"] not in labels:
            labels.append(row["label"])
        cell = f"{100 * row['miss_rate']:.2f}%"
        if "bytes_paged" in row:
            cell += f" {row['bytes_paged'] / 2**30:.2f} GiB"
        cells[(row["label"], row["capacity"])] = cell
    return caps, labels, cells


def cache_sim_table(result: dict[str, Any]) -> Table:
    """One row per policy, one column per capacity, cells = miss rate (`result`: run_cache_sim's dict)."""
    t = result["trace"]
    unit = "per layer" if result["scope"] == "per_layer" else "total"
    table = Table(title=f"expert-cache miss rate, scope={safe(result['scope'])}",
                  caption=(f"{safe(t['model'])}: {t['moe_layers']} MoE layers x {t['num_experts']} experts, "
                           f"top-{t['top_k']}, {t['accesses']} accesses, cold misses "
                           f"{100 * t['cold_miss_rate']:.2f}%"))
    table.add_column("policy")
    caps, labels, cells = cache_sim_grid(result)
    for spec, cap in caps:
        table.add_column(f"{safe(spec)} ({cap} {unit})", justify="right")
    for label in labels:
        table.add_row(safe(label), *(cells.get((label, cap), "") for _, cap in caps))
    return table
