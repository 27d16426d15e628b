"""Run the committed conformance corpus against this reader, and check the writer still produces it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import colibri_format
from colibri_format import errors as E
from colibri_format.cli import main as cli_main
from colibri_format.inspect import inspect_file, validate_file
from colibri_format.reader import load_tables

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())
MAX_CORPUS_BYTES = 1_500_000


def _make_corpus():
    spec = importlib.util.spec_from_file_location("make_corpus", HERE / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(MANIFEST["valid"]))
def test_valid_file(name: str, capsys) -> None:
    path = CORPUS / name
    report = validate_file(path)
    assert report.valid, report.faults
    expected = json.loads((CORPUS / MANIFEST["valid"][name]["inspect"]).read_text())
    got = inspect_file(path)
    got.pop("path")
    assert json.loads(json.dumps(got)) == expected
    assert cli_main(["inspect", "--json", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    printed.pop("path")
    assert printed == expected
    with colibri_format.open(path, verify="always") as f:
        for n in f.dense_names():
            f.dense(n)
        for layer in f.tables.plan.moe_layers:
            for e in range(f.header.num_experts):
                f.expert(layer, e)


@pytest.mark.parametrize("name", sorted(MANIFEST["invalid"]))
def test_invalid_file(name: str, capsys) -> None:
    entry = MANIFEST["invalid"][name]
    cls = getattr(E, entry["error"])
    assert name.startswith(f"bad_{entry['error']}_")
    path = CORPUS / name
    if entry["detected_by"] == "open":
        with pytest.raises(E.ColibriFormatError) as info:
            load_tables(path)
        assert type(info.value) is cls and info.value.field == entry["field"]
    else:
        load_tables(path)
    report = validate_file(path)
    assert not report.valid
    assert report.faults[0].error == entry["error"] and report.faults[0].field == entry["field"]
    assert cli_main(["validate", str(path)]) == 1
    capsys.readouterr()


def test_one_invalid_file_per_error_class() -> None:
    classes = {e["error"] for e in MANIFEST["invalid"].values()}
    file_classes = {c.__name__ for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.ColibriFormatError)
                    and c.__doc__ and c.__module__ == E.__name__}
    reading = {"TruncatedFile", "BadMagic", "UnsupportedVersion", "CorruptHeader", "InvalidHeaderField", "LayoutError",
               "SizeMismatch", "CorruptSection", "InvalidDirectoryEntry", "InvalidMetadata", "CorruptTensor",
               "CorruptExpert", "NonZeroPadding"}
    assert reading <= file_classes
    # NotARegularFile is about the path (directory, FIFO, device), which a corpus of files cannot hold.
    assert classes == reading


def test_corpus_listing_is_complete() -> None:
    on_disk = {p.name for p in CORPUS.iterdir()}
    listed = set(MANIFEST["valid"]) | set(MANIFEST["invalid"]) | {"manifest.json"}
    listed |= {v["inspect"] for v in MANIFEST["valid"].values()}
    assert on_disk == listed
    assert sum(p.stat().st_size for p in CORPUS.iterdir()) <= MAX_CORPUS_BYTES


def test_regenerated_corpus_is_byte_identical(tmp_path: Path) -> None:
    """The writer is deterministic: a drift in any byte it writes shows up here."""
    _make_corpus().build(tmp_path)
    fresh = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_bytes() for p in CORPUS.iterdir()}
    assert sorted(fresh) == sorted(committed)
    differing = [n for n in fresh if fresh[n] != committed[n]]
    assert not differing, f"regenerated files differ from the committed corpus: {differing} " \
                          f"(if the format changed on purpose, run python -m tests.conformance.make_corpus)"
