#!/usr/bin/env bash
# Every forced tuning candidate (tests/ops/test_every_candidate.py, the odd sizes) under
# compute-sanitizer's memcheck, on a CUDA machine. Out-of-bounds or misaligned accesses of any kernel
# show as memcheck errors. Each candidate runs in a sanitized pytest process of its own, JOBS at a time
# (default: the CPU count, at most 16), so one slow or hung candidate costs only its own time limit.
#
#   bash tests/memcheck.sh [seconds per candidate, default 600] [name=pattern ...]
#
# The candidates are grouped into families for the summary (pytest -k expressions, ANDed with "odd").
# With name=pattern arguments only those families run, e.g. the GDN state scans alone:
#   bash tests/memcheck.sh 300 fwd_state="gdn_fwd_state" bwd_state="gdn_bwd_state"
#
# torch's caching allocator is switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so memcheck sees every
# buffer's real bounds; with it on, reads past a tensor land in the allocator's slack and go unseen.
# Each process gets one CPU thread (OMP_NUM_THREADS=1): the references run on the CPU, and processes
# with a thread per core each oversubscribe the cores many times over, so no candidate finishes in time.
# Logs: $OUT (default /tmp/memcheck)/<family>/<n>.{pytest,memcheck}.log; the last lines summarise them.
set -uo pipefail
OUT=${OUT:-/tmp/memcheck}
LIMIT=${1:-600}
JOBS=${JOBS:-$(( $(nproc) < 16 ? $(nproc) : 16 ))}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; fi
# The plain-torch references run on the CPU (tests/helpers.on_reference_device): only the kernels under test
# need the sanitizer, and a step-by-step reference's thousands of instrumented launches dominated the time.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 DFLASH_KERNELS_POISON=1 PYTHONUNBUFFERED=1 DFLASH_TEST_REFERENCE_DEVICE=cpu
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
declare -A FAMILIES=([attention]="block_sparse or mask_rev" [gdn]="gdn" [conv_loss]="causal_conv1d or linear_ce or adamw"
                     [elementwise]="rms_norm or rope or swiglu")
if [ $# -gt 1 ]; then
  FAMILIES=()
  for spec in "${@:2}"; do FAMILIES["${spec%%=*}"]="${spec#*=}"; done
fi
rm -rf "$OUT"; mkdir -p "$OUT"
: > "$OUT/candidates.txt"
for fam in "${!FAMILIES[@]}"; do
  mkdir -p "$OUT/$fam"
  python3 -m pytest tests/ops/test_every_candidate.py -k "odd and (${FAMILIES[$fam]})" --collect-only -q \
    -p no:cacheprovider 2>/dev/null | grep "::" | awk -v f="$fam" '{print f, NR, $0}' >> "$OUT/candidates.txt"
done
echo "$(wc -l < "$OUT/candidates.txt") candidates in ${#FAMILIES[@]} families, $JOBS processes at a time"
for fam in "${!FAMILIES[@]}"; do  # a pattern that selects nothing is a mistake, not a clean family
  grep -q "^$fam " "$OUT/candidates.txt" || { echo "family $fam (${FAMILIES[$fam]}): no candidate selected"; exit 2; }
done

one() {  # family, number, test id
  # the limit as SIGINT to pytest under the sanitizer: pytest stops, summarises, and memcheck writes its summary
  "$SAN" --tool memcheck --target-processes all --print-limit 50 --log-file "$OUT/$1/$2.memcheck.log" \
    timeout -s INT "$LIMIT" python3 -m pytest "$3" -v -p no:cacheprovider -p no:xdist --timeout "$LIMIT" -rfE \
    --tb=short > "$OUT/$1/$2.pytest.log" 2>&1
}
export -f one; export OUT LIMIT SAN
xargs -a "$OUT/candidates.txt" -P "$JOBS" -L 1 bash -c 'one "$@"' _

rc=0
while read -r fam n id; do  # a candidate is clean when its test passed and every sanitized process reported 0 errors
  p="$OUT/$fam/$n.pytest.log"; m="$OUT/$fam/$n.memcheck.log"
  if ! grep -q " PASSED" "$p"; then
    echo "NOT PASSED $id: $(grep -E "FAILED|ERROR|SKIPPED|Timeout|Interrupt" "$p" | tail -1 | cut -c1-160)"; rc=1
  fi
  if ! grep -q "ERROR SUMMARY" "$m" || grep "ERROR SUMMARY" "$m" | grep -vq "ERROR SUMMARY: 0 errors" \
     || grep -q "Internal Sanitizer Error" "$m"; then
    echo "MEMCHECK $id: $(grep -E "ERROR SUMMARY|Internal Sanitizer Error" "$m" | sort | uniq -c | tr '\n' ' ')"
    grep -E "Invalid|out of bounds|misaligned" "$m" | head -3; rc=1
  fi
done < "$OUT/candidates.txt"
for fam in "${!FAMILIES[@]}"; do
  total=$(ls "$OUT/$fam"/*.pytest.log 2>/dev/null | wc -l)
  passed=$(grep -l " PASSED" "$OUT/$fam"/*.pytest.log 2>/dev/null | wc -l)
  clean=$(grep -l "ERROR SUMMARY: 0 errors" "$OUT/$fam"/*.memcheck.log 2>/dev/null | wc -l)
  echo "$fam: $passed of $total candidates passed; $clean with memcheck's 0-error summary"
done
exit $rc
