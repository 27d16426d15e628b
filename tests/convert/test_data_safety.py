"""Data safety of `convert()`: what it may replace at its output path, the temporary files it never writes through,
resume against a source edited in place, tensors nothing uses, non-finite and unrepresentable weights, huge numbers
in the JSON it reads, and the tokenizer files it embeds. Each refusal is one ColibriFormatError subclass.
(tests/cli/test_edges_convert.py runs the same families through the command line.)"""

from __future__ import annotations

import json
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
from colibri_format.convert import crashpoint
from colibri_format.convert.journal import journal_path_for, lock_path_for, read_journal
from colibri_format.convert.pipeline import convert
from colibri_format.convert.verify import keep_journaled_pieces
from colibri_format.inspect import validate_file
from colibri_format.errors import (ColibriFormatError, InvalidInput, InvalidTokenizer, NonFiniteWeight,
                                   OutputPathRefused, UnusedTensors)
from colibri_format.writer import part_path_for
from tests.convert.edge_checkpoints import (add_tensors, add_tokenizer, edit_config, make_small, poke, read_element,
                                            shard_of, to_float64)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ENV.pop("COLIBRI_CRASH_AT", None)
EXPERT = "model.layers.0.block_sparse_moe.experts.1.w1.weight"   # [32, 64]
DOWN = "model.layers.1.block_sparse_moe.experts.2.w2.weight"      # [64, 32]


def _digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return make_small(tmp_path_factory.mktemp("small") / "ckpt")


