"""4-bit experts on the bundled demo model: perplexity and greedy agreement of int4 g32/g64/g128 and int8
against transformers bf16, with llama.cpp's Q4_0 (computed in NumPy by gguf-py) as a point of comparison.

    OPENBLAS_NUM_THREADS=1 python benchmarks/quality_4bit.py --threads 1 --out quality_4bit.json   # all of eval.txt
    python benchmarks/quality_4bit.py --tokens 4096 --prompts 8 --out q.json                      # a quick run

Held-out text, windows and teacher-forced scoring are those of benchmarks/quality.py (imported from it): every
token of `models/colibri-demo-moe/eval.txt` after the first is predicted once, in non-overlapping windows of 512
that each start a fresh KV cache.

Rows:

* ``transformers bf16`` (the reference) and ``transformers fp32``: the shipped checkpoint, eager, on CPU.
* ``colibri f16 / int8 row``, ``int8 g32``, ``int4 g32``, ``int4 g32 search`` (and ``int4 g64`` / ``g128`` where
  --model's expert widths allow them): real `.colibri` files from ``colibri convert --dtype float16 [--quant-bits 4]
  [--group-size G] [--scale-search]``, run by the NumPy engine (float32 arithmetic) with float activations
  (``int8_activations=False``): this table is the weights' own cost; what the default int8 activations add to int4
  experts is benchmarks/quality_activations.py's.
* ``sim ...`` rows: the same float16 dense tensors, and expert weights quantized then dequantized in NumPy and
  stored as float32 experts (a `.colibri` file the engine runs like any other). ``sim int4 g32`` uses the
  converter's own quantizer (`quantize_int4`) and must score exactly as the real int4 g32 file (a check of the
  method); ``sim int4 g64`` and ``g128`` are what the format cannot store for this model (groups must divide the
  expert width 160): their ``down`` rows (160 inputs) end with a short group of 32 (64+64+32, 128+32), the
  ``gate_up`` rows (256 inputs) are whole groups; their ``search`` rows choose the scales as ``--scale-search``
  does. ``sim Q4_0`` is llama.cpp's Q4_0 (blocks of 32, one float16
  scale d = x[argmax|x|] / -8, q = clamp(trunc(x/d + 8.5), 0, 15), 4.5 bits a weight like int4 g32), from
  gguf-py's NumPy implementation (`gguf.quants`).

Columns: perplexity and its change against transformers bf16; teacher-forced top-1 agreement (the share of the
69,632 positions where the argmax equals transformers bf16's); free-running greedy agreement (``--prompts``
prompts of ``--prompt-len`` tokens, the first of each window, ``--new-tokens`` greedy tokens each, compared with
transformers bf16's greedy continuation: the mean share of tokens before the first divergence, and the share of
continuations identical to the end); the stored quantization error (`quantization.error` for real files; the
same measure computed here for simulated rows); expert bytes per expert (a blob; Q4_0: its 18 bytes a block).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import quality as Q  # noqa: E402  (benchmarks/quality.py: data, windows, scoring, machine)

MODEL_DIR = Q.MODEL_DIR

# name, convert() options
FILE_ROWS = [
    ("colibri f16 / int8 row", dict(quant_bits=8, group_size=None)),
    ("colibri f16 / int8 g32", dict(quant_bits=8, group_size=32)),
    ("colibri f16 / int4 g32", dict(quant_bits=4, group_size=32)),
    ("colibri f16 / int4 g32 search", dict(quant_bits=4, group_size=32, scale_search=True)),
]
# real files of the larger groups, for a model (--model) whose expert widths they divide
WIDE_GROUP_ROWS = [(f"colibri f16 / int4 g{g}{' search' if search else ''}",
                    dict(quant_bits=4, group_size=g, **({"scale_search": True} if search else {})))
                   for g in (64, 128) for search in (False, True)]
SIM_ROWS = [("sim int4 g32", ("int4", 32, False)), ("sim int4 g64", ("int4", 64, False)),
            ("sim int4 g128", ("int4", 128, False)), ("sim int4 g64 search", ("int4", 64, True)),
            ("sim int4 g128 search", ("int4", 128, True)), ("sim Q4_0", ("q4_0", 32, False))]


# --- simulated quantization ------------------------------------------------------------------------------------------
def fake_int4(w: np.ndarray, group: int, search: bool = False) -> np.ndarray:
    """Quantize [R, C] with the converter's int4_group quantizer and dequantize; a row whose length `group` does not
    divide ends with one shorter group (what the format itself cannot store)."""
    from colibri_format.convert.quantize import quantize_int4
    from colibri_format.dequant import dequantize_matrix
    from colibri_format.spec import ExpertFormat

    out = np.empty_like(w)
    full = w.shape[1] // group * group
    for lo, hi, g in ((0, full, group), (full, w.shape[1], w.shape[1] - full)):
        if hi > lo:
            q = quantize_int4(np.ascontiguousarray(w[:, lo:hi]), g, search=search)
            out[:, lo:hi] = dequantize_matrix(ExpertFormat.INT4_GROUP, q.q, q.scale, np.float32)
    return out


def fake_q4_0(w: np.ndarray) -> np.ndarray:
    """llama.cpp Q4_0 of [R, C] (C a multiple of 32) and back, by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    return dequantize(quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType.Q4_0),
                      GGMLQuantizationType.Q4_0).astype(np.float32).reshape(w.shape)


