"""Held-out quality of the bundled demo model when the prefill expert GEMM rounds its activations to bf16
(`EngineConfig(fast_expert_gemm="bf16")`) instead of splitting them into bf16 hi + lo ("split", the default).

    OPENBLAS_NUM_THREADS=1 python benchmarks/quality_bf16_activations.py --threads 1 --out q.json

The CUDA kernel cannot run here, so its arithmetic is emulated on the NumPy engine (float32): "bf16" rounds each
expert product's input to bf16 (round to nearest even, as `ops.split_bf16`'s hi half) - x before gate_up, and
silu(gate) * up before down - and multiplies in float32, which is what the kernel's bf16 tensor-core products with
fp32 accumulation compute up to summation order; "split" keeps about 16 bits of each input, within ~1e-5 of the
float32 engine, so the unmodified NumPy engine stands for it. Both rows score the default conversion (float16 dense,
int8 row experts) over the windows of `benchmarks/quality.py` (every predicted token of eval.txt unless --tokens),
against transformers bf16 and fp32 as references, with quality.py's columns. Only prefill passes (more rows than
the GEMV path takes) run the grouped GEMM on the GPU; a window's logits are one prefill, as here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402

from colibri_format.dtypes import float32_to_bf16_bits  # noqa: E402
from colibri_format.runtime import numpy_backend  # noqa: E402


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 value (ties to even), kept in x's float dtype."""
    bits = float32_to_bf16_bits(np.asarray(x, np.float32)).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(x.dtype, copy=False)


@contextmanager
def bf16_expert_inputs():
    """numpy_backend.expert_ffn with both products' inputs rounded to bf16 while the block runs (moe() looks the
    function up at each call)."""
    real = numpy_backend.expert_ffn

    def rounded(x, gate_up, down, *, act=None, gate_up_bias=None, down_bias=None):
        h = round_to_bf16(x) @ gate_up.T
        if gate_up_bias is not None:
            h = h + gate_up_bias
        inter = gate_up.shape[0] // 2
        if act is None:
            a = numpy_backend.silu(h[:, :inter]) * h[:, inter:]
        else:
            a = numpy_backend.clamped_swiglu(h[:, :inter], h[:, inter:], **act)
        y = round_to_bf16(a) @ down.T
        return y if down_bias is None else y + down_bias

    numpy_backend.expert_ffn = rounded
    try:
        yield
    finally:
        numpy_backend.expert_ffn = real


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="predicted tokens (default: all of eval.txt)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the transformers rows")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch

    from colibri_format.convert.pipeline import convert

    torch.set_num_threads(args.threads)
    wins = quality.windows(quality.held_out_ids(), args.window, args.tokens)
    scores = {f"transformers {tag}": quality.score_transformers(wins, tag, args.batch) for tag in ("bf16", "fp32")}
    with tempfile.TemporaryDirectory(prefix="colibri-bf16-act-") as tmp:
        path = Path(tmp) / "default.colibri"
        convert(quality.MODEL_DIR, path, resume=False)
        scores["colibri f16 / int8 row, split (fp32-class) activations"] = quality.score_colibri(path, wins,
                                                                                               args.batch)
        with bf16_expert_inputs():
            scores["colibri f16 / int8 row, bf16 expert activations"] = quality.score_colibri(path, wins,
                                                                                            args.batch)
    ref_bf16, ref_fp32 = scores["transformers bf16"], scores["transformers fp32"]
    rows = [quality.summarize(name, s, ref_bf16, ref_fp32, wins) for name, s in scores.items()]
    table = quality.markdown(rows)
    print(table)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_head": quality.git_head(), "machine": quality.machine(), "window": args.window,
            "predicted_tokens": len(wins) * args.window}
    print(f"\n{info['predicted_tokens']} predicted tokens, {info['machine']['nproc']} cores, {info['date']}")
    if args.out:
        Path(args.out).write_text(json.dumps({**info, "rows": rows, "markdown": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
