"""What happens when a .colibri file changes under a running reader or engine (docs/runtime.md).

Our writers never modify a file in place: they write a `.part` file and rename it over the
destination. A process that already mapped the old file keeps the old inode and sees the old bytes.
Truncating a mapped file in place (something only a foreign tool does) cannot be caught in Python:
the kernel sends SIGBUS on the next access to a lost page. These tests pin down both facts.
"""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

import colibri_format
from colibri_format.runtime.engine import Engine, EngineConfig
from colibri_format.synthetic import synthetic_model, write_synthetic


def test_replacing_the_file_leaves_a_running_engine_on_the_old_bytes(tmp_path):
    path = tmp_path / "m.colibri"
    model = synthetic_model(layers=2, experts=4)
    write_synthetic(path, model, seed=1)
    with Engine(str(path), EngineConfig()) as engine:
        before = engine.logits([[1, 2, 3]])
        write_synthetic(path, model, seed=2)          # atomic replace by the writer, as convert does
        after = engine.logits([[1, 2, 3]])
        np.testing.assert_array_equal(np.asarray(before[0]), np.asarray(after[0]))
    with Engine(str(path), EngineConfig()) as fresh:    # a new engine sees the new file
        assert not np.allclose(np.asarray(fresh.logits([[1, 2, 3]])[0]), np.asarray(before[0]))


def test_replacing_the_file_keeps_expert_checksums_valid_for_old_readers(tmp_path):
    path = tmp_path / "m.colibri"
    write_synthetic(path, seed=1)
    with colibri_format.open(path, verify="always") as f:
        first = f.expert(0, 1).gate_up.copy()
        write_synthetic(path, seed=2)
        np.testing.assert_array_equal(f.expert(0, 1).gate_up, first)   # verified again: still intact


def test_in_place_truncation_of_a_mapped_file_is_a_sigbus(tmp_path):
    path = tmp_path / "m.colibri"
    write_synthetic(path, seed=1)
    child = textwrap.dedent(f"""
        import os, colibri_format
        f = colibri_format.open({str(path)!r}, verify="never")
        view = f.expert(1, 3).down
        os.truncate({str(path)!r}, 4096)              # a foreign tool shrinking the file in place
        print(int(view.sum()))                        # touches a page that no longer exists
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-500:])
    assert os.path.getsize(path) == 4096
