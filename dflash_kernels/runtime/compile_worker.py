"""A compile process of :func:`dflash_kernels.precompile` (not a user command):

    python -m dflash_kernels.runtime.compile_worker JOB_FILE INDEX               (precompile's specs)
    python -m dflash_kernels.runtime.compile_worker --signatures JOB_FILE INDEX  (precompile_recorded)
    python -m dflash_kernels.runtime.compile_worker --serve                      (the tuning compile pool)

Specs: every spec of the job runs on each of its devices in compile-only mode (``settings.set_compile_shard``):
each kernel-cache miss compiles this worker's share of the key's configs into Triton's on-disk cache and
launches nothing. Signatures: this worker's share of every recorded launch signature's configs is compiled
straight from the signature (Triton's ``warmup`` on stand-in tensors), no op run. Prints
``RESULT {"compiled": n, "errors": [...]}`` last.
"""

import fcntl
import importlib
import json
import os
import sys
import time

import torch


def main(path: str, index: int) -> None:
    with open(path) as f:
        job = json.load(f)
    from dflash_kernels.runtime import settings

    settings.set_compile_shard((index, job["shards"]))
    import dflash_kernels  # noqa: F401 - registers every op's builder
    from dflash_kernels.runtime.kernel import cache_info

    for module in job["modules"]:
        importlib.import_module(module)
    errors = []
    specs = job["specs"]
    # Every worker runs every spec (each compiles its share of the configs), each from its own starting point,
    # so that the workers' inputs of the largest shapes are not on the GPU all at once; a spec that ran out of
    # memory is tried again at the end, one worker at a time (a lock beside the job file): retried together,
    # the largest shapes of 16 workers ran out again. The retries also wait for every worker's first pass
    # (a mark per worker beside the job file): while another worker still runs its largest shapes, a retry
    # ran out again (the H100's `--preset ops`).
    start = index % len(specs) if specs else 0
    for n, device in enumerate(job["devices"]):
        dev = torch.device(device)
        retry = []
        for op, shape, dtype in specs[start:] + specs[:start]:
            _build(op, shape, dtype, dev, job["backward"], errors, retry)
        _release(dev)
        first_pass_done(path, n, index)
        if retry:
            wait_for_first_passes(path, n, job["shards"])
            with open(path + ".retry.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    for op, shape, dtype in retry:
                        if _build(op, shape, dtype, dev, job["backward"], errors, None):
                            _release(dev)  # the next worker's retry gets the memory this one held
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    compiled = sum(v["compiles"] for v in cache_info().values())
    print("RESULT " + json.dumps({"compiled": compiled, "errors": errors}), flush=True)


FIRST_PASS_WAIT_S = 900.0  # a retry waits at most this long for the other workers' first passes


def first_pass_done(path: str, device: int, index: int) -> None:
    """Mark that worker ``index`` finished its first pass over the specs on the job's ``device``-th device."""
    open(f"{path}.first.{device}.{index}", "w").close()


def wait_for_first_passes(path: str, device: int, shards: int, timeout: float = None) -> bool:
    """Wait until every one of the ``shards`` workers has marked its first pass on that device; False after
    ``timeout`` seconds (default FIRST_PASS_WAIT_S: a worker that died never marks, and the retries then run
    anyway)."""
    deadline = time.monotonic() + (FIRST_PASS_WAIT_S if timeout is None else timeout)
    while not all(os.path.exists(f"{path}.first.{device}.{i}") for i in range(shards)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def out_of_memory(e: BaseException) -> bool:
    """A failure of device memory: torch's OutOfMemoryError, or cuBLAS failing to allocate its workspace or
    handle (a RuntimeError, "CUBLAS_STATUS_ALLOC_FAILED"), which other processes' allocations cause alike."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("CUBLAS_STATUS_ALLOC_FAILED" in str(e) or "out of memory" in str(e)))


def _build(op, shape, dtype, dev, backward, errors, retry) -> bool:
    """Run one spec's builder; False if it failed. An out-of-memory failure releases the cached memory and goes
    to ``retry`` when one is given; every other failure (and one on the retry) goes to ``errors``."""
    from dflash_kernels.runtime.precompile import _builders, decode

    try:
        _builders[op](decode(shape), decode(dtype), dev, backward)
        return True
    except Exception as e:  # noqa: BLE001 - reported; the parent's serial pass compiles what is left
        oom = out_of_memory(e)
        if oom:
            _release(dev)
        if retry is not None and oom:
            retry.append((op, shape, dtype))
        else:
            errors.append(f"{op} {shape}: {type(e).__name__}: {str(e)[:300]}")
        return False


def _release(dev):
    """Hand this process's cached device memory back, so that the other workers (and the retries) can use it."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def signatures(path: str, index: int) -> None:
    with open(path) as f:
        job = json.load(f)
    import dflash_kernels  # noqa: F401 - defines every op's kernels
    from dflash_kernels.runtime import tuning
    from dflash_kernels.runtime.kernel import all_kernels

    dev = torch.device(job["device"])
    torch.cuda.set_device(dev)
    kernels = {k.name: k for k in all_kernels()}
    compiled, errors = 0, []
    for name, signature in sorted(job["signatures"].items()):
        persist = name[len(tuning.SIGNATURE_PREFIX):]
        kernel = kernels.get(persist.partition("|")[0])
        if kernel is None:
            continue
        try:
            compiled += kernel.compile_signature(persist, signature, dev.index, (index, job["shards"]))
        except Exception as e:  # noqa: BLE001 - reported; that kernel compiles at its first call instead
            errors.append(f"{persist[:160]}: {type(e).__name__}: {str(e)[:300]}")
    print("RESULT " + json.dumps({"compiled": compiled, "errors": errors}), flush=True)


def serve() -> None:
    """The tuning compile pool's worker (``runtime/compile_pool.py``): each request line names a kernel, a launch
    signature, configs and a device; the configs are compiled into Triton's on-disk cache with their launchers'
    host modules (the kernel is not loaded onto the GPU), and one reply line says how many."""
    import dflash_kernels  # noqa: F401 - defines every op's kernels
    from triton.runtime import driver

    from dflash_kernels.runtime.compile_pool import REPLY
    from dflash_kernels.runtime.kernel import Config, all_kernels

    kernels = {k.name: k for k in all_kernels()}
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        compiled, errors = 0, []
        kernel = kernels.get(request["kernel"])
        for config in request["configs"] if kernel is not None else ():
            try:
                for ck in kernel.compiled_for_signature(None, request["signature"], request["device"],
                                                        configs=[Config.from_dict(config)]):
                    driver.active.launcher_cls(ck.src, ck.metadata)
                    compiled += 1
            except Exception as e:  # noqa: BLE001 - that candidate is compiled (or fails) in the tuning process
                errors.append(f"{config}: {type(e).__name__}: {str(e)[:200]}")
        print(REPLY + json.dumps({"compiled": compiled, "errors": errors}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--serve":
        serve()
    elif len(sys.argv) == 4 and sys.argv[1] == "--signatures":
        signatures(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 3:
        main(sys.argv[1], int(sys.argv[2]))
    else:
        raise SystemExit("usage: python -m dflash_kernels.runtime.compile_worker [--signatures] JOB_FILE INDEX | --serve")
