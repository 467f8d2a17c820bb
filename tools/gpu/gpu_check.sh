#!/usr/bin/env bash
# One batched GPU run: peers from .peers/ (wheels copied into that ignored folder), the test suite on CUDA
# (gpu-marked tests included), then the op benchmarks. Logs go to $OUT when set.
# Usage, from the repository root: bash tools/gpu/gpu_check.sh "<pytest paths/args>" "<benchmarks/ops.py args>"
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
source "$(dirname "$0")/peers_env.sh"
export PYTHONUNBUFFERED=1 DFLASH_KERNELS_CACHE_DIR=/tmp/dk_cache
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [ -n "${1:-}" ]; then
  # Tuning every test key would cost minutes; the tuning tests switch it back on themselves.
  DFLASH_KERNELS_TUNE=0 timeout 420 python3 -m pytest $1 -q -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ -n "${2:-}" ]; then
  timeout 400 python3 benchmarks/ops.py $2 2>&1 | tee "$OUT/bench.log"
  cp benchmarks/results/ops.jsonl "$OUT/ops.jsonl" 2>/dev/null
fi
exit $rc
