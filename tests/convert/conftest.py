"""Session-cached tiny checkpoints: each (arch, layout) is saved once per test run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.convert.synth_checkpoint import mixtral_config, write_checkpoint
from tests.hf_models import make_tiny_checkpoint, reference_state


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(arch, fused=..., sharded=..., tie=..., dtype=...)` -> a saved folder (cached)."""
    cache: dict[tuple[Any, ...], Path] = {}

    def make(arch: str, *, fused: bool = False, sharded: bool = False, tie: bool = False,
             dtype: str = "float32") -> Path:
        key = (arch, fused, sharded, tie, dtype)
        if key not in cache:
            name = f"{arch}-{'fused' if fused else 'legacy'}-{'sharded' if sharded else 'single'}-" \
                   f"{'tied' if tie else 'untied'}-{dtype}"
            cache[key] = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(name), fused=fused,
                                              sharded=sharded, tie=tie, dtype=dtype)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_reference() -> Callable[..., dict[str, Any]]:
    """`tiny_reference(arch, tie=..., dtype=...)` -> the in-memory model's state_dict as NumPy (cached)."""
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def make(arch: str, *, tie: bool = False, dtype: str = "float32") -> dict[str, Any]:
        key = (arch, tie, dtype)
        if key not in cache:
            cache[key] = reference_state(arch, tie=tie, dtype=dtype)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def bf16_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16, 2 layers x 6 experts of hidden 128 / FFN 96, several shards (read only: copy it to change it)."""
    d = tmp_path_factory.mktemp("bf16_moe")
    write_checkpoint(d, mixtral_config(vocab=300, hidden=128, layers=2, experts=6, inter=96, heads=4, kv_heads=2),
                     dtype="bfloat16", shard_bytes=200 << 10)
    return d
