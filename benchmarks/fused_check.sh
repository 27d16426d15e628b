#!/usr/bin/env bash
# Device check of the fused layer kernels and the bf16 tensor-core dense products, then gpu_vs_hf.
#   OUT=/tmp/x T_TESTS=60 T_HF=130 TESTS="tests/runtime/cuda/test_gpu_fused_kernels.py ..." HF_SHAPES=qwen3,olmoe bash benchmarks/fused_check.sh
set -o pipefail
OUT=${OUT:-/tmp/fused_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T_TESTS=${T_TESTS:-60} T_HF=${T_HF:-130}
TESTS=${TESTS:-"tests/runtime/cuda/test_gpu_fused_kernels.py tests/runtime/cuda/test_gpu_cuda_engine.py"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader > "$OUT/machine.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/machine.txt"
t0=$SECONDS
if [ "$T_TESTS" != 0 ]; then
  timeout "$T_TESTS" python3 -m pytest $TESTS -q -p no:cacheprovider --maxfail=5 -rs --tb=short -k "${TEST_K:-not nothing}" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? ($((SECONDS - t0)) s)"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -20
fi
t0=$SECONDS
if [ "$T_HF" != 0 ]; then
  timeout "$T_HF" python3 benchmarks/gpu_vs_hf.py --out "$OUT/gpu_vs_hf.json" --shapes "${HF_SHAPES:-qwen3,olmoe,mixtral}" \
      > "$OUT/gpu_vs_hf.log" 2>&1
  echo "gpu_vs_hf rc=$? ($((SECONDS - t0)) s)"
  grep -E "FAILED|Error" "$OUT/gpu_vs_hf.log" | tail -5
  python3 - "$OUT/gpu_vs_hf.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    if "colibri" not in r:
        print(r.get("shape"), r.get("error")); continue
    c1, c32, hf = r["colibri"]["b1"], r["colibri"]["b32"], r["hf"]
    k = c1.get("kernels", {})
    print(f"{r['shape']}: b1 {c1['decode']['tokens_per_s']:.0f} (HF {hf['decode_b1_tokens_per_s']:.0f}) share "
          f"{c1['roofline']['share_of_roofline']:.0%} roof {c1['roofline']['roofline_tokens_per_s']:.0f} | b32 "
          f"{c32['decode']['tokens_per_s']:.0f} (HF {hf['decode_b32_tokens_per_s']:.0f}) | prefill "
          f"{c1['prefill']['ms']:.1f} (HF {hf['prefill_ms']:.1f}) ms | graph {c1['decode']['graph']} host "
          f"{c1['decode']['host_ms_per_step']:.3f}")
    print("   kernels us: " + ", ".join(f"{n} {v['us']:.0f}/{v['calls']}" for n, v in sorted(k.items(), key=lambda x: -x[1]['us'])))
PY
fi
