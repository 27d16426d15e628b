"""How well the next layer's router, applied to the current layer's hidden state, predicts the next layer's experts:
recall and precision on the bundled demo model's real routing (the engine's `prefetch=True` counters).

Run from the repository root (the benchmark imports the library, nothing else):

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python benchmarks/prefetch_accuracy.py [--tokens 512] [--out F.json] \
        [--model DIR]

Converts `models/colibri-demo-moe` (float16 dense, int8 experts) into a temporary folder, then feeds the same
four held-out modules of `eval.txt` as benchmarks/real_traces.py (teacher forcing: the first `--tokens` tokens of
each module, one token per decode step through the NumPy engine) with experts paged (`max_cached_experts` at
40% of the experts, global) and `prefetch=True`. Per decode pass and MoE layer after the first, the pool counts
the experts the prediction named (P), the experts actually routed (A) and both (P & A): recall = |P & A| / |A|,
precision = |P & A| / |P| (`PagingCounters`). Baseline: a random guess of as many experts as the model routes
has precision top_k / num_experts. --model: another Hugging Face checkpoint with the same `eval.txt` layout beside
its tokenizer (e.g. docs/quality.md's second, wider model).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_traces import MODEL_DIR, MODULES, module_ids  # noqa: E402


def measure(model: Path, passages: list[list[int]], tokens: int) -> dict:
    from colibri_format.runtime.engine import Engine, EngineConfig

    with Engine(model) as probe:
        m = probe.reader.model
        total = len(m["moe_layers"]) * m["num_experts"]
    rows = []
    cfg = EngineConfig(max_cached_experts=max(1, int(0.4 * total)), prefetch=True)
    for name, ids in zip(MODULES, passages):
        with Engine(model, cfg) as eng:
            seq = np.asarray(ids[:tokens])
            runner = eng.decode_runner(1, len(seq))
            c0 = eng.experts.counters.as_dict()
            for pos, tok in enumerate(seq):
                runner.step(np.array([tok]), np.array([pos]))
            eng.experts.flush()
            c = {k: v - c0[k] for k, v in eng.experts.counters.as_dict().items()
                 if k in ("predicted", "predicted_correct", "actual_next")}
        rows.append({"module": name, "passes": len(seq), **c,
                     "recall": c["predicted_correct"] / c["actual_next"],
                     "precision": c["predicted_correct"] / c["predicted"]})
        print(f"{name}: recall {rows[-1]['recall']:.3f}, precision {rows[-1]['precision']:.3f}", file=sys.stderr)
    tot = {k: sum(r[k] for r in rows) for k in ("predicted", "predicted_correct", "actual_next")}
    return {"rows": rows, "recall": tot["predicted_correct"] / tot["actual_next"],
            "precision": tot["predicted_correct"] / tot["predicted"],
            "random_guess_precision": m["top_k"] / m["num_experts"], "experts": m["num_experts"], "top_k": m["top_k"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", type=Path, default=MODEL_DIR, help="the checkpoint (default: the bundled demo model)")
    args = ap.parse_args(argv)
    if not all((args.model / name).is_file() for name in ("config.json", "tokenizer.json", "eval.txt")):
        ap.error(f"--model {args.model}: needs config.json, tokenizer.json and eval.txt")
    from colibri_format.convert.pipeline import convert

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="colibri-prefetch-") as tmp:
        model = Path(tmp) / "demo.colibri"
        convert(args.model, model, dtype="float16", quantize="expert", resume=False)
        result = measure(model, module_ids(model_dir=args.model), args.tokens)
    result.update(date=time.strftime("%Y-%m-%d %H:%M"), tokens=args.tokens, seconds=time.perf_counter() - t0,
                  model=str(args.model))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