@pytest.fixture()
def ckpt(small, tmp_path) -> Path:
    """A private copy of the small checkpoint, free to damage."""
    return Path(shutil.copytree(small, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def clean(small, tmp_path_factory) -> tuple[str, int]:
    """(digest of the small checkpoint's conversion, number of crash points it passes)."""
    out = tmp_path_factory.mktemp("clean") / "m.colibri"
    crashpoint.reset()
    convert(small, out, workers=1)
    return _digest(out), crashpoint.count()


# --- the output path ---------------------------------------------------------------------------------
def test_an_unrelated_file_is_never_replaced(ckpt, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("my notes")
    for force in (False, True):
        with pytest.raises(OutputPathRefused, match="not a .colibri file") as info:
            convert(ckpt, out, force=force)
        assert info.value.field == "output_path"
    assert out.read_text() == "my notes"
    assert not part_path_for(out).exists() and not lock_path_for(out).exists()


@pytest.mark.parametrize("name", ["model-00001-of-00009.safetensors", "config.json",
                                  "model.safetensors.index.json", "tokenizer.json", "generation_config.json"])
def test_the_checkpoints_own_files_are_never_replaced(ckpt, name):
    add_tokenizer(ckpt)
    target = ckpt / name
    before = target.read_bytes()
    for force in (False, True):
        with pytest.raises(OutputPathRefused, match=f"checkpoint's own {name}"):
            convert(ckpt, target, force=force)
    assert target.read_bytes() == before


def test_a_colibri_inside_the_checkpoint_folder_is_not_a_source(ckpt, clean):
    out = ckpt / "m.colibri"
    convert(ckpt, out)
    convert(ckpt, out, force=True)
    assert _digest(out) == clean[0]


def test_a_source_reached_through_a_hard_link_or_a_linked_folder_is_refused(ckpt, tmp_path):
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    hard = tmp_path / "hard.colibri"
    os.link(shard, hard)
    linked = tmp_path / "linked"
    linked.symlink_to(ckpt, target_is_directory=True)
    for out in (hard, linked / shard.name):
        with pytest.raises(OutputPathRefused, match="checkpoint's own"):
            convert(ckpt, out, force=True)
    assert shard.read_bytes() == before


def test_a_symlink_at_the_output_path_is_refused(ckpt, tmp_path, clean):
    real = tmp_path / "real.colibri"
    convert(ckpt, real)
    before = real.read_bytes()
    for target in (real, tmp_path / "missing.colibri"):
        link = tmp_path / "link.colibri"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        with pytest.raises(OutputPathRefused, match="symbolic link"):
            convert(ckpt, link, force=True)
        assert link.is_symlink() and os.readlink(link) == str(target)
    assert real.read_bytes() == before and not (tmp_path / "missing.colibri").exists()


def test_an_existing_colibri_is_replaced_only_with_force(ckpt, tmp_path, clean):
    out = tmp_path / "m.colibri"
    convert(ckpt, out)
    poke(ckpt, EXPERT, (0, 0), 0.5)
    with pytest.raises(OutputPathRefused, match="--force"):
        convert(ckpt, out)
    assert _digest(out) == clean[0]
    convert(ckpt, out, force=True)
    assert _digest(out) != clean[0]
    assert validate_file(out).valid


def test_a_fifo_at_the_output_path_is_refused_without_blocking(ckpt, tmp_path):
    fifo = tmp_path / "pipe.colibri"
    os.mkfifo(fifo)
    with pytest.raises(OutputPathRefused, match="not a regular file"):
        convert(ckpt, fifo, force=True)


def test_something_appearing_at_the_output_during_the_conversion_is_not_replaced(ckpt, tmp_path, monkeypatch):
    out = tmp_path / "m.colibri"
    from colibri_format.convert import pipeline

    real = pipeline._metadata

    def plant(job, run):
        out.write_text("arrived meanwhile")
        return real(job, run)

    monkeypatch.setattr(pipeline, "_metadata", plant)
    with pytest.raises(OutputPathRefused, match="not a .colibri file"):
        convert(ckpt, out)
    assert out.read_text() == "arrived meanwhile"


def test_the_last_check_runs_just_before_the_rename(ckpt, tmp_path, monkeypatch):
    out = tmp_path / "m.colibri"
    from colibri_format.convert import pipeline

    real, calls = pipeline.check_output_path, []

    def check(dest, sources, *, force):
        calls.append(dest)
        if len(calls) == 3:  # at the start, after the pieces, then inside finalize before the rename
            out.write_text("arrived during finalize")
        return real(dest, sources, force=force)

    monkeypatch.setattr(pipeline, "check_output_path", check)
    with pytest.raises(OutputPathRefused, match="not a .colibri file"):
        convert(ckpt, out)
    assert out.read_text() == "arrived during finalize" and len(calls) == 3
    assert part_path_for(out).exists()  # complete and kept: the journal still lists every piece


# --- temporary files never follow a planted link -----------------------------------------------------
@pytest.mark.parametrize("which", [".part", ".journal", ".journal.new", ".lock"])
@pytest.mark.parametrize("resume", [True, False])
def test_planted_symlinks_at_temporary_names_are_not_followed(ckpt, tmp_path, clean, which, resume):
    out = tmp_path / "m.colibri"
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 100)
    link = out.with_name(f".{out.name}{which}")
    link.symlink_to(victim)
    convert(ckpt, out, resume=resume)
    assert victim.read_bytes() == b"precious" * 100
    assert _digest(out) == clean[0]
    assert not link.exists() and not link.is_symlink()


def test_planted_symlinks_to_missing_targets_create_nothing(ckpt, tmp_path, clean):
    out = tmp_path / "m.colibri"
    for suffix in (".part", ".journal", ".journal.new", ".lock"):
        out.with_name(f".{out.name}{suffix}").symlink_to(tmp_path / f"created{suffix}")
    convert(ckpt, out)
    assert not list(tmp_path.glob("created*"))
    assert _digest(out) == clean[0]


def test_a_directory_at_a_temporary_name_is_one_write_error(ckpt, tmp_path):
    from colibri_format.errors import WriteError

    out = tmp_path / "m.colibri"
    for suffix in (".lock", ".part"):
        blocker = out.with_name(f".{out.name}{suffix}")
        blocker.mkdir()
        with pytest.raises(WriteError):
            convert(ckpt, out)
        blocker.rmdir()
    convert(ckpt, out)


def test_a_hard_link_planted_at_the_part_name_is_not_written_through(ckpt, tmp_path, clean):
    out = tmp_path / "m.colibri"
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 100)
    os.link(victim, part_path_for(out))
    convert(ckpt, out)  # resume=True: an existing .part is reused only when it is ours alone
    assert victim.read_bytes() == b"precious" * 100 and _digest(out) == clean[0]


# --- resume checks the source bytes of every reused piece ------------------------------------------------
def _crash(ckpt: Path, out: Path, n: int, *extra: str) -> None:
    out.parent.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "colibri_format", "convert", "--model-path", str(ckpt),
                           "--output-path", str(out), "--quiet", "--workers", "1", *extra],
                          env={**ENV, "COLIBRI_CRASH_AT": str(n)}, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]


