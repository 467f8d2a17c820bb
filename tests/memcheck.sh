#!/usr/bin/env bash
# Every forced tuning candidate (tests/ops/test_every_candidate.py, the odd sizes) under
# compute-sanitizer's memcheck, on a CUDA machine. Out-of-bounds or misaligned accesses and leaks of
# any kernel show as memcheck errors; each pytest worker writes its own log.
#
#   bash tests/memcheck.sh [pytest -k expression, default "odd"] [workers, default 4]
#
# torch's caching allocator is switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so memcheck sees every
# buffer's real bounds; with it on, reads past a tensor land in the allocator's slack and go unseen,
# and the sanitizer's own bookkeeping ran out of device memory with 8 workers sharing one GPU.
# Logs: $OUT (default /tmp/memcheck)/memcheck.<pid>.log; the last lines summarise every log.
set -uo pipefail
OUT=${OUT:-/tmp/memcheck}
mkdir -p "$OUT"
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; fi
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 DFLASH_KERNELS_POISON=1 PYTHONUNBUFFERED=1
"$SAN" --tool memcheck --target-processes all --print-limit 50 --log-file "$OUT/memcheck.%p.log" \
  python3 -m pytest tests/ops/test_every_candidate.py -k "${1:-odd}" -n "${2:-4}" -q --timeout 1800 \
  -p no:cacheprovider -rfE --tb=line 2>&1 | tee "$OUT/pytest.log" | tail -15
rc=${PIPESTATUS[0]}
echo "memcheck logs:"; grep -h "ERROR SUMMARY" "$OUT"/memcheck.*.log | sort | uniq -c
if grep -l "Internal Sanitizer Error" "$OUT"/memcheck.*.log >/dev/null 2>&1; then
  echo "WARNING: the sanitizer could not track some launches (Internal Sanitizer Error): the run is incomplete"
  rc=1
fi
exit $rc
