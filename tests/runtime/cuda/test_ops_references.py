"""Every `ops.NAME` / `self.ops.NAME` the runtime's code uses exists in kernels/ops.py (CPU-only: the GPU tests that
would call them skip on machines without a GPU, so a wrapper renamed or lost there would otherwise first fail on one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from colibri_format.runtime.cuda.kernels import ops

RUNTIME = Path(ops.__file__).resolve().parents[2]          # colibri_format/runtime
USERS = sorted(p for p in RUNTIME.rglob("*.py") if p.resolve() != Path(ops.__file__).resolve())


def ops_names(path: Path) -> set[str]:
    """The attributes read off a name or attribute called `ops` in the code of `path` (not its prose)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "ops") or (isinstance(base, ast.Attribute)
                                                                      and base.attr == "ops"):
                names.add(node.attr)
    return names


def test_the_runtime_uses_ops():
    assert {"moe_experts", "dispatch_buffers", "gemm_bf16"} <= set().union(*map(ops_names, USERS))


@pytest.mark.parametrize("path", USERS, ids=lambda p: str(p.relative_to(RUNTIME)))
def test_every_ops_name_used_exists(path):
    missing = sorted(n for n in ops_names(path) if not hasattr(ops, n))
    assert not missing, f"{path.name} uses ops.{', ops.'.join(missing)}, which kernels/ops.py does not define"
