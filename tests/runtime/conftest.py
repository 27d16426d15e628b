"""Runtime tests: make the repository root importable under a bare `pytest` run from any folder.

`python -m pytest` puts the current folder on sys.path; a bare `pytest` does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
_HERE = str(Path(__file__).resolve().parent)   # helpers (numpy_tiny, hf_tiny) under --import-mode=importlib
for _path in (_ROOT, _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)
