"""Held-out quality of the bundled demo model: transformers references vs colibri conversions.

    OPENBLAS_NUM_THREADS=1 python benchmarks/quality.py --threads 1 --out quality.json   # all of eval.txt
    python benchmarks/quality.py --tokens 4096 --out q.json        # a quick run on the first 8 windows

On a shared, busy machine use one thread for torch (``--threads 1``) and for NumPy's OpenBLAS
(``OPENBLAS_NUM_THREADS=1``, which must be set before NumPy loads): with 2 spinning BLAS/OpenMP threads per
process on 2 oversubscribed cores, both the transformers rows and the NumPy engine ran about 10x slower.

The held-out text (``models/colibri-demo-moe/eval.txt``) is tokenized with the bundled tokenizer (which
prepends ``<|bos|>``) and cut into fixed, non-overlapping windows: window ``w`` reads ids
``[w*W, w*W + W)`` and predicts ids ``[w*W + 1, w*W + W + 1)``, so every token after the first is predicted
exactly once, with between 0 and W-1 tokens of context. Each window starts a fresh KV cache.

Rows:

* ``transformers bf16`` - the checkpoint as shipped (bf16 weights, bf16 activations), eager attention and
  eager experts on CPU. This is the reference for top-1 agreement.
* ``transformers fp32`` - the same weights upcast to float32.
* ``colibri f32 / none`` - ``--dtype float32 --quantize none``; the NumPy engine computes in float32, so
  this must track transformers fp32 to float32 rounding.
* ``colibri f16 / none`` - ``--dtype float16 --quantize none`` (isolates the float16 storage of the weights).
* ``colibri f16 / int8 row`` - the default conversion (float16 dense, int8 per-row experts).
* ``colibri f16 / int8 g32`` and ``g16`` - int8 per-group experts. Group 128 is not storable for this model:
  the format needs the group to divide both the hidden size (256) and the expert width (160), and 128 does
  not divide 160, so 32 is the largest valid group.

Per row: perplexity, its change against transformers bf16 and fp32, top-1 agreement of the argmax with the
transformers bf16 argmax (and with fp32), top-1 accuracy against the real next token, the largest per-token
change of the target log-probability against transformers fp32, wall time, and for colibri files the file
size and the quantization error stored in the file's metadata.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

MODEL_DIR = ROOT / "models" / "colibri-demo-moe"

# name, dtype, quantize, group_size
COLIBRI_VARIANTS = [
    ("colibri f32 / none", "float32", "none", None),
    ("colibri f16 / none", "float16", "none", None),
    ("colibri f16 / int8 row", "float16", "expert", None),
    ("colibri f16 / int8 g32", "float16", "expert", 32),
    ("colibri f16 / int8 g16", "float16", "expert", 16),
]


# --- data ---------------------------------------------------------------------------------------------
def held_out_ids(model_dir: Path = MODEL_DIR) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode((model_dir / "eval.txt").read_text(encoding="utf-8")).ids
    if not ids or ids[0] != 1:
        raise SystemExit("expected the tokenizer to prepend <|bos|> (id 1)")
    return ids


def windows(ids: list[int], window: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Non-overlapping windows of `window` predicted tokens: each array holds window + 1 ids."""
    n = (len(ids) - 1) // window
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // window))
    return [np.asarray(ids[w * window: w * window + window + 1], dtype=np.int64) for w in range(n)]


# --- scoring ------------------------------------------------------------------------------------------
class Scores:
    """Per-token results of one model over all windows."""

    def __init__(self) -> None:
        self.logprob: list[np.ndarray] = []   # log p(target) per position
        self.argmax: list[np.ndarray] = []
        self.first_logits: np.ndarray | None = None   # logits of window 0, for a direct logit comparison
        self.seconds = 0.0

    def add(self, logits: np.ndarray, targets: np.ndarray) -> None:
        logits = logits.astype(np.float32, copy=False)
        m = logits.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
        self.logprob.append(logits[np.arange(len(targets)), targets] - lse)
        self.argmax.append(logits.argmax(-1))
        if self.first_logits is None:
            self.first_logits = logits.copy()

    def cat(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.logprob), np.concatenate(self.argmax)


def score_transformers(wins: list[np.ndarray], dtype_name: str, batch: int, model_dir: Path = MODEL_DIR) -> Scores:
    import torch
    import transformers

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()
    out = Scores()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(wins), batch):
            chunk = np.stack(wins[i:i + batch])
            logits = model(torch.from_numpy(chunk[:, :-1])).logits.float().numpy()
            for row, ids in zip(logits, chunk):
                out.add(row, ids[1:])
    out.seconds = time.perf_counter() - t0
    return out


def score_colibri(path: Path, wins: list[np.ndarray], batch: int, **engine_options) -> Scores:
    """Every window of `wins` scored by the NumPy engine on `path` (engine_options: more EngineConfig fields)."""
    from colibri_format.runtime.engine import Engine, EngineConfig

    out = Scores()
    with Engine(path, EngineConfig(max_batch_size=batch, **engine_options)) as eng:
        t0 = time.perf_counter()
        for i in range(0, len(wins), batch):
            chunk = wins[i:i + batch]
            for logits, ids in zip(eng.logits([w[:-1].tolist() for w in chunk]), chunk):
                out.add(logits, ids[1:])
        out.seconds = time.perf_counter() - t0
        quant = eng.metadata.get("quantization") or {}
    out.quant = quant  # type: ignore[attr-defined]
    return out


