"""Data safety of `colibri convert` at the command line: each case family runs `python -m colibri_format convert`
in a subprocess and checks the exit code, standard error (exactly one `error:` line plus the COLIBRI_DEBUG hint
line that cli/errors.py prints after library errors; nothing at all on success with --quiet) and a clean standard
output.

Families: the output path (an unrelated file, the checkpoint's own files, a symlink, an existing .colibri without
and with --force); symlinks planted at the temporary names; resume after a same-size in-place edit with the mtime
kept; tensors nothing uses; NaN/inf, float16 overflow and float64 beyond float32 (named by tensor, index, layer and
expert); huge numbers in every JSON file the converter reads; tokenizer files that do not load or carry odd types;
rows of ~1e-44 beside zero groups (finite error statistics, through a crash and resume); what a refusal leaves
behind (nothing, unless a resume can reuse it); weights that are not floats; an index naming too many shards and
shard headers adding up over the cap; an oversized tokenizer.json.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

import colibri_format
from colibri_format.cli.errors import DEBUG_HINT
from colibri_format.convert import crashpoint
from colibri_format.convert.pipeline import convert
from colibri_format.convert.safetensors_file import HEADER_MAX_BYTES
from colibri_format.convert.source import MAX_SHARDS, MAX_TOTAL_HEADER_BYTES
from colibri_format.convert.tokenizer_files import TOKENIZER_JSON_MAX_BYTES
from tests.convert.edge_checkpoints import (INDEX, add_tensors, add_tokenizer, edit_config, make_small, poke,
                                            poke_rows, shard_of, to_float64)

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("COLIBRI_DEBUG", "COLIBRI_CRASH_AT", "COLUMNS")}
ENV["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
EXPERT = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
HUGE = "1" + "0" * 5000   # over Python's int-conversion digit limit
BIG = "1" + "0" * 400     # an int no float holds


def convert_cli(ckpt: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_format", "convert", "--model-path", str(ckpt),
                           "--output-path", str(out), "--quiet", "--workers", "1", *extra],
                          capture_output=True, env=env or ENV, timeout=180)


def lines(data: bytes) -> list[str]:
    return data.decode("utf-8", "backslashreplace").splitlines()


def assert_one_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 1, nothing on standard output, standard error = one `error:` line + the COLIBRI_DEBUG hint."""
    err = lines(done.stderr)
    assert done.returncode == 1, err
    assert done.stdout == b"", done.stdout[:300]
    assert len(err) == 2 and err[0].startswith("error: ") and err[1] == DEBUG_HINT, err
    for needle in needles:
        assert needle in err[0], err
    return err[0]


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, lines(done.stderr)
    assert done.stdout == b"" and done.stderr == b""


def digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_small(tmp_path_factory.mktemp("edges") / "ckpt")


@pytest.fixture(scope="module")
def crash_points(base, tmp_path_factory) -> int:
    crashpoint.reset()
    convert(base, tmp_path_factory.mktemp("count") / "m.colibri", workers=1)
    return crashpoint.count()


