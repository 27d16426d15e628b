"""Peak memory of the CPU engine generating from a file of ~1.8 GB: anonymous memory (the engine's own) apart from
file-backed pages (the file's mapping: page cache the kernel can reclaim).

    PYTHONPATH=. python benchmarks/cpu_engine_memory.py [--max-cached-experts N]

The file (written once to /tmp): vocabulary 32,000, hidden 1024, 16 MoE layers of 64 int8 experts (FFN 512, top-8),
bf16 dense, one random blob repeated. The engine generates 24 tokens after an 8-token prompt; a thread samples
RssAnon and RssFile of /proc/self/status every 10 ms.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from colibri_format import spec as S
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.synthetic import synthetic_model, write_synthetic

PATH = "/tmp/colibri_cpu_memory.colibri"


def sample(peak: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        with open("/proc/self/status") as fh:
            for line in fh:
                key = line.split(":")[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]))
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-cached-experts", type=int, default=None)
    args = ap.parse_args()
    if not os.path.exists(PATH):
        model = synthetic_model(vocab=32000, hidden=1024, layers=16, heads=8, kv_heads=2, experts=64, top_k=8,
                                expert_inter=512)
        write_synthetic(PATH, model, reuse_expert=True, dense_dtype=S.DType.BF16)
    peak, stop = {"RssAnon": 0, "RssFile": 0}, threading.Event()
    watcher = threading.Thread(target=sample, args=(peak, stop))
    watcher.start()
    with Engine(PATH, EngineConfig(max_cached_experts=args.max_cached_experts)) as eng:
        eng.generate(list(range(1, 9)), max_new_tokens=24, stop_ids=[])
    stop.set()
    watcher.join()
    print(f"file {os.path.getsize(PATH) / 2**30:.2f} GiB: peak anonymous {peak['RssAnon'] / 1024:.0f} MiB, "
          f"peak file-backed {peak['RssFile'] / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
