"""`colibri convert`: a Hugging Face MoE checkpoint -> .colibri (streaming, resumable, crash-safe)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import err, out, print_json


def command(
    model_path: Annotated[Path, typer.Option("--model-path", "--model_path", help="Hugging Face checkpoint folder.",
                                             show_default=False)],
    output_path: Annotated[Path, typer.Option("--output-path", "--output_path", help="The .colibri file to write.",
                                              show_default=False)],
    dtype: Annotated[str, typer.Option("--dtype", help="Dense (and unquantized expert) dtype: "
                                                       "float16, bfloat16 or float32.")] = "float16",
    quantize: Annotated[str, typer.Option("--quantize", help="expert: quantized experts (--quant-bits); mxfp4: an "
                                                             "MXFP4 checkpoint's experts copied as they are; none: "
                                                             "experts in --dtype.")]
    = "expert",
    quant_bits: Annotated[Optional[int], typer.Option("--quant-bits", "--quant_bits",
                                                      help="Bits per expert weight: 8 (int8, default) or 4 "
                                                           "(int4_group).")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", "--group_size",
                                                      help="Inputs per scale: int8 a multiple of 16 (default: one "
                                                           "scale per row); int4 32 (default), 64 or 128.")] = None,
    scale_search: Annotated[bool, typer.Option(
        "--scale-search", "--scale_search",
        help="int4: give each group the scale of least squared error (about 4x slower to convert) instead of "
             "max|w| / 7.")] = False,
    num_experts: Annotated[Optional[int], typer.Option("--num-experts", "--num_experts",
                                                       help="Expected expert count (checked against config.json).")]
    = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", "--top_k",
                                                 help="Expected top-k (checked against config.json).")] = None,
    workers: Annotated[int, typer.Option("--workers", help="Conversion threads.")] = 2,
    resume: Annotated[bool, typer.Option("--resume/--restart",
                                         help="Continue an interrupted conversion, or discard it.")] = True,
    verify: Annotated[bool, typer.Option(
        "--verify/--no-verify",
        help="Read every piece back from the file and re-hash it before the final rename (doubles the disk "
             "traffic; `colibri validate` runs the same check later).")] = False,
    allow_pickle: Annotated[bool, typer.Option(
        "--allow-pickle", "--allow_pickle",
        help="Read pytorch_model*.bin when no safetensors exist (weights-only torch.load).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing .colibri file at --output-path (anything else there is refused).")]
    = False,
    allow_unused_tensors: Annotated[bool, typer.Option(
        "--allow-unused-tensors", "--allow_unused_tensors",
        help="Convert even when the checkpoint holds tensors nothing uses (listed in the provenance).")] = False,
    allow_non_finite: Annotated[bool, typer.Option(
        "--allow-non-finite", "--allow_non_finite",
        help="Store NaN/inf (and float16 overflow) in float tensors instead of refusing them.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or table.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    """Convert a Hugging Face MoE checkpoint to .colibri (streaming, resumable, crash-safe)."""
    from ..convert.pipeline import convert
    from .render import convert_progress, render_convert_summary

    with convert_progress(err, quiet or as_json) as progress:
        summary = convert(model_path, output_path, dtype=dtype, quantize=quantize, quant_bits=quant_bits,
                          group_size=group_size, num_experts=num_experts, top_k=top_k, workers=workers,
                          resume=resume, verify=verify, progress=progress, allow_pickle=allow_pickle, force=force,
                          allow_unused_tensors=allow_unused_tensors, allow_non_finite=allow_non_finite,
                          scale_search=scale_search)
    if as_json:
        print_json(summary.to_dict())
    elif not quiet:
        render_convert_summary(out, summary.to_dict())
