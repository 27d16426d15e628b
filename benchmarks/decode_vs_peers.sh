#!/usr/bin/env bash
# Batch-1 and batch-8 decode at full depth beside both peers, in one device call (issue 14): llama.cpp's
# llama-bench on GGUFs of the same shapes (Q8_0 experts, F16 dense; flash attention off and on; half the layers'
# experts on the CPU with --n-cpu-moe), our engine (benchmarks/decode_profile.py: tokens/s, chained tokens/s and
# the CUPTI timeline at batch 1 and 8), then the torch.compile int8 peer on the same shapes.
#
# Set-up on the CPU machine (the peers are not in this repository): fetch github:unslothai/llama.cpp with the search
# tool, write the paths listed in ../shared/tools/llamacpp_peer/README.md into build/peer/llamacpp (~23 MB without
# the other backends), and copy run_peer.sh, make_gguf.py and ../shared/tools/peer_torch_compile_moe.py into
# build/peer/. On the device, from the repository root, with build/peer carried:
#   SHAPES="qwen3" bash benchmarks/decode_vs_peers.sh          # OUT: the device call's $OUT
# The llama.cpp build (llama-bench only, sm_90) takes ~260 s of 16 cores; BUILD_S caps it (run_peer.sh). Without
# build/peer/llamacpp the llama.cpp step is skipped with a line saying so.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/build/cupy_cache}
OUT=${OUT:-/tmp/decode_vs_peers}
SHAPES=${SHAPES:-qwen3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
date -u
if [ -d build/peer/llamacpp ]; then
  (cd build/peer && OUT=$OUT SHAPES="$SHAPES" BUILD_S=${BUILD_S:-330} bash run_peer.sh) 2>&1 | tee "$OUT/llamacpp.log"
else
  echo "llama.cpp skipped: build/peer/llamacpp is missing (see this script's header)"
fi
PEER=()
[ -f build/peer/peer_torch_compile_moe.py ] && PEER=(--peer build/peer/peer_torch_compile_moe.py)
t0=$SECONDS
python3 benchmarks/decode_profile.py --out "$OUT/engine" --skip-gemv --shapes "${SHAPES// /,}" --batches 1,8 \
    "${PEER[@]}" > "$OUT/engine.log" 2>&1
echo "engine + torch.compile peer rc=$? ($((SECONDS - t0)) s)"
grep -E "tokens/s|peer|tok/s" "$OUT/engine.log" | tail -30
date -u
