"""Expert parallelism on CPU: gloo process groups of 2 and 3 ranks on loopback against the one-process engine.

Every supported architecture's tiny checkpoint is converted to a float32 `.colibri` file (plus an int8 and an int4
one); one group of ranks is started per world size and runs every file: logits of a ragged batch, greedy and seeded
sampled generation. The test process compares them with `Engine` (<= 1e-5 relative logit error, equal tokens)
and checks that each rank loaded only experts it owns. Ranks are this file run as a script (`--rank`), so no
pickling of test functions across processes is needed. Placement and the exchange plan are tested in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]

from colibri_format.errors import InvalidInput
from colibri_format.runtime.parallel.placement import (describe, expert_loads, plan_placement,
                                                       quotas)

LOGIT_TOL = 1e-5
BATCH = [[5, 17, 99, 3, 64, 8, 21], [3, 9], [100, 1, 2, 64, 33], [7]]   # ragged: 15 rows, one of length 1
PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 6
RANK_TIMEOUT_S = 120


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# --- the ranks (this file run as a script) --------------------------------------------------------------

def rank_main(rank: int, world: int, port: int, job_path: str) -> None:
    from colibri_format.runtime.engine import EngineConfig
    from colibri_format.runtime.parallel.dist import init_rank, shutdown
    from colibri_format.runtime.parallel.engine import ExpertParallelEngine

    job = json.loads(Path(job_path).read_text())
    init_rank(rank, world, "cpu", port=port, timeout_s=60)
    report, arrays = {}, {}
    try:
        for name, path in job["files"].items():
            trace = job["traces"].get(name)
            with ExpertParallelEngine(path, EngineConfig(max_seq_len=64), trace=trace, check_routing=True) as eng:
                for i, x in enumerate(eng.logits(job["batch"])):
                    arrays[f"{name}/{i}"] = x
                for layer, (x, w, idx) in moe_inputs(eng.reader.model).items():
                    arrays[f"{name}/moe{layer}"] = eng.exchange.routed(layer, x, w, idx)
                infer = eng.infer(job["batch"])
                greedy = eng.generate(job["prompt"], max_new_tokens=job["new_tokens"])
                report[name] = {
                    "infer": infer, "greedy": greedy.output_ids, "greedy_stats": greedy.stats.as_dict(),
                    "sampled": eng.generate(job["prompt"], max_new_tokens=job["new_tokens"], temperature=0.8,
                                            seed=3).output_ids,
                    "owned": sorted(eng.owned_experts), "touched": sorted(eng.touched_experts),
                    "strategy": eng.placement.strategy}
    finally:
        shutdown()
    out = Path(job["out"])
    np.savez(out / f"rank{rank}.npz", **arrays)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def routed_sum(eng, layer: int, x: np.ndarray, weights: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The one-process decoder's routed-expert sum of one layer (its residual multiplier divided out)."""
    from colibri_format.runtime.forward import Workspace

    h = np.zeros(x.shape, np.float32)
    eng.decoder.routed(layer, x.astype(np.float32), idx.astype(np.int32), weights.astype(np.float32), h,
                       Workspace(eng.be))
    return h / np.float32(eng.args.residual_mult)


def moe_inputs(model: dict, rows: int = 15) -> dict:
    """Seeded hidden rows and routing per MoE layer, identical on every rank: the routed sum on its own."""
    rng = np.random.default_rng(7)
    E, k, H = model["num_experts"], model["top_k"], model["hidden_size"]
    out = {}
    for layer in model["moe_layers"]:
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(rows)])
        out[layer] = (rng.standard_normal((rows, H)).astype(np.float32),
                      rng.uniform(0.1, 1.0, (rows, k)).astype(np.float32), idx)
    return out


def run_group(world: int, job: dict, tmp: Path) -> list[tuple[dict, dict]]:
    from colibri_format.runtime.parallel.dist import free_port

    job = {**job, "out": str(tmp)}
    (tmp / "job.json").write_text(json.dumps(job))
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--job", str(tmp / "job.json")], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=RANK_TIMEOUT_S)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-3000:]}"
    return [(json.loads((tmp / f"rank{r}.json").read_text()), dict(np.load(tmp / f"rank{r}.npz")))
            for r in range(world)]