@pytest.mark.parametrize("tensor", [EXPERT, "model.embed_tokens.weight"])
def test_resume_after_a_same_size_edit_with_the_mtime_kept_equals_a_fresh_conversion(ckpt, tmp_path, clean,
                                                                                      tensor):
    out = tmp_path / "out" / "m.colibri"
    _crash(ckpt, out, clean[1] - 2)  # late: every piece is journaled, nothing finalized
    journaled = read_journal(journal_path_for(out)).pieces
    assert len(journaled) == 3 + 2 * 7 + 2 * 4
    shard = shard_of(ckpt, tensor)
    stamp = shard.stat().st_mtime_ns
    poke(ckpt, tensor, (3, 5), 7.0, keep_mtime=True)
    assert shard.stat().st_mtime_ns == stamp
    summary = convert(ckpt, out)
    assert summary.pieces_resumed == len(journaled) - 1  # only the edited piece is converted again
    fresh = tmp_path / "fresh.colibri"
    convert(ckpt, fresh)
    assert _digest(out) == _digest(fresh) != clean[0]


def test_journal_records_without_a_source_digest_are_redone(ckpt, tmp_path, clean):
    out = tmp_path / "out" / "m.colibri"
    _crash(ckpt, out, clean[1] - 2)
    path = journal_path_for(out)
    state = read_journal(path)
    from colibri_format.convert.journal import frame

    stripped = [{k: v for k, v in r.items() if k != "source"} for r in state.pieces]
    path.write_bytes(b"".join(frame(r) for r in [state.header, *stripped]))
    assert convert(ckpt, out).pieces_resumed == 0
    assert _digest(out) == clean[0]


def test_keep_journaled_pieces_checks_the_source_before_the_part(tmp_path):
    class Writer:
        def __init__(self):
            self.asked = []

        def slot(self, key):
            return key

        def keep_if_intact(self, key, checksum):
            self.asked.append(key)
            return True

    w = Writer()
    records = [{"kind": "dense", "name": "a", "checksum": 1, "source": 10},
               {"kind": "dense", "name": "b", "checksum": 2, "source": 11},
               {"kind": "dense", "name": "c", "checksum": 3, "source": 12, "non_finite": True},
               {"kind": "dense", "name": "d", "checksum": 4}]
    kept = keep_journaled_pieces(w, records, 2, {"a": 10, "b": 99, "c": 12, "d": 13}.__getitem__)
    assert [r["name"] for r in kept] == ["a"] and w.asked == ["a"]
    kept = keep_journaled_pieces(w, records, 2, {"a": 10, "b": 99, "c": 12, "d": 13}.__getitem__,
                                 allow_non_finite=True)
    assert [r["name"] for r in kept] == ["a", "c"]


# --- tensors nothing uses ----------------------------------------------------------------------------
def test_a_config_with_fewer_layers_than_the_weights_is_refused(ckpt, tmp_path):
    edit_config(ckpt, num_hidden_layers=1)
    with pytest.raises(UnusedTensors) as info:
        convert(ckpt, tmp_path / "m.colibri")
    text = str(info.value)
    n_layer = 2 + 5 + 4 * 3  # norms, q/k/v/o + router, 4 experts x 3
    assert f"{n_layer} checkpoint tensors" in text and "model.layers.1." in text
    assert f"and {n_layer - 5} more" in text and "--allow-unused-tensors" in text
    assert not (tmp_path / "m.colibri").exists() and not lock_path_for(tmp_path / "m.colibri").exists()
    out = tmp_path / "m.colibri"
    convert(ckpt, out, allow_unused_tensors=True)
    with colibri_format.open(out) as f:
        prov = f.metadata["provenance"]
    assert prov["unused_tensors"]["count"] == n_layer
    assert all(n.startswith("model.layers.1.") for n in prov["unused_tensors"]["names"])


