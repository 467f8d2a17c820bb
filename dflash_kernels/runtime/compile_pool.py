"""Compile processes kept up while a process tunes: a key's candidate configs compiled at once.

Tuning a key times every candidate config, and each candidate must be compiled first: a second or more each,
one after another in one process (Triton's compiler holds the GIL, so threads do not help). When a key with
several candidates is tuned on a GPU, its candidates are sent to a pool of worker processes
(``python -m dflash_kernels.runtime.compile_worker --serve``) that compile them side by side into Triton's
on-disk cache; the timing loop then finds each one compiled. The pool starts at the first such key (its
processes' start-up overlaps nothing else, a few seconds once) and ends after ``IDLE_S`` without work.

``DFLASH_KERNELS_TUNE_WORKERS``: processes (default: the usable cores up to 8, shared among torchrun's local
processes; 0 or 1 turns the pool off). A pool that fails is reported once and not used again in the process:
the candidates are then compiled in this process, as without a pool.
"""

import atexit
import json
import os
import subprocess
import sys
import threading
import time
import warnings

from dflash_kernels.runtime import settings

__all__ = ["compile_candidates", "workers", "shutdown"]

IDLE_S = 30.0  # a pool with no request for this long is closed (its processes hold a CUDA context each)
REQUEST_TIMEOUT_S = 600.0
REPLY = "DFLASH_KERNELS_POOL "
WORKER_CMD = [sys.executable, "-m", "dflash_kernels.runtime.compile_worker", "--serve"]


def workers() -> int:
    return settings.process_count("DFLASH_KERNELS_TUNE_WORKERS", 8)


class _Pool:
    def __init__(self, n: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if isinstance(p, str) and p))
        self.procs = [subprocess.Popen(WORKER_CMD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, bufsize=1, env=env) for _ in range(n)]
        self.ready = False

    def _read(self, proc, deadline):
        while True:  # the worker answers every request on a line of its own; a dead one gives EOF
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a compile process exited (code {proc.poll()})")
            if time.perf_counter() > deadline:
                raise TimeoutError("a compile process took too long")
            if line.startswith(REPLY):  # anything else a library printed is not an answer
                return json.loads(line[len(REPLY):])

    def run(self, kernel: str, signature: dict, configs: list, dev: int) -> int:
        deadline = time.perf_counter() + REQUEST_TIMEOUT_S
        if not self.ready:
            for p in self.procs:
                if self._read(p, deadline).get("ready") is not True:
                    raise RuntimeError("a compile process did not start")
            self.ready = True
        parts = [configs[i::len(self.procs)] for i in range(len(self.procs))]
        busy = []
        for proc, part in zip(self.procs, parts):
            if part:
                proc.stdin.write(json.dumps({"kernel": kernel, "signature": signature, "configs": part,
                                             "device": dev}) + "\n")
                proc.stdin.flush()
                busy.append(proc)
        return sum(self._read(p, deadline)["compiled"] for p in busy)

    def close(self):
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


_lock = threading.Lock()
_pool = None
_broken = None  # the error that ended the pool: not started again in this process
_timer = None


def _close_idle():
    global _pool
    with _lock:
        if _pool is not None:
            _pool.close()
            _pool = None


def shutdown() -> None:
    if _timer is not None:
        _timer.cancel()
    _close_idle()


atexit.register(shutdown)


def compile_candidates(kernel, signature: dict, dev: int) -> int:
    """Compile ``kernel``'s candidate configs for a launch of ``signature`` on CUDA device ``dev`` in the pool,
    into Triton's on-disk cache. Returns how many were compiled there; 0 when the pool is off or failed (the
    caller compiles them itself, as it would without a pool)."""
    global _pool, _broken, _timer
    n = workers()
    if n < 2 or _broken is not None or settings.compile_shard() is not None or settings.interpreting():
        return 0
    configs = [c.as_dict() for c in kernel.configs]
    with _lock:  # one key at a time through the pool: each process answers one request at a time
        if _timer is not None:
            _timer.cancel()
        try:
            if _pool is None:
                _pool = _Pool(n)
            return _pool.run(kernel.name, signature, configs, dev)
        except Exception as e:  # noqa: BLE001 - reported once; the caller compiles the candidates itself
            _broken = e
            if _pool is not None:
                _pool.close()
                _pool = None
            warnings.warn(f"the tuning compile pool failed ({type(e).__name__}: {e}); candidates are compiled in this "
                          f"process from now on (DFLASH_KERNELS_TUNE_WORKERS=0 turns the pool off)", RuntimeWarning,
                          stacklevel=3)
            return 0
        finally:
            if _pool is not None:
                _timer = threading.Timer(IDLE_S, _close_idle)
                _timer.daemon = True
                _timer.start()