# --- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from colibri_format.convert.pipeline import convert
    from tests.hf_models import ARCHS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ep-files")
    archs = [a for a in ARCHS if a != "gpt_oss"]   # its experts (biases, clamped SwiGLU) are refused by EP ranks
    out = {arch: str(root / f"{arch}.colibri") for arch in archs}
    for arch in archs:
        convert(make_tiny_checkpoint(arch, root / f"hf-{arch}"), out[arch], dtype="float32", quantize="none")
    out["qwen3_moe-int8"] = str(root / "qwen3_moe-int8.colibri")
    convert(root / "hf-qwen3_moe", out["qwen3_moe-int8"], dtype="float32", quantize="expert")
    # int4_group experts: both engines round the expert products' inputs to int8 (EngineConfig.int8_activations
    # on by default), which moves the routed sum by far more than LOGIT_TOL, so the ranks must round too
    # (experts of 32 rows: an int4 group of 32 must divide the expert's intermediate size)
    out["qwen3_moe-int4"] = str(root / "qwen3_moe-int4.colibri")
    convert(make_tiny_checkpoint("qwen3_moe", root / "hf-qwen3_moe-i32", moe_intermediate_size=32),
            out["qwen3_moe-int4"], dtype="float32", quantize="expert", quant_bits=4)
    return out


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> dict:
    """The one-process NumPy engine on every file; also records a routing trace for balanced placement."""
    from colibri_format.runtime import Engine, EngineConfig

    traces = tmp_path_factory.mktemp("ep-traces")
    ref = {}
    for name, path in files.items():
        trace = str(traces / f"{name}.jsonl")
        with Engine(path, EngineConfig(max_seq_len=64, trace_path=trace)) as eng:
            logits = eng.logits(BATCH)
            moe = {layer: routed_sum(eng, layer, *args) for layer, args in moe_inputs(eng.reader.model).items()}
            ref[name] = {"logits": logits, "moe": moe, "infer": eng.infer(BATCH),
                         "greedy": eng.generate(PROMPT, max_new_tokens=NEW_TOKENS).output_ids,
                         "sampled": eng.generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.8,
                                                 seed=3).output_ids,
                         "trace": trace}
    return ref


