"""Runtime tests: make the repository root importable under a bare `pytest` run from any folder.

`python -m pytest` puts the current folder on sys.path; a bare `pytest` does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
