"""Ahead-of-time compile and tune: run each declared (op, shape, dtype, device) once before work starts.

Each op registers an example builder that makes inputs of a shape and runs the op (forward, and
backward when asked) through the normal launch path, so exactly the keys a real run needs get
compiled. Afterwards :func:`dflash_kernels.strict` turns any further compile into an error.
"""

import sys
import time

import torch

from dflash_kernels.runtime.kernel import cache_info

__all__ = ["register_precompile", "precompile"]

_builders = {}


def register_precompile(op: str, *more: str):
    """Decorator: ``fn(shape: dict, dtype, device, backward: bool)`` runs ``op`` once on made-up inputs.

    The builder must run every form of the op a run can take (each public function, each constexpr variant
    a shape bucket can take), so that :func:`dflash_kernels.strict` after a precompile meets no miss. ``more``
    names further ops it serves (an op whose public functions dispatch under several names): a spec of any
    of the names runs it. A name given two different builders is an error, not a silent replacement (the same
    builder again, as a reloaded module gives it, replaces its old self)."""
    names = (op,) + more

    def where(fn):
        return f"{fn.__module__}.{fn.__qualname__}"

    def wrap(fn):
        for name in names:
            if name in _builders and where(_builders[name]) != where(fn):
                raise ValueError(f"op: {name!r} already has a precompile builder ({where(_builders[name])}); "
                                 f"got another one ({where(fn)})")
        for name in names:
            _builders[name] = fn
        return fn
    return wrap


def precompile(specs, devices=None, backward=True, verbose=True) -> dict:
    """Compile (and on the GPU tune) every kernel that ``specs`` need.

    Args:
        specs: iterable of ``(op, shape, dtype)`` tuples; ``shape`` is a dict of the op's sizes
            (e.g. ``dict(B=1, D=1024, T=4096, W=4)`` for ``conv1d``).
        devices: devices to compile for (default: every visible CUDA device, else the CPU).
        backward: also compile the backward kernels.
        verbose: print one progress line per spec.

    Returns:
        ``{"seconds": total, "items": [{op, shape, dtype, device, seconds, new_keys}], "keys": [...]}``.
    """
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    specs = list(specs)
    for op, _, _ in specs:
        if op not in _builders:
            raise ValueError(f"specs: unknown op {op!r}; precompilable ops: {sorted(_builders)}")
    before = set(cache_info())
    items, t_start = [], time.perf_counter()
    total = len(specs) * len(devices)
    for device in devices:
        device = torch.device(device)
        for op, shape, dtype in specs:
            known = set(cache_info())
            t0 = time.perf_counter()
            _builders[op](dict(shape), dtype, device, backward)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            new = sorted(set(cache_info()) - known, key=repr)
            item = {"op": op, "shape": dict(shape), "dtype": str(dtype), "device": str(device),
                    "seconds": time.perf_counter() - t0, "new_keys": len(new)}
            items.append(item)
            if verbose:
                print(f"[dflash_kernels] precompile {len(items)}/{total}: {op} {shape} {dtype} on {device}: "
                      f"{item['new_keys']} new kernels in {item['seconds']:.2f}s", file=sys.stderr, flush=True)
    keys = sorted(set(cache_info()) - before, key=repr)
    return {"seconds": time.perf_counter() - t_start, "items": items, "keys": keys}
