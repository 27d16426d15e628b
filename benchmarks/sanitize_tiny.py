"""A small CUDA-engine workload for `compute-sanitizer --tool memcheck` (benchmarks/gpu_suite.sh runs it).

Tiny Mixtral-like checkpoint (head_dim 64), converted with int8 experts; exercises prefill, graph capture and
replay, batched decode, the paged path with multi-pass layers and prefetch, and the staging-free copy path.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from colibri_format.convert.pipeline import convert
    from colibri_format.runtime.engine import Engine, EngineConfig
    from tests.hf_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint("qwen3_moe", Path(tmp) / "hf", hidden_size=128, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=64)
        path = Path(tmp) / "m.colibri"
        convert(Path(tmp) / "hf", path, dtype="bfloat16", quantize="expert", workers=1, verify=False)
        with Engine(path, EngineConfig(device="cuda", max_seq_len=64)) as eng:
            print("logits", [x.shape for x in eng.logits([[1, 2, 3, 4], [5, 6]])])
            print("generate", eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids)
            print("batch", eng.generate_batch([[1, 2], [3], [4, 5, 6]], 3), eng.stats()["graphs"])
        with Engine(path, EngineConfig(device="cuda", max_seq_len=64, max_cached_experts=2, prefetch=True)) as eng:
            print("paged", eng.generate([1, 2, 3], max_new_tokens=4, stop_ids=[]).output_ids,
                  eng.stats()["paging"]["passes"])
    print("sanitize workload done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
