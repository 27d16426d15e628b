"""`colibri inspect` on files that are valid but heavy: a provenance near MAX_METADATA_BYTES (one long string, a
million keys, a long list), many dense tensors. The human view shows each value cut to a few lines with the size
of the whole and at most a page of rows per table; `--json` prints everything. Both stay linear in the header and
tables: the time guards below are generous ceilings against the old quadratic rendering (a 2 MiB string took
4 s, 8 MiB 51 s), not performance claims.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from colibri_format.cli import main
from colibri_format.cli.render import BRIEF_CHARS, MAX_ROWS
from colibri_format.synthetic import synthetic_model
from tests.cli.test_edges import ENV, lines
from tests.inspect import heavy_files as H

pytestmark = pytest.mark.timeout(300)

# A ceiling on the CPU seconds of one inspect of a 32 MiB provenance (measured: about 1 s). CPU time of this process,
# not wall time: the regression it guards against (an 8 MiB string took 51 s) burns CPU, while a loaded machine (a
# fresh clone's suite beside other jobs took 12.5 wall seconds here) only stretches the wall clock.
GUARD_S = 10.0


@pytest.fixture(scope="module")
def string_file(tmp_path_factory):
    """32 MiB of provenance in one string (escapes, accents and CJK in it)."""
    prov = H.big_string(32 * H.MIB)
    return H.write_file(tmp_path_factory.mktemp("heavy") / "string.colibri", provenance=prov), prov


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    """Just under MAX_JSON_ELEMENTS provenance keys, about 24 MiB."""
    prov = H.many_keys(24 * H.MIB)
    return H.write_file(tmp_path_factory.mktemp("heavy") / "keys.colibri", provenance=prov), prov


def flat(out: str) -> str:
    """The human view as one line: table borders and line breaks (rich wraps long cells) become one space."""
    return re.sub(r"[│\s]+", " ", out)


def _inspect(capsys, *args) -> tuple[str, float]:
    """(what inspect printed, the CPU seconds this process spent on it)."""
    t0 = time.process_time()
    assert main(["inspect", *args]) == 0
    seconds = time.process_time() - t0
    return capsys.readouterr().out, seconds


def test_a_long_string_is_cut_with_its_size(string_file, capsys):
    path, prov = string_file
    out, seconds = _inspect(capsys, path)
    assert seconds < GUARD_S
    assert len(out) < 20_000                                         # a page, whatever the file holds
    size = len(prov["notes"].encode())
    assert f"({size:,} bytes in all)" in flat(out)
    assert prov["notes"][:40].replace("\t", "?") in flat(out) and "synthetic" in out


def test_a_million_keys_show_one_page_and_a_count(keys_file, capsys):
    path, prov = keys_file
    out, seconds = _inspect(capsys, path)
    assert seconds < GUARD_S
    assert len(out) < 20_000
    assert f"{len(prov) - MAX_ROWS:,} more (use --json for all)" in flat(out)
    assert "k0000000" in out and f"k{MAX_ROWS:07d}" not in out


@pytest.mark.parametrize("which", ["string", "keys"])
def test_json_prints_the_whole_provenance(which, string_file, keys_file, capsys):
    path, prov = string_file if which == "string" else keys_file
    out, seconds = _inspect(capsys, path, "--json")
    assert seconds < GUARD_S
    assert json.loads(out)["metadata"]["provenance"] == prov


def test_every_table_is_bounded(tmp_path, capsys):
    """Many dense tensors (9217, as many as MAX_LAYERS allows) and a long list: a page each, with counts."""
    model = synthetic_model(vocab=16, hidden=16, layers=1024, heads=1, kv_heads=1, experts=2, top_k=1,
                            expert_inter=16, dense_layers=tuple(range(1, 1024)))
    path = H.write_file(tmp_path / "dense.colibri", model, provenance=H.long_list(4 * H.MIB))
    out, seconds = _inspect(capsys, path)
    assert seconds < GUARD_S and len(out) < 60_000
    assert "... 8961 more dense tensors (use --json for all)" in out
    assert "bytes in all" in flat(out)
    info = json.loads(_inspect(capsys, path, "--json")[0])
    assert len(info["dense_tensors"]) == 9217 and len(info["metadata"]["provenance"]["files"]) > 400_000


def test_a_cut_value_is_still_escaped(tmp_path, capsys):
    """Markup and control characters in a long value: escaped in the part shown, the cut never opens a tag."""
    prov = {"evil": "[bold red]x[/]\x1b[31m" * (BRIEF_CHARS // 3)}
    path = H.write_file(tmp_path / "evil.colibri", provenance=prov)
    out, _ = _inspect(capsys, path)
    assert "\x1b" not in out and "[bold red]x" in out and "bytes in all" in out


def test_subprocess_human_view_is_clean(string_file):
    path, _ = string_file
    done = subprocess.run([sys.executable, "-m", "colibri_format", "inspect", path], capture_output=True, env=ENV,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == b"", lines(done.stderr)
    assert b"bytes in all" in done.stdout and len(done.stdout) < 20_000
