set -u
T_TESTS=330 bash benchmarks/gpu_session.sh ext,tests
export PYTHONPATH=/tmp/peers DFLASH_KERNELS_CACHE_DIR=/tmp/dk_cache PYTHONUNBUFFERED=1
timeout 90 python3 -m pytest tests/ops/test_conv1d_cuda.py -q -p no:cacheprovider -n 8 -rfE 2>&1 | tail -3 | tee $OUT/ext_pytest.log
timeout 240 python3 benchmarks/experiments/gdn_fwd_paths.py 2>&1 | tee $OUT/ab.log | grep "^AB\|^PROFILE\|Error" | cut -c1-160
cd $OUT && tar czf /tmp/all.tgz . && find . -type f -delete && mv /tmp/all.tgz .
