#!/usr/bin/env bash
# Final GPU check of a release: the whole GPU test suite, then the bundled demo model through the CLI on
# the CUDA engine (resident and paged) and `colibri bench` (this script checks the installed commands, so it
# runs them; the Python benchmarks import the library only). Run from the repository root. Logs and JSON go
# to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/gpu_final}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/machine.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/machine.txt"
timeout 300 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs --tb=short > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$?: $(tail -1 "$OUT/pytest_gpu.log")"
demo=/tmp/demo.colibri
colibri() { python3 -m colibri_format "$@"; }
colibri convert --model-path models/colibri-demo-moe --output-path $demo --quiet --restart || exit 1
prompt='def fibonacci(n):'
colibri infer $demo --prompt "$prompt" --max-new-tokens 64 --json > "$OUT/demo_cpu.json"
colibri infer $demo --prompt "$prompt" --max-new-tokens 64 --device cuda --json > "$OUT/demo_cuda.json"
colibri infer $demo --prompt "$prompt" --max-new-tokens 64 --device cuda --max-cached-experts 3 \
    --cache-policy lru --json > "$OUT/demo_cuda_paged.json"
timeout 120 python3 -m colibri_format bench $demo --batch-size 1 --seq-len 128 --num-iters 64 --json \
    > "$OUT/bench_demo.json" 2> "$OUT/bench_demo.err"
echo "bench rc=$?"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {k: json.load(open(f"{out}/demo_{k}.json")) for k in ("cpu", "cuda", "cuda_paged")}
for k, r in runs.items():
    s = r["stats"]
    print(f"{k:11s} same_as_cpu={r['output_ids'] == runs['cpu']['output_ids']} decode_tok/s={s['decode_tokens_per_s']:.1f} "
          f"hit_rate={s['hit_rate']:.3f} misses/token={s['misses_per_token']:.2f} GB/s_paged={s['paged_gb_per_s']:.3f} "
          f"stall_ms/token={s['stall_ms_per_token']:.3f}")
print(repr(runs["cuda"]["text"][:200]))
PY
