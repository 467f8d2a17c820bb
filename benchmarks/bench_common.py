"""Timing, memory and process helpers shared by every benchmark script."""

import json
import subprocess
import threading
import time

import torch


def bench_ms(fn, quick: bool = False, cuda: bool = True) -> float:
    """Median milliseconds of ``fn``: CUDA events via ``triton.testing.do_bench`` on the GPU,
    the mean of three host-timed calls after one warm-up elsewhere (CPU runs only show the job works)."""
    if cuda:
        import triton.testing
        # One short pass first, discarded: the first timing of a call path in a process can read several
        # times high for ops shorter than a tenth of a millisecond (host-side warm-up showing through);
        # every implementation gets the same treatment.
        triton.testing.do_bench(fn, warmup=5, rep=10, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                       return_mode="median")
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def peak_mib(fn, cuda: bool = True) -> float:
    """Peak device memory ``fn`` allocates above what was allocated before it, in MiB (NaN off the GPU)."""
    if not cuda:
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def run_rows(cmd, op: str, impl: str, timeout_s: float, env=None) -> list:
    """Run an implementation's process (``cmd``), echoing its output, and return the rows it printed as
    ``ROW {json}`` lines, each tagged ``process: impl``; plus one error row when it was killed at
    ``timeout_s`` or exited non-zero, with the end of its output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    timed_out = []
    timer = threading.Timer(timeout_s, lambda: (timed_out.append(True), proc.kill()))
    timer.start()
    rows, tail = [], []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
            else:
                tail = (tail + [line])[-8:]
            print(f"  [{impl}] {line[:400]}", flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
    secs = time.perf_counter() - t0
    for r in rows:
        r["process"] = impl
    if timed_out or rc != 0:
        how = f"process killed at the {timeout_s:.0f} s limit" if timed_out else f"process exited with {rc}"
        rows.append({"op": op, "impl": impl, "process": impl,
                     "error": f"{how} after {secs:.0f} s; last output: {' | '.join(tail)[-300:]}"})
    print(f"  [{impl}] done in {secs:.0f} s, rc={rc}", flush=True)
    return rows
