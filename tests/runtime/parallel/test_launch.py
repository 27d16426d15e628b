"""The launcher: runs a given worker command once per device and returns the group's status; it never reads
the process's arguments nor ends the process (tests/runtime/parallel/test_expert_parallel.py runs real ranks)."""

from __future__ import annotations

import functools
import sys

import pytest

from colibri_format.errors import InvalidInput
from colibri_format.runtime.parallel import launch


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_launch_returns_zero_when_every_rank_succeeds(tmp_path, monkeypatch):
    code = ("import os, pathlib; pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text("
            "os.environ['WORLD_SIZE'] + ' ' + os.environ['COLIBRI_EP_DEVICES'])")
    monkeypatch.setenv("OUT", str(tmp_path))                           # the ranks inherit the environment
    assert launch.launch(_py(code), [0, 1, 2], "cpu") == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {r: "3 0,1,2" for r in ("0", "1", "2")}


def test_launch_returns_the_failing_status_and_stops_the_others():
    code = "import os, sys, time; sys.exit(7) if os.environ['RANK'] == '1' else time.sleep(60)"
    assert launch.launch(_py(code), [0, 1], "cpu") == 7               # not SystemExit, and well before 60 s


def test_launch_refuses_before_starting(tmp_path):
    marker = tmp_path / "ran"
    command = _py(f"open({str(marker)!r}, 'w')")
    with pytest.raises(InvalidInput):
        launch.launch(command, [0], "cpu")
    with pytest.raises(InvalidInput):
        launch.launch(command, [0, 1], "tpu")
    assert not marker.exists()


def test_infer_runner_by_process_kind(monkeypatch):
    from colibri_format.runtime.infer import run_infer
    from colibri_format.runtime.parallel.run import run_infer_parallel

    monkeypatch.delenv("COLIBRI_EP_WORKER", raising=False)
    one = launch.infer_runner([3], "cpu")
    assert isinstance(one, functools.partial) and one.func is run_infer and one.keywords == {"device_id": 3}
    assert launch.infer_runner([0, 1], "cpu") is None                  # the parent: the ranks are to be started
    monkeypatch.setenv("COLIBRI_EP_WORKER", "1")
    assert launch.infer_runner([0, 1], "cpu") is run_infer_parallel     # a rank the launcher started
    with pytest.raises(InvalidInput):
        launch.infer_runner([0, 1], "tpu")


@pytest.mark.parametrize("argv", [[], ["--nproc", "2"], ["--", "infer"], ["--nproc", "x", "--", "infer"],
                                  ["--nproc", "2", "--devices", "0", "--", "infer"],
                                  ["--nproc", "1", "--", "infer"]])
def test_module_main_returns_2_on_bad_usage(argv, capsys):
    assert launch.main(argv) == 2                                      # a status, never SystemExit
    assert capsys.readouterr().err


def test_module_main_builds_the_colibri_command(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "launch", lambda command, devices, device: seen.append((command, devices, device))
                        or 5)
    assert launch.main(["--nproc", "2", "--", "cache-sim", "t.jsonl", "--device", "cuda"]) == 5
    command, devices, device = seen[0]
    assert command == launch.colibri_command(["cache-sim", "t.jsonl", "--device", "cuda", "--devices", "0,1"])
    assert command[:3] == [sys.executable, "-m", "colibri_format"]
    assert devices == [0, 1] and device == "cuda"
