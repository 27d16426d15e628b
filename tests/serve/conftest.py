"""What the serve tests share: the bundled demo model converted once (real text, its tokenizer and chat template),
and a tiny synthetic file without a tokenizer (token-id prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri_format.cli import main

DEMO = Path(__file__).resolve().parents[2] / "models" / "colibri-demo-moe"


@pytest.fixture(scope="session")
def demo_file(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("serve-demo") / "colibri-demo-moe.colibri"
    assert main(["convert", "--model-path", str(DEMO), "--output-path", str(out), "--quiet"]) == 0
    return str(out)
