"""write_synthetic refuses, before writing, a file its folder cannot hold (the full-depth benchmark files are tens of GB)."""

from __future__ import annotations

import shutil

import pytest

from colibri_format.errors import WriteError
from colibri_format import reader
from colibri_format.synthetic import synthetic_model, write_synthetic


def test_a_file_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: free._replace(free=4096))
    with pytest.raises(WriteError) as info:
        write_synthetic(tmp_path / "big.colibri", synthetic_model())
    assert info.value.field == "free_space" and info.value.value > 4096 and "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []                        # the .part was removed, nothing else written


def test_a_file_that_fits_is_written_and_reads_back(tmp_path):
    path = write_synthetic(tmp_path / "small.colibri", synthetic_model())
    with reader.open(path, verify="always") as f:
        assert f.model["num_layers"] == synthetic_model()["num_layers"]
    assert [p.name for p in tmp_path.iterdir()] == ["small.colibri"]
