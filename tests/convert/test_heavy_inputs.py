"""Hostile and heavy inputs to `convert()`, part two: non-finite weights named by tensor, layer, expert and
element; error statistics of tiny (subnormal) and zero rows; what a refused conversion leaves behind; the bound
on shards and on their safetensors headers together; fused expert tensors read from a pickle without a copy per
expert; tokenizer files and the whole metadata sized before anything is converted.
(tests/cli/test_edges_convert.py runs the refusals through the command line.)"""

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
from colibri_format import spec as S
from colibri_format import writer as writer_module
from colibri_format.convert import crashpoint, emit, pipeline, source, tokenizer_files
from colibri_format.convert.journal import journal_path_for, lock_path_for, read_journal
from colibri_format.convert.pipeline import convert
from colibri_format.convert.safetensors_file import HEADER_MAX_BYTES, SafetensorsFile
from colibri_format.errors import (InvalidInput, InvalidTokenizer, NonFiniteWeight, UnsupportedModel,
                                   WriteError)
from colibri_format.writer import part_path_for
from tests.convert.edge_checkpoints import INDEX, add_tensors, add_tokenizer, make_small, poke, poke_rows, to_float64

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ENV.pop("COLIBRI_CRASH_AT", None)
EXPERT = "model.layers.0.block_sparse_moe.experts.1.w1.weight"      # [32, 64]
LAST_EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"  # [64, 32], the last piece converted
DENSE = "model.layers.1.self_attn.k_proj.weight"


