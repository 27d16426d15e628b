"""A test hook for deterministic crash points (see tests/convert/test_crash_resume.py).

With `COLIBRI_CRASH_AT=N` in the environment, the converter kills itself with SIGKILL just before its Nth
I/O step (data write, fsync, journal append or rename, final rename), as a power cut would stop it.
Without the variable `hit` only counts, so a clean run tells a test how many crash points there are.
"""

from __future__ import annotations

import os
import signal
import threading

_lock = threading.Lock()
_count = 0


def _target() -> int:
    try:
        return int(os.environ.get("COLIBRI_CRASH_AT", "0"))
    except ValueError:
        return 0


def hit(what: str) -> None:
    """Count one I/O step; die before it if it is the one the environment names."""
    global _count
    with _lock:
        _count += 1
        n = _count
    if n == _target():
        os.kill(os.getpid(), signal.SIGKILL)


def count() -> int:
    return _count


def reset() -> None:
    global _count
    with _lock:
        _count = 0