def rel_error(w: np.ndarray, d: np.ndarray) -> tuple[float, float]:
    """max and sum of |w - d| / max|w[row]| (the measure of quantization.error)."""
    row = np.abs(w).max(axis=1, keepdims=True)
    e = np.abs(w.astype(np.float64) - d) / np.where(row > 0, row, 1.0)
    return float(e.max()), float(e.sum())


def write_simulated(path: Path, dense_file: Path, expert_file: Path, kind: str, group: int, search: bool) -> dict:
    """A float32-expert file: dense tensors from `dense_file` as stored, experts from `expert_file` (float32, the
    source's bf16 values exactly) quantized and dequantized. Returns its error stats."""
    import colibri_format
    from colibri_format import spec as S
    from colibri_format.writer import ColibriWriter

    fq = (lambda w: fake_int4(w, group, search)) if kind == "int4" else fake_q4_0
    err_max, err_sum, count = 0.0, 0.0, 0
    with colibri_format.open(dense_file) as dense, colibri_format.open(expert_file) as experts:
        meta = json.loads(json.dumps(dense.metadata))
        w = ColibriWriter(path, dense.model, dense_dtype=S.DType.F16, expert_format=S.ExpertFormat.F32)
        try:
            for t in w.plan.dense:
                w.write_dense(t.name, np.asarray(dense.dense(t.name)))
            for layer, e in w.plan.blob_keys():
                arrays = {}
                for name, m in zip(("gate_up", "down"), experts.expert_f32(layer, e)):
                    arrays[name] = fq(m)
                    mx, sm = rel_error(m, arrays[name])
                    err_max, err_sum, count = max(err_max, mx), err_sum + sm, count + m.size
                w.write_expert(layer, e, arrays)
            meta["quantization"] = {"experts": "float32", "dense_dtype": "float16", "bits": None, "group_size": None,
                                    "error": None}
            w.finalize(meta)
        except BaseException:
            w.abort(remove_part=True)
            raise
    return {"max_rel": err_max, "mean_rel": err_sum / count}


def expert_bytes(model: dict, kind: str, group: int | None) -> int | None:
    """Bytes of one expert: its blob where the format can store it, Q4_0's 18 bytes a block of 32."""
    from colibri_format import spec as S
    from colibri_format.spec.checks import group_rule

    h, i = model["hidden_size"], model["expert_intermediate_size"]
    if kind == "q4_0":
        return 3 * h * i // 32 * 18
    fmt = {"int8 row": S.ExpertFormat.INT8_ROW, "int8": S.ExpertFormat.INT8_GROUP, "int4": S.ExpertFormat.INT4_GROUP,
           "bf16": S.ExpertFormat.BF16}[kind]
    g = group or 0
    if group_rule(fmt, g, h, i) is not None:
        return None
    return S.blob_layout(h, i, fmt, g).size