def _digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def _hidden(folder: Path) -> list[str]:
    """What the converter may leave beside its output: the .part, the journal (and its .new), the lock."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return make_small(tmp_path_factory.mktemp("small") / "ckpt")


@pytest.fixture()
def ckpt(small, tmp_path) -> Path:
    return Path(shutil.copytree(small, tmp_path / "ckpt"))


@pytest.fixture()
def out(tmp_path) -> Path:
    (tmp_path / "out").mkdir()
    return tmp_path / "out" / "m.colibri"


# --- 1. a non-finite weight is named by tensor, layer, expert and element ----------------------------------
@pytest.mark.parametrize("options, needle", [
    ({}, "int8 experts cannot hold it"),
    ({"group_size": 16}, "int8 experts cannot hold it"),
    ({"quantize": "none"}, "--allow-non-finite stores"),
    ({"quantize": "none", "dtype": "bfloat16"}, "--allow-non-finite stores"),
])
@pytest.mark.parametrize("value, word", [(float("nan"), "NaN"), (float("-inf"), "-inf")])
def test_a_non_finite_expert_weight_names_tensor_index_layer_and_expert(ckpt, out, options, needle, value, word):
    offset = poke(ckpt, EXPERT, (17, 40), value)
    with pytest.raises(NonFiniteWeight) as info:
        convert(ckpt, out, **options)
    text = str(info.value)
    assert f"tensor {EXPERT!r} holds {word} at index [17, 40], in expert 1 of layer 0; {needle}" in text
    assert info.value.field == EXPERT and info.value.offset == offset and "field=weight" not in text


def test_overflow_in_an_expert_names_layer_and_expert_and_a_dense_tensor_names_none(ckpt, out):
    to_float64(ckpt)
    poke(ckpt, LAST_EXPERT, (63, 31), 1e300)
    with pytest.raises(NonFiniteWeight, match=r"holds 1e\+300 at index \[63, 31\], beyond the float32 range "
                                              r"\(largest 3.40282e\+38\), in expert 3 of layer 1; int8"):
        convert(ckpt, out)
    with pytest.raises(NonFiniteWeight, match=r"index \[63, 31\], beyond the float16 range .*in expert 3 of layer 1"):
        convert(ckpt, out, quantize="none")
    poke(ckpt, LAST_EXPERT, (63, 31), 0.5)
    poke(ckpt, DENSE, (2, 3), float("inf"))
    with pytest.raises(NonFiniteWeight) as info:
        convert(ckpt, out, resume=False)  # the float16 run above kept its pieces for a resume
    assert f"{DENSE!r} holds +inf at index [2, 3]; --allow" in str(info.value) and "expert" not in str(info.value)


def test_a_non_finite_value_in_a_fused_tensor_names_its_expert_twice(tiny_checkpoint, tmp_path):
    ckpt = Path(shutil.copytree(tiny_checkpoint("qwen3_moe", fused=True), tmp_path / "fused"))
    name = "model.layers.1.mlp.experts.down_proj"  # [E, H, I]
    poke(ckpt, name, (3, 30, 7), float("nan"))
    with pytest.raises(NonFiniteWeight, match=r"holds NaN at index \[3, 30, 7\], in expert 3 of layer 1;"):
        convert(ckpt, tmp_path / "m.colibri")


# --- 2. tiny, subnormal and zero rows ----------------------------------------------------------------------
def _tiny_rows(ckpt: Path, magnitude: float) -> None:
    """Rows of an expert matrix near 1e-44: whole, in one group among zero groups, mixed with a normal value,
    all zero; and a second expert whose whole matrix is zero."""
    v = np.float32(magnitude)
    row = np.zeros(64, np.float32)
    poke_rows(ckpt, EXPERT, {0: np.full(64, v), 1: np.where(np.arange(64) < 16, v, 0), 2: np.zeros(64),
                             3: np.where(np.arange(64) % 16 == 5, -v, 0), 4: np.where(np.arange(64) == 9, 1.0, v)})
    poke_rows(ckpt, "model.layers.1.block_sparse_moe.experts.0.w3.weight", {r: row for r in range(32)})


def _errors_are_finite(path: Path) -> list:
    with colibri_format.open(path) as f:
        error = f.metadata["quantization"]["error"]
    values = [error["max_rel"], error["mean_rel"], *(x for row in error["per_expert"] for x in row[2:])]
    assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in values), error
    return error["per_expert"]


@pytest.mark.parametrize("magnitude", [1e-44, 1.4e-45, 1e-40, 2e-39])
@pytest.mark.parametrize("group", [None, 16])
def test_tiny_rows_with_zero_groups_convert_with_finite_errors(ckpt, out, magnitude, group):
    _tiny_rows(ckpt, magnitude)
    convert(ckpt, out, group_size=group)
    per_expert = _errors_are_finite(out)
    assert [row[2] for row in per_expert if row[:2] == [1, 0]] == [pytest.approx(per_expert[4][2])]
    assert not _hidden(out.parent)


def test_tiny_rows_are_journaled_with_finite_errors_and_resume(ckpt, out):
    _tiny_rows(ckpt, 1e-44)
    crashpoint.reset()
    convert(ckpt, out.with_name("fresh.colibri"), group_size=16)
    late = crashpoint.count() - 2  # every piece journaled, nothing finalized
    done = subprocess.run([sys.executable, "-m", "colibri_format", "convert", "--model-path", str(ckpt),
                           "--output-path", str(out), "--quiet", "--workers", "1", "--group-size", "16"],
                          env={**ENV, "COLIBRI_CRASH_AT": str(late)}, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    records = read_journal(journal_path_for(out)).pieces
    experts = [r for r in records if r["kind"] == "expert"]
    assert len(experts) == 8 and all(all(math.isfinite(x) for x in r["error"]) for r in experts)
    assert convert(ckpt, out, group_size=16).pieces_resumed == len(records)
    assert _digest(out) == _digest(out.with_name("fresh.colibri"))
    _errors_are_finite(out)


def test_a_non_finite_number_is_never_written_to_the_journal(ckpt, out, monkeypatch):
    real = emit.fill_expert

    def nan_stats(*args, **kwargs):
        filled = real(*args, **kwargs)
        return filled._replace(stats=emit.ErrorStats(float("nan"), 0.0, 1))

    monkeypatch.setattr(pipeline, "fill_expert", nan_stats)
    with pytest.raises(WriteError, match=r"cannot journal the expert record \[0, 0\]: it holds a non-finite"):
        convert(ckpt, out, workers=1)
    assert _hidden(out.parent) == []  # the batch holding it never reached the journal: nothing to resume


# --- 3. what a refused conversion leaves behind ------------------------------------------------------------
def test_a_refusal_no_resume_can_mend_removes_the_part_and_the_journal(ckpt, out, monkeypatch):
    poke(ckpt, LAST_EXPERT, (10, 10), float("nan"))
    seen = []
    real = pipeline._after_refusal

    def spy(exc, job, writer, journal, state, journal_file):
        seen.append((journal.pieces, part_path_for(out).exists(), journal_file.exists()))
        return real(exc, job, writer, journal, state, journal_file)

    monkeypatch.setattr(pipeline, "_after_refusal", spy)
    with pytest.raises(NonFiniteWeight, match="int8 experts cannot hold it") as info:
        convert(ckpt, out, workers=1)
    assert seen == [(3 + 2 * 7 + 7, True, True)]  # every other piece was journaled, and nothing is kept
    assert "kept" not in str(info.value)
    assert _hidden(out.parent) == [] and not out.exists()


def test_a_refusal_before_any_piece_is_durable_removes_what_it_created(ckpt, out, monkeypatch):
    def full(*args, **kwargs):
        raise WriteError("write failed: No space left on device", field="offset", value=0)

    monkeypatch.setattr(pipeline, "fill_dense", full)  # the first pieces fail: a resume would have nothing
    with pytest.raises(WriteError, match="No space left") as info:
        convert(ckpt, out, workers=1)
    assert "kept" not in str(info.value) and _hidden(out.parent) == []
    monkeypatch.undo()
    monkeypatch.setattr(writer_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 1))
    with pytest.raises(WriteError, match="not enough free space") as info:
        convert(ckpt, out)
    assert "kept" not in str(info.value) and _hidden(out.parent) == []


def test_an_earlier_runs_empty_journal_goes_too(ckpt, out, monkeypatch):
    done = subprocess.run([sys.executable, "-m", "colibri_format", "convert", "--model-path", str(ckpt),
                           "--output-path", str(out), "--quiet", "--workers", "1"],
                          env={**ENV, "COLIBRI_CRASH_AT": "3"}, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert read_journal(journal_path_for(out)).pieces == [] and part_path_for(out).exists()
    monkeypatch.setattr(writer_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 1))
    with pytest.raises(WriteError, match="not enough free space"):
        convert(ckpt, out)
    assert _hidden(out.parent) == []


@pytest.mark.parametrize("case", ["dense-nan", "float-expert-nan", "disk-full"])
def test_a_refusal_a_resume_can_get_past_keeps_the_pieces_and_says_so(ckpt, out, tmp_path, monkeypatch, case):
    options = {"quantize": "none"} if case == "float-expert-nan" else {}
    if case == "dense-nan":
        poke(ckpt, DENSE, (1, 1), float("nan"))
    elif case == "float-expert-nan":
        poke(ckpt, LAST_EXPERT, (1, 1), float("nan"))
    else:
        real, calls = pipeline.fill_expert, []

        def full(stream, *args, **kwargs):
            calls.append(1)
            if len(calls) > 3:
                raise WriteError("write failed: No space left on device", field="offset", value=0)
            return real(stream, *args, **kwargs)

        monkeypatch.setattr(pipeline, "fill_expert", full)
    with pytest.raises((NonFiniteWeight, WriteError)) as info:
        convert(ckpt, out, workers=1, **options)
    text = str(info.value)
    kept = len(read_journal(journal_path_for(out)).pieces)
    assert kept > 0 and (f"{kept} converted pieces are kept (.m.colibri.part, .m.colibri.journal): run the same "
                         "command again to resume, or add --restart to start over") in text
    assert text.endswith(")") and text.count("(field=") == 1  # the note sits before the field/value tail
    assert _hidden(out.parent) == [".m.colibri.journal", ".m.colibri.part"]
    monkeypatch.undo()
    allow = case != "disk-full"
    summary = convert(ckpt, out, allow_non_finite=allow, **options)
    assert summary.pieces_resumed == kept
    fresh = tmp_path / "fresh.colibri"
    convert(ckpt, fresh, allow_non_finite=allow, **options)
    assert _digest(out) == _digest(fresh) and _hidden(out.parent) == []


def test_files_put_at_the_temporary_names_meanwhile_are_never_removed(ckpt, out, monkeypatch):
    poke(ckpt, LAST_EXPERT, (0, 0), float("nan"))
    real = pipeline._do_piece

    def swap(job, writer, piece):
        if piece.key == (1, 3):
            for name in (part_path_for(out), journal_path_for(out)):
                theirs = name.with_name(name.name + ".theirs")
                theirs.write_text(f"someone else's {name.name}")
                os.replace(theirs, name)
        return real(job, writer, piece)

    monkeypatch.setattr(pipeline, "_do_piece", swap)
    with pytest.raises(NonFiniteWeight):
        convert(ckpt, out, workers=1)
    assert part_path_for(out).read_text() == "someone else's .m.colibri.part"
    assert journal_path_for(out).read_text() == "someone else's .m.colibri.journal"
    assert not lock_path_for(out).exists()


def test_a_weight_that_is_not_a_float_is_refused_before_anything_is_written(ckpt, out, monkeypatch):
    from safetensors.numpy import save_file

    shard = json.loads((ckpt / INDEX).read_text())["weight_map"][LAST_EXPERT]
    tensors = {n: SafetensorsFile(ckpt / shard, shard).native_view(n).copy()
               for n in SafetensorsFile(ckpt / shard, shard).names}
    tensors[LAST_EXPERT] = tensors[LAST_EXPERT].astype(np.int8)
    save_file(tensors, str(ckpt / shard))
    monkeypatch.setattr(pipeline, "ColibriWriter", None)  # never reached
    with pytest.raises(UnsupportedModel, match=f"tensor '{LAST_EXPERT}' is stored as i8; only float32, float16"):
        convert(ckpt, out)
    assert _hidden(out.parent) == []


# --- 4. shards and their headers, bounded in total ---------------------------------------------------------
def _index_naming(ckpt: Path, n: int) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"].update({f"extra.{i}.weight": f"shard-{i:06d}.safetensors" for i in range(n)})
    (ckpt / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("n", [source.MAX_SHARDS + 1, 100_000])
def test_an_index_naming_too_many_shards_is_refused_before_any_is_opened(ckpt, out, monkeypatch, n):
    _index_naming(ckpt, n)  # none of these shards exist: the count is checked first
    opened, real = [], source.resolve_member
    monkeypatch.setattr(source, "resolve_member",
                        lambda root, name, **k: opened.append(name) or real(root, name, **k))
    with pytest.raises(InvalidInput) as info:
        convert(ckpt, out)
    total = len(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values()))
    assert str(info.value).startswith(f"model.safetensors.index.json names {total:,} weight files, over the "
                                      f"limit of {source.MAX_SHARDS:,}")
    assert opened == [INDEX] and _hidden(out.parent) == []


def test_a_pickle_index_naming_too_many_shards_is_refused(ckpt, out):
    index = {"weight_map": {f"t{i}": f"pytorch_model-{i:06d}.bin" for i in range(source.MAX_SHARDS + 1)}}
    for p in ckpt.glob("*.safetensors*"):
        p.unlink()
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidInput, match=f"names {source.MAX_SHARDS + 1:,} weight files, over the limit"):
        convert(ckpt, out, allow_pickle=True)


def test_many_small_headers_adding_up_over_the_cap_are_refused_before_any_is_read(ckpt, out, monkeypatch):
    shards = sorted(ckpt.glob("*.safetensors"))
    total = sum(int.from_bytes(p.read_bytes()[:8], "little") for p in shards)
    monkeypatch.setattr(source, "MAX_TOTAL_HEADER_BYTES", total - 1)
    parsed = []
    monkeypatch.setattr(source, "SafetensorsFile", lambda *a: parsed.append(a))
    with pytest.raises(InvalidInput) as info:
        convert(ckpt, out)
    assert str(info.value).startswith(f"the safetensors headers of the {len(shards)} shards take {total:,} bytes "
                                      f"together, over the limit of {total - 1:,}")
    assert parsed == [] and _hidden(out.parent) == []
    monkeypatch.setattr(source, "MAX_TOTAL_HEADER_BYTES", total)
    monkeypatch.undo()
    convert(ckpt, out)


def _sparse_shard(path: Path, header_bytes: int) -> None:
    """A shard declaring a header of `header_bytes` (zeros, never read): sparse, so it costs no disk."""
    with open(path, "wb") as fh:
        fh.write(header_bytes.to_bytes(8, "little"))
        fh.truncate(8 + header_bytes)


def test_big_declared_headers_are_summed_without_reading_them(ckpt, out):
    real_total = sum(int.from_bytes(p.read_bytes()[:8], "little") for p in ckpt.glob("*.safetensors"))
    per = HEADER_MAX_BYTES - 1  # each one under the per-shard cap
    count = source.MAX_TOTAL_HEADER_BYTES // per + 1
    index = json.loads((ckpt / INDEX).read_text())
    for i in range(count):
        _sparse_shard(ckpt / f"big-{i}.safetensors", per)
        index["weight_map"][f"big.{i}.weight"] = f"big-{i}.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index))
    with pytest.raises(InvalidInput) as info:
        convert(ckpt, out)
    assert (f"take {real_total + per * count:,} bytes together, over the limit of "
            f"{source.MAX_TOTAL_HEADER_BYTES:,}") in str(info.value)


# --- 5. fused expert tensors from a pickle: one view per tensor, no copy per expert -------------------------
def _pickled_fused(tmp_path: Path, experts: int) -> Path:
    import torch
    from safetensors.torch import load_file

    from tests.hf_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("qwen3_moe", tmp_path / f"st{experts}", fused=True, num_experts=experts)
    pt = tmp_path / f"pt{experts}"
    pt.mkdir()
    (pt / "config.json").write_bytes((ckpt / "config.json").read_bytes())
    torch.save(load_file(ckpt / "model.safetensors"), pt / "pytorch_model.bin")
    return pt


def test_pickled_fused_experts_are_read_without_copying_the_tensor_per_expert(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from colibri_format.convert.torch_bin import TorchBinFile

    real = TorchBinFile.native_view
    copied, writeable = {}, []

    def counting(self, name):
        view = real(self, name)
        experts = len(self._state["model.layers.0.mlp.experts.gate_up_proj"])
        owner = view  # a copy owns its memory (or views an array that does); a view of torch's tensor does not
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        if isinstance(owner, np.ndarray):
            copied[experts] = copied.get(experts, 0) + view.nbytes
        writeable.append(view.flags.writeable)
        return view

    monkeypatch.setattr(TorchBinFile, "native_view", counting)
    for experts in (8, 32):
        pt = _pickled_fused(tmp_path, experts)
        convert(pt, tmp_path / f"pt{experts}.colibri", allow_pickle=True, quantize="none", dtype="float32")
        convert(tmp_path / f"st{experts}", tmp_path / f"st{experts}.colibri", quantize="none", dtype="float32")
        with colibri_format.open(tmp_path / f"pt{experts}.colibri") as a, \
                colibri_format.open(tmp_path / f"st{experts}.colibri") as b:
            assert a.model["num_experts"] == experts
            for layer in a.model["moe_layers"]:
                for e in range(experts):
                    np.testing.assert_array_equal(a.expert(layer, e).gate_up, b.expert(layer, e).gate_up)
                    np.testing.assert_array_equal(a.expert(layer, e).down, b.expert(layer, e).down)
    assert copied == {}  # 8 or 32 experts: not one byte of a tensor copied (it was E x the tensor, per tensor)
    assert writeable and not any(writeable)


def test_pickled_bfloat16_reads_as_read_only_bit_patterns(tmp_path):
    torch = pytest.importorskip("torch")
    from colibri_format.convert.torch_bin import TorchBinFile

    t = torch.tensor([[1.0, -2.5], [3.0, 0.0]], dtype=torch.bfloat16)
    torch.save({"w": t, "f": t.float().t()}, tmp_path / "x.bin")  # "f" is not contiguous
    f = TorchBinFile(tmp_path / "x.bin", "x.bin")
    view = f.native_view("w")
    assert view.dtype == np.uint16 and view.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    assert not view.flags.writeable and not f.native_view("f").flags.writeable
    np.testing.assert_array_equal(f.native_view("f"), t.float().t().numpy())


# --- 6. tokenizer files and the whole metadata, sized before anything is converted -------------------------
def _count_pieces(monkeypatch) -> list:
    started = []
    real = pipeline._do_piece
    monkeypatch.setattr(pipeline, "_do_piece", lambda *a: started.append(a[2].key) or real(*a))
    return started


def test_an_oversized_tokenizer_json_is_refused_on_its_size_first(ckpt, out, monkeypatch):
    add_tokenizer(ckpt)
    with open(ckpt / "tokenizer.json", "r+b") as fh:  # sparse: the size is all that is looked at
        fh.truncate(tokenizer_files.TOKENIZER_JSON_MAX_BYTES + 1)
    started = _count_pieces(monkeypatch)
    loaded = []
    monkeypatch.setattr(tokenizer_files, "check_loads", loaded.append)
    with pytest.raises(InvalidTokenizer) as info:
        convert(ckpt, out)
    cap = tokenizer_files.TOKENIZER_JSON_MAX_BYTES
    assert str(info.value).startswith(f"tokenizer.json is {cap + 1:,} bytes, over the {cap:,}-byte cap on it")
    assert info.value.field == "tokenizer.json"
    assert started == [] and loaded == [] and _hidden(out.parent) == []


@pytest.mark.parametrize("name, cap", [("tokenizer_config.json", "CONFIG_MAX_BYTES"),
                                       ("generation_config.json", "CONFIG_MAX_BYTES"),
                                       ("chat_template.jinja", "TEMPLATE_MAX_BYTES")])
def test_every_tokenizer_file_has_one_cap_checked_first(ckpt, out, monkeypatch, name, cap):
    add_tokenizer(ckpt)
    (ckpt / name).write_text("x" * 100 if name.endswith("jinja") else json.dumps({"pad": "x" * 100}))
    monkeypatch.setattr(tokenizer_files, cap, 50)
    started = _count_pieces(monkeypatch)
    with pytest.raises(InvalidTokenizer, match=f"^{name} is 1.. bytes, over the 50-byte cap on it"):
        convert(ckpt, out)
    assert started == [] and _hidden(out.parent) == []


def test_a_tokenizer_that_escapes_past_the_room_is_refused_before_converting(ckpt, out, monkeypatch):
    add_tokenizer(ckpt)
    text = json.loads((ckpt / "tokenizer.json").read_text())
    text["padding"] = None
    text["normalizer"] = None
    text["added_tokens"] = []
    raw = (ckpt / "tokenizer.json").read_text()
    monkeypatch.setattr(tokenizer_files, "TOKENIZER_JSON_MAX_BYTES", len(raw) + 10)
    monkeypatch.setattr(tokenizer_files, "METADATA_ROOM", S.MAX_METADATA_BYTES - len(raw) - 10)
    started = _count_pieces(monkeypatch)
    with pytest.raises(InvalidTokenizer, match="the tokenizer files take .* bytes of metadata, over the"):
        convert(ckpt, out)  # its quotes are escaped once stored: more than its size on disk
    assert started == [] and _hidden(out.parent) == []


def test_metadata_over_the_section_is_refused_before_converting(ckpt, out, monkeypatch):
    started = _count_pieces(monkeypatch)
    monkeypatch.setattr(S, "MAX_METADATA_BYTES", 2000)
    with pytest.raises(InvalidInput) as info:
        convert(ckpt, out)
    assert " bytes (0 of them the tokenizer files), over the 2,000-byte limit of the metadata section" in str(info.value)
    assert info.value.field == "metadata_size" and started == [] and _hidden(out.parent) == []


@pytest.mark.parametrize("options", [{}, {"group_size": 16}, {"quantize": "none"}])
def test_the_metadata_bound_holds_for_the_file_written(ckpt, out, options):
    from colibri_format.convert.source import open_checkpoint

    add_tokenizer(ckpt)
    add_tensors(ckpt, {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    convert(ckpt, out, **options)
    with colibri_format.open(out) as f:
        written = f.header.metadata_size
    with open_checkpoint(ckpt) as src:
        job = pipeline.plan_job(src, pipeline.check_options(options.get("dtype", "float16"),
                                                             options.get("quantize", "expert"), 8,
                                                             options.get("group_size"), 1), None, None)
        assert written <= pipeline.metadata_size_bound(job) <= written + 32 * 8 + 64
