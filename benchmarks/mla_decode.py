"""Decode speed of multi-head latent attention (DeepSeek-V3 family) on the CUDA engine, and its cache per token.

    PYTHONPATH=. python benchmarks/mla_decode.py --out OUT_DIR [--shapes deepseek_v3,moonlight] [--batches 1,8]
    PYTHONPATH=. python benchmarks/mla_decode.py --out OUT_DIR --tiny --device cpu     # a check of the script

Shapes (random weights from `synthetic.write_synthetic(reuse_expert=True)`, bf16 dense tensors, int8 experts, written
to /dev/shm and deleted after their run):
- deepseek_v3: DeepSeek-V3's widths and vocabulary (../shared/reference/architectures_2026.md) over 5 layers, its
  first 3 dense (first_k_dense_replace 3) and 2 MoE (256 experts, top-8 in 8 groups keep 4, one shared expert);
- moonlight: Moonlight-16B-A3B at full depth, widths from its published config.json (hidden 2048, 27 layers, the
  first dense with intermediate 11264, 64 experts of 1408 top-6 plus 2 shared, 16 heads, no q LoRA, kv_lora_rank
  512, qk 128 + 64, v 128, vocabulary 163840, rope theta 50000; cross-checked with Megatron-Bridge's Moonlight
  config in the code corpus).
Per shape and batch: `runtime.cuda.bench.run_bench` (decode tokens/s, graph status, a 512-token prefill, the roofline
against the measured copy rate), the roofline share against a 4.0e12 B/s HBM copy rate, and the KV cache per token:
the latent (kv_lora_rank + qk_rope_head_dim values a layer) against the per-head keys and values a cache without
latent compression would hold for the same heads (num_heads x (qk_nope + qk_rope + v_head_dim) values a layer).
`--device cpu` runs the same steps on the NumPy engine (`bench.decode_bench`; no copy ceiling, no kernel profile),
with `--tiny` on shrunk widths. Writes mla_decode.json and mla_decode.txt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.synthetic_decode import HBM_COPY_BPS, write_timed

CACHE_VALUE_BYTES = 4           # the engine keeps its caches in float32
PREFILL_TOKENS = 512

# name -> (layers, dense leading layers, model fields)
SHAPES = {
    "deepseek_v3": (5, 3, dict(vocab=129280, hidden=7168, heads=128, experts=256, top_k=8, expert_inter=2048,
                               dense_inter=18432, shared=2048, groups=(8, 4), scale=2.5, eps=1e-6, theta=10000.0,
                               mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                        v_head_dim=128))),
    "moonlight": (27, 1, dict(vocab=163840, hidden=2048, heads=16, experts=64, top_k=6, expert_inter=1408,
                              dense_inter=11264, shared=2 * 1408, groups=(1, 1), scale=2.446, eps=1e-5, theta=50000.0,
                              mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128))),
    "tiny": (3, 1, dict(vocab=256, hidden=64, heads=4, experts=8, top_k=2, expert_inter=32, dense_inter=96,
                        shared=32, groups=(2, 1), scale=2.5, eps=1e-6, theta=10000.0,
                        mla=dict(q_lora_rank=32, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                 v_head_dim=16))),
}


def log(msg: str) -> None:
    print(f"[mla_decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mla_model(name: str) -> dict:
    """The `model` object of a shape: synthetic_model's fields with the DeepSeek-V3 graph's."""
    from colibri_format.synthetic import synthetic_model

    layers, dense, f = SHAPES[name]
    m = f["mla"]
    model = synthetic_model(vocab=f["vocab"], hidden=f["hidden"], layers=layers, heads=f["heads"],
                            kv_heads=f["heads"], experts=f["experts"], top_k=f["top_k"],
                            expert_inter=f["expert_inter"], dense_layers=tuple(range(dense)))
    head_dim = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    model.update(head_dim=head_dim, rms_norm_eps=f["eps"], max_position_embeddings=4096,
                 rope={"type": "default", "theta": f["theta"]}, dense_intermediate_size=f["dense_inter"],
                 router={"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": True, "bias": True,
                         "scale": f["scale"], "n_group": f["groups"][0], "topk_group": f["groups"][1]},
                 shared_expert={"intermediate_size": f["shared"], "gate": "none"},
                 mla={**m, "latent_norm_eps": f["eps"]})
    model["multipliers"] = {**model["multipliers"], "attention": head_dim ** -0.5}
    return model


def cache_bytes_per_token(model: dict) -> dict:
    """KV-cache bytes per token over all layers: the latent cache against per-head keys and values."""
    m, layers, heads = model["mla"], model["num_layers"], model["num_attention_heads"]
    latent = layers * (m["kv_lora_rank"] + m["qk_rope_head_dim"])
    per_head = layers * heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"] + m["v_head_dim"])
    return {"latent_values": latent, "per_head_kv_values": per_head, "latent_bytes": CACHE_VALUE_BYTES * latent,
            "per_head_kv_bytes": CACHE_VALUE_BYTES * per_head, "ratio": per_head / latent}


def expert_bytes_estimate(eng, batch: int) -> int:
    """Expert bytes a decode step reads at most: min(experts, batch x top_k) blobs per MoE layer."""
    a = eng.args
    return len(a.moe_layers) * min(eng.reader.model["num_experts"], batch * a.top_k) * eng.experts.blob_size


def open_engine(path: Path, device: str, max_batch: int, iters: int):
    """One engine per shape for all its batches (the file is loaded once), configured as run_bench would."""
    from colibri_format.runtime.engine import Engine, EngineConfig

    cfg = EngineConfig(device=device, max_batch_size=max_batch, max_seq_len=max(PREFILL_TOKENS, 16 + 8 + iters + 1),
                       verify="never")
    return Engine(path, cfg)


def measure(eng, path: Path, batch: int, iters: int) -> dict:
    """run_bench on the GPU; on the CPU the same decode loop (bench.decode_bench) without ceilings or profile."""
    import numpy as np

    from colibri_format.runtime.cuda import bench

    if eng.be.name == "cuda":
        r = bench.run_bench(path, batch_size=batch, seq_len=PREFILL_TOKENS, num_iters=iters, warmup_iters=8,
                            engine=eng)
        log("\n" + bench.render(r))
        return r
    decode, _ = bench.decode_bench(eng, batch, iters, 8, np.random.default_rng(0))
    weights = bench.dense_weight_bytes(eng) + expert_bytes_estimate(eng, batch)
    return {"decode": decode, "roofline": {"weight_bytes_per_step": weights, "estimated": True}}


def summary(name: str, model: dict, batch: int, r: dict) -> dict:
    tps, weights = r["decode"]["tokens_per_s"], r["roofline"]["weight_bytes_per_step"]
    roof = batch * HBM_COPY_BPS / weights
    return {"shape": name, "layers": model["num_layers"], "batch": batch, "tokens_per_s": tps,
            "ms_per_step": r["decode"]["ms_per_step"], "graph": r["decode"]["graph"],
            "weight_bytes_per_step": weights, "roofline_tokens_per_s_at_4TBps": roof, "share_at_4TBps": tps / roof,
            "share_measured_copy": r["roofline"].get("share_of_roofline"),
            "prefill_tokens_per_s": (r.get("prefill") or {}).get("tokens_per_s")}


def table(rows: list[dict], caches: dict) -> str:
    lines = [f"{'shape':<12}{'layers':>7}{'batch':>6}{'tok/s':>10}{'ms/step':>9}{'GB/step':>9}{'roof@4TB/s':>11}"
             f"{'share':>7}  graph"]
    for s in rows:
        lines.append(f"{s['shape']:<12}{s['layers']:>7}{s['batch']:>6}{s['tokens_per_s']:>10.1f}"
                     f"{s['ms_per_step']:>9.3f}{s['weight_bytes_per_step'] / 1e9:>9.3f}"
                     f"{s['roofline_tokens_per_s_at_4TBps']:>11.1f}{s['share_at_4TBps']:>7.1%}  {s['graph']}")
    lines.append(f"{'shape':<12}{'latent B/token':>16}{'per-head KV B/token':>21}{'ratio':>8}  (float32 caches)")
    for name, c in caches.items():
        lines.append(f"{name:<12}{c['latent_bytes']:>16}{c['per_head_kv_bytes']:>21}{c['ratio']:>8.1f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="deepseek_v3,moonlight", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--iters", type=int, default=64, help="timed decode steps per batch")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape only (checks the script)")
    ap.add_argument("--dir", default="/dev/shm", help="where the random files are written (and deleted)")
    args = ap.parse_args()
    shapes = ["tiny"] if args.tiny else [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "hbm_bytes_per_s": HBM_COPY_BPS,
                    "shapes": {}, "summary": [], "cache_per_token": {}}
    for name in shapes:
        model = mla_model(name)
        result["cache_per_token"][name] = cache_bytes_per_token(model)
        path = Path(args.dir) / f"mla_{name}.colibri"
        write_timed(path, model, log)
        batches = [int(b) for b in args.batches.split(",")]
        try:
            with open_engine(path, args.device, max(batches), args.iters) as eng:
                runs = {}
                for batch in batches:
                    runs[batch] = measure(eng, path, batch, args.iters)
                    result["summary"].append(summary(name, model, batch, runs[batch]))
            result["shapes"][name] = {"model": model, "runs": runs}
        finally:
            path.unlink()
        (out / "mla_decode.json").write_text(json.dumps(result, indent=1, default=str))
    text = table(result["summary"], result["cache_per_token"])
    (out / "mla_decode.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