def test_tensors_skipped_on_purpose_are_listed_in_the_provenance(ckpt, tmp_path):
    h = 64
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
             "lm_head.weight": None,  # already in the checkpoint; tied below
             "model.layers.2.input_layernorm.weight": np.ones(h, np.float32),     # MTP layer
             "model.layers.2.eh_proj.weight": np.ones((h, 2 * h), np.float32),
             "visual.blocks.0.attn.qkv.weight": np.ones((4, 4), np.float32)}
    add_tensors(ckpt, {k: v for k, v in extra.items() if v is not None})
    edit_config(ckpt, tie_word_embeddings=True, num_nextn_predict_layers=1, vision_config={"depth": 1})
    out = tmp_path / "m.colibri"
    convert(ckpt, out)
    with colibri_format.open(out) as f:
        prov = f.metadata["provenance"]
    reasons = {g["reason"].split(" (")[0]: g["names"] for g in prov["skipped_tensors"]}
    assert reasons == {"rotary inverse frequencies": ["model.layers.0.self_attn.rotary_emb.inv_freq"],
                       "lm_head": ["lm_head.weight"],
                       "multi-token-prediction layers": ["model.layers.2.eh_proj.weight",
                                                         "model.layers.2.input_layernorm.weight"],
                       "vision tower": ["visual.blocks.0.attn.qkv.weight"]}
    assert prov["unused_tensors"] == {"count": 0, "names": []}


