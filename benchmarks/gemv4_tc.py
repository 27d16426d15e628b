"""The 4-bit (int4_group) decode GEMVs: moe_gemv4.cu's SIMT kernels against moe_gemv4_tc.cu's tensor-core ones
and moe_gemv4_dp4a.cu's dp4a ones on int8 activations (issue 16), in one process.

    PYTHONPATH=. python benchmarks/gemv4_tc.py --out OUT_DIR [--shapes mixtral,gpt_oss,qwen3] [--tokens 1,2,4,8]
                                                             [--group 32]

Shapes (random int4_group experts, generated on the device): Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2),
gpt-oss-20b (2880, 2880, 32, top-4), Qwen3-30B-A3B (2048, 768, 128, top-8); T tokens a step. Each kernel is
captured in a CUDA graph of many launches over rotated routings (each launch picks other experts of a set larger
than L2, so the weights come from HBM) and timed by `gpu_kernels.time_graph` (median of replays): µs per launch and
GB/s of the expert bytes it reads (matrices and scales of its distinct experts), beside a device-to-device copy
measured in the same run. The tensor-core rows include their activation staging launch (moe4tc_stage), the dp4a
rows their activation quantization launch (moe4a8_quantize). Before timing, each tensor-core output is checked
against the SIMT kernel's (tested against float64 NumPy), and each dp4a output against the SIMT kernel's on the
same activations rounded to int8 per group of 32 (`ops.round_activations_a8`). Writes
gemv4_tc.json and gemv4_tc.md to OUT_DIR and prints the table. Needs a CUDA GPU and CuPy (exits with status 2
without them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import copy_bandwidth, log, time_graph  # noqa: E402

from colibri_format import spec as S  # noqa: E402
from colibri_format.runtime.cuda.kernels import ops  # noqa: E402

SHAPES = {  # name: (H, I, E, k)
    "mixtral": (4096, 14336, 8, 2),     # Mixtral-8x7B
    "gpt_oss": (2880, 2880, 32, 4),     # gpt-oss-20b
    "qwen3": (2048, 768, 128, 8),       # Qwen3-30B-A3B
}
ROUTINGS = 16           # routings a graph rotates over
LAUNCHES = 64           # launches a graph holds
AGREE = 1e-4            # relative difference allowed between the tensor-core and the SIMT outputs
STAGES = {"gate_up": ("gate_up", "gate_up_scale"), "down": ("down", "down_scale")}


def gpu_or_none():
    """CuPy, or None when it or a CUDA device is missing."""
    try:
        import cupy  # noqa: PLC0415

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 -- any import or driver failure: no GPU
        return None


# scale dtype and size (times 1 / sqrt(H): about a quantizer's for N(0, 1/H) weights) of the random experts below
RANDOM_SCALES = {S.ExpertFormat.INT4_GROUP: ("float16", 3.0 / 7.0), S.ExpertFormat.INT8_ROW: ("float32", 1.0 / 127)}


def device_experts(cp, E: int, H: int, I: int, seed: int, expert_format=S.ExpertFormat.INT4_GROUP, group: int = 0):
    """(buffer, table, layout): E random experts of `expert_format` (int4_group of `group`, or int8_row) on the
    device: random codes, scales uniform in [0.5, 1.5] times RANDOM_SCALES' size."""
    layout = S.blob_layout(H, I, expert_format, group)
    dtype, size = RANDOM_SCALES[expert_format]
    cp.random.seed(seed)
    buf = cp.random.randint(0, 256, E * layout.size, dtype=cp.uint8)
    for e in range(E):
        for name in ("gate_up_scale", "down_scale"):
            a = layout.array(name)
            start = e * layout.size + a.offset
            scales = cp.random.uniform(0.5, 1.5, a.nbytes // np.dtype(dtype).itemsize) * size / np.sqrt(H)
            buf[start:start + a.nbytes] = scales.astype(dtype).view(cp.uint8)
    ptrs = cp.asarray(np.array([buf.data.ptr + e * layout.size for e in range(E)], np.uint64))
    table = ops.PackedExpertTable if expert_format in S.PACKED_FORMATS else ops.ExpertTable
    return buf, table.from_layout(ptrs, layout), layout


def expert_bytes(layout, ids_list, stage: str) -> float:
    """Mean bytes a launch reads of its distinct experts (matrices and scales of `stage`)."""
    per_expert = sum(layout.array(n).nbytes for n in STAGES[stage])
    return float(np.mean([len(np.unique(ids.get())) for ids in ids_list])) * per_expert


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_shape(cp, name: str, T: int, group: int, copy_gbps: float, wrong: list) -> list[dict]:
    H, I, E, k = SHAPES[name]
    buf, table, layout = device_experts(cp, E, H, I, T, S.ExpertFormat.INT4_GROUP, group)
    rng = np.random.default_rng(T)
    ids_list = [cp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
                for _ in range(ROUTINGS)]
    disps = [ops.dispatch(ids, E) for ids in ids_list]
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    w = cp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    act, act_tc = cp.empty((T * k, I), cp.float32), cp.empty((T * k, I), cp.float32)
    y, y_tc = cp.empty((T * k, H), cp.float32), cp.empty((T * k, H), cp.float32)
    x_staged, act_staged = cp.empty((T, 2, H // 2), cp.uint32), cp.empty((T * k, 2, I // 2), cp.uint32)
    act_a8, y_a8 = cp.empty((T * k, I), cp.float32), cp.empty((T * k, H), cp.float32)
    xq, xs = cp.empty((T, H), cp.int8), cp.empty((T, H // ops.A8_GROUP), cp.float32)
    aq, as_ = cp.empty((T * k, I), cp.int8), cp.empty((T * k, I // ops.A8_GROUP), cp.float32)

    def gate_up_a8(d):
        ops.quantize_activations_a8(x, q=xq, scales=xs)
        return ops.moe_gate_up_4bit_a8(xq, xs, table, d, k, out=act_a8)

    def down_a8(d):
        ops.quantize_activations_a8(act, q=aq, scales=as_)
        return ops.moe_down_4bit_a8(aq, as_, table, d, w, out=y_a8)

    kernels = {
        ("gate_up", "simt"): lambda d: ops.moe_gate_up_4bit(x, table, d, k, out=act),
        ("gate_up", "tc"): lambda d: ops.moe_gate_up_4bit_tc(x, table, d, k, staged=x_staged, out=act_tc),
        ("gate_up", "dp4a"): gate_up_a8,
        ("down", "simt"): lambda d: ops.moe_down_4bit(act, table, d, w, out=y),
        ("down", "tc"): lambda d: ops.moe_down_4bit_tc(act, table, d, w, staged=act_staged, out=y_tc),
        ("down", "dp4a"): down_a8,
    }
    for stage, outs in (("gate_up", (act_tc, act)), ("down", (y_tc, y))):
        kernels[stage, "simt"](disps[0])
        kernels[stage, "tc"](disps[0])
        diff = rel(outs[0].get(), outs[1].get())
        if diff > AGREE:
            wrong.append(f"{name} T={T} g{group} {stage}: tensor cores differ from SIMT by {diff:.2e}")
    # dp4a against SIMT on the same rounded activations (act: the SIMT gate_up's, as the dp4a down reads it)
    want_act = ops.moe_gate_up_4bit(ops.round_activations_a8(x), table, disps[0], k).get()
    want_y = ops.moe_down_4bit(ops.round_activations_a8(act), table, disps[0], w).get()
    for stage, got, want in (("gate_up", gate_up_a8(disps[0]), want_act), ("down", down_a8(disps[0]), want_y)):
        diff = rel(got.get(), want)
        if diff > AGREE:
            wrong.append(f"{name} T={T} g{group} {stage}: dp4a differs from SIMT on rounded inputs by {diff:.2e}")
    rows = []
    for (stage, variant), fn in kernels.items():
        us = time_graph(cp, [lambda d=d, fn=fn: fn(d) for d in disps], per_graph=LAUNCHES)
        nbytes = expert_bytes(layout, ids_list, stage)
        rows.append({"shape": name, "H": H, "I": I, "E": E, "k": k, "T": T, "group": group, "stage": stage,
                     "variant": variant, "us": us, "expert_bytes": nbytes, "gbps": nbytes / us / 1e3,
                     "share_of_copy": nbytes / us / 1e3 / copy_gbps})
        log(f"  {name} T={T} {stage:7s} {variant:4s} {us:9.1f} µs {rows[-1]['gbps']:7.0f} GB/s")
    del buf
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def table_md(rows: list[dict], copy_gbps: float) -> str:
    lines = [f"device copy: {copy_gbps:.0f} GB/s (read + written)", "",
             "| shape | T | stage | SIMT µs | TC µs | dp4a µs | SIMT GB/s | TC GB/s | dp4a GB/s | TC / SIMT speed "
             "| dp4a / SIMT speed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["shape"], r["T"], r["stage"], r["variant"]): r for r in rows}
    for (shape, T, stage, variant), r in by.items():
        if variant != "simt":
            continue
        tc, a8 = by[shape, T, stage, "tc"], by[shape, T, stage, "dp4a"]
        lines.append(f"| {shape} | {T} | {stage} | {r['us']:.1f} | {tc['us']:.1f} | {a8['us']:.1f} | "
                     f"{r['gbps']:.0f} | {tc['gbps']:.0f} | {a8['gbps']:.0f} | {r['us'] / tc['us']:.2f}x | "
                     f"{r['us'] / a8['us']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,2,4,8", help="comma list of tokens a step")
    ap.add_argument("--group", type=int, default=32, help="int4_group scale group (32, 64 or 128)")
    args = ap.parse_args()
    cp = gpu_or_none()
    if cp is None:
        print("gemv4_tc.py needs a CUDA GPU and CuPy; none found", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copy_gbps = copy_bandwidth(cp)
    log(f"device copy {copy_gbps:.0f} GB/s")
    rows, wrong = [], []
    for name in args.shapes.split(","):
        for T in (int(t) for t in args.tokens.split(",")):
            rows += bench_shape(cp, name, T, args.group, copy_gbps, wrong)
    md = table_md(rows, copy_gbps) + "".join(f"\nWRONG: {w}" for w in wrong)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    (out / "gemv4_tc.json").write_text(json.dumps({"when": stamp, "copy_gbps": copy_gbps, "rows": rows,
                                                   "wrong": wrong}, indent=1))
    (out / "gemv4_tc.md").write_text(md)
    print(md)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
