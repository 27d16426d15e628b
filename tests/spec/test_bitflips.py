"""Every single-bit flip of a small valid file is caught by `validate_file`.

The file is the smallest the format allows that still has every piece (one layer, one expert, tied
embeddings, float16 dense tensors, int8_row experts): about 15 KB, so about 120,000 flips. Each flip is
done in place on a copy in /dev/shm (a temp dir if there is none) with os.pwrite and undone after the
check; the bit positions are split over two processes. The run time is printed (pytest -s shows it).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from colibri_format.cli import main as cli_main
from colibri_format.inspect import validate_file
from tests.spec import craft

WORKERS = 2


def _scratch_dir() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _flip_range(args: tuple[str, int, int, int]) -> tuple[list[int], list[str], dict[str, int]]:
    """Flip bits start, start+step, ... < end of the file at `src` (on a private copy); return
    (bits not detected, unexpected exceptions, fault counts by class)."""
    src, start, end, step = args
    fd_dir = tempfile.mkdtemp(dir=_scratch_dir(), prefix="colibri-bitflip-")
    path = os.path.join(fd_dir, "f.colibri")
    shutil.copyfile(src, path)
    missed, crashes, counts = [], [], Counter()
    fd = os.open(path, os.O_RDWR)
    try:
        for bit in range(start, end, step):
            pos, mask = bit >> 3, 1 << (bit & 7)
            orig = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([orig[0] ^ mask]), pos)
            try:
                report = validate_file(path)
                if report.valid:
                    missed.append(bit)
                else:
                    counts[report.faults[0].error] += 1
            except Exception as exc:  # anything that is not a report is a bug
                crashes.append(f"bit {bit}: {type(exc).__name__}: {exc}")
            finally:
                os.pwrite(fd, orig, pos)
    finally:
        os.close(fd)
        shutil.rmtree(fd_dir, ignore_errors=True)
    return missed, crashes, dict(counts)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bitflips") / "tiny.colibri"
    return craft.write(path, craft.valid_bytes(craft.TINY_MODEL))


@pytest.mark.timeout(240)
def test_every_bit_flip_is_detected(tiny_file: str, capsys) -> None:
    assert validate_file(tiny_file).valid
    nbits = os.path.getsize(tiny_file) * 8
    jobs = [(tiny_file, k, nbits, WORKERS) for k in range(WORKERS)]
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(WORKERS) as pool:
        results = pool.map(_flip_range, jobs)
    seconds = time.perf_counter() - start
    missed = sorted(b for r in results for b in r[0])
    crashes = [c for r in results for c in r[1]]
    counts = Counter()
    for r in results:
        counts.update(r[2])
    with capsys.disabled():
        print(f"\nbit flips: {nbits} flips of a {nbits // 8}-byte file in {seconds:.1f} s with {WORKERS} processes; "
              f"first fault by class: {dict(sorted(counts.items()))}")
    assert not crashes, crashes[:5]
    assert not missed, f"{len(missed)} undetected flips, first bytes: {sorted({b >> 3 for b in missed})[:20]}"
    assert sum(counts.values()) == nbits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(craft.FOUR_BIT))
def test_every_bit_flip_of_a_4bit_file_is_detected(kind: str, tmp_path: Path, capsys) -> None:
    """The v1.1 formats (int4_group, mxfp4; H = I = 32, one expert): every bit of the header, of the expert blob
    (packed values, float16 or E8M0 scales, padding) and of the sections after it. The dense tensors between them
    are the 1.0 layout, flipped whole by the test above."""
    path = craft.write(tmp_path / f"{kind}.colibri", craft.valid_bytes(craft.TINY_4BIT_MODEL, **craft.FOUR_BIT[kind]))
    assert validate_file(path).valid
    h = craft.header_of(Path(path).read_bytes())
    assert h.version_minor == 1
    ranges = [(0, 8 * 512), (8 * h.experts_offset, 8 * h.file_size)]
    jobs = [(path, lo + k, hi, WORKERS) for lo, hi in ranges for k in range(WORKERS)]
    with multiprocessing.get_context("fork").Pool(WORKERS) as pool:
        results = pool.map(_flip_range, jobs)
    missed = sorted(b for r in results for b in r[0])
    crashes = [c for r in results for c in r[1]]
    counts = Counter()
    for r in results:
        counts.update(r[2])
    assert not crashes, crashes[:5]
    assert not missed, f"{len(missed)} undetected flips, first bytes: {sorted({b >> 3 for b in missed})[:20]}"
    assert sum(counts.values()) == sum(hi - lo for lo, hi in ranges)
    assert counts["CorruptExpert"] > 0 and counts["NonZeroPadding"] > 0


@pytest.mark.timeout(120)
def test_bit_flips_through_the_cli(tiny_file: str, tmp_path: Path, capsys) -> None:
    """200 random flips, each through `colibri validate` (the real entry point): exit code 1 every time."""
    data = bytearray(Path(tiny_file).read_bytes())
    rng = random.Random(20261129)
    path = tmp_path / "flip.colibri"
    for bit in rng.sample(range(len(data) * 8), 200):
        flipped = bytearray(data)
        flipped[bit >> 3] ^= 1 << (bit & 7)
        path.write_bytes(flipped)
        assert cli_main(["validate", str(path)]) == 1, f"bit {bit}"
        capsys.readouterr()
    path.write_bytes(data)
    assert cli_main(["validate", str(path)]) == 0
