#!/usr/bin/env bash
# Cold start on a fresh GPU machine, with only what the package ships: each covered op's first call
# (benchmarks/first_call.py, a process per row with empty caches), then the main job's first step of
# group (a) against the peers' group (b) in one run, with cache folders made empty for it.
# Peers come from .peers/ (the wheels of shared/peers copied into that ignored folder).
# Usage, from the repository root: bash tools/gpu/cold_start.sh          (logs and rows in $OUT when set)
set -uo pipefail
OUT=${OUT:-/tmp/cold_start_out}
mkdir -p "$OUT"
source "$(dirname "$0")/peers_env.sh"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
sha256sum dflash_kernels/runtime/tuned/*.json dflash_kernels/runtime/compiled/* | tee -a "$OUT/gpu.txt"
echo "== first_call ($(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/gpu.txt"
timeout "${T_FIRST_CALL:-150}" python3 benchmarks/first_call.py --cases covered --json "$OUT/first_call.jsonl" \
  2>&1 | tee "$OUT/first_call.log" | tail -20
caches=$(mktemp -d)
echo "== tok_s a,b cold, caches in $caches ($(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/gpu.txt"
TRITON_CACHE_DIR=$caches/triton DFLASH_KERNELS_CACHE_DIR=$caches/dk \
  timeout "${T_TOK_S:-420}" python3 benchmarks/tok_s.py --preset real --groups a,b --steps 3 --warmup 1 \
  2>&1 | tee "$OUT/tok_s.log" | tail -40
cp benchmarks/results/tok_s.jsonl "$OUT/tok_s.jsonl" 2>/dev/null
echo "== done ($(date -u +%H:%M:%S) UTC)" | tee -a "$OUT/gpu.txt"
