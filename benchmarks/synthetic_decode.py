"""What the full-depth decode benchmarks (new_arch_decode, hybrid_decode, int4_decode, mla_decode, decode_profile,
prefill_engine) share: the nominal roofline rate, the model of a shape, the timed write of a synthetic file, and one
decode measurement on either engine (run_bench on CUDA; on the NumPy engine bench.decode_bench, a check of the
scripts, with the expert bytes a step reads at most: min(E, batch x top_k) blobs, and their bias rows, per MoE
layer)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HBM_COPY_BPS = 4.0e12          # the H200's device-to-device copy rate (bytes/s): the nominal roofline
# the expert formats a benchmark's --experts / --formats name: spec.ExpertFormat member and group size
EXPERT_FORMATS = {"int8": ("INT8_ROW", 0), "int4_g32": ("INT4_GROUP", 32), "int4_g64": ("INT4_GROUP", 64),
                  "int4_g128": ("INT4_GROUP", 128), "mxfp4": ("MXFP4", 32)}


def expert_options(name: str) -> dict:
    """write_synthetic's expert_format and group_size for an EXPERT_FORMATS name."""
    from colibri_format import spec as S

    member, group = EXPERT_FORMATS[name]
    return {"expert_format": S.ExpertFormat[member], "group_size": group}


def shaped_model(widths: dict, synthetic_options: dict | None = None, **fields) -> dict:
    """The metadata `model` object of `synthetic_model(**widths, **synthetic_options)` with `fields` set over it (a
    head_dim, max_position_embeddings, an architecture's features), spec-checked."""
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_model

    model = synthetic_model(**widths, **(synthetic_options or {}))
    model.update(fields)
    S.check_model(model)
    return model


def write_timed(path: Path, model: dict, log: Callable[[str], None], **write_options) -> dict:
    """Write a synthetic file (one random blob everywhere, bf16 dense unless `write_options` say otherwise;
    write_synthetic refuses one the folder cannot hold before writing); its bytes and write time."""
    from colibri_format import spec as S
    from colibri_format.synthetic import write_synthetic

    t0 = time.perf_counter()
    write_synthetic(path, model, reuse_expert=True, **{"dense_dtype": S.DType.BF16, **write_options})
    info = {"bytes": path.stat().st_size, "write_s": time.perf_counter() - t0}
    log(f"wrote {path} ({info['bytes'] / 1e9:.1f} GB) in {info['write_s']:.0f} s")
    return info


def ensure_file(path: Path, model: dict, log: Callable[[str], None]) -> dict:
    """The file at `path`: kept from an earlier --keep run, else written."""
    info = {"path": str(path)}
    if not path.exists():
        info.update(write_timed(path, model, log))
    info["bytes"] = path.stat().st_size
    return info


def cuda_decode(path: Path, batch: int, iters: int, log: Callable[[str], None], *, warmup_iters: int = 8,
                prefill: bool = False, **cache) -> dict:
    """run_bench at `batch` rows (cache: EngineConfig's max_cached_experts or gpu_memory); its decode figures."""
    from colibri_format.runtime.cuda.bench import render, run_bench

    r = run_bench(path, batch_size=batch, num_iters=iters, warmup_iters=warmup_iters, prefill=prefill,
                  verify="never", **cache)
    log("\n" + render(r))
    return {"tokens_per_s": r["decode"]["tokens_per_s"], "ms_per_step": r["decode"]["ms_per_step"],
            "chained_tokens_per_s": r["decode"]["chained_tokens_per_s"], "graph": r["decode"]["graph"],
            "weight_bytes_per_step": r["roofline"]["weight_bytes_per_step"],
            "share_at_measured_copy": r["roofline"]["share_of_roofline"],
            "measured_copy_gbps": r["ceilings"]["d2d_copy_gbps"], "capacity": r["engine"]["capacity"],
            "paging": r["decode"].get("paging"), "prefill": r.get("prefill"), "run_bench": r}


def cpu_decode(path: Path, batch: int, iters: int, **config) -> dict:
    """The same decode loop on the NumPy engine (config: more EngineConfig fields)."""
    from colibri_format.runtime import Engine, EngineConfig
    from colibri_format.runtime.cuda.bench import decode_bench, dense_weight_bytes

    with Engine(path, EngineConfig(max_batch_size=batch, max_seq_len=16 + 2 + iters + 1, **config)) as eng:
        d, _ = decode_bench(eng, batch, iters, 2, np.random.default_rng(0))
        m, blob = eng.reader.model, eng.reader.blob_layout.size
        biases = 4 * (2 * m["expert_intermediate_size"] + m["hidden_size"]) if m.get("expert_bias") else 0
        experts = len(m["moe_layers"]) * min(m["num_experts"], batch * m["top_k"]) * (blob + biases)
        return {"tokens_per_s": d["tokens_per_s"], "ms_per_step": d["ms_per_step"],
                "chained_tokens_per_s": d["chained_tokens_per_s"], "graph": d["graph"],
                "weight_bytes_per_step": dense_weight_bytes(eng) + experts, "capacity": eng.experts.capacity,
                "paging": d.get("paging")}
