"""Decode speed of a full-depth Qwen3.6-35B-A3B-shaped file on the CUDA engine (issue 18: Gated DeltaNet + gated
attention layers, the recurrent state beside the KV cache).

    PYTHONPATH=. python benchmarks/hybrid_decode.py --out OUT_DIR [--cases resident,half,24GiB] [--batches 1,8] [--keep]
    PYTHONPATH=. python benchmarks/hybrid_decode.py --out OUT_DIR --tiny --device cpu     # smoke test, no GPU

The file is synthetic and random (`synthetic.write_synthetic(reuse_expert=True)`: bf16 dense, int8 per-row experts),
written to --dir (default /dev/shm)/qwen36_35b_a3b.colibri when missing (about 36 GB) and deleted after the run
unless --keep. Shape (Qwen/Qwen3.6-35B-A3B's config, ../shared/reference/architectures_2026.md): 40 layers in ten
groups of three Gated DeltaNet layers (16 key heads and 32 value heads of 128, conv kernel 4) and one gated full
attention layer (16 query / 2 kv heads of 256, per-head q/k norms, partial RoPE 0.25), 256 experts top-8 of
intermediate 512 and a sigmoid-gated shared expert of 512 in every layer, hidden 2048, vocabulary 248,320.
Cases: every expert resident; the expert cache at half the experts (max_cached_experts, lrfu); a 24 GiB device budget
(gpu_memory, the user of the issue). Routing is the random router's (near-uniform: little reuse, the paging worst
case). `runtime.cuda.bench.run_bench` measures decode at each batch (CUDA graphs), the weight bytes a step reads (dense
matrices as stored + the distinct experts the step's profile touched) and the roofline share at its measured copy
rate; the table adds the share at the H200's nominal HBM_COPY_BPS, and the recurrent state's traffic a step (each
sequence's delta-rule state read twice and written once per Gated DeltaNet layer), which weight rooflines leave out.
With --device cpu (the NumPy engine: a check of the script and the file) `bench.decode_bench` times the steps and the
expert bytes are the upper bound min(E, batch * top_k) experts a layer.
Writes hybrid_decode.json and hybrid_decode.txt to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.synthetic_decode import HBM_COPY_BPS, cpu_decode, cuda_decode, ensure_file, shaped_model

BUDGET = "24GiB"               # the gpu_memory case
SHAPES = {  # name -> widths; "tiny": the same layer pattern and features at toy widths (the smoke test)
    "qwen36_35b_a3b": dict(vocab=248320, hidden=2048, layers=40, heads=16, kv_heads=2, head_dim=256, experts=256,
                           top_k=8, expert_inter=512, shared=512, key_heads=16, value_heads=32, key_dim=128,
                           value_dim=128),
    "tiny": dict(vocab=512, hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, experts=16, top_k=4,
                 expert_inter=64, shared=64, key_heads=2, value_heads=4, key_dim=32, value_dim=32),
}
CASES = ("resident", "half", BUDGET)


def log(msg: str) -> None:
    print(f"[hybrid_decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_of(shape: dict) -> dict:
    """The metadata `model` object of a shape (spec-checked): every fourth layer full attention, the rest linear."""
    widths = {k: shape[k] for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "experts", "top_k",
                                    "expert_inter", "shared")}
    return shaped_model(
        widths, {"qk_norm": "per_head"}, head_dim=shape["head_dim"], rms_norm_eps=1e-6,
        max_position_embeddings=262144, attention_gate=True,
        rope={"type": "default", "theta": 1e7, "partial_rotary_factor": 0.25},
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape["layers"])],
        linear_attention={"num_key_heads": shape["key_heads"], "num_value_heads": shape["value_heads"],
                          "key_head_dim": shape["key_dim"], "value_head_dim": shape["value_dim"], "conv_kernel": 4})


def state_bytes_per_step(model: dict, batch: int) -> int:
    """Recurrent-state traffic of a decode step: per sequence and Gated DeltaNet layer the fp32 [nv, dk, dv] state read
    twice and written once (deltanet_recurrent), the conv state read and written once."""
    lin = model["linear_attention"]
    delta = 4 * lin["num_value_heads"] * lin["key_head_dim"] * lin["value_head_dim"]
    channels = 2 * lin["num_key_heads"] * lin["key_head_dim"] + lin["num_value_heads"] * lin["value_head_dim"]
    conv = 4 * channels * (lin["conv_kernel"] - 1)
    layers = sum(k == "linear_attention" for k in model["layer_types"])
    return batch * layers * (3 * delta + 2 * conv)


def cache_options(case: str, model: dict) -> dict:
    """EngineConfig / run_bench keywords of a case."""
    if case == "half":
        return {"max_cached_experts": len(model["moe_layers"]) * model["num_experts"] // 2}
    if case == BUDGET:
        return {"gpu_memory": BUDGET}
    return {}


def run(path, batch: int, iters: int, device: str, cache: dict) -> dict:
    """One decode measurement: a paged case warms its cache longer; batch 1 also times a prefill."""
    if device == "cuda":
        return cuda_decode(path, batch, iters, log, warmup_iters=32 if cache else 8, prefill=batch == 1, **cache)
    return cpu_decode(path, batch, iters, **cache)


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':<16}{'cache':>10}{'batch':>6}{'tokens/s':>10}{'ms/step':>9}{'hit':>7}{'weights MB':>12}"
             f"{'state MB':>10}{'roof tok/s':>11}{'share':>7}{'+state':>8}  graph"]
    for r in rows:
        roof = r["batch"] * HBM_COPY_BPS / r["weight_bytes_per_step"]
        with_state = r["batch"] * HBM_COPY_BPS / (r["weight_bytes_per_step"] + r["state_bytes_per_step"])
        hit = f"{r['paging']['hit_rate']:.0%}" if r.get("paging") else "-"
        lines.append(f"{r['shape']:<16}{r['case']:>10}{r['batch']:>6}{r['tokens_per_s']:>10.1f}{r['ms_per_step']:>9.2f}"
                     f"{hit:>7}{r['weight_bytes_per_step'] / 1e6:>12.1f}{r['state_bytes_per_step'] / 1e6:>10.1f}"
                     f"{roof:>11.1f}{r['tokens_per_s'] / roof:>7.1%}{r['tokens_per_s'] / with_state:>8.1%}  "
                     f"{r['graph']}")
    lines.append(f"roofline: weight bytes a step reads at {HBM_COPY_BPS / 1e12:.1f} TB/s (H200 device copy rate); "
                 "+state: with the recurrent state's traffic added")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--iters", type=int, default=64, help="timed decode steps a batch")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy widths, same layer pattern (a check of the script)")
    ap.add_argument("--dir", default="/dev/shm", help="where the file is written")
    ap.add_argument("--keep", action="store_true", help="keep the file after the run (for another --cases run)")
    args = ap.parse_args()
    cases = args.cases.split(",")
    if set(cases) - set(CASES):
        ap.error(f"unknown cases {sorted(set(cases) - set(CASES))}; known: {', '.join(CASES)}")
    name = "tiny" if args.tiny else "qwen36_35b_a3b"
    model = model_of(SHAPES[name])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(args.dir) / f"{name}.colibri"
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "hbm_copy_bps": HBM_COPY_BPS,
                    "file": ensure_file(path, model, log), "rows": []}
    try:
        for case in cases:
            for batch in (int(b) for b in args.batches.split(",")):
                if case == BUDGET and args.tiny:
                    continue                # a toy file fits any budget: nothing is paged
                row = {"shape": name, "case": case, "batch": batch,
                       "state_bytes_per_step": state_bytes_per_step(model, batch),
                       **run(path, batch, args.iters, args.device, cache_options(case, model))}
                result["rows"].append(row)
                (out / "hybrid_decode.json").write_text(json.dumps(result, indent=1, default=str))
    finally:
        if not args.keep:
            path.unlink()
    text = table(result["rows"])
    (out / "hybrid_decode.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
