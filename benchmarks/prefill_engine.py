"""Full-depth prefill on the CUDA engine with each prefill opt-in, and transformers bf16 on the same shape, in one
process (issue 15); batch-1 and batch-4 decode (issue 14) on the same file.

    PYTHONPATH=. python benchmarks/prefill_engine.py --out OUT_DIR [--shapes mixtral,qwen3] [--tokens 512,4096]
    PYTHONPATH=. python benchmarks/prefill_engine.py --out OUT_DIR --tiny --device cpu     # a check of the script

Per shape (decode_profile.SHAPES: Mixtral-8x7B, Qwen3-30B-A3B, OLMoE-1B-7B at full depth, real vocabularies):
1. peer: transformers builds the model in bf16 on the GPU (random weights, its default attention and experts
   implementations), one forward pass over a --tokens prompt with `logits_to_keep=1` (the engine computes the last
   row's logits only too), median of 3 after a warm-up; the model is then freed.
2. colibri: a synthetic file of the same shape (`synthetic.write_synthetic(reuse_expert=True)`, bf16 dense, int8
   experts) in --dir, one Engine; per variant (VARIANTS, or those --variants names: the backend's
   `fast_expert_gemm` / `flash_prefill` / `cublas_expert_gemm` switched on the open engine, which reads them per
   call; "tc + split-attn" is the engine before the first two became defaults; "defaults" are EngineConfig's, as
   the engine opened with them) `bench.prefill_bench`: the median of 3 `infer` calls
   of a --tokens prompt after a warm-up, wall time (infer returns host logits, so it includes the sync).
   With --timeline, the defaults' prefill of each length is also profiled once more (CUPTI through PyTorch's
   profiler, `bench.timeline_profile`): every kernel's time, so the figures add up to the pass. With
   --host-profile, one more prefill of each length under cProfile: where the host's time goes (the Python
   functions with the most time of their own), to tell launch overhead from device work.
3. decode (unless --no-decode): `bench.decode_bench` at batch 1 and 4 (CUDA graphs on cuda) on an engine opened
   with the defaults.
The file is deleted after its shape. Writes prefill_engine.json and prefill_engine.txt to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import SHAPES  # noqa: E402
from synthetic_decode import shaped_model, write_timed  # noqa: E402

VARIANTS = {  # (fast_expert_gemm, flash_prefill, cublas_expert_gemm) switched on the open engine's backend;
    # EngineConfig's defaults last
    "tc + split-attn": (None, False, None), "fast-split": ("split", False, False), "fast-bf16": ("bf16", False, False),
    "tc + flash": (None, True, None), "fast-bf16 + flash": ("bf16", True, False),
    "fast-split + flash": ("split", True, False), "cublas-bf16 + flash": ("bf16", True, True),
    "cublas-split + flash": ("split", True, True), "cublas-int8 + flash": ("int8", True, True),
    "fast-int8 + flash": ("int8", True, None), "auto + flash": ("auto", True, None),
    "defaults": None}     # the open engine's own (EngineConfig's defaults)
HF_CLASSES = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "olmoe": ("OlmoeConfig", "OlmoeForCausalLM")}
TINY = dict(vocab=256, hidden=128, layers=2, heads=2, kv_heads=1, experts=8, top_k=2, expert_inter=64)
HEAD_DIM = 128
MAX_POSITIONS = 8192
TIMELINE_ROWS = 15     # kernels printed per prefill timeline (all are in the JSON)


def log(msg: str) -> None:
    print(f"[prefill_engine {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_of(shape: dict) -> dict:
    return shaped_model(shape, head_dim=HEAD_DIM if shape["hidden"] > 256 else shape["hidden"] // shape["heads"],
                        max_position_embeddings=MAX_POSITIONS)


def hf_config(name: str, model: dict):
    import transformers

    kw = dict(vocab_size=model["vocab_size"], hidden_size=model["hidden_size"],
              num_hidden_layers=model["num_layers"], num_attention_heads=model["num_attention_heads"],
              num_key_value_heads=model["num_key_value_heads"], max_position_embeddings=MAX_POSITIONS,
              num_experts_per_tok=model["top_k"], tie_word_embeddings=False)
    inter = model["expert_intermediate_size"]
    if name == "mixtral":
        kw.update(intermediate_size=inter, num_local_experts=model["num_experts"])
    elif name == "qwen3":
        kw.update(moe_intermediate_size=inter, intermediate_size=inter, num_experts=model["num_experts"],
                  head_dim=model["head_dim"], norm_topk_prob=True)
    else:
        kw.update(intermediate_size=inter, num_experts=model["num_experts"])
    return getattr(transformers, HF_CLASSES[name][0])(**kw)


def hf_prefill(name: str, model: dict, tokens: list[int], device: str) -> dict:
    """transformers bf16: build, time one forward per prompt length, free."""
    import torch
    import transformers

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)          # built in bf16 directly: an fp32 Mixtral does not fit
    try:
        with torch.device(device):
            hf = getattr(transformers, HF_CLASSES[name][1])(hf_config(name, model)).eval()
    finally:
        torch.set_default_dtype(old)
    out = {"build_s": time.perf_counter() - t0, "attn_implementation": hf.config._attn_implementation}
    with torch.no_grad():
        for n in tokens:
            ids = torch.randint(0, model["vocab_size"], (1, n), device=device)
            times = []
            for _ in range(4):
                sync()
                t1 = time.perf_counter()
                hf(ids, logits_to_keep=1)
                sync()
                times.append(time.perf_counter() - t1)
            out[str(n)] = 1e3 * statistics.median(times[1:])
            log(f"{name} transformers bf16 prefill {n}: {out[str(n)]:.1f} ms")
    del hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def colibri_prefill(path: Path, tokens: list[int], device: str, timeline: bool, names: list[str],
                    host_profile: bool = False) -> dict:
    from colibri_format.runtime import Engine, EngineConfig
    from colibri_format.runtime.cuda.bench import prefill_bench

    out: dict = {}
    variants = {n: VARIANTS[n] for n in names} if device == "cuda" else {"numpy": (None, False, None)}
    with Engine(path, EngineConfig(device=device, max_seq_len=max(tokens) + 8, verify="never")) as eng:
        if device == "cuda":
            defaults = (eng.be.fast_expert_gemm, eng.be.flash_prefill, eng.be.cublas_expert_gemm)
        for name, switches in variants.items():
            if device == "cuda":     # read by the backend per call
                eng.be.fast_expert_gemm, eng.be.flash_prefill, eng.be.cublas_expert_gemm = switches or defaults
            out[name] = {}
            for n in tokens:
                out[name][str(n)] = prefill_bench(eng, n, np.random.default_rng(n))["ms"]
                log(f"colibri {name} prefill {n}: {out[name][str(n)]:.1f} ms")
        if timeline and device == "cuda":
            out["timelines"] = {str(n): prefill_timeline(eng, n) for n in tokens}
        if host_profile:
            out["host_profiles"] = {str(n): prefill_host_profile(eng, n) for n in tokens}
    return out


def prefill_host_profile(eng, n: int) -> list[dict]:
    """The host functions with the most time of their own in one `n`-token prefill under cProfile, printed."""
    import cProfile
    import pstats

    prompt = np.random.default_rng(n).integers(0, eng.vocab_size, n).tolist()
    eng.infer([prompt])
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(eng.infer, [prompt])
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    rows = sorted(({"function": f"{Path(f).name}:{line}:{fn}", "calls": nc, "own_ms": 1e3 * tt, "cum_ms": 1e3 * ct}
                   for (f, line, fn), (_, nc, tt, ct, _) in stats.items()), key=lambda r: -r["own_ms"])
    log(f"prefill {n} host profile: {1e3 * wall:.1f} ms under cProfile")
    for r in rows[:TIMELINE_ROWS]:
        log(f"  {r['function'][:60]:<60}{r['calls']:>7}{r['own_ms']:>9.2f} ms{r['cum_ms']:>9.2f} ms")
    return rows[:60]


def prefill_timeline(eng, n: int) -> dict | None:
    """The device timeline of one `n`-token prefill with the engine's last variant (the defaults), printed."""
    from colibri_format.runtime.cuda.bench import timeline_profile

    prompt = np.random.default_rng(n).integers(0, eng.vocab_size, n).tolist()
    t = timeline_profile(eng, lambda: eng.infer([prompt]), steps=2)
    if t is not None:
        log(f"prefill {n} timeline (CUPTI): span {t['span_us'] / 1e3:.1f} ms = busy {t['busy_us'] / 1e3:.1f} + idle "
            f"{t['idle_us'] / 1e3:.1f}; {t['kernels_per_step']:.0f} kernels and copies")
        for name, k in sorted(t["kinds"].items(), key=lambda kv: -kv[1]["us"])[:TIMELINE_ROWS]:
            log(f"  {name[:60]:<60}{k['calls']:>6.0f}{k['us'] / 1e3:>9.2f} ms{k['us'] / t['span_us']:>7.1%}")
    return t


