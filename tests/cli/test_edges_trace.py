"""`--trace` is an output path: each case runs `python -m colibri_format infer ...` in a subprocess (exit code, one
line on standard error plus the COLIBRI_DEBUG hint, clean standard output) and checks what is left on disk.

Families:
* the model itself, by its own name, through a hard link or a symbolic link, with or without --force: refused
  before anything runs, the model's bytes unchanged (it used to be truncated under its own mapping: SIGBUS);
* an existing file: refused without --force, untouched; with --force replaced by a new file (its name unlinked,
  so another name of the old file keeps the old bytes);
* anything not a regular file: a FIFO (it used to block forever), a device, a folder, a symbolic link to a file or
  to nowhere: refused with or without --force, nothing written through it;
* the library: an engine never replaces an existing file (O_EXCL), a link planted between the check and the
  creation makes the creation fail, and a full disk (a tmpfs of one page) is one line.

`colibri chat` and `colibri bench` write no file (no --trace, no --out): nothing to check there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_format.errors import OutputPathRefused
from colibri_format.runtime.cache import trace as trace_mod
from colibri_format.runtime.cache.trace import read_trace
from tests.cli.test_edges import ENV, assert_one_error, colibri, lines

pytestmark = pytest.mark.timeout(300)

RUN = ("--ids", "1,2", "--max-new-tokens", "3")


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def infer(model, trace, *extra, timeout: float = 60):
    return colibri("infer", str(model), *RUN, "--trace", str(trace), *extra, timeout=timeout)


# --- the model itself -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
@pytest.mark.parametrize("how", ["same", "relative", "hardlink", "symlink", "symlinked-model"])
def test_the_model_is_never_the_trace(model_file, tmp_path, how, force):
    model = Path(model_file)
    before = digest(model)
    run_model, trace = model, model
    if how == "relative":
        trace = Path(os.path.relpath(model, Path.cwd()))
    elif how == "hardlink":
        trace = tmp_path / "hard.colibri"
        os.link(model, trace)
    elif how == "symlink":
        trace = tmp_path / "link.jsonl"
        trace.symlink_to(model)
    elif how == "symlinked-model":                    # the model run through a link, the trace at its real name
        run_model = tmp_path / "alias.colibri"
        run_model.symlink_to(model)
    needle = "symbolic link" if how == "symlink" else "is the model file being run"
    assert_one_error(infer(run_model, trace, *force), 1, "--trace", needle, "field=trace", hint=True)
    assert digest(model) == before
    assert colibri("validate", str(model)).returncode == 0


# --- an existing file ---------------------------------------------------------------------------------------------

def test_an_existing_file_needs_force(model_file, tmp_path):
    old = tmp_path / "t.jsonl"
    old.write_text("my notes\n")
    assert_one_error(infer(model_file, old), 1, "--trace already exists; pass --force to replace it", hint=True)
    assert old.read_text() == "my notes\n"
    keep = tmp_path / "keep.txt"                      # a second name of the old file
    os.link(old, keep)
    done = infer(model_file, old, "--force")
    assert done.returncode == 0 and done.stderr == b"", lines(done.stderr)
    assert read_trace(old).header.num_experts == 8 and len(read_trace(old).records) >= 2
    assert keep.read_text() == "my notes\n" and os.stat(old).st_ino != os.stat(keep).st_ino
    assert_one_error(infer(model_file, old), 1, "already exists", hint=True)   # our own trace, too


def test_a_new_file_is_created_without_force(model_file, tmp_path):
    trace = tmp_path / "new.jsonl"
    done = infer(model_file, trace)
    assert done.returncode == 0, lines(done.stderr)
    assert read_trace(trace).header.top_k == 2


def test_refusal_as_json(model_file, tmp_path):
    old = tmp_path / "t.jsonl"
    old.write_text("x")
    done = infer(model_file, old, "--json")
    assert done.returncode == 1 and done.stderr == b""
    error = json.loads(done.stdout)["error"]
    assert error["type"] == "OutputPathRefused" and error["field"] == "trace" and error["value"] == str(old)


# --- not a regular file -----------------------------------------------------------------------------------------

def _not_regular(kind: str, tmp_path: Path) -> tuple[Path, Path | None, str]:
    """(the --trace path, a file that must stay untouched or absent, the message part)."""
    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
        return path, None, "not a regular file"
    if kind == "device":
        return Path("/dev/null"), None, "not a regular file"
    if kind == "folder":
        return tmp_path, None, "is a folder"
    target = tmp_path / ("target.txt" if kind == "link-to-file" else "absent.txt")
    if kind == "link-to-file":
        target.write_text("precious\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    return link, target, "symbolic link"


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "link-to-file", "dangling-link"])
def test_only_regular_files(model_file, tmp_path, kind, force):
    path, target, needle = _not_regular(kind, tmp_path)
    assert_one_error(infer(model_file, path, *force, timeout=30), 1, "--trace", needle, hint=True)
    if kind == "link-to-file":
        assert target.read_text() == "precious\n" and path.is_symlink()
    elif kind == "dangling-link":
        assert not target.exists() and path.is_symlink()
    elif kind == "fifo":
        assert path.is_fifo()


# --- the library: an engine's trace is always a new file --------------------------------------------------------

def test_engine_never_replaces_a_file(model_file, tmp_path):
    from colibri_format.runtime import Engine, EngineConfig

    before = digest(model_file)
    with pytest.raises(OutputPathRefused, match="already exists; remove it or choose another path"):
        Engine(model_file, EngineConfig(trace_path=model_file))
    assert digest(model_file) == before
    with Engine(model_file, EngineConfig(trace_path=str(tmp_path / "t.jsonl"))) as eng:
        eng.generate([1, 2], max_new_tokens=2)
    assert read_trace(tmp_path / "t.jsonl").records


def test_a_link_planted_after_the_check_is_not_followed(tmp_path, monkeypatch):
    target = tmp_path / "target.txt"
    target.write_text("precious\n")
    path = tmp_path / "t.jsonl"
    path.symlink_to(target)
    monkeypatch.setattr(trace_mod, "check_trace_path", lambda *a, **k: False)   # the check saw nothing there
    with pytest.raises(OutputPathRefused, match="taken by another file"):
        trace_mod.create_trace_file(path)
    assert target.read_text() == "precious\n"


def test_overwrite_refuses_a_protected_file(tmp_path):
    model = tmp_path / "m.bin"
    model.write_bytes(b"weights")
    twin = tmp_path / "twin.bin"
    os.link(model, twin)
    with pytest.raises(OutputPathRefused, match="model file being run"):
        trace_mod.TraceWriter(twin, num_layers=1, moe_layers=[0], num_experts=2, top_k=1, overwrite=True,
                              protect=[model])
    assert model.read_bytes() == b"weights"
    with trace_mod.TraceWriter(tmp_path / "new.jsonl", num_layers=1, moe_layers=[0], num_experts=2, top_k=1) as w:
        w.record(0, 0, 0, [1])
    with trace_mod.TraceWriter(tmp_path / "new.jsonl", num_layers=1, moe_layers=[0], num_experts=2, top_k=1,
                               overwrite=True) as w:
        w.record(0, 0, 0, [0])
    assert [r.experts for r in read_trace(tmp_path / "new.jsonl").records] == [((0, (0,)),)]


def _tmpfs_works(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4k none '{where}'"],
                           capture_output=True)
    return probe.returncode == 0


def test_trace_onto_a_full_disk(model_file, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if not _tmpfs_works(small):
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (needs root and unshare)")
    trace = small / "t.jsonl"
    script = (f"mount -t tmpfs -o size=4k none '{small}' && exec '{sys.executable}' -m colibri_format infer "
              f"'{model_file}' --ids 1,2 --max-new-tokens 120 --trace '{trace}'")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, env=ENV, timeout=120)
    assert_one_error(done, 1, "cannot write the routing trace", "No space left on device", hint=True)