def test_skip_rules_apply_only_when_the_config_declares_them(ckpt, tmp_path):
    add_tensors(ckpt, {"model.layers.2.input_layernorm.weight": np.ones(64, np.float32),
                       "visual.proj.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(UnusedTensors, match="2 checkpoint tensors"):
        convert(ckpt, tmp_path / "m.colibri")


# --- non-finite and unrepresentable weights ----------------------------------------------------------
@pytest.mark.parametrize("value, word", [(float("nan"), "NaN"), (float("inf"), "+inf"), (-float("inf"), "-inf")])
def test_non_finite_expert_weights_are_refused_with_name_index_and_offset(ckpt, tmp_path, value, word):
    offset = poke(ckpt, EXPERT, (5, 9), value)
    with pytest.raises(NonFiniteWeight) as info:
        convert(ckpt, tmp_path / "m.colibri")
    err = info.value
    assert f"tensor {EXPERT!r} holds {word} at index [5, 9]" in str(err)
    assert err.field == EXPERT and err.offset == offset
    assert read_element(ckpt, EXPERT, (5, 9)) == np.array([value], np.float32).tobytes()
    with pytest.raises(NonFiniteWeight, match="int8 experts cannot hold it"):   # allowed or not
        convert(ckpt, tmp_path / "m.colibri", allow_non_finite=True)
    out = tmp_path / "f.colibri"
    convert(ckpt, out, quantize="none", dtype="float32", allow_non_finite=True)
    with colibri_format.open(out) as f:
        gate = np.asarray(f.expert(0, 1).gate_up)
        got = gate[5, 9]
    assert (np.isnan(got) and np.isnan(value)) or got == value
    assert not (tmp_path / "m.colibri").exists()


def test_non_finite_in_a_fused_expert_tensor_names_expert_row_and_column(tiny_checkpoint, tmp_path):
    ckpt = Path(shutil.copytree(tiny_checkpoint("qwen3_moe", fused=True), tmp_path / "fused"))
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [E, 2I, H]
    offset = poke(ckpt, name, (2, 3, 4), float("inf"))
    with pytest.raises(NonFiniteWeight, match=r"holds \+inf at index \[2, 3, 4\]") as info:
        convert(ckpt, tmp_path / "m.colibri")
    assert info.value.field == name and info.value.offset == offset


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_non_finite_dense_weights_are_refused_unless_allowed(ckpt, tmp_path, dtype):
    poke(ckpt, "model.layers.1.self_attn.k_proj.weight", (2, 3), float("nan"))
    with pytest.raises(NonFiniteWeight, match=r"self_attn.k_proj.weight' holds NaN at index \[2, 3\]") as info:
        convert(ckpt, tmp_path / "m.colibri", dtype=dtype)
    assert "--allow-non-finite" in str(info.value)
    convert(ckpt, tmp_path / "m.colibri", dtype=dtype, allow_non_finite=True)


def test_float16_overflow_is_refused_and_wider_dtypes_take_it(ckpt, tmp_path):
    poke(ckpt, "model.embed_tokens.weight", (7, 1), -70000.0)
    with pytest.raises(NonFiniteWeight, match=r"holds -70000 at index \[7, 1\], beyond the float16 range"):
        convert(ckpt, tmp_path / "a.colibri")
    for dtype in ("bfloat16", "float32"):
        convert(ckpt, tmp_path / f"{dtype}.colibri", dtype=dtype)
    convert(ckpt, tmp_path / "a.colibri", allow_non_finite=True)  # stored as -inf, as asked
    with colibri_format.open(tmp_path / "a.colibri") as f:
        assert np.asarray(f.dense("embed_tokens"))[7, 1] == -np.inf


def test_float16_overflow_in_unquantized_experts(ckpt, tmp_path):
    poke(ckpt, DOWN, (60, 31), 1e5)
    with pytest.raises(NonFiniteWeight, match=r"index \[60, 31\], beyond the float16 range"):
        convert(ckpt, tmp_path / "m.colibri", quantize="none")
    convert(ckpt, tmp_path / "m.colibri", quantize="none", dtype="bfloat16", resume=False)


def test_float64_values_beyond_float32_are_refused(ckpt, tmp_path):
    to_float64(ckpt)
    poke(ckpt, EXPERT, (1, 2), 1e300)
    with pytest.raises(NonFiniteWeight, match=r"holds 1e\+300 at index \[1, 2\], beyond the float32 range"):
        convert(ckpt, tmp_path / "m.colibri")
    with pytest.raises(NonFiniteWeight, match="beyond the float32 range"):
        convert(ckpt, tmp_path / "f.colibri", quantize="none", dtype="float32")


def test_bfloat16_nan_is_refused(tmp_path):
    ckpt = make_small(tmp_path / "bf16", dtype="bfloat16")
    poke(ckpt, DOWN, (0, 0), float("nan"))
    with pytest.raises(NonFiniteWeight, match=r"holds NaN at index \[0, 0\]"):
        convert(ckpt, tmp_path / "m.colibri")


def test_subnormal_only_and_zero_rows_quantize_correctly(ckpt, tmp_path):
    tiny = np.float32(1e-40)  # subnormal float32
    shard_rows = {0: tiny, 1: np.float32(3e-45), 2: np.float32(2e-38), 3: np.float32(0.0)}
    for row, v in shard_rows.items():
        for col in range(64):
            poke(ckpt, EXPERT, (row, col), float(v) * (1 if col % 3 else -0.5))
    out = tmp_path / "m.colibri"
    for group in (None, 16):
        convert(ckpt, out, group_size=group, force=True)
        with colibri_format.open(out) as f:
            from colibri_format.reader import dequantize

            e = f.expert(0, 1)
            deq = dequantize(np.asarray(e.gate_up), np.asarray(e.gate_up_scale))
            assert np.isfinite(np.asarray(e.gate_up_scale)).all() and (np.asarray(e.gate_up_scale) > 0).all()
        for row, v in shard_rows.items():
            want = np.array([float(v) * (1 if c % 3 else -0.5) for c in range(64)], np.float32)
            scale = np.abs(want).max() / 127 if v else 1.0
            step = np.nextafter(np.float32(scale), np.float32(1)) if v else 0
            assert np.all(np.abs(deq[row].astype(np.float64) - want) <= step / 2 + 2.0**-149), (row, group)
        assert (deq[3] == 0).all()


def test_subnormal_dense_values_convert(ckpt, tmp_path):
    poke(ckpt, "model.norm.weight", (5,), 1e-40)
    for dtype in ("float16", "bfloat16", "float32"):
        out = tmp_path / f"{dtype}.colibri"
        convert(ckpt, out, dtype=dtype)
        with colibri_format.open(out) as f:
            got = f.dense_f32("final_norm")[5]
        # float32 keeps it exactly; float16 flushes it to 0 and bfloat16 rounds it: no error either way
        assert got == np.float32(1e-40) if dtype == "float32" else abs(float(got) - 1e-40) <= 1e-40


# --- JSON the converter reads ------------------------------------------------------------------------
HUGE = "1" + "0" * 5000            # over Python's int-conversion digit limit
BIG = "1" + "0" * 400              # a valid int that overflows a float


def _raw_json(path: Path, key: str, literal: str) -> None:
    obj = json.loads(path.read_text())
    obj[key] = "@@"
    path.write_text(json.dumps(obj).replace('"@@"', literal))


@pytest.mark.parametrize("name, key, literal", [
    ("config.json", "max_position_embeddings", HUGE), ("config.json", "rope_theta", BIG),
    ("config.json", "rms_norm_eps", "1e999"), ("config.json", "hidden_size", BIG),
    ("config.json", "eos_token_id", BIG),
    ("model.safetensors.index.json", "metadata", HUGE),
    ("tokenizer.json", "version", HUGE), ("tokenizer_config.json", "model_max_length", HUGE),
    ("tokenizer_config.json", "x", "1e999"),
    ("generation_config.json", "eos_token_id", HUGE), ("generation_config.json", "eos_token_id", BIG),
    ("generation_config.json", "temperature", "1e999"),
])
def test_huge_numbers_in_json_files_are_one_error(ckpt, tmp_path, name, key, literal):
    add_tokenizer(ckpt)
    _raw_json(ckpt / name, key, literal)
    with pytest.raises(ColibriFormatError) as info:
        convert(ckpt, tmp_path / "m.colibri")
    assert isinstance(info.value, InvalidInput) and len(str(info.value)) < 600
    assert "\n" not in str(info.value)


def _rewrite_header(shard: Path, edit) -> None:
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    text = edit(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


@pytest.mark.parametrize("edit", [
    lambda h: json.dumps(h).replace('"data_offsets": [0, ', f'"data_offsets": [{HUGE}, ', 1),
    lambda h: json.dumps(h).replace('"shape": [', f'"shape": [{BIG}, ', 1),
    lambda h: json.dumps(h).replace('"shape": [', f'"shape": [{"9" * 4000}, {"9" * 4000}, ', 1),
    lambda h: json.dumps({**h, "__metadata__": "@@"}).replace('"@@"', HUGE),
])
def test_huge_numbers_in_a_safetensors_header_are_one_error(ckpt, tmp_path, edit):
    _rewrite_header(sorted(ckpt.glob("*.safetensors"))[0], edit)
    with pytest.raises(InvalidInput) as info:
        convert(ckpt, tmp_path / "m.colibri")
    assert len(str(info.value)) < 600


# --- tokenizer files -----------------------------------------------------------------------------------
def test_a_good_tokenizer_is_embedded(ckpt, tmp_path):
    add_tokenizer(ckpt, config={"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
                                "pad_token": None, "additional_special_tokens": ["<s>"],
                                "model_max_length": 1000000000000000019884624838656,  # int(1e30), as HF writes
                                "chat_template": [{"name": "default", "template": "{{ messages }}"}]},
                  generation={"eos_token_id": [2, 1], "pad_token_id": -1, "bos_token_id": 1})
    convert(ckpt, tmp_path / "m.colibri")
    with colibri_format.open(tmp_path / "m.colibri") as f:
        tok = f.metadata["tokenizer"]
    assert tok["tokenizer_config"]["model_max_length"] == 10**30 + 19884624838656
    assert tok["generation_config"]["eos_token_id"] == [2, 1]


@pytest.mark.parametrize("config, generation, needle", [
    (None, {"eos_token_id": "2"}, "'eos_token_id' must be an integer"),
    (None, {"eos_token_id": True}, "'eos_token_id'"),
    (None, {"eos_token_id": []}, "'eos_token_id'"),
    (None, {"eos_token_id": 128}, r"in \[0, 127\]"),
    (None, {"eos_token_id": [2, "x"]}, "'eos_token_id'"),
    (None, {"bos_token_id": 1.5}, "'bos_token_id'"),
    ({"eos_token": 5}, None, "'eos_token' must be a string"),
    ({"bos_token": {"content": 3}}, None, "'bos_token'"),
    ({"additional_special_tokens": "x"}, None, "'additional_special_tokens'"),
    ({"chat_template": 7}, None, "'chat_template'"),
    ({"chat_template": [{"name": "default"}]}, None, "'chat_template'"),
    ({"nested": json.loads("[" * 20 + "]" * 20)}, None, "nested too deeply"),
])
def test_odd_tokenizer_fields_are_refused(ckpt, tmp_path, config, generation, needle):
    add_tokenizer(ckpt, config=config, generation=generation)
    with pytest.raises(InvalidTokenizer, match=needle):
        convert(ckpt, tmp_path / "m.colibri")


def test_a_tokenizer_json_that_does_not_load_is_refused(ckpt, tmp_path):
    add_tokenizer(ckpt)
    (ckpt / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": "x"},
                                                                                 "merges": []}}))
    with pytest.raises(InvalidTokenizer, match="does not load as a tokenizer"):
        convert(ckpt, tmp_path / "m.colibri")


def test_config_json_eos_token_id_is_checked(ckpt, tmp_path):
    edit_config(ckpt, eos_token_id={"id": 2})
    with pytest.raises(InvalidTokenizer, match="config.json: 'eos_token_id'"):
        convert(ckpt, tmp_path / "m.colibri")
