#!/usr/bin/env bash
# A whole GPU run in one command (device time is scarce). Stages, in this order:
#   ext    build the CUDA extension in the background (setup.py build_ext --inplace)
#   tests  the test suite on CUDA (pytest-xdist, a time limit per test)      } these two run
#   train  a short trainer run on the embedded default, then trainer.eval   } side by side
#   pipe   the threaded pipeline on the embedded default, target and drafter threads sharing GPU 0 }
#   warm   attention and gdn benchmarks with DFLASH_KERNELS_TUNE=compile    } (compiles every tuning
#          candidate into Triton's disk cache, so the timed runs below only time)
#   conv   benchmarks/ops.py conv: ours on triton, ours on cuda (the extension), then each peer in a
#          process of its own (a peer's CUDA fault kills only its own rows)
#   attention, gdn, overhead   benchmarks/ops.py <op>, one process each
#   tok_s  the main job
# Usage, from the repository root: bash tools/gpu/gpu_session.sh [comma list of stages]   (default: all of the above)
# Knobs: PYTEST_ARGS (default "tests"), PYTEST_WORKERS, T_TEST (per test), TRAIN_ARGS, PIPE_ARGS, TOKS_ARGS
# (default "--preset embedded"), T_<STAGE> seconds (T_CC1D=0 skips the causal-conv1d peer, T_FLA for fla's conv;
# GDN_TUNE=0 times the gdn stage untuned; T_CONV is 150 s: tuning the Triton conv from a cold cache takes
# more than 40 s). The embedded default is read from
# $XDG_CACHE_HOME/dflash_trainer when a prebuilt one travels in .cache/. Logs and rows go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session_out}
STAGES=",${1:-ext,tests,train,pipe,warm,conv,attention,gdn,overhead,tok_s},"
has() { [[ $STAGES == *,$1,* ]]; }
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[gpu_session +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/stages.txt"; }
source "$(dirname "$0")/peers_env.sh"
[ -d .cache/dflash_trainer ] && export XDG_CACHE_HOME=$PWD/.cache
export PYTHONUNBUFFERED=1 DFLASH_KERNELS_CACHE_DIR=/tmp/dk_cache
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if has ext; then
  stamp "ext build (background)"
  ( DFLASH_KERNELS_FORCE_CUDA_BUILD=1 DFLASH_KERNELS_CUDA_ARCHS=90 MAX_JOBS=4 \
      timeout 300 python3 setup.py build_ext --inplace >"$OUT/ext_build.log" 2>&1; echo $? >"$OUT/ext_build.rc" ) &
  EXT_PID=$!
fi
if has train; then
  stamp "train (background): ${TRAIN_ARGS:-}"
  ( export DFLASH_KERNELS_TUNE=0  # the run's loss and acceptance are the point here, not its speed
    timeout "${T_TRAIN:-170}" python3 -m trainer.train --out-dir /tmp/dk_run ${TRAIN_ARGS:-} >"$OUT/train.log" 2>&1
    echo "train rc=$?" >>"$OUT/train.log"
    cp /tmp/dk_run/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
    timeout "${T_EVAL:-70}" python3 -m trainer.eval --drafter /tmp/dk_run/drafter --num-prompts 16 >"$OUT/eval.log" 2>&1
    echo "eval rc=$?" >>"$OUT/eval.log" ) &
  TRAIN_PID=$!
fi
if has pipe; then
  stamp "pipe (background): ${PIPE_ARGS:-}"
  ( export DFLASH_KERNELS_TUNE=0
    timeout "${T_PIPE:-170}" python3 -m trainer.train --target-gpus 0 --drafter-gpus 0 --out-dir /tmp/dk_pipe \
      ${PIPE_ARGS:-} >"$OUT/pipe.log" 2>&1
    echo "pipe rc=$?" >>"$OUT/pipe.log"
    cp /tmp/dk_pipe/metrics.jsonl "$OUT/pipe_metrics.jsonl" 2>/dev/null ) &
  PIPE_PID=$!
fi
if has warm; then
  stamp "warm (background): compile-only attention, gdn"
  ( DFLASH_KERNELS_TUNE=compile timeout "${T_WARM:-170}" python3 benchmarks/ops.py attention --quick --no-record \
      >"$OUT/warm_attention.log" 2>&1; echo "rc=$?" >>"$OUT/warm_attention.log" ) &
  WARM1=$!
  ( DFLASH_KERNELS_TUNE=compile timeout "${T_WARM:-170}" python3 benchmarks/ops.py gdn --quick --no-record \
      >"$OUT/warm_gdn.log" 2>&1; echo "rc=$?" >>"$OUT/warm_gdn.log" ) &
  WARM2=$!
fi
if has tests; then
  stamp "tests: ${PYTEST_ARGS:-tests}"
  # Tuning every test key would cost minutes (the tuning tests switch it on themselves).
  DFLASH_KERNELS_TUNE=0 timeout "${T_TESTS:-200}" python3 -m pytest ${PYTEST_ARGS:-tests} -q -p no:cacheprovider \
    -n "${PYTEST_WORKERS:-8}" --timeout "${T_TEST:-240}" --durations 10 -rfE \
    --ignore tests/ops/test_conv1d_cuda.py 2>&1 | tee "$OUT/pytest.log" | grep -v "^  \|Warning\|warn" | tail -40
  r=${PIPESTATUS[0]}; stamp "tests rc=$r"; [ "$r" = 0 ] || rc=$r
fi
if has train; then wait "$TRAIN_PID"; stamp "train+eval done"; tail -4 "$OUT/train.log"; tail -8 "$OUT/eval.log"; fi
if has pipe; then wait "$PIPE_PID"; stamp "pipe done"; grep -v "^\[" "$OUT/pipe.log" | tail -6; fi
if has ext; then wait "$EXT_PID"; stamp "ext build rc=$(cat "$OUT/ext_build.rc")"; fi
if has warm; then wait "$WARM1" "$WARM2"; stamp "warm done: $(tail -1 "$OUT/warm_attention.log") $(tail -1 "$OUT/warm_gdn.log")"; fi
ops() {  # ops.py in its own process, rows printed as a table at the end
  local name=$1; shift
  stamp "ops: $name"
  timeout "${T_OPS:-60}" "$@" 2>&1 | tee -a "$OUT/ops.log" | grep "^ROW\|^conv \|^copy\|^overhead\|appended\|Error" | cut -c1-400
  stamp "ops $name rc=${PIPESTATUS[0]}"
}
if has conv; then
  DFLASH_KERNELS_BACKEND=conv1d=triton T_OPS=${T_CONV:-150} ops conv-triton python3 benchmarks/ops.py conv --impls dflash,torch
  if [ "$(cat "$OUT/ext_build.rc" 2>/dev/null)" = 0 ]; then
    timeout 60 python3 -m pytest tests/ops/test_conv1d_cuda.py -q -p no:cacheprovider -rfE 2>&1 | tail -3 | tee "$OUT/ext_pytest.log"
    DFLASH_KERNELS_BACKEND=conv1d=cuda T_OPS=${T_CONV:-150} ops conv-cuda python3 benchmarks/ops.py conv --impls dflash
  fi
  [ "${T_CC1D:-30}" -gt 0 ] && T_OPS=${T_CC1D:-30} ops conv-causal_conv1d python3 benchmarks/ops.py conv --impls causal_conv1d
  T_OPS=${T_FLA:-90} ops conv-fla python3 benchmarks/ops.py conv --impls fla
fi
has attention && T_OPS=${T_ATTENTION:-130} ops attention python3 benchmarks/ops.py attention
has gdn && DFLASH_KERNELS_TUNE=${GDN_TUNE:-1} T_OPS=${T_GDN:-130} ops gdn python3 benchmarks/ops.py gdn
has overhead && T_OPS=30 ops overhead python3 benchmarks/ops.py overhead
if has tok_s; then
  stamp "tok_s: ${TOKS_ARGS:---preset embedded}"
  DFLASH_KERNELS_TUNE=${TOKS_TUNE:-0} timeout "${T_TOKS:-90}" python3 benchmarks/tok_s.py ${TOKS_ARGS:---preset embedded} 2>&1 | tee "$OUT/tok_s.log" | tail -20
  stamp "tok_s rc=${PIPESTATUS[0]}"
fi
cp benchmarks/results/*.jsonl "$OUT/" 2>/dev/null
stamp "end rc=$rc"
exit $rc
