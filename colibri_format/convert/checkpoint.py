"""Temporary re-export: `open_hf_checkpoint` is a test helper and lives in tests/convert/hf_checkpoint.py.

Only tests/runtime/hf_tiny.py still imports it from here; delete this module once that import reads
`from tests.convert.hf_checkpoint import open_hf_checkpoint`.
"""

from tests.convert.hf_checkpoint import HFCheckpoint, open_hf_checkpoint

__all__ = ["HFCheckpoint", "open_hf_checkpoint"]
