"""Timing and memory helpers shared by every benchmark script."""

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
