"""Precompile builders for tests/runtime/test_parallel_precompile.py: each fails with a device-memory error the
first time a process runs it and records, on its retry, when the retry ran (``shape["log"]``), so that the test
can see that the workers' retries ran one at a time; ``toy_slow`` records each worker's run of it (longer in the
second worker), so that the test can see that no retry began before every worker's first pass was over. Imported
by the test and, through the job's modules, by the compile workers."""

import os
import time

import torch

from dflash_kernels.runtime import register_precompile, settings

_seen = set()


def _once_then_log(op, error, shape):
    if op not in _seen:
        _seen.add(op)
        raise error
    t0 = time.time()
    time.sleep(0.3)  # long enough for an overlapping retry of another worker to show
    with open(shape["log"], "a") as f:
        f.write(f"{os.getpid()} {op} {t0} {time.time()}\n")


@register_precompile("toy_oom_once")
def _oom_once(shape, dtype, device, backward):
    _once_then_log("toy_oom_once", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), shape)


@register_precompile("toy_cublas_once")
def _cublas_once(shape, dtype, device, backward):
    _once_then_log("toy_cublas_once", RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), shape)


@register_precompile("toy_slow")
def _slow(shape, dtype, device, backward):
    t0 = time.time()
    shard = settings.compile_shard()
    time.sleep(0.2 + 1.5 * (shard[0] if shard else 0))
    with open(shape["log"], "a") as f:
        f.write(f"{os.getpid()} toy_slow {t0} {time.time()}\n")
