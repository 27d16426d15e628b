"""A short, deterministic run of the mutation fuzzer, and a replay of every saved crasher."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_format", HERE / "fuzz_format.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_short_fuzz_run(tmp_path: Path) -> None:
    fz = _fuzz_module()
    result = fz.fuzz(2000, seed=20261129, timeout=5.0, crash_dir=tmp_path / "crashes", quiet=True)
    assert not result["crashes"], result["crashes"][:3]
    outcomes = result["tables_outcomes"]
    # the mutations reach every stage: header, sections, directory, metadata and valid tables
    for cls in ("ok", "CorruptHeader", "InvalidHeaderField", "CorruptSection", "InvalidDirectoryEntry",
                "InvalidMetadata", "TruncatedFile", "LayoutError"):
        assert outcomes.get(cls, 0) > 0, (cls, outcomes)
    for cls in ("CorruptTensor", "CorruptExpert", "NonZeroPadding", "valid"):
        assert result["validate_outcomes"].get(cls, 0) > 0, (cls, result["validate_outcomes"])


def test_mutations_are_deterministic() -> None:
    fz = _fuzz_module()
    seeds = fz.make_seeds()
    a = [bytes(fz.mutate(random.Random(3), seeds)) for _ in range(1)]
    b = [bytes(fz.mutate(random.Random(3), seeds)) for _ in range(1)]
    assert a == b


@pytest.mark.parametrize("crasher", sorted((HERE / "crashes").glob("*.colibri")), ids=lambda p: p.name)
def test_saved_crashers_are_fixed(crasher: Path) -> None:
    fz = _fuzz_module()
    fz.run_one(str(crasher), random.Random(0))       # raises if the bug is back
