"""Decode speed of gpt-oss-20b- and MiniMax-M2-shaped files on the CUDA engine (issue 17).

    PYTHONPATH=. python benchmarks/new_arch_decode.py --out OUT_DIR [--shapes gpt_oss_20b,minimax_m2] [--batches 1,8]
    PYTHONPATH=. python benchmarks/new_arch_decode.py --out OUT_DIR --tiny --device cpu     # smoke test, no GPU

Each shape is a synthetic random file (`synthetic.write_synthetic(reuse_expert=True)`: bf16 dense, int8 per-row
experts) written to /dev/shm/<shape>.colibri when missing and deleted after its run unless --keep:
- gpt_oss_20b: full depth, every width and the vocabulary of openai/gpt-oss-20b (24 layers, 32 experts, top-4,
  hidden = expert intermediate = 2880, 64 query / 8 kv heads of 64, vocabulary 201088), with everything its
  experts and attention compute: q/k/v/o biases, attention sinks, a window of 128 on the even layers, YaRN, the biased
  router (top-k of logits + bias), per-expert biases and the clamped SwiGLU (the `*_extras` expert kernels).
  About 23 GB.
- minimax_m2: MiniMax-M2's widths and vocabulary (256 experts, top-8, hidden 3072, expert intermediate 1536, 48
  query / 8 kv heads of 128, full-projection q/k norms, partial RoPE 64 of 128, sigmoid routing with a selection
  bias) but MINIMAX_LAYERS of its 62 layers, so the file (about 43 GB) fits beside the engine; the output states
  the depth.
Every expert is resident. `runtime.cuda.bench.run_bench` measures decode at each batch (CUDA graphs), the weight
bytes a step reads (dense matrices as stored + the distinct experts the step's profile touched) and the roofline
share at its measured device copy rate; the table adds the share at the H200's nominal HBM_COPY_BPS.
With --device cpu (the NumPy engine: a check that the script and the files work) `bench.decode_bench` times the
steps and the expert bytes are the upper bound min(E, batch * top_k) experts a layer.
Writes new_arch_decode.json and new_arch_decode.txt to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.synthetic_decode import HBM_COPY_BPS, cpu_decode, cuda_decode, ensure_file, shaped_model

MINIMAX_LAYERS = 11            # of 62: experts 11 x 3.6 GB, with the dense tensors about 43 GB
GPT_OSS_YARN = {"type": "yarn", "theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096.0}

SHAPES = {  # name -> (kind, widths); the "tiny" ones have the same features at toy widths (the smoke test)
    "gpt_oss_20b": ("gpt_oss", dict(vocab=201088, hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64,
                                    experts=32, top_k=4, expert_inter=2880, window=128)),
    "minimax_m2": ("minimax_m2", dict(vocab=200064, hidden=3072, layers=MINIMAX_LAYERS, heads=48, kv_heads=8,
                                      head_dim=128, experts=256, top_k=8, expert_inter=1536)),
    "gpt_oss_tiny": ("gpt_oss", dict(vocab=512, hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64,
                                     experts=8, top_k=4, expert_inter=128, window=8)),
    "minimax_m2_tiny": ("minimax_m2", dict(vocab=512, hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64,
                                           experts=16, top_k=8, expert_inter=64)),
}
FULL_LAYERS = {"gpt_oss_20b": 24, "minimax_m2": 62}


def log(msg: str) -> None:
    print(f"[new_arch_decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_of(kind: str, shape: dict) -> dict:
    """The metadata `model` object of a shape (spec-checked)."""
    widths = {k: shape[k] for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "experts", "top_k",
                                    "expert_inter")}
    if kind == "gpt_oss":
        return shaped_model(widths, head_dim=shape["head_dim"], qkv_bias=True, o_bias=True, attention_sinks=True,
                            sliding_window=shape["window"], sliding_layers=list(range(0, shape["layers"], 2)),
                            rope=dict(GPT_OSS_YARN), max_position_embeddings=131072,
                            router={"scoring": "softmax", "order": "topk_softmax", "normalize_topk": False,
                                    "bias": True, "scale": 1.0},
                            expert_bias=True, expert_act={"alpha": 1.702, "limit": 7.0, "up_offset": 1.0})
    return shaped_model(widths, {"qk_norm": "full"}, head_dim=shape["head_dim"], rms_norm_eps=1e-6,
                        max_position_embeddings=196608,
                        rope={"type": "default", "theta": 5e6, "partial_rotary_factor": 0.5},
                        router={"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True,
                                "scale": 1.0})


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':<16}{'layers':>10}{'batch':>6}{'tokens/s':>10}{'ms/step':>9}{'weights MB':>12}"
             f"{'roof tok/s':>11}{'share':>7}  graph"]
    for r in rows:
        roof = r["batch"] * HBM_COPY_BPS / r["weight_bytes_per_step"]
        lines.append(f"{r['shape']:<16}{r['layers']:>10}{r['batch']:>6}{r['tokens_per_s']:>10.1f}"
                     f"{r['ms_per_step']:>9.2f}{r['weight_bytes_per_step'] / 1e6:>12.1f}{roof:>11.1f}"
                     f"{r['tokens_per_s'] / roof:>7.1%}  {r['graph']}")
    lines.append(f"roofline: weight bytes a step reads at {HBM_COPY_BPS / 1e12:.1f} TB/s (H200 device copy rate)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", help="comma list (default gpt_oss_20b,minimax_m2; with --tiny their tiny forms)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--iters", type=int, default=64, help="timed decode steps a batch")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy widths with the same features (a check of the script)")
    ap.add_argument("--dir", default="/dev/shm", help="where the files are written")
    ap.add_argument("--keep", action="store_true", help="keep the files after their run")
    args = ap.parse_args()
    shapes = (args.shapes or ("gpt_oss_tiny,minimax_m2_tiny" if args.tiny else "gpt_oss_20b,minimax_m2")).split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "hbm_copy_bps": HBM_COPY_BPS,
                    "files": {}, "rows": []}
    for name in shapes:
        kind, shape = SHAPES[name]
        path = Path(args.dir) / f"{name}.colibri"
        result["files"][name] = ensure_file(path, model_of(kind, shape), log)
        try:
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"shape": name, "batch": batch,
                       "layers": f"{shape['layers']} of {FULL_LAYERS.get(name, shape['layers'])}",
                       **(cuda_decode(path, batch, args.iters, log) if args.device == "cuda"
                          else cpu_decode(path, batch, args.iters))}
                result["rows"].append(row)
                (out / "new_arch_decode.json").write_text(json.dumps(result, indent=1, default=str))
        finally:
            if not args.keep:
                path.unlink()
    text = table(result["rows"])
    (out / "new_arch_decode.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
