"""Batch-1 decode with int8 vs 4-bit experts (int4_group g32/g64/g128, mxfp4) on a full-depth Mixtral-8x7B-shaped file
(issue 16): resident tokens/s and paged PCIe bytes per token.

    PYTHONPATH=. python benchmarks/int4_decode.py --out OUT_DIR [--formats int8,int4_g32,int4_g128,mxfp4]
        [--float-activations]
    PYTHONPATH=. python benchmarks/int4_decode.py --out OUT_DIR --tiny --device cpu      # smoke test, no GPU

Each format is a synthetic random file (`synthetic.write_synthetic(reuse_expert=True)`: bf16 dense, one random
expert blob repeated) of Mixtral-8x7B's full shape (32 layers, vocabulary 32000, hidden 4096, 8 experts top-2 of
FFN 14336, 32 query / 8 kv heads of 128) written to --dir (/dev/shm) and deleted after its runs, before the next
format's file is written (int8 ~47 GB, int4 g32 ~26 GB, mxfp4 ~25 GB). Per format, in this one process:
- resident: `runtime.cuda.bench.run_bench` (CUDA graphs, no prefill): tokens/s, the weight bytes a step reads (dense
  matrices as stored + the distinct experts its profile touched) and the roofline share at HBM_COPY_BPS;
- paged: the expert cache at 50% (4 of 8 experts a layer, per-layer lrfu) through `benchmarks/paging.py`'s
  `one_run`, the routes replayed from one synthetic Zipf trace (`paging.TraceRoutes`), so every format pages the
  same expert sequence: tokens/s, hit rate and the PCIe bytes per token (misses read over PCIe plus admission
  copies).
The table adds each 4-bit figure's ratio to int8's (targets: resident tokens/s >= 1.6x, PCIe bytes per token
halved) and the ratio a bandwidth-bound engine would reach (int8 weight bytes / 4-bit weight bytes per step: the
bf16 attention weights are the same in both, so this bounds the resident speed-up).
Activations: int4_group experts run on int8 activations (`EngineConfig.int8_activations`, the default: the dp4a
GEMVs of moe_gemv4_dp4a.cu), every other format on float ones; each row records which ("activations": "int8" or
"float", and the config flag). --float-activations adds, for each format the switch changes (limits.A8_FORMATS), a
resident run with int8_activations=False (row "<format>/float"; not paged).
With --device cpu (the NumPy engine: a check of the script and the files) `bench.decode_bench` times the steps and
the expert bytes are the upper bound min(E, top_k) experts a layer. Writes int4_decode.json and int4_decode.txt to
--out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.synthetic_decode import (EXPERT_FORMATS, HBM_COPY_BPS, cpu_decode, cuda_decode, expert_options,
                                         shaped_model, write_timed)

MIXTRAL = dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, experts=8, top_k=2,
               expert_inter=14336)
TINY = dict(vocab=256, hidden=128, layers=3, heads=2, kv_heads=1, head_dim=64, experts=8, top_k=2, expert_inter=128)


def log(msg: str) -> None:
    print(f"[int4_decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_of(shape: dict) -> dict:
    return shaped_model({k: v for k, v in shape.items() if k != "head_dim"}, head_dim=shape["head_dim"],
                        max_position_embeddings=4096)


def paged(path: Path, args, ceilings: dict, experts: int) -> dict:
    from benchmarks.paging import one_run

    row = one_run(path, batch=1, capacity=experts // 2, routing="trace", n=args.paged_iters, warmup=args.warmup,
                  ceilings=ceilings, scope="per_layer", device=args.device, int8_activations=True)
    keys = ("tokens_per_s", "hit_rate", "misses_per_token", "pcie_mb_per_token", "blob_bytes", "graph",
            "stall_ms_per_token", "copy_gbps", "chained_tokens_per_s")
    return {k: row.get(k) for k in keys}


def activations(fmt, int8_activations: bool) -> str:
    """Which expert activations a run of format `fmt` uses: 'int8' (the dp4a path) or 'float'."""
    from colibri_format.runtime.cuda.limits import rounds_activations

    return "int8" if rounds_activations(int8_activations, fmt) else "float"


def resident(path: Path, args, int8_activations: bool) -> dict:
    """Resident batch-1 decode (run_bench on CUDA, decode_bench on the NumPy engine) with the activation switch."""
    if args.device == "cuda":
        return cuda_decode(path, 1, args.iters, log, int8_activations=int8_activations)
    return cpu_decode(path, 1, args.iters, verify="never", int8_activations=int8_activations)


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["format"] == "int8"), None)
    lines = [f"{'format':<16}{'act':>6}{'file GB':>8}{'tok/s':>9}{'x int8':>8}{'chained':>9}{'x int8':>8}"
             f"{'bound x':>8}{'weights MB':>11}{'share':>7}{'paged tok/s':>12}{'hit':>6}{'PCIe MB/tok':>12}"
             f"{'x int8':>8}"]
    for r in rows:
        res = r["resident"]
        pg = r["paged"] or {"tokens_per_s": 0.0, "hit_rate": None, "pcie_mb_per_token": None}
        roof = HBM_COPY_BPS / res["weight_bytes_per_step"]
        ratio = chained_ratio = bound = pcie = "-"
        if base is not None:
            ratio = f"{res['tokens_per_s'] / base['resident']['tokens_per_s']:.2f}"
            chained_ratio = f"{res['chained_tokens_per_s'] / base['resident']['chained_tokens_per_s']:.2f}"
            bound = f"{base['resident']['weight_bytes_per_step'] / res['weight_bytes_per_step']:.2f}"
            if base["paged"]["pcie_mb_per_token"] and pg["pcie_mb_per_token"]:
                pcie = f"{pg['pcie_mb_per_token'] / base['paged']['pcie_mb_per_token']:.2f}"
        lines.append(f"{r['format']:<16}{r['activations']:>6}{r['file']['bytes'] / 1e9:>8.1f}"
                     f"{res['tokens_per_s']:>9.1f}{ratio:>8}{res['chained_tokens_per_s']:>9.1f}{chained_ratio:>8}"
                     f"{bound:>8}{res['weight_bytes_per_step'] / 1e6:>11.0f}{res['tokens_per_s'] / roof:>7.1%}"
                     f"{pg['tokens_per_s']:>12.2f}{pg['hit_rate'] or 0:>6.2f}{pg['pcie_mb_per_token'] or 0:>12.1f}"
                     f"{pcie:>8}")
    lines.append(f"tok/s: a step at a time, the token read by the host each step; chained: the same steps as one "
                 "chain, tokens fed back on the device (generate chains 16 at a time); "
                 f"share: of the roofline at {HBM_COPY_BPS / 1e12:.1f} TB/s (weight bytes a step reads); bound x: "
                 "int8 weight bytes / this format's (the resident speed-up a bandwidth-bound engine reaches); paged: "
                 "cache at 50% (4 of 8 experts a layer, lrfu), routes replayed from one trace; act: the expert "
                 "activations (int8: moe_gemv4_dp4a.cu's dp4a GEMVs)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int8,int4_g32,mxfp4")
    ap.add_argument("--iters", type=int, default=64, help="timed resident decode steps")
    ap.add_argument("--paged-iters", type=int, default=32, help="timed paged decode steps")
    ap.add_argument("--warmup", type=int, default=32, help="paged steps that fill the cache first")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy widths (a check of the script)")
    ap.add_argument("--dir", default="/dev/shm", help="where the files are written")
    ap.add_argument("--float-activations", action="store_true",
                    help="also run the formats int8 activations apply to (int4_g32) with int8_activations=False")
    args = ap.parse_args()
    names = args.formats.split(",")
    if set(names) - set(EXPERT_FORMATS):
        ap.error(f"unknown formats {sorted(set(names) - set(EXPERT_FORMATS))}; known: {sorted(EXPERT_FORMATS)}")
    if args.tiny:
        args.iters, args.paged_iters, args.warmup = min(args.iters, 4), min(args.paged_iters, 3), min(args.warmup, 2)
    from benchmarks.paging import copy_ceiling

    shape = TINY if args.tiny else MIXTRAL
    model = model_of(shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceilings = copy_ceiling(args.device, 1 << 20 if args.tiny else 1 << 30)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "shape": shape,
                    "hbm_copy_bps": HBM_COPY_BPS, "ceilings": ceilings, "rows": []}
    for name in names:
        options = expert_options(name)
        fmt = options["expert_format"]
        path = Path(args.dir) / f"int4_decode_{name}.colibri"
        try:
            file = write_timed(path, model, log, **options)
            row = {"format": name, "file": file, "int8_activations": True, "activations": activations(fmt, True)}
            row["resident"] = resident(path, args, True)
            row["paged"] = paged(path, args, ceilings, shape["experts"])
            res, pg = row["resident"], row["paged"]
            log(f"{name} ({row['activations']} activations): resident {res['tokens_per_s']:.1f} tok/s, paged "
                f"{pg['tokens_per_s']:.2f} tok/s at {pg['pcie_mb_per_token']:.1f} MB/token over PCIe")
            result["rows"].append(row)
            (out / "int4_decode.json").write_text(json.dumps(result, indent=1, default=str))
            if args.float_activations and activations(fmt, True) != activations(fmt, False):
                flt = {"format": f"{name}/float", "file": file, "int8_activations": False,
                       "activations": activations(fmt, False), "resident": resident(path, args, False),
                       "paged": None}
                log(f"{name} (float activations): resident {flt['resident']['tokens_per_s']:.1f} tok/s")
                result["rows"].append(flt)
                (out / "int4_decode.json").write_text(json.dumps(result, indent=1, default=str))
        finally:
            path.unlink(missing_ok=True)
    text = table(result["rows"])
    (out / "int4_decode.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