# --- greedy agreement -------------------------------------------------------------------------------------------------
def greedy_reference(prompts: np.ndarray, new_tokens: int, dtype_name: str, model_dir: Path) -> np.ndarray:
    import torch
    import transformers

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.inference_mode():
        out = model.generate(torch.from_numpy(prompts), attention_mask=torch.ones_like(torch.from_numpy(prompts)),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:].numpy()


def greedy_colibri(path: Path, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    from colibri_format.runtime.engine import Engine, EngineConfig

    with Engine(path, EngineConfig(max_batch_size=len(prompts), int8_activations=False)) as eng:
        return np.asarray(eng.generate_batch([p.tolist() for p in prompts], new_tokens))


def agreement(got: np.ndarray, ref: np.ndarray) -> dict:
    same = got == ref
    prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    return {"greedy_prefix_share": float(prefix.mean() / same.shape[1]), "greedy_identical": float(same.all(1).mean())}


# --- output ---------------------------------------------------------------------------------------------------------------
def markdown(rows: list[dict]) -> str:
    head = ("| experts | perplexity | vs tf bf16 | top-1 agree (tf bf16) | greedy prefix / identical (tf bf16) "
            "| quant max / mean rel err | bytes per expert | vs int8 row | tokens/s |")
    lines = [head, "| --- " * (head.count("|") - 1) + "|"]
    base = next((r["expert_bytes"] for r in rows if r["name"].endswith("int8 row")), None)
    for r in rows:
        q = r.get("quant_error")
        qs = f"{q['max_rel']:.4f} / {q['mean_rel']:.5f}" if q else "-"
        eb = r.get("expert_bytes")
        lines.append(
            f"| {r['name']} | {r['ppl']:.4f} | {Q._pct(r.get('ppl_delta_vs_bf16'), 2)} "
            f"| {100 * r.get('top1_agree_bf16', float('nan')):.2f}% "
            f"| {100 * r['greedy_prefix_share']:.1f}% / {100 * r['greedy_identical']:.1f}% | {qs} "
            f"| {f'{eb:,}' if eb else 'not storable' if r['name'].startswith('sim') else '-'} "
            f"| {f'{eb / base:.3f}' if eb and base else '-'} "
            f"| {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="predicted tokens (whole windows; default: all)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--prompts", type=int, default=64, help="prompts for the free-running greedy agreement")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the transformers rows")
    p.add_argument("--workdir", default=None, help="where the .colibri files go (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--model", type=Path, default=MODEL_DIR, help="a Hugging Face MoE checkpoint with eval.txt beside "
                   "its tokenizer (default: the bundled demo model); int4 g64 / g128 files are scored too where its "
                   "expert widths allow them")
    args = p.parse_args(argv)
    missing = [f for f in ("config.json", "tokenizer.json", "eval.txt") if not (args.model / f).is_file()]
    if missing:
        p.error(f"--model {args.model}: no {', '.join(missing)} there")

    import torch
    torch.set_num_threads(args.threads)
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    cmd = [os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": (f"OPENBLAS_NUM_THREADS={blas} " if blas else "") + "python " + " ".join(cmd),
            "git_head": Q.git_head(), "machine": Q.machine()}
    ids = Q.held_out_ids(args.model)
    wins = Q.windows(ids, args.window, args.tokens)
    starts = Q.windows(ids, args.window)
    step = max(1, len(starts) // args.prompts)
    prompts = np.stack([w[:args.prompt_len] for w in starts[::step][:args.prompts]])
    info.update({"eval_tokens": len(ids), "window": args.window, "windows": len(wins),
                 "predicted_tokens": len(wins) * args.window, "greedy_prompts": len(prompts),
                 "prompt_len": args.prompt_len, "new_tokens": args.new_tokens})
    print(f"{len(wins)} windows of {args.window}; {len(prompts)} greedy prompts", file=sys.stderr)

    scores, extra = {}, {}
    greedy = {tag: greedy_reference(prompts, args.new_tokens, tag, args.model) for tag in ("bf16", "fp32")}
    for tag in ("bf16", "fp32"):
        name = f"transformers {tag}"
        scores[name] = Q.score_transformers(wins, tag, args.batch, args.model)
        extra[name] = {**agreement(greedy[tag], greedy["bf16"]), "expert_bytes": None}
        print(f"{name}: {scores[name].seconds:.1f}s", file=sys.stderr)

    from colibri_format.convert.pipeline import convert

    with tempfile.TemporaryDirectory(prefix="colibri-q4-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        dense_file, expert_file = work / "f16-none.colibri", work / "f32-none.colibri"
        convert(args.model, dense_file, dtype="float16", quantize="none", resume=False, force=True)
        convert(args.model, expert_file, dtype="float32", quantize="none", resume=False, force=True)
        import colibri_format
        with colibri_format.open(dense_file) as f:
            model = f.model
        extra["transformers bf16"]["expert_bytes"] = expert_bytes(model, "bf16", 0)
        wide = [row for row in WIDE_GROUP_ROWS if expert_bytes(model, "int4", row[1]["group_size"]) is not None]
        for name, opts in FILE_ROWS + wide:
            path = work / (name.split("/ ")[1].replace(" ", "-") + ".colibri")
            t0 = time.perf_counter()
            convert(args.model, path, dtype="float16", resume=False, force=True, **opts)
            seconds = time.perf_counter() - t0
            s = scores[name] = Q.score_colibri(path, wins, args.batch, int8_activations=False)
            err = (getattr(s, "quant", {}) or {}).get("error")
            kind = "int4" if opts["quant_bits"] == 4 else "int8" if opts["group_size"] else "int8 row"
            extra[name] = {**agreement(greedy_colibri(path, prompts, args.new_tokens), greedy["bf16"]),
                           "file_bytes": path.stat().st_size, "convert_seconds": seconds,
                           "expert_bytes": expert_bytes(model, kind, opts["group_size"]),
                           "quant_error": None if err is None else {"max_rel": err["max_rel"],
                                                                   "mean_rel": err["mean_rel"]}}
            print(f"{name}: {s.seconds:.1f}s", file=sys.stderr)
        for name, (kind, group, search) in SIM_ROWS:
            path = work / (name.replace(" ", "-") + ".colibri")
            err = write_simulated(path, dense_file, expert_file, kind, group, search)
            s = scores[name] = Q.score_colibri(path, wins, args.batch, int8_activations=False)
            extra[name] = {**agreement(greedy_colibri(path, prompts, args.new_tokens), greedy["bf16"]),
                           "expert_bytes": expert_bytes(model, kind, group), "quant_error": err}
            print(f"{name}: {s.seconds:.1f}s", file=sys.stderr)

    ref_bf16, ref_fp32 = scores["transformers bf16"], scores["transformers fp32"]
    rows = []
    for name, s in scores.items():
        row = Q.summarize(name, s, ref_bf16, ref_fp32, wins)
        row.update(extra.get(name, {}))
        rows.append(row)
    real = next(r for r in rows if r["name"] == "colibri f16 / int4 g32")
    sim = next(r for r in rows if r["name"] == "sim int4 g32")
    info["sim_int4_g32_equals_file"] = bool(real["nll"] == sim["nll"] and real["top1_agree_bf16"] == sim["top1_agree_bf16"])
    table = markdown(rows)
    print(table)
    print(f"\n{info['predicted_tokens']} predicted tokens ({info['windows']} windows of {args.window}); "
          f"greedy: {len(prompts)} prompts x {args.new_tokens} tokens; sim int4 g32 == file int4 g32: "
          f"{info['sim_int4_g32_equals_file']}; {info['machine']['nproc']} cores, {info['machine']['cpu']}, "
          f"{info['date']}")
    if args.out:
        Path(args.out).write_text(json.dumps({**info, "rows": rows, "markdown": table}, indent=1) + "\n")
    if not info["sim_int4_g32_equals_file"]:
        print("error: the simulated int4 g32 row does not score as the int4 g32 file: the method check failed",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
