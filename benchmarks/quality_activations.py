"""Held-out quality of the bundled demo model when the expert products round their inputs: to bf16 (the prefill
GEMM's `EngineConfig(fast_expert_gemm="bf16")` instead of bf16 hi + lo, "split", the default), or to int8 with one
scale per group of 32 inputs (what a dp4a / int8 tensor-core expert kernel, W8A8 or W4A8, computes: for int4_group
experts moe_gemv4_dp4a.cu does, `EngineConfig.int8_activations`), or to int8 with one scale per token (row), what a
W8A8 s8 x s8 tensor-core / cuBLAS int8 GEMM with per-token activation scales computes.

    OPENBLAS_NUM_THREADS=1 python benchmarks/quality_activations.py --threads 1 [--forms bf16,int8_g32,int8_token] \
        [--experts int8_row,int4_g32] [--kv-bf16] --out q.json

--dense-bf16 adds rows with the dense products' inputs (q|k|v, o_proj, dense MLPs, lm_head) rounded to bf16 in
passes of more than 32 rows, what one bf16 cuBLAS product a matrix instead of the hi + lo split computes: emulated
on a float16-dense conversion, and (--experts int8_row_bf16, a bfloat16-dense conversion) the engine's own
`EngineConfig(dense_gemm="bf16")`, which rounds bf16-stored matrices' inputs only (limits.rounds_dense_bf16).
--kv-bf16 adds rows of the engine with its KV cache in bf16 (`EngineConfig(kv_cache_dtype="bfloat16")`: keys and
values rounded to nearest even as the CUDA kernels store them), alone and, for int8 row experts, with W8A8.

The CUDA kernels cannot run here, so their arithmetic is emulated on the NumPy engine (float32) in every pass: "bf16"
rounds each expert product's input to bf16 (round to nearest even, as `ops.split_bf16`'s hi half) - x before
gate_up, and silu(gate) * up before down - and multiplies in float32, which is what the kernel's bf16 tensor-core
products with fp32 accumulation compute up to summation order; "int8_g32" replaces each group of 32 inputs by
rint(v / s) * s with s = max|v| / 127 of the group (symmetric, as llama.cpp's q8_1 activations), which an integer
kernel's int32 group sums times s and the weight scales compute exactly; "int8_token" does the same with one scale
per row (per token: s = max|v| / 127 of the whole row), the activations of a W8A8 GEMM with per-token scales (s8 x
s8 tensor cores or cuBLAS int8, as benchmarks/prefill_gemm.py times). "split" keeps about 16 bits of each
input, within ~1e-5 of the float32 engine, so the unmodified NumPy engine stands for it. Every row scores the
default conversion (float16 dense, int8 row experts) over the windows of `benchmarks/quality.py` (every predicted
token of eval.txt unless --tokens), against transformers bf16 and fp32 as references, with quality.py's columns.
The windows are prefill passes; a decode step's rows are rounded the same way, row by row.

--experts picks the conversions scored (default int8_row, the file above): int4_g32 is `convert(quant_bits=4,
group_size=32)`, whose products the engine itself rounds to int8 per group of 32 by default
(`EngineConfig(int8_activations=True)`, numpy_backend.round_int8_groups). Every "split" and emulated row runs
with int8_activations=False (float activations, then the form's rounding alone); an int4_g32 file adds a row of
the engine's own default, int8_activations=True, which must score exactly as its emulated int8_g32 row.
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


INT8_GROUP = 32         # inputs sharing one int8 scale


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 value (ties to even), kept in x's float dtype."""
    bits = float32_to_bf16_bits(np.asarray(x, np.float32)).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(x.dtype, copy=False)