def summarize(name: str, s: Scores, ref_bf16: Scores | None, ref_fp32: Scores | None,
              wins: list[np.ndarray]) -> dict:
    lp, am = s.cat()
    targets = np.concatenate([w[1:] for w in wins])
    nll = float(-lp.mean())
    row = {"name": name, "tokens": int(lp.size), "nll": nll, "ppl": math.exp(nll),
           "top1_acc": float((am == targets).mean()), "seconds": s.seconds,
           "tokens_per_s": lp.size / s.seconds if s.seconds else None}
    for tag, ref in (("bf16", ref_bf16), ("fp32", ref_fp32)):
        if ref is None:
            continue
        rlp, ram = ref.cat()
        row[f"top1_agree_{tag}"] = float((am == ram).mean())
        row[f"ppl_delta_vs_{tag}"] = math.exp(nll) / math.exp(float(-rlp.mean())) - 1.0
        row[f"max_abs_dlogprob_vs_{tag}"] = float(np.abs(lp - rlp).max())
        row[f"mean_abs_dlogprob_vs_{tag}"] = float(np.abs(lp - rlp).mean())
        row[f"max_abs_dlogit_w0_vs_{tag}"] = float(np.abs(s.first_logits - ref.first_logits).max())
    return row


# --- machine ------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    import tokenizers
    import torch
    import transformers
    return {"nproc": os.cpu_count(), "cpu": cpu, "loadavg_at_start": load, "python": platform.python_version(),
            "numpy": np.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "torch_threads": torch.get_num_threads(),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# --- output -------------------------------------------------------------------------------------------
def _pct(x: float | None, digits: int = 3) -> str:
    return "" if x is None else f"{100 * x:+.{digits}f}%"


def markdown(rows: list[dict]) -> str:
    head = ("| model | perplexity | vs tf bf16 | vs tf fp32 | top-1 agree (tf bf16) | top-1 agree (tf fp32) "
            "| top-1 acc | mean / max abs d logprob vs tf fp32 | quant max / mean rel err | file size | tokens/s |")
    lines = [head, "| --- " * (head.count("|") - 1) + "|"]
    for r in rows:
        q = r.get("quant_error")
        qs = f"{q['max_rel']:.5f} / {q['mean_rel']:.6f}" if q else "-"
        size = f"{r['file_bytes'] / 2**20:.2f} MiB" if r.get("file_bytes") else "-"
        lines.append(
            f"| {r['name']} | {r['ppl']:.4f} | {_pct(r.get('ppl_delta_vs_bf16'))} "
            f"| {_pct(r.get('ppl_delta_vs_fp32'))} "
            f"| {100 * r.get('top1_agree_bf16', float('nan')):.2f}% | {100 * r.get('top1_agree_fp32', float('nan')):.2f}% "
            f"| {100 * r['top1_acc']:.2f}% | {r.get('mean_abs_dlogprob_vs_fp32', float('nan')):.1e} / "
            f"{r.get('max_abs_dlogprob_vs_fp32', float('nan')):.1e} | {qs} | {size} "
            f"| {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="predicted tokens to use (rounded down to whole windows; default: all of eval.txt)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the transformers rows")
    p.add_argument("--workdir", default=None, help="where the .colibri files go (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    cmd = [os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": (f"OPENBLAS_NUM_THREADS={blas} " if blas else "") + "python " + " ".join(cmd),
            "git_head": git_head(), "machine": machine()}
    ids = held_out_ids()
    wins = windows(ids, args.window, args.tokens)
    info.update({"eval_tokens": len(ids), "window": args.window, "windows": len(wins),
                 "predicted_tokens": len(wins) * args.window})
    print(f"eval.txt: {len(ids)} tokens; {len(wins)} windows of {args.window} -> {len(wins) * args.window} "
          "predicted tokens", file=sys.stderr)

    scores: dict[str, Scores] = {}
    extra: dict[str, dict] = {}
    for tag in ("bf16", "fp32"):
        name = f"transformers {tag}"
        scores[name] = score_transformers(wins, tag, args.batch)
        print(f"{name}: {scores[name].seconds:.1f}s", file=sys.stderr)

    from colibri_format.convert.pipeline import convert

    with tempfile.TemporaryDirectory(prefix="colibri-quality-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, dtype, quantize, group in COLIBRI_VARIANTS:
            path = work / (name.replace("colibri ", "").replace(" / ", "-").replace(" ", "-") + ".colibri")
            t0 = time.perf_counter()
            summary = convert(MODEL_DIR, path, dtype=dtype, quantize=quantize, group_size=group, resume=False)
            s = scores[name] = score_colibri(path, wins, args.batch)
            q = getattr(s, "quant", {}) or {}
            err = q.get("error") or None
            extra[name] = {"file_bytes": path.stat().st_size, "convert_seconds": time.perf_counter() - t0 - s.seconds,
                           "expert_format": summary.expert_format, "dense_dtype": summary.dense_dtype,
                           "group_size": q.get("group_size"),
                           "quant_error": None if err is None else {"max_rel": err["max_rel"],
                                                                   "mean_rel": err["mean_rel"]}}
            print(f"{name}: {s.seconds:.1f}s", file=sys.stderr)

    ref_bf16, ref_fp32 = scores["transformers bf16"], scores["transformers fp32"]
    rows = []
    for name, s in scores.items():
        row = summarize(name, s, ref_bf16, ref_fp32, wins)
        row.update(extra.get(name, {}))
        rows.append(row)
    rows[0]["file_bytes"] = (MODEL_DIR / "model.safetensors").stat().st_size   # the shipped bf16 checkpoint
    table = markdown(rows)
    print(table)
    print(f"\n{info['predicted_tokens']} predicted tokens ({info['windows']} windows of {args.window}), "
          f"{info['machine']['nproc']} cores, {info['machine']['cpu']}, {info['date']}")
    if args.out:
        Path(args.out).write_text(json.dumps({**info, "rows": rows, "markdown": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