@pytest.fixture(scope="module", params=[2, 3])
def group(request, files, reference, tmp_path_factory):
    world = request.param
    # world 3 places one file's experts by its recorded routing (balanced), the rest contiguously.
    traces = {"qwen3_moe": reference["qwen3_moe"]["trace"]} if world == 3 else {}
    job = {"files": files, "traces": traces, "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW_TOKENS}
    return world, run_group(world, job, tmp_path_factory.mktemp(f"ep-world{world}"))


# --- end to end over gloo -------------------------------------------------------------------------------

def test_logits_match_one_process_engine(group, reference):
    world, ranks = group
    for name, ref in reference.items():
        for i, want in enumerate(ref["logits"]):
            for r, (_, arrays) in enumerate(ranks):
                got = arrays[f"{name}/{i}"]
                assert got.shape == want.shape
                assert rel_err(got, want) <= LOGIT_TOL, (name, world, r, i, rel_err(got, want))


def test_routed_expert_sum_matches_one_process_engine(group, reference):
    """The MoE layer alone: in tiny models the experts' share of the logits is small, so check it directly."""
    world, ranks = group
    for name, ref in reference.items():
        for layer, want in ref["moe"].items():
            for r, (_, arrays) in enumerate(ranks):
                err = rel_err(arrays[f"{name}/moe{layer}"], want)
                assert err <= LOGIT_TOL, (name, layer, world, r, err)


def test_tokens_match_one_process_engine(group, reference):
    _, ranks = group
    for name, ref in reference.items():
        for report, _ in ranks:
            got = report[name]
            assert (got["infer"], got["greedy"], got["sampled"]) == (ref["infer"], ref["greedy"], ref["sampled"]), name


def test_each_rank_touches_only_owned_experts(group, files):
    world, ranks = group
    for name in files:
        owned = [set(map(tuple, rep[name]["owned"])) for rep, _ in ranks]
        touched = [set(map(tuple, rep[name]["touched"])) for rep, _ in ranks]
        assert all(t <= o for t, o in zip(touched, owned)), name
        assert all(not (owned[a] & owned[b]) for a in range(world) for b in range(a + 1, world)), name
        assert all(touched), f"{name}: some rank computed no expert"


def test_stats_count_each_ranks_expert_accesses(group, files):
    """Every rank counts the experts it computes: accesses > 0, loads only for owned experts it had not loaded."""
    _, ranks = group
    for name in files:
        for rep, _ in ranks:
            stats = rep[name]["greedy_stats"]
            assert stats["cache_hits"] + stats["cache_misses"] > 0, name
            assert stats["expert_loads"] == stats["cache_misses"] and stats["bytes_paged"] >= 0, name


def test_trace_balanced_placement_is_used(group):
    world, ranks = group
    for rep, _ in ranks:
        assert rep["mixtral"]["strategy"] == "contiguous"
        assert rep["qwen3_moe"]["strategy"] == ("balanced" if world == 3 else "contiguous")


# --- the command line -----------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=RANK_TIMEOUT_S)


def test_cli_devices_on_cpu_end_to_end(files, reference):
    ids = ",".join(map(str, PROMPT))
    done = _cli("colibri_format", "infer", files["mixtral"], "--ids", ids, "--max-new-tokens", str(NEW_TOKENS),
                "--devices", "0,1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)            # exactly one JSON document: only rank 0 printed
    assert result["output_ids"] == reference["mixtral"]["greedy"]
    assert result["stats"]["world_size"] == 2


def test_launcher_module_end_to_end(files, reference):
    ids = ",".join(map(str, PROMPT))
    done = _cli("colibri_format.runtime.parallel.launch", "--nproc", "2", "--", "infer", files["olmoe"],
                "--ids", ids, "--max-new-tokens", str(NEW_TOKENS))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in reference["olmoe"]["greedy"]]


def test_cli_rejects_more_devices_than_experts(files):
    done = _cli("colibri_format", "infer", files["mixtral"], "--ids", "1,2", "--devices", "0,1,2,3,4")
    assert done.returncode != 0
    assert "exceeds the 4 experts" in done.stderr


@pytest.mark.parametrize("text", ["0,x", "", "1,1", "-1,0"])
def test_parse_devices_rejects_bad_lists(text):
    from colibri_format.runtime.parallel.dist import parse_devices

    with pytest.raises(InvalidInput):
        parse_devices(text)


# --- the exchange plan (pure NumPy) ---------------------------------------------------------------------

@pytest.mark.parametrize("world,T", [(2, 15), (3, 1), (3, 2), (4, 9)])
def test_exchange_plans_agree_across_ranks(world, T):
    from colibri_format.runtime.parallel.ep import make_plan

    rng = np.random.default_rng(T)
    E, k = 8, 2
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    owners = plan_placement(E, [0], world).owner_array(0)
    plans = [make_plan(owners, idx, r, world) for r in range(world)]
    for a in range(world):
        for b in range(world):
            assert plans[a].send_splits[b] == plans[b].recv_splits[a]
    computed = np.sort(np.concatenate([p.recv_pairs for p in plans]))
    assert computed.tolist() == list(range(T * k))                      # every (token, slot) once
    assert all((owners[idx.reshape(-1)[p.recv_pairs]] == r).all() for r, p in enumerate(plans))


def test_resident_experts_refuse_foreign_experts():
    from colibri_format.runtime.parallel.ep import NotOwned, ResidentExperts

    cache = ResidentExperts({(0, 1)}, "cpu")
    arrays = (np.ones((4, 2), np.float32), np.ones((2, 2), np.float32))
    assert cache.get(0, 1, lambda: arrays)[0].shape == (4, 2)
    with pytest.raises(NotOwned):
        cache.get(0, 2, lambda: arrays)


# --- placement (pure Python) ----------------------------------------------------------------------------

def test_contiguous_placement_is_disjoint_and_balanced_in_count():
    p = plan_placement(8, [1, 3], 3)
    assert p.owners[1] == (0, 0, 0, 1, 1, 1, 2, 2) == p.owners[3]
    assert set().union(*(p.owned(r) for r in range(3))) == {(l, e) for l in (1, 3) for e in range(8)}
    assert sum(len(p.owned(r)) for r in range(3)) == 16
    assert quotas(8, 3) == [3, 3, 2]


def _skewed_trace(E=8, layers=(0, 1), steps=40, seed=0):
    from colibri_format.runtime.cache.trace import Trace, TraceRecord, make_header

    rng = np.random.default_rng(seed)
    probs = np.array([0.5 ** (e % 4) for e in range(E)])[::-1]        # hot experts clustered at high ids
    probs = probs / probs.sum()
    recs = [TraceRecord(t, 0, None, tuple((l, tuple(int(x) for x in rng.choice(E, 2, replace=False, p=probs)))
                                          for l in layers)) for t in range(steps)]
    return Trace(make_header(max(layers) + 1, layers, E, 2, "test"), recs)


def test_trace_balanced_placement_lowers_max_load_and_keeps_counts():
    trace = _skewed_trace()
    loads = expert_loads(trace, 8, (0, 1))
    contiguous = plan_placement(8, (0, 1), 2)
    balanced = plan_placement(8, (0, 1), 2, trace)
    assert balanced.strategy == "balanced"
    for layer in (0, 1):
        assert balanced.rank_loads(loads)[layer].max() <= contiguous.rank_loads(loads)[layer].max()
        counts = np.bincount(balanced.owner_array(layer), minlength=2)
        assert counts.max() - counts.min() <= 1
    assert balanced.imbalance(loads)["mean_max_over_mean"] < contiguous.imbalance(loads)["mean_max_over_mean"]
    summary = describe(balanced, loads)
    assert summary["predicted"]["mean_max_over_mean"] < summary["predicted_contiguous"]["mean_max_over_mean"]
    assert plan_placement(8, (0, 1), 2, trace) == balanced                # deterministic


def test_balanced_counts_within_one_for_uneven_split():
    trace = _skewed_trace(E=7, steps=60, seed=4)
    p = plan_placement(7, (0, 1), 3, trace)
    for layer in (0, 1):
        assert sorted(np.bincount(p.owner_array(layer), minlength=3).tolist()) == [2, 2, 3]


@pytest.mark.parametrize("args", [(4, [0], 5), (4, [0], 0), (0, [0], 1), (4, [0, 0], 2), (4, [0], True)])
def test_placement_rejects_bad_sizes(args):
    with pytest.raises(InvalidInput):
        plan_placement(*args)


def test_placement_rejects_trace_of_another_model():
    with pytest.raises(InvalidInput):
        plan_placement(4, (0, 1), 2, _skewed_trace(E=8))


if __name__ == "__main__":
    cli = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--port"):
        cli.add_argument(flag, type=int, required=True)
    cli.add_argument("--job", required=True)
    ns = cli.parse_args()
    rank_main(ns.rank, ns.world, ns.port, ns.job)
