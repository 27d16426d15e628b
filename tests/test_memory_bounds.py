"""Peak memory of `colibri inspect`, `colibri inspect --json`, `colibri validate` and opening an `Engine` stays
within a stated bound over a corpus of worst-case-but-valid files built here.

The bound, per command, for a file with M metadata bytes, E JSON elements in the metadata (arrays, objects and
members, as the spec counts them), T bytes of tables (dense directory + WSIT) and D bytes of dense tensors:

    peak RSS  <=  peak RSS of the same command on a small file  +  12 M  +  256 B x E  +  64 T  (+ 2 D for the engine)

It is read as the child's own high-water mark (VmHWM in /proc/self/status at its exit), one fresh process per
command. 12 M covers the metadata read, its text and the parsed strings (each up to 4 bytes a character in
Python: ASCII with one emoji) and the checks' copies; 256 B an element the parsed objects and keys; 64 T the
tables parsed and, for inspect, one dict an entry. Over the spec's limits (M <= 64 MiB, E <= 2^20, T <= 44 MiB)
that is at most 3.75 GiB above the baseline, most of it for a 1M-entry WSIT, a file of gigabytes.

The corpus (under 300 MiB on disk, built here): provenance strings near MAX_METADATA_BYTES (escapes and CJK;
ASCII with one emoji, the widest in memory), just under MAX_JSON_ELEMENTS keys, a list of short strings,
MAX_JSON_DEPTH nesting, MAX_JSON_ELEMENTS empty objects, 9217 dense tensors (1024 layers), 32768 experts. The
measured peaks are printed (pytest -s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_format import spec as S
from colibri_format.errors import InvalidMetadata
from colibri_format.reader import load_tables
from colibri_format.synthetic import synthetic_model
from tests.inspect import heavy_files as H

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PER_METADATA_BYTE = 12
PER_ELEMENT = 256
PER_TABLE_BYTE = 64
PER_DENSE_BYTE = 2          # the engine only
MIB = 1 << 20

COMMANDS = {
    "inspect": "sys.exit(main(['inspect', sys.argv[1]]))",
    "inspect --json": "sys.exit(main(['inspect', sys.argv[1], '--json']))",
    "validate": "sys.exit(main(['validate', sys.argv[1]]))",
    "engine": "from colibri_format.runtime import Engine; Engine(sys.argv[1]).close()",
}

# Runs one command in a fresh interpreter and writes its VmHWM (kB) to a file at exit. The process's own
# high-water mark: `ru_maxrss` of a child also counts the parent's memory it was forked (or vforked) from.
PROBE = """
import sys
report, code = sys.argv.pop(1), sys.argv.pop(1)
try:
    from colibri_format.cli import main
    exec(code)
finally:
    with open("/proc/self/status") as fh:
        hwm = next(line for line in fh if line.startswith("VmHWM:")).split()[1]
    with open(report, "w") as fh:
        fh.write(hwm)
"""


def peak_rss(command: str, path: str, report: Path) -> int:
    """Run `command` on `path` in a fresh interpreter, output discarded; its peak resident set size in bytes (the
    command must succeed)."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(report), command, path], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=240)
    assert done.returncode == 0, done.stderr[-500:]
    return int(report.read_text()) * 1024


def json_elements(raw: bytes) -> int:
    """`[`, `{` and `,` outside JSON strings (the spec's count)."""
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = b"".join(bare.split(b'"')[::2])
    return structure.count(b"[") + structure.count(b"{") + structure.count(b",")


def sizes(path: str) -> dict[str, int]:
    t = load_tables(path)
    h = t.header
    with open(path, "rb") as fh:
        fh.seek(h.metadata_offset)
        raw = fh.read(h.metadata_size)
    return {"M": h.metadata_size, "E": json_elements(raw), "T": h.dense_dir_size + h.wsit_size,
            "D": sum(e.size for e in t.dense)}


def allowance(command: str, s: dict[str, int]) -> int:
    extra = PER_METADATA_BYTE * s["M"] + PER_ELEMENT * s["E"] + PER_TABLE_BYTE * s["T"]
    return extra + (PER_DENSE_BYTE * s["D"] if command == "engine" else 0)


def _tiny(layers: int, experts: int, dense_layers: tuple[int, ...] = ()) -> dict:
    return synthetic_model(vocab=16, hidden=16, layers=layers, heads=1, kv_heads=1, experts=experts, top_k=1,
                           expert_inter=16, dense_layers=dense_layers)


CORPUS = {
    "string": lambda p: H.write_file(p, provenance=H.big_string(60 * MIB)),
    "wide": lambda p: H.write_file(p, provenance={"notes": "a" * (60 * MIB) + "😀"}),   # 4 bytes a character in memory
    "keys": lambda p: H.write_file(p, provenance=H.many_keys(24 * MIB)),
    "list": lambda p: H.write_file(p, provenance=H.long_list(32 * MIB)),
    "deep": lambda p: H.write_file(p, provenance=H.deep(32 * MIB)),
    "elements": lambda p: H.write_file(p, provenance=H.many_elements()),
    "dense": lambda p: H.write_file(p, _tiny(1024, 2, tuple(range(1, 1024)))),
    "experts": lambda p: H.write_file(p, _tiny(32, 1024)),
}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> dict[str, int]:
    if not Path("/proc/self/status").exists():
        pytest.skip("reads VmHWM from /proc (Linux)")
    where = tmp_path_factory.mktemp("small")
    small = H.write_file(where / "small.colibri")
    return {name: peak_rss(command, small, where / "hwm") for name, command in COMMANDS.items()}


@pytest.mark.parametrize("kind", list(CORPUS))
def test_peak_memory_stays_within_the_bound(kind, baselines, tmp_path):
    path = CORPUS[kind](tmp_path / f"{kind}.colibri")
    s = sizes(path)
    report = []
    for name, command in COMMANDS.items():
        peak = peak_rss(command, path, tmp_path / "hwm")
        bound = baselines[name] + allowance(name, s)
        report.append(f"{name}: {peak / MIB:.0f} MiB (baseline {baselines[name] / MIB:.0f}, bound {bound / MIB:.0f})")
        assert peak <= bound, (kind, name, peak, bound, s)
    print(f"\n{kind} (M={s['M'] / MIB:.1f} MiB, E={s['E']:,}, T={s['T']:,} B, D={s['D']:,} B, "
          f"file {os.path.getsize(path) / MIB:.0f} MiB): " + "; ".join(report))
    Path(path).unlink()


def test_the_corpus_is_at_the_limits(tmp_path):
    """The heavy files are as heavy as the spec allows where it says so, and still valid."""
    from colibri_format.inspect import validate_file

    path = H.write_file(tmp_path / "deep.colibri", provenance=H.deep(1 << 12))
    assert validate_file(path, quick=True).valid
    with pytest.raises(InvalidMetadata, match="nested too deeply"):      # the writer used to write it anyway
        H.write_file(tmp_path / "deeper.colibri", provenance=H.deep(1 << 12, depth=S.MAX_JSON_DEPTH - 1))
    assert not (tmp_path / "deeper.colibri").exists()
    elements = H.write_file(tmp_path / "elements.colibri", provenance=H.many_elements())
    assert S.MAX_JSON_ELEMENTS - 16384 < sizes(elements)["E"] <= S.MAX_JSON_ELEMENTS
    assert validate_file(elements, quick=True).valid