def round_to_int8_groups(x: np.ndarray, group: int = INT8_GROUP) -> np.ndarray:
    """Each row's groups of `group` values replaced by rint(v / s) * s, s = max|v| / 127 of the group (a group of
    zeros stays zero), kept in x's dtype."""
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"{cols} inputs are not whole groups of {group}")
    g = x.reshape(rows, cols // group, group)
    scale = np.abs(g).max(axis=2, keepdims=True) / 127
    q = np.rint(np.divide(g, scale, out=np.zeros_like(g), where=scale > 0))
    return (q * scale).reshape(rows, cols).astype(x.dtype, copy=False)


def round_to_int8_rows(x: np.ndarray) -> np.ndarray:
    """Each row (a token's inputs) replaced by rint(v / s) * s with one scale for the whole row, s = max|v| / 127 (a
    row of zeros stays zero), kept in x's dtype: round_to_int8_groups with one group per row, the activations of a
    W8A8 GEMM with per-token scales (s8 x s8 tensor cores or cuBLAS, int32 sums times s and the weight scales)."""
    return round_to_int8_groups(x, group=x.shape[1])


FORMS = {"bf16": round_to_bf16, "int8_g32": round_to_int8_groups, "int8_token": round_to_int8_rows}
# --experts: row label, convert() options
EXPERTS = {"int8_row": ("int8 row", {}), "int4_g32": ("int4 g32", dict(quant_bits=4, group_size=32)),
           "int8_row_bf16": ("int8 row", dict(dtype="bfloat16"))}


@contextmanager
def rounded_expert_inputs(round_input):
    """numpy_backend.expert_ffn with both products' inputs passed through `round_input` while the block runs (moe()
    looks the function up at each call)."""
    real = numpy_backend.expert_ffn

    def rounded(x, gate_up, down, *, act=None, gate_up_bias=None, down_bias=None):
        h = round_input(x) @ gate_up.T
        if gate_up_bias is not None:
            h = h + gate_up_bias
        inter = gate_up.shape[0] // 2
        if act is None:
            a = numpy_backend.silu(h[:, :inter]) * h[:, inter:]
        else:
            a = numpy_backend.clamped_swiglu(h[:, :inter], h[:, inter:], **act)
        y = round_input(a) @ down.T
        return y if down_bias is None else y + down_bias

    numpy_backend.expert_ffn = rounded
    try:
        yield
    finally:
        numpy_backend.expert_ffn = real


@contextmanager
def rounded_dense_inputs(round_input, min_rows: int = 33):
    """NumpyDense.linear with its input passed through `round_input` in passes of at least `min_rows` rows (the
    prefill-shaped passes, which the CUDA engine multiplies on cuBLAS: 'dense_bf16' is their input as bf16 alone, one
    product, where the engine now splits it into hi + lo, two)."""
    real = numpy_backend.NumpyDense.linear

    def rounded(self, x, name, bias, out):
        return real(self, round_input(x) if x.shape[0] >= min_rows else x, name, bias, out)

    numpy_backend.NumpyDense.linear = rounded
    try:
        yield
    finally:
        numpy_backend.NumpyDense.linear = real


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="predicted tokens (default: all of eval.txt)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the transformers rows")
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {', '.join(FORMS)}")
    p.add_argument("--experts", default="int8_row", help=f"comma list of {', '.join(EXPERTS)} (the conversions)")
    p.add_argument("--kv-bf16", action="store_true", help="also rows with the engine's bf16 KV cache "
                   "(EngineConfig.kv_cache_dtype='bfloat16'): alone, and with W8A8 for int8 row experts")
    p.add_argument("--dense-bf16", action="store_true", help="also rows with the dense products' inputs rounded to "
                   "bf16 in passes of more than 32 rows (emulated): alone, and with W8A8 for int8 row experts")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    forms = args.forms.split(",") if args.forms else []
    if set(forms) - set(FORMS):
        p.error(f"unknown --forms {sorted(set(forms) - set(FORMS))}; known: {', '.join(FORMS)}")
    experts = args.experts.split(",")
    if not experts or set(experts) - set(EXPERTS):
        p.error(f"unknown --experts {sorted(set(experts) - set(EXPERTS))}; known: {', '.join(EXPERTS)}")

    import torch

    from colibri_format.convert.pipeline import convert

    torch.set_num_threads(args.threads)
    wins = quality.windows(quality.held_out_ids(), args.window, args.tokens)
    scores = {f"transformers {tag}": quality.score_transformers(wins, tag, args.batch) for tag in ("bf16", "fp32")}
    checks = {}
    with tempfile.TemporaryDirectory(prefix="colibri-act-") as tmp:
        for kind in experts:
            label, opts = EXPERTS[kind]
            label = ("bf16" if opts.get("dtype") == "bfloat16" else "f16") + " / " + label   # dense dtype / experts
            path = Path(tmp) / f"{kind}.colibri"
            convert(quality.MODEL_DIR, path, resume=False, **opts)

            def score(path=path, **engine):
                """The NumPy engine's scores with float expert inputs unless `engine` asks otherwise: the default
                fast_expert_gemm 'auto' would round long passes' inputs to int8 (W8A8) under every row's label."""
                return quality.score_colibri(path, wins, args.batch,
                                             **{"int8_activations": False, "fast_expert_gemm": None, **engine})

            scores[f"colibri {label}, split (fp32-class) activations"] = score()
            for form in forms:
                with rounded_expert_inputs(FORMS[form]):
                    scores[f"colibri {label}, {form} expert activations"] = score()
            if "quant_bits" not in opts:     # int8 row experts: the engine's own W8A8 (its twin: limits.rounds_rows_int8)
                name = f"colibri {label}, engine fast_expert_gemm='int8' (W8A8)"
                scores[name] = score(fast_expert_gemm="int8")
                emulated = scores.get(f"colibri {label}, int8_token expert activations")
                if emulated is not None:
                    same = all(np.array_equal(a, b) for a, b in zip(scores[name].logprob, emulated.logprob))
                    checks[f"{kind}: engine fast_expert_gemm='int8' == emulated int8_token"] = same
            if args.kv_bf16:      # the engine's own bf16 KV cache (numpy_backend.cache_entries), not an emulation
                scores[f"colibri {label}, bf16 KV cache"] = score(kv_cache_dtype="bfloat16")
                if "quant_bits" not in opts:
                    scores[f"colibri {label}, W8A8 + bf16 KV cache"] = score(fast_expert_gemm="int8",
                                                                             kv_cache_dtype="bfloat16")
            if args.dense_bf16 and opts.get("dtype") == "bfloat16":     # the engine's own dense_gemm='bf16'
                scores[f"colibri {label}, engine dense_gemm='bf16'"] = score(dense_gemm="bf16")
                scores[f"colibri {label}, engine W8A8 + dense_gemm='bf16'"] = score(fast_expert_gemm="int8",
                                                                                   dense_gemm="bf16")
            elif args.dense_bf16:
                with rounded_dense_inputs(round_to_bf16):
                    scores[f"colibri {label}, dense_bf16 activations"] = score()
                    if "quant_bits" not in opts:
                        scores[f"colibri {label}, W8A8 + dense_bf16 activations"] = score(fast_expert_gemm="int8")
            if opts.get("quant_bits") == 4:    # limits.A8_FORMATS: the engine rounds these itself when asked
                name = f"colibri {label}, engine int8_activations=True (default)"
                scores[name] = score(int8_activations=True)
                emulated = scores.get(f"colibri {label}, int8_g32 expert activations")
                if emulated is not None:
                    same = all(np.array_equal(a, b) for a, b in zip(scores[name].logprob, emulated.logprob))
                    checks[f"{kind}: engine int8_activations == emulated int8_g32"] = same
    ref_bf16, ref_fp32 = scores["transformers bf16"], scores["transformers fp32"]
    rows = [quality.summarize(name, s, ref_bf16, ref_fp32, wins) for name, s in scores.items()]
    table = quality.markdown(rows)
    print(table)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_head": quality.git_head(), "machine": quality.machine(), "window": args.window,
            "predicted_tokens": len(wins) * args.window, "checks": checks}
    print(f"\n{info['predicted_tokens']} predicted tokens, {info['machine']['nproc']} cores, {info['date']}")
    for what, ok in checks.items():
        print(f"{what}: {ok}")
    if args.out:
        Path(args.out).write_text(json.dumps({**info, "rows": rows, "markdown": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
