#!/usr/bin/env bash
# Every forced tuning candidate (tests/ops/test_every_candidate.py, the odd sizes) under
# compute-sanitizer's memcheck, on a CUDA machine. Out-of-bounds or misaligned accesses of any kernel
# show as memcheck errors. Four sanitized pytest processes run side by side, one per kernel family
# (attention and its mask, Gated DeltaNet, conv, LM-head loss and AdamW, norm / RoPE / SwiGLU), each
# writing its own log, so a time limit cuts every family's tail rather than whole families.
#
#   bash tests/memcheck.sh [seconds per family, default 3000] [name=pattern ...]
#
# With name=pattern arguments only those families run (a pattern is a pytest -k expression, ANDed with
# "odd"), e.g. the GDN candidates split over several processes:
#   bash tests/memcheck.sh 560 fwd_state="gdn_fwd_state and not output" fwd_out="gdn_fwd_state_output"
#
# torch's caching allocator is switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so memcheck sees every
# buffer's real bounds; with it on, reads past a tensor land in the allocator's slack and go unseen.
# Logs: $OUT (default /tmp/memcheck)/<family>.{pytest,memcheck}.log; the last lines summarise them.
set -uo pipefail
OUT=${OUT:-/tmp/memcheck}
LIMIT=${1:-3000}
mkdir -p "$OUT"
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; fi
# The plain-torch references run on the CPU (tests/helpers.on_reference_device): only the kernels under test
# need the sanitizer, and a step-by-step reference's thousands of instrumented launches dominated the time.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 DFLASH_KERNELS_POISON=1 PYTHONUNBUFFERED=1 DFLASH_TEST_REFERENCE_DEVICE=cpu
declare -A FAMILIES=([attention]="block_sparse or mask_rev" [gdn]="gdn" [conv_loss]="causal_conv1d or linear_ce or adamw"
                     [elementwise]="rms_norm or rope or swiglu")
if [ $# -gt 1 ]; then
  FAMILIES=()
  for spec in "${@:2}"; do FAMILIES["${spec%%=*}"]="${spec#*=}"; done
fi
for fam in "${!FAMILIES[@]}"; do
  # the limit as SIGINT to pytest under the sanitizer: pytest stops, summarises, and memcheck writes its summary
  "$SAN" --tool memcheck --target-processes all --print-limit 50 --log-file "$OUT/$fam.memcheck.log" \
    timeout -s INT "$LIMIT" python3 -m pytest tests/ops/test_every_candidate.py -k "odd and (${FAMILIES[$fam]})" -v -p no:cacheprovider \
    -p no:xdist --timeout 600 -rfE --tb=line > "$OUT/$fam.pytest.log" 2>&1 &
done
wait
rc=0
for fam in "${!FAMILIES[@]}"; do
  echo "$fam: $(grep -cE " PASSED" "$OUT/$fam.pytest.log") passed, $(grep -cE " FAILED| ERROR" "$OUT/$fam.pytest.log") failed" \
       "of the tests that ran; $(tail -1 "$OUT/$fam.pytest.log" | cut -c1-120)"
  echo "  memcheck: $(grep -h "ERROR SUMMARY" "$OUT/$fam.memcheck.log" | sort | uniq -c | tr '\n' ' ')"
  # every process's summary must say 0 errors, and there must be one
  grep -q "ERROR SUMMARY" "$OUT/$fam.memcheck.log" || { echo "  no memcheck summary"; rc=1; }
  if grep "ERROR SUMMARY" "$OUT/$fam.memcheck.log" | grep -vq "ERROR SUMMARY: 0 errors"; then rc=1; fi
  if grep -q "Internal Sanitizer Error" "$OUT/$fam.memcheck.log"; then
    echo "  WARNING: the sanitizer could not track some launches (Internal Sanitizer Error): incomplete"; rc=1
  fi
done
exit $rc