def colibri_decode(path: Path, device: str) -> dict:
    from colibri_format.runtime import Engine, EngineConfig
    from colibri_format.runtime.cuda.bench import decode_bench

    out = {}
    cfg = EngineConfig(device=device, max_batch_size=4, max_seq_len=128, verify="never")
    with Engine(path, cfg) as eng:
        for batch in (1, 4):
            d, _ = decode_bench(eng, batch, 64, 8, np.random.default_rng(0))
            out[f"b{batch}"] = d["tokens_per_s"]
            log(f"colibri decode b{batch}: {d['tokens_per_s']:.1f} tok/s ({d['graph']})")
    return out


def table(rows: dict, tokens: list[int]) -> str:
    lines = []
    for shape, r in rows.items():
        lines.append(f"{shape}: prefill ms (transformers bf16 / colibri variants), then decode tokens/s")
        head = f"{'variant':<18}" + "".join(f"{n:>10}" for n in tokens) + "".join(f"{'x HF ' + str(n):>12}"
                                                                              for n in tokens)
        lines.append(head)
        hf = r.get("transformers")
        if hf:
            lines.append(f"{'transformers bf16':<18}" + "".join(f"{hf[str(n)]:>10.1f}" for n in tokens))
        for name, ms in ((k, v) for k, v in r["colibri"].items() if k not in ("timelines", "host_profiles")):
            ratios = "".join(f"{hf[str(n)] / ms[str(n)]:>12.2f}" if hf else f"{'-':>12}" for n in tokens)
            lines.append(f"{name:<18}" + "".join(f"{ms[str(n)]:>10.1f}" for n in tokens) + ratios)
        for name, tps in r["decode"].items():
            lines.append(f"  decode {name}: {tps:.1f} tok/s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="mixtral,qwen3", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy widths (a check of the script)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--timeline", action="store_true", help="also a CUPTI timeline of the defaults' prefills")
    ap.add_argument("--host-profile", action="store_true", help="also a cProfile of the last variant's prefills")
    ap.add_argument("--dir", default="/dev/shm", help="where the files are written (and deleted)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of the VARIANTS to time")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode runs")
    args = ap.parse_args()
    names = args.variants.split(",")
    if set(names) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(set(names) - set(VARIANTS))}; known: {list(VARIANTS)}")
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens takes a comma list of whole numbers, got {args.tokens!r}")
    if min(tokens) < 1:
        ap.error(f"--tokens must be positive, got {args.tokens!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict = {}
    for shape in shapes:
        model = model_of(TINY if args.tiny else SHAPES[shape])
        r: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        if not args.no_peer:
            r["transformers"] = hf_prefill(shape, model, tokens, args.device)
        path = Path(args.dir) / f"prefill_{shape}.colibri"
        try:
            r["file"] = write_timed(path, model, log)
            r["colibri"] = colibri_prefill(path, tokens, args.device, args.timeline, names,
                                          args.host_profile)
            r["decode"] = {} if args.no_decode else colibri_decode(path, args.device)
        finally:
            path.unlink(missing_ok=True)
        rows[shape] = r
        (out / "prefill_engine.json").write_text(json.dumps(rows, indent=1))
    text = table(rows, tokens)
    (out / "prefill_engine.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
