"""Commands backed by the converter and the engines (imported lazily by `colibri_format.cli`).

Each command is a self-contained section: its options, its rendering, its imports inside the function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli import _print_json, app, err, out


# ================================================================================================
# colibri convert
# ================================================================================================
def _convert_progress(quiet: bool):
    """A context manager yielding the pipeline's progress callback (a rich bar on stderr, or None)."""
    import contextlib

    if quiet:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    @contextlib.contextmanager
    def bar():
        columns = [TextColumn("[bold]converting"), BarColumn(), TextColumn("{task.fields[pieces]} pieces"),
                   DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
        with Progress(*columns, console=err, transient=True) as progress:
            task = progress.add_task("convert", total=None, pieces="0/?")

            def update(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
                # the bar and the speed follow source bytes; pieces = dense tensors + expert blobs
                progress.update(task, completed=done_bytes, total=total_bytes or None, pieces=f"{done}/{total}")
            yield update

    return bar()


def _render_convert_summary(summary) -> None:
    from rich.table import Table

    from .render import safe

    t = Table(title="colibri convert", show_header=False, title_justify="left")
    t.add_column("field", style="cyan")
    t.add_column("value")
    d = summary.to_dict()
    rows = [("output", safe(d["output_path"])), ("architecture", safe(d["architecture"])),
            ("experts / dense dtype", f"{d['expert_format']} / {d['dense_dtype']}"),
            ("dense tensors", f"{d['dense_tensors']:,}"), ("expert blobs", f"{d['experts']:,}"),
            ("resumed pieces", f"{d['pieces_resumed']:,}"),
            ("bytes in (this run)", f"{d['bytes_in']:,}"), ("bytes out", f"{d['bytes_out']:,}"),
            ("time", f"{d['seconds']:.2f} s"), ("throughput", f"{d['gb_per_s']:.2f} GB/s of source")]
    if d["quant_error_max"] is not None:
        rows.append(("quant. error (rel.)", f"max {d['quant_error_max']:.3e}, mean {d['quant_error_mean']:.3e}"))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


@app.command()
def convert(
    model_path: Annotated[Path, typer.Option("--model-path", "--model_path", help="Hugging Face checkpoint folder.",
                                             show_default=False)],
    output_path: Annotated[Path, typer.Option("--output-path", "--output_path", help="The .colibri file to write.",
                                              show_default=False)],
    dtype: Annotated[str, typer.Option("--dtype", help="Dense (and unquantized expert) dtype: "
                                                       "float16, bfloat16 or float32.")] = "float16",
    quantize: Annotated[str, typer.Option("--quantize", help="expert: int8 experts; none: experts in --dtype.")]
    = "expert",
    quant_bits: Annotated[int, typer.Option("--quant-bits", "--quant_bits", help="Bits per expert weight (8).")] = 8,
    group_size: Annotated[Optional[int], typer.Option("--group-size", "--group_size",
                                                      help="int8 group size (default: one scale per row).")] = None,
    num_experts: Annotated[Optional[int], typer.Option("--num-experts", "--num_experts",
                                                       help="Expected expert count (checked against config.json).")]
    = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", "--top_k",
                                                 help="Expected top-k (checked against config.json).")] = None,
    workers: Annotated[int, typer.Option("--workers", help="Conversion threads.")] = 2,
    resume: Annotated[bool, typer.Option("--resume/--restart",
                                         help="Continue an interrupted conversion, or discard it.")] = True,
    verify: Annotated[bool, typer.Option("--verify/--no-verify",
                                         help="Re-hash the whole file before the final rename.")] = True,
    allow_pickle: Annotated[bool, typer.Option(
        "--allow-pickle", "--allow_pickle",
        help="Read pytorch_model*.bin when no safetensors exist (weights-only torch.load).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or table.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    """Convert a Hugging Face MoE checkpoint to .colibri (streaming, resumable, crash-safe)."""
    from .convert.pipeline import convert as run_convert

    with _convert_progress(quiet or as_json) as progress:
        summary = run_convert(model_path, output_path, dtype=dtype, quantize=quantize, quant_bits=quant_bits,
                              group_size=group_size, num_experts=num_experts, top_k=top_k, workers=workers,
                              resume=resume, verify=verify, progress=progress, allow_pickle=allow_pickle)
    if as_json:
        _print_json(summary.to_dict())
    elif not quiet:
        _render_convert_summary(summary)
