"""`make demo`: the main job on the bundled default model, one CLI command at a time.

convert (with its progress bar) -> inspect -> validate -> infer with the CPU engine (with stats).
Every step is the real `colibri` command, printed before it runs, so a user can repeat it by hand.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "colibri-demo-moe"
OUT = ROOT / "demo-out"
PROMPT = "def fibonacci(n):\n    "


def colibri(*args: str) -> None:
    cmd = [sys.executable, "-m", "colibri_format", *args]
    print(f"\n$ colibri {' '.join(shlex.quote(a) for a in args)}", flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"[{time.perf_counter() - start:.1f} s, exit {rc}]", flush=True)
    if rc != 0:
        sys.exit(rc)


def convert_args(target: Path) -> list[str]:
    """The demo's convert command: --force replaces the file an earlier `make demo` wrote there (demo-out/ is the
    demo's own folder), so the demo runs again."""
    return ["convert", "--model-path", str(MODEL), "--output-path", str(target), "--dtype", "float16",
            "--quantize", "expert", "--restart", "--force"]


def main() -> None:
    OUT.mkdir(exist_ok=True)
    target = OUT / "colibri-demo-moe.colibri"
    started = time.perf_counter()
    colibri(*convert_args(target))
    colibri("inspect", str(target))
    colibri("validate", str(target))
    colibri("infer", str(target), "--prompt", PROMPT, "--max-new-tokens", "48", "--stats")
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
