#!/usr/bin/env bash
# The package's shipped caches for this GPU model, from one run on it: each preset's kernels recorded (tagged
# with the preset's name) and tuned into empty caches, then the tuning file and the compiled-kernel bundle
# written into dflash_kernels/runtime/tuned/ and dflash_kernels/runtime/compiled/, each naming this run.
#
#   bash tools/gpu/ship_caches.sh [real,ops,embedded,27b,ship]      (default: all five, in that order)
#
# Stages may run in separate calls: the caches live in $SHIP_DIR (default /tmp/dk_ship) between them.
# `ship` copies the results into the package (and into $OUT when set).
set -euo pipefail
stages=${1:-real,ops,embedded,27b,ship}
SHIP_DIR=${SHIP_DIR:-/tmp/dk_ship}
export PYTHONUNBUFFERED=1 DFLASH_KERNELS_CACHE_DIR=$SHIP_DIR/dk TRITON_CACHE_DIR=$SHIP_DIR/triton
mkdir -p "$SHIP_DIR"
has() { [[ ",$stages," == *",$1,"* ]]; }
# A stage that fails is reported and the others still run: ship takes whatever was recorded.
try() { timeout "${STAGE_TIMEOUT:-540}" "$@" || echo "== failed (exit $?): $*"; }
stage() { echo "== $1 ($(date -u +%H:%M:%S) UTC)"; echo "$1: ${*:2}" >> "$SHIP_DIR/commands.txt"; }
tok_s="benchmarks/tok_s.py --groups a --steps 2 --warmup 1 --isolate off --no-record"
if has real; then
  stage real "$tok_s --preset real"
  DFLASH_KERNELS_RECORD_TAG=real try python3 $tok_s --preset real
fi
if has ops; then
  stage ops "python3 -m dflash_kernels.precompile --preset ops"
  DFLASH_KERNELS_RECORD_TAG=ops try python3 -m dflash_kernels.precompile --preset ops
fi
if has embedded; then
  stage embedded "$tok_s --preset embedded"
  DFLASH_KERNELS_RECORD_TAG=embedded try python3 $tok_s --preset embedded
fi
if has 27b; then
  stage 27b "benchmarks/roles.py --preset 27b --steps 1 --warmup 1 --no-record"
  DFLASH_KERNELS_RECORD_TAG=27b try python3 benchmarks/roles.py --preset 27b --steps 1 --warmup 1 --no-record
fi
if has ship; then
  gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
  vers=$(python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')")
  run="$gpu, $vers, empty caches, $(date -u +%Y-%m-%d): bash tools/gpu/ship_caches.sh $stages ($(paste -sd';' "$SHIP_DIR/commands.txt"))"
  # The bundle holds every launch the shipped tuning file records for this GPU model, also those recorded by
  # earlier runs (named in the file's run| entries), all compiled here by `precompile --preset all`.
  bundle_run="$run; then every launch recorded in the shipped tuning file compiled: python3 -m dflash_kernels.precompile --preset all"
  for f in "$DFLASH_KERNELS_CACHE_DIR"/tuning-*.json; do
    python3 -m dflash_kernels.runtime.tuning ship "$f" --run "$run"
  done
  # Every recorded launch compiled into this cache (those of stages run on another machine too), then exported.
  python3 -m dflash_kernels.precompile --preset all
  python3 -m dflash_kernels.precompile --list --export-kernels shipped --run "$bundle_run"
  mkdir -p "$SHIP_DIR/out"
  cp dflash_kernels/runtime/tuned/tuning-*.json dflash_kernels/runtime/compiled/*.tar.xz "$SHIP_DIR/out"/
  if [ -n "${OUT:-}" ]; then cp "$SHIP_DIR"/out/* "$OUT"/; fi
fi
