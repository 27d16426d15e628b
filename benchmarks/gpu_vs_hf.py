"""colibri's CUDA engine against transformers (bf16) on the same random weights, on one GPU.

For each shape (Mixtral-8x7B, Qwen3-30B-A3B, OLMoE-1B-7B: the published per-layer dimensions, with FEWER
LAYERS, see SHAPES) a random model is built by transformers in bf16 on the GPU and timed there first:

* decode tokens/s at batch 1 and 32: greedy `generate`, (t(1 + N new tokens) - t(1 new token)) / N, after a
  16-token prompt (HF default attention and experts implementations);
* prefill: one forward pass over 512 tokens (median of 3 after a warm-up).

The same model is then `save_pretrained` (safetensors, bf16) to tmpfs, converted by `colibri convert`'s
pipeline to int8 experts (bf16 dense), opened once as `Engine(path, EngineConfig(device="cuda"))` and timed by
`colibri_format.runtime.cuda.bench.run_bench(..., engine=eng)`: decode at batch 1 and 32 (CUDA-graph replay),
512-token prefill, per-kernel GPU times and the roofline (weight bytes touched per step of THIS reduced model /
the measured device copy bandwidth).

Run from the repository root (the benchmark imports the library, nothing else):

    PYTHONPATH=. python benchmarks/gpu_vs_hf.py --out results.json [--shapes mixtral,qwen3,olmoe] [--dry-run]

`--dry-run` runs the whole flow on the CPU with tiny dimensions: HF on the CPU, the colibri engine as
`EngineConfig(device="cpu")` (the NumPy backend), timed through the engine's public step API (`run_bench`
measures CUDA kernels and copy ceilings, which the NumPy backend has not, so no kernel table and no roofline
there). It checks the script, not speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_format.runtime.engine import Engine, EngineConfig

# name: (config class, model class, config kwargs, layers run, layers of the real model)
SHAPES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                     max_position_embeddings=4096), 2, 32),
    "qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
              dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                   num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                   num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096), 4, 48),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
                   num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                   max_position_embeddings=4096), 4, 16),
}
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64)
PROMPT = 16


def log(msg: str) -> None:
    print(f"[gpu_vs_hf {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_hf(name: str, dry: bool):
    import torch
    import transformers

    cfg_cls, model_cls, kw, layers, _ = SHAPES[name]
    kw = {**kw, "num_hidden_layers": layers}
    if dry:
        kw = {**kw, **{k: v for k, v in TINY.items() if k in kw}}
    if name != "qwen3":
        kw.pop("head_dim", None)
    config = getattr(transformers, cfg_cls)(**kw)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):      # the tiny vocabulary of --dry-run
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= config.vocab_size:
            setattr(config, name, config.vocab_size - 1)
    torch.manual_seed(0)
    device = "cpu" if dry else "cuda"
    with torch.device(device):
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    return model.eval(), device


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def hf_generate_time(model, device: str, batch: int, new_tokens: int) -> float:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device=device)
    mask = torch.ones_like(ids)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - t0


def hf_bench(model, device: str, n: int, seq_len: int) -> dict:
    import torch

    res = {}
    for batch in (1, 32):
        hf_generate_time(model, device, batch, 2)                       # warm-up
        t1 = min(hf_generate_time(model, device, batch, 1) for _ in range(2))
        tn = min(hf_generate_time(model, device, batch, 1 + n) for _ in range(2))
        res[f"decode_b{batch}_tokens_per_s"] = batch * n / max(tn - t1, 1e-9)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    times = []
    with torch.no_grad():
        for _ in range(4):
            _sync(device)
            t0 = time.perf_counter()
            model(ids)
            _sync(device)
            times.append(time.perf_counter() - t0)
    res["prefill_ms"] = 1e3 * statistics.median(times[1:])
    res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    return res


def host_bench(eng: Engine, batch: int, seq_len: int, n: int, warmup: int, prefill: bool, seed: int = 0) -> dict:
    """run_bench's prefill and decode phases alone, for a backend without CUDA events (device="cpu"): no kernel
    profile, no copy ceiling, so no roofline."""
    from colibri_format.runtime.cuda.bench import decode_bench, prefill_bench

    rng = np.random.default_rng(seed)
    out: dict = {"roofline": {"roofline_tokens_per_s": None, "share_of_roofline": None}}
    if prefill:
        out["prefill"] = prefill_bench(eng, seq_len, rng)
    out["decode"] = decode_bench(eng, batch, n, warmup, rng, context=PROMPT)[0]
    return out


def colibri_bench(path: Path, n: int, seq_len: int, device: str) -> dict:
    cfg = EngineConfig(device=device, max_batch_size=32, max_seq_len=max(seq_len, 64 + n))
    with Engine(path, cfg) as eng:
        if device == "cuda":
            from colibri_format.runtime.cuda.bench import run_bench

            b1 = run_bench(path, batch_size=1, seq_len=seq_len, num_iters=n, warmup_iters=4, engine=eng)
            b32 = run_bench(path, batch_size=32, seq_len=seq_len, num_iters=n, warmup_iters=2, engine=eng,
                            prefill=False)
        else:
            b1 = host_bench(eng, 1, seq_len, n, 4, prefill=True)
            b32 = host_bench(eng, 32, seq_len, n, 2, prefill=False)
    return {"device": device, "b1": b1, "b32": b32}


def run_shape(name: str, args, work: Path) -> dict:
    import torch

    from colibri_format.convert.pipeline import convert

    _, _, kw, layers, full_layers = SHAPES[name]
    log(f"{name}: building a {layers}-layer random bf16 model")
    model, device = build_hf(name, args.dry_run)
    out = {"shape": name, "layers": layers, "layers_of_real_model": full_layers}
    t0 = time.perf_counter()
    out["hf"] = hf_bench(model, device, args.new_tokens, args.seq_len)
    log(f"{name}: transformers {json.dumps(out['hf'])} ({time.perf_counter() - t0:.1f} s)")
    hf_dir, path = work / f"{name}-hf", work / f"{name}.colibri"
    model.save_pretrained(hf_dir)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    convert(hf_dir, path, dtype="bfloat16", quantize="expert", workers=args.workers, verify=False)
    out["convert_seconds"] = time.perf_counter() - t0
    shutil.rmtree(hf_dir)
    log(f"{name}: converted in {out['convert_seconds']:.1f} s ({path.stat().st_size / 1e9:.2f} GB)")
    try:
        out["colibri"] = colibri_bench(path, args.new_tokens, args.seq_len, "cpu" if args.dry_run else "cuda")
    finally:
        path.unlink()
    return out


def summary_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if "colibri" not in r:
            continue
        c1, c32, hf = r["colibri"]["b1"], r["colibri"]["b32"], r["hf"]
        rows.append({
            "shape": f"{r['shape']} ({r['layers']} of {r['layers_of_real_model']} layers)",
            "colibri_b1": c1["decode"]["tokens_per_s"], "hf_b1": hf["decode_b1_tokens_per_s"],
            "speedup_b1": c1["decode"]["tokens_per_s"] / hf["decode_b1_tokens_per_s"],
            "roofline_b1": c1["roofline"]["roofline_tokens_per_s"], "share_b1": c1["roofline"]["share_of_roofline"],
            "colibri_b32": c32["decode"]["tokens_per_s"], "hf_b32": hf["decode_b32_tokens_per_s"],
            "roofline_b32": c32["roofline"]["roofline_tokens_per_s"],
            "colibri_prefill_ms": c1["prefill"]["ms"], "hf_prefill_ms": hf["prefill_ms"],
            "graph_b1": c1["decode"]["graph"], "graph_b32": c32["decode"]["graph"],
            "host_ms_b1": c1["decode"]["host_ms_per_step"],
        })
    return rows


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    print("| shape | colibri b1 tok/s | HF b1 | x | roofline b1 | share | colibri b32 | HF b32 | roofline b32 "
          "| prefill 512 ms colibri / HF |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['colibri_b1']:.1f} | {r['hf_b1']:.1f} | {r['speedup_b1']:.1f} | "
              f"{_fmt(r['roofline_b1'], '.0f')} | {_fmt(r['share_b1'], '.0%')} | {r['colibri_b32']:.0f} | "
              f"{r['hf_b32']:.0f} | {_fmt(r['roofline_b32'], '.0f')} | "
              f"{r['colibri_prefill_ms']:.1f} / {r['hf_prefill_ms']:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,qwen3,olmoe")
    ap.add_argument("--out", default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--work-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        args.new_tokens, args.seq_len = 3, 16
    results = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for name in args.shapes.split(","):
            try:
                results.append(run_shape(name, args, Path(tmp)))
            except Exception as exc:  # noqa: BLE001 -- one shape failing must not lose the others
                log(f"{name}: FAILED {type(exc).__name__}: {exc}")
                results.append({"shape": name, "error": f"{type(exc).__name__}: {exc}"})
            if args.out:
                Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results,
                                                      "summary": summary_rows(results)}, indent=1))
    print_table(summary_rows(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