@pytest.fixture()
def ckpt(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ckpt"))


# --- the output path -----------------------------------------------------------------------------
def test_output_path_family(ckpt, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for extra in ((), ("--force",)):
        assert_one_error(convert_cli(ckpt, notes, *extra), "not a .colibri file", "output_path")
    assert notes.read_text() == "mine"

    shard = sorted(ckpt.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    for target in (shard, ckpt / "config.json"):
        assert_one_error(convert_cli(ckpt, target, "--force"), f"checkpoint's own {target.name}")
    assert shard.read_bytes() == before

    link = tmp_path / "link.colibri"
    link.symlink_to(tmp_path / "elsewhere.colibri")
    assert_one_error(convert_cli(ckpt, link, "--force"), "symbolic link")
    assert not (tmp_path / "elsewhere.colibri").exists()

    out = tmp_path / "m.colibri"
    assert_ok(convert_cli(ckpt, out))
    first = digest(out)
    poke(ckpt, EXPERT, (0, 0), 0.25)
    assert_one_error(convert_cli(ckpt, out), "already exists", "--force")
    assert digest(out) == first
    assert_ok(convert_cli(ckpt, out, "--force"))
    assert digest(out) != first


# --- temporary names -------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [(), ("--restart",)])
def test_planted_symlinks_at_the_temporary_names(ckpt, tmp_path, extra):
    out = tmp_path / "m.colibri"
    victims = {}
    for suffix in (".part", ".journal", ".journal.new", ".lock"):
        victim = tmp_path / f"victim{suffix}"
        victim.write_bytes(suffix.encode() * 50)
        victims[victim] = victim.read_bytes()
        out.with_name(f".{out.name}{suffix}").symlink_to(victim)
    assert_ok(convert_cli(ckpt, out, *extra))
    assert all(v.read_bytes() == data for v, data in victims.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", "m.colibri", *(v.name for v in victims)])


# --- resume ------------------------------------------------------------------------------------------
def test_resume_after_a_same_size_edit_with_the_mtime_kept(ckpt, tmp_path, crash_points):
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    done = convert_cli(ckpt, out, env={**ENV, "COLIBRI_CRASH_AT": str(crash_points - 2)})
    assert done.returncode == -signal.SIGKILL, lines(done.stderr)
    shard = shard_of(ckpt, EXPERT)
    stamp = shard.stat().st_mtime_ns
    poke(ckpt, EXPERT, (4, 4), -3.0, keep_mtime=True)
    assert shard.stat().st_mtime_ns == stamp
    assert_ok(convert_cli(ckpt, out))
    fresh = tmp_path / "fresh.colibri"
    assert_ok(convert_cli(ckpt, fresh))
    assert digest(out) == digest(fresh)


# --- unused tensors ----------------------------------------------------------------------------------
def test_unused_tensors(ckpt, tmp_path):
    edit_config(ckpt, num_hidden_layers=1)
    line = assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"), "19 checkpoint tensors", "model.layers.1.",
                            "and 14 more", "--allow-unused-tensors")
    assert "model.layers.0." not in line
    assert_ok(convert_cli(ckpt, tmp_path / "m.colibri", "--allow-unused-tensors"))


def test_skipped_tensors_convert(ckpt, tmp_path):
    add_tensors(ckpt, {"model.layers.1.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    assert_ok(convert_cli(ckpt, tmp_path / "m.colibri"))


# --- non-finite and unrepresentable weights ----------------------------------------------------------
def test_non_finite_weights(ckpt, tmp_path):
    poke(ckpt, EXPERT, (5, 9), float("nan"))
    out = tmp_path / "m.colibri"
    assert_one_error(convert_cli(ckpt, out), f"tensor '{EXPERT}' holds NaN at index [5, 9], in expert 1 of layer 0;",
                     "offset=")
    assert_one_error(convert_cli(ckpt, out, "--allow-non-finite"), "int8 experts cannot hold it", "expert 1 of layer 0")
    assert_ok(convert_cli(ckpt, tmp_path / "f.colibri", "--quantize", "none", "--allow-non-finite"))
    assert not out.exists()


def test_float16_overflow_and_float64_beyond_float32(ckpt, tmp_path):
    poke(ckpt, "model.norm.weight", (3,), 1e6)
    assert_one_error(convert_cli(ckpt, tmp_path / "a.colibri"), "'model.norm.weight' holds 1e+06 at index [3]",
                     "beyond the float16 range", "--allow-non-finite")
    assert_ok(convert_cli(ckpt, tmp_path / "b.colibri", "--dtype", "float32"))
    to_float64(ckpt)
    poke(ckpt, EXPERT, (1, 1), -1e200)
    assert_one_error(convert_cli(ckpt, tmp_path / "c.colibri", "--dtype", "float32"),
                     "holds -1e+200 at index [1, 1], beyond the float32 range")


# --- JSON numbers ------------------------------------------------------------------------------------
def _raw_json(path: Path, key: str, literal: str) -> None:
    obj = json.loads(path.read_text())
    obj[key] = "@@"
    path.write_text(json.dumps(obj).replace('"@@"', literal))


@pytest.mark.parametrize("name, key, literal, needle", [
    ("config.json", "num_hidden_layers", HUGE, "config.json holds a number too large"),
    ("config.json", "rope_theta", BIG, "'rope_theta'"),
    ("model.safetensors.index.json", "metadata", HUGE, "index.json holds a number too large"),
    ("tokenizer.json", "version", HUGE, "tokenizer.json holds a number too large"),
    ("tokenizer_config.json", "model_max_length", "1e999", "overflows to infinity"),
    ("generation_config.json", "eos_token_id", HUGE, "generation_config.json holds a number too large"),
    ("generation_config.json", "eos_token_id", BIG, "'eos_token_id' must be an integer"),
])
def test_huge_numbers_in_json(ckpt, tmp_path, name, key, literal, needle):
    add_tokenizer(ckpt)
    _raw_json(ckpt / name, key, literal)
    assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"), needle)


def test_huge_number_in_a_safetensors_header(ckpt, tmp_path):
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = data[8:8 + n].decode().replace('"data_offsets":[0,', f'"data_offsets":[{HUGE},', 1).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"), f"{shard.name} header holds a number too large")


# --- tokenizer files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("config, generation, needle", [
    (None, {"eos_token_id": "2"}, "generation_config.json: 'eos_token_id' must be an integer"),
    ({"eos_token": ["</s>"]}, None, "tokenizer_config.json: 'eos_token' must be a string"),
    ({"chat_template": {"default": "x"}}, None, "'chat_template' must be a string"),
])
def test_odd_tokenizer_types(ckpt, tmp_path, config, generation, needle):
    add_tokenizer(ckpt, config=config, generation=generation)
    assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"), needle)


def test_tokenizer_json_that_does_not_load(ckpt, tmp_path):
    add_tokenizer(ckpt)
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"), "tokenizer.json does not load as a tokenizer")


# --- error statistics of tiny rows -------------------------------------------------------------------------
def test_tiny_rows_with_zero_groups_convert_and_resume(ckpt, tmp_path):
    v = np.float32(1e-44)
    poke_rows(ckpt, EXPERT, {0: np.where(np.arange(64) < 16, v, 0), 1: np.zeros(64), 2: np.full(64, v),
                             3: np.where(np.arange(64) == 3, 1.0, v)})
    fresh = tmp_path / "fresh.colibri"
    crashpoint.reset()
    convert(ckpt, fresh, group_size=16, workers=1)
    late = crashpoint.count() - 2
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    done = convert_cli(ckpt, out, "--group-size", "16", env={**ENV, "COLIBRI_CRASH_AT": str(late)})
    assert done.returncode == -signal.SIGKILL, lines(done.stderr)
    assert_ok(convert_cli(ckpt, out, "--group-size", "16"))
    assert digest(out) == digest(fresh)
    with colibri_format.open(out) as f:
        error = f.metadata["quantization"]["error"]
    assert all(math.isfinite(x) for row in error["per_expert"] for x in row[2:])


# --- what a refused conversion leaves behind ---------------------------------------------------------------
def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_refusal_no_resume_can_mend_leaves_nothing(ckpt, tmp_path):
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    poke(ckpt, "model.layers.1.block_sparse_moe.experts.3.w2.weight", (0, 0), float("inf"))  # the last piece
    line = assert_one_error(convert_cli(ckpt, out), "holds +inf", "in expert 3 of layer 1", "int8 experts")
    assert "kept" not in line and hidden(out.parent) == []


def test_a_refusal_a_resume_gets_past_keeps_the_pieces_and_says_so(ckpt, tmp_path):
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    poke(ckpt, "model.layers.1.self_attn.k_proj.weight", (0, 0), float("nan"))
    assert_one_error(convert_cli(ckpt, out), "holds NaN", "converted pieces are kept (.m.colibri.part, "
                     ".m.colibri.journal): run the same command again to resume, or add --restart to start over")
    assert hidden(out.parent) == [".m.colibri.journal", ".m.colibri.part"]
    assert_ok(convert_cli(ckpt, out, "--allow-non-finite"))
    assert hidden(out.parent) == []


def test_a_weight_that_is_not_a_float_is_refused_before_converting(ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    shard = shard_of(ckpt, EXPERT)
    tensors = load_file(str(shard))
    tensors[EXPERT] = tensors[EXPERT].astype(np.int8)
    save_file(tensors, str(shard))
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    assert_one_error(convert_cli(ckpt, out), f"tensor '{EXPERT}' is stored as i8; only float32, float16")
    assert hidden(out.parent) == []


# --- shards and their headers ------------------------------------------------------------------------------
def test_an_index_naming_too_many_shards(ckpt, tmp_path):
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"].update({f"x.{i}": f"s-{i:06d}.safetensors" for i in range(MAX_SHARDS + 1)})
    (ckpt / INDEX).write_text(json.dumps(index))
    count = len(set(index["weight_map"].values()))
    assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"),
                     f"{INDEX} names {count:,} weight files, over the limit of {MAX_SHARDS:,}")


def test_shard_headers_adding_up_over_the_cap(ckpt, tmp_path):
    index = json.loads((ckpt / INDEX).read_text())
    for i in range(MAX_TOTAL_HEADER_BYTES // (HEADER_MAX_BYTES - 1) + 1):
        with open(ckpt / f"big-{i}.safetensors", "wb") as fh:  # sparse: a declared header, never read
            fh.write((HEADER_MAX_BYTES - 1).to_bytes(8, "little"))
            fh.truncate(HEADER_MAX_BYTES + 7)
        index["weight_map"][f"big.{i}"] = f"big-{i}.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index))
    assert_one_error(convert_cli(ckpt, tmp_path / "m.colibri"), "safetensors headers of the",
                     f"bytes together, over the limit of {MAX_TOTAL_HEADER_BYTES:,}")


# --- an oversized tokenizer file -------------------------------------------------------------------------
def test_an_oversized_tokenizer_json_is_refused_first(ckpt, tmp_path):
    add_tokenizer(ckpt)
    with open(ckpt / "tokenizer.json", "r+b") as fh:
        fh.truncate(TOKENIZER_JSON_MAX_BYTES + 1)  # sparse
    out = tmp_path / "out" / "m.colibri"
    out.parent.mkdir()
    assert_one_error(convert_cli(ckpt, out), f"tokenizer.json is {TOKENIZER_JSON_MAX_BYTES + 1:,} bytes, over the "
                     f"{TOKENIZER_JSON_MAX_BYTES:,}-byte cap on it")
    assert hidden(out.parent) == []
