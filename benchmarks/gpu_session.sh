#!/usr/bin/env bash
# A whole GPU session in one command (device time is scarce): peers, the CUDA extension build (in the
# background), the test suite on CUDA, the op benchmarks, the extension's tests and benchmark, and the
# main job. Each stage has its own time limit; logs and result rows go to $OUT.
# Usage: bash benchmarks/gpu_session.sh [stages]   stages: comma list of
#   tests, ops, ext, tok_s, train (default: tests,ops,ext,tok_s)
# Knobs: PYTEST_ARGS (default "tests"), OPS_ARGS (default "conv attention gdn overhead"),
#        TOKS_ARGS (default "--preset embedded"), T_TESTS / T_OPS / T_EXT / T_TOKS / T_TRAIN seconds.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session_out}
STAGES=",${1:-tests,ops,ext,tok_s},"
mkdir -p "$OUT" /tmp/peers
T0=$(date +%s)
stamp() { echo "[gpu_session +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/stages.txt"; }
if ls .peers/*.whl >/dev/null 2>&1; then
  tar xzf .peers/causal_conv1d-*-site.tgz -C /tmp/peers &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/*.whl
  export PYTHONPATH=/tmp/peers:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 DFLASH_KERNELS_CACHE_DIR=/tmp/dk_cache
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [[ $STAGES == *,ext,* ]]; then
  stamp "ext build started (background)"
  ( DFLASH_KERNELS_FORCE_CUDA_BUILD=1 DFLASH_KERNELS_CUDA_ARCHS=90 MAX_JOBS=8 \
      timeout 300 python3 setup.py build_ext --inplace >"$OUT/ext_build.log" 2>&1; echo $? >"$OUT/ext_build.rc" ) &
  EXT_PID=$!
fi
if [[ $STAGES == *,tests,* ]]; then
  stamp "tests: ${PYTEST_ARGS:-tests}"
  # Tuning every test key would cost minutes; the tuning tests switch it back on themselves.
  # pytest-xdist and pytest-timeout are in the GPU image: compiles run in parallel, a hung test is
  # killed with its stack trace instead of eating the stage.
  DFLASH_KERNELS_TUNE=0 timeout "${T_TESTS:-240}" python3 -m pytest ${PYTEST_ARGS:-tests} -q -p no:cacheprovider \
    -n "${PYTEST_WORKERS:-8}" --timeout "${T_TEST:-150}" --durations 15 \
    --ignore tests/ops/test_conv1d_cuda.py -rfE 2>&1 | tee "$OUT/pytest.log" | tail -60
  r=${PIPESTATUS[0]}; stamp "tests rc=$r"; [ "$r" = 0 ] || rc=$r
fi
if [[ $STAGES == *,ops,* ]]; then
  # One process per op: a peer's CUDA fault kills its process's context, not the other ops' rows.
  for op in ${OPS_ARGS:-overhead conv attention gdn}; do
    stamp "ops: $op"
    timeout "${T_OPS:-100}" python3 benchmarks/ops.py $op 2>&1 | tee -a "$OUT/ops.log" | grep -v "^  " | tail -25
    stamp "ops $op rc=${PIPESTATUS[0]}"
  done
fi
if [[ $STAGES == *,ext,* ]]; then
  wait "$EXT_PID"; stamp "ext build rc=$(cat "$OUT/ext_build.rc")"; tail -5 "$OUT/ext_build.log"
  timeout "${T_EXT:-90}" python3 -m pytest tests/ops/test_conv1d_cuda.py -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/ext_pytest.log" | tail -15
  DFLASH_KERNELS_BACKEND=conv1d=cuda timeout 60 python3 benchmarks/ops.py conv 2>&1 | tee "$OUT/ext_bench.log" | grep -v "^  " | tail -20
  stamp "ext done"
fi
if [[ $STAGES == *,tok_s,* ]]; then
  stamp "tok_s: ${TOKS_ARGS:---preset embedded}"
  timeout "${T_TOKS:-150}" python3 benchmarks/tok_s.py ${TOKS_ARGS:---preset embedded} 2>&1 | tee "$OUT/tok_s.log" | tail -30
  stamp "tok_s rc=${PIPESTATUS[0]}"
fi
if [[ $STAGES == *,train,* ]]; then
  stamp "train: ${TRAIN_ARGS:-}"
  timeout "${T_TRAIN:-150}" python3 -m trainer.train --out-dir /tmp/dk_run ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log" | tail -30
  stamp "train rc=${PIPESTATUS[0]}"
  cp /tmp/dk_run/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
  timeout "${T_EVAL:-60}" python3 -m trainer.eval --drafter /tmp/dk_run/drafter --num-prompts 16 2>&1 | tee "$OUT/eval.log" | tail -15
  stamp "eval rc=${PIPESTATUS[0]}"
fi
cp benchmarks/results/*.jsonl "$OUT/" 2>/dev/null
cp -r benchmarks/results/plots "$OUT/" 2>/dev/null
stamp "end rc=$rc"
exit $rc
