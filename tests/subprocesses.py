"""Helpers for tests that run the CLI in a child process."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """preexec_fn: SIGINT back to its default disposition in the child. A test run started in the background of a
    non-interactive shell (`make test &`) inherits SIGINT ignored, and an ignored disposition survives exec, so a
    child that should see a Ctrl-C would not (Python installs its KeyboardInterrupt handler only when SIGINT is not
    ignored at startup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
