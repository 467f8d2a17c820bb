"""Ahead-of-time compile and tune: run each declared (op, shape, dtype, device) once before work starts.

Each op registers an example builder that makes inputs of a shape and runs the op (forward, and
backward when asked) through the normal launch path, so exactly the keys a real run needs get
compiled. Afterwards :func:`dflash_kernels.strict` turns any further compile into an error.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

from dflash_kernels.runtime import kernel_bundle, settings, tuning
from dflash_kernels.runtime.devices import gpu_model
from dflash_kernels.runtime.kernel import all_kernels, cache_info

__all__ = ["register_precompile", "precompile", "precompile_recorded"]

_builders = {}
WORKER_TIMEOUT_S = 1800.0  # the parallel pass's limit; a hung compile process is killed and reported


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


def precompile(specs, devices=None, backward=True, verbose=True, workers=None) -> dict:
    """Compile (and on the GPU tune) every kernel that ``specs`` need.

    On a GPU the compiling runs in parallel first: ``workers`` processes each run every spec in compile-only
    mode (no kernel launches; each compiles its share of every key's configs into Triton's on-disk cache).
    Then this process runs the specs in order as a real call would: each kernel is found compiled on disk
    (milliseconds) and only the timing of untuned keys is left. The second pass is the one that counts:
    a worker that fails only costs time, and is reported.

    Args:
        specs: iterable of ``(op, shape, dtype)`` tuples; ``shape`` is a dict of the op's sizes
            (e.g. ``dict(B=1, D=1024, T=4096, W=4)`` for ``conv1d``).
        devices: devices to compile for (default: every visible CUDA device, else the CPU).
        backward: also compile the backward kernels.
        verbose: print a progress line per spec (with the time left) and per worker.
        workers: compile processes (default: ``DFLASH_KERNELS_PRECOMPILE_WORKERS``, else the machine's cores
            up to 16 on a GPU; 0 or 1: no parallel pass). Never used on the CPU, where nothing compiles.

    Returns:
        ``{"seconds", "items": [{op, shape, dtype, device, seconds, new_keys, compiled, tuned, stored}],
        "keys": [...], "parallel": {"workers", "seconds", "compiled", "errors"} or None}``: per spec, the
        new keys and how each got its config (``tuned``: timed here; ``stored``: found in the tuning store
        or shipped with the package; ``compiled``: every new key).
    """
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    devices = [torch.device(d) for d in devices]
    specs = list(specs)
    for op, _, _ in specs:
        if op not in _builders:
            raise ValueError(f"specs: unknown op {op!r}; precompilable ops: {sorted(_builders)}")
    t_start = time.perf_counter()
    workers = default_workers(devices) if workers is None else int(workers)
    parallel = None
    if workers > 1 and specs and any(d.type == "cuda" for d in devices) and not settings.interpreting():
        parallel = _parallel_compile(specs, devices, backward, workers, verbose)
    before = set(cache_info())
    items = []
    total = len(specs) * len(devices)
    t_serial = time.perf_counter()
    for device in devices:
        for op, shape, dtype in specs:
            known = set(cache_info())
            t0 = time.perf_counter()
            _builders[op](dict(shape), dtype, device, backward)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            info = cache_info()
            new = sorted(set(info) - known, key=repr)
            item = {"op": op, "shape": dict(shape), "dtype": str(dtype), "device": str(device),
                    "seconds": time.perf_counter() - t0, "new_keys": len(new), "compiled": len(new),
                    "tuned": sum(info[k]["tuned_from"] == "timed" for k in new),
                    "stored": sum(info[k]["tuned_from"] in ("disk", "packaged") for k in new)}
            items.append(item)
            if verbose:
                done = len(items)
                left = (time.perf_counter() - t_serial) / done * (total - done)
                print(f"[dflash_kernels] precompile {done}/{total}: {op} {shape} {dtype} on {device}: "
                      f"{item['new_keys']} new kernels ({item['tuned']} tuned, {item['stored']} with stored "
                      f"tuning) in {item['seconds']:.2f}s" + (f"; about {left:.0f}s left" if done < total else ""),
                      file=sys.stderr, flush=True)
    keys = sorted(set(cache_info()) - before, key=repr)
    return {"seconds": time.perf_counter() - t_start, "items": items, "keys": keys, "parallel": parallel}


def default_workers(devices) -> int:
    """Compile processes for :func:`precompile`: ``DFLASH_KERNELS_PRECOMPILE_WORKERS`` when set, else the
    usable cores up to 16 when a device is a GPU (compiling is one core's work per kernel; under torchrun the
    cores divided by ``LOCAL_WORLD_SIZE``), else 0."""
    if not os.environ.get("DFLASH_KERNELS_PRECOMPILE_WORKERS", "").strip() and not any(
            torch.device(d).type == "cuda" for d in devices):
        return 0
    return settings.process_count("DFLASH_KERNELS_PRECOMPILE_WORKERS", 16)


def _parallel_compile(specs, devices, backward, workers, verbose) -> dict:
    """Run every spec in ``workers`` compile-only processes, one device per GPU model (Triton's on-disk cache
    is keyed by the GPU's architecture, not its index). Processes are started as ``python -m`` children, not
    by multiprocessing: a user's script without a ``__main__`` guard is never run again."""
    t0 = time.perf_counter()
    by_model = {}
    for d in devices:
        by_model.setdefault(torch.cuda.get_device_name(d) if d.type == "cuda" else d.type, d)
    builders = {op: _builders[op].__module__ for op, _, _ in specs}
    runnable = [s for s in specs if builders[s[0]] != "__main__"]  # builders a child can import
    job = {"specs": [(op, encode(dict(shape)), encode(dtype)) for op, shape, dtype in runnable],
           "modules": sorted(set(builders[op] for op, _, _ in runnable)), "backward": bool(backward),
           "devices": [str(d) for d in by_model.values()], "shards": workers}
    compiled, errors = _run_workers(job, workers, verbose)
    seconds = time.perf_counter() - t0
    if verbose:
        print(f"[dflash_kernels] precompile: {workers} compile processes built {compiled} kernels in {seconds:.1f}s"
              + (f"; {len(errors)} problems (the pass below compiles what they left):\n  " + "\n  ".join(errors)
                 if errors else ""), file=sys.stderr, flush=True)
    if errors:
        warnings.warn(f"precompile: the parallel compile pass had {len(errors)} problems (the serial pass compiles "
                      f"what it left): {errors[0]}", RuntimeWarning, stacklevel=3)
    return {"workers": workers, "seconds": seconds, "compiled": compiled, "errors": errors}


_done = set()  # (GPU model, persist name) of launches precompile_recorded compiled in this process
_model_locks = {}  # GPU model -> the lock a precompile_recorded pass holds (a second call waits for the first)
_state_lock = threading.Lock()


class PendingPrecompile:
    """A :func:`precompile_recorded` running in a background thread (its worker processes do the work):
    ``wait()`` returns its report, or raises what it raised."""

    def __init__(self, fn):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="dflash_kernels-precompile", daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e

    def wait(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def precompile_recorded(device=None, workers=None, verbose=True, background=False, tags=None):
    """Compile, in parallel worker processes, every kernel launch recorded for this GPU model: by any earlier
    run on it with this cache folder, and shipped with the package (``runtime/tuned/``). Each compiles into
    Triton's on-disk cache, so this process's first call of such a kernel loads it in milliseconds instead of
    compiling it. Signatures of edited kernels are never used (their source hash differs).

    A fresh machine's first step pays this (seconds, on many cores) instead of compiling one kernel at a time.
    Nothing runs on the CPU (nothing compiles there).

    Args:
        device: the GPU (default: the current CUDA device).
        workers: compile processes (default as :func:`precompile`'s).
        verbose: print what was compiled, skipped and how long it took.
        background: return at once a :class:`PendingPrecompile` whose ``wait()`` gives the report, so that the
            compiling overlaps other start-up work (loading a model). A later call for the same GPU model waits
            for it and compiles only what it left.
        tags: only the launches recorded under one of these names (a run's preset: ``real``, ``embedded``,
            ``27b``, ``ops``; see ``DFLASH_KERNELS_RECORD_TAG``).

    Returns:
        ``{"recorded", "current", "shipped", "done_before", "compiled", "untuned", "workers", "seconds",
        "errors"}``: signatures found (of ``tags``), those of the current kernel sources, those whose compiled
        kernels the package shipped (in the cache folder already), those an earlier call in this process
        compiled, kernels compiled now, and signatures with several candidate configs but no stored tuning
        (all candidates compiled; timed at their first call).
    """
    if background:
        return PendingPrecompile(lambda: precompile_recorded(device, workers, verbose, tags=tags))
    t0 = time.perf_counter()
    report = {"recorded": 0, "current": 0, "shipped": 0, "done_before": 0, "compiled": 0, "untuned": 0,
              "workers": 0, "seconds": 0.0, "errors": []}
    if not torch.cuda.is_available() or settings.interpreting():
        return report
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return report
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    model = gpu_model(index)
    with _state_lock:
        lock = _model_locks.setdefault(model, threading.Lock())
    with lock:
        _precompile_recorded(index, model, workers, verbose, report, tags)
    report["seconds"] = time.perf_counter() - t0
    if verbose:
        print(f"[dflash_kernels] precompile_recorded on {model}: {report['current']} recorded kernel launches of "
              f"the current sources ({report['recorded'] - report['current']} of edited kernels skipped, "
              f"{report['shipped']} shipped compiled, {report['done_before']} compiled earlier in this process), "
              f"{report['compiled']} kernels compiled by "
              f"{report['workers']} processes in {report['seconds']:.1f}s"
              + (f"; {len(report['errors'])} problems: " + "; ".join(report["errors"][:3]) if report["errors"]
                 else ""), file=sys.stderr, flush=True)
    if report["errors"]:
        warnings.warn(f"precompile_recorded: {len(report['errors'])} problems (those kernels compile at their first "
                      f"call): {report['errors'][0]}", RuntimeWarning, stacklevel=2)
    return report


def _precompile_recorded(index, model, workers, verbose, report, tags=None):
    recorded, current = kernel_bundle.recorded_launches(index, tags)
    shipped = kernel_bundle.ensure_shipped(index)
    fresh = {p: v for p, v in current.items() if p not in shipped}
    entries = {tuning.SIGNATURE_PREFIX + p: v for p, v in fresh.items() if (model, p) not in _done}
    report.update(recorded=recorded, current=len(current), shipped=len(current) - len(fresh),
                  done_before=len(fresh) - len(entries))
    kernels = {k.name: k for k in all_kernels()}
    for n in entries:
        persist = n[len(tuning.SIGNATURE_PREFIX):]
        kernel = kernels[persist.partition("|")[0]]
        if len(kernel.configs) > 1 and settings.tuning_enabled() and tuning.store().get(index, persist) is None:
            report["untuned"] += 1
    workers = default_workers([torch.device("cuda", index)]) if workers is None else int(workers)
    report["workers"] = workers = max(1, min(workers, len(entries))) if entries else 0
    if entries:
        job = {"device": f"cuda:{index}", "shards": workers, "signatures": entries}
        report["compiled"], report["errors"] = _run_workers(job, workers, verbose, "--signatures")
        if not report["errors"]:
            _done.update((model, n[len(tuning.SIGNATURE_PREFIX):]) for n in entries)


def _run_workers(job, workers, verbose, mode=None):
    """Run ``workers`` compile processes on ``job``; returns (kernels compiled, problems)."""
    t0 = time.perf_counter()
    procs = []
    with tempfile.TemporaryDirectory(prefix="dflash_kernels_precompile_") as tmp:
        path = os.path.join(tmp, "job.json")
        with open(path, "w") as f:
            json.dump(job, f)
        # The children import what this process imports: the package and the builders' modules by this
        # process's import path (a script run from a checkout, not installed, included).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if isinstance(p, str) and p))
        for i in range(workers):
            cmd = [sys.executable, "-m", "dflash_kernels.runtime.compile_worker"] + ([mode] if mode else []) + [
                path, str(i)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        compiled, errors = 0, []
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(60.0, WORKER_TIMEOUT_S - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err = f"killed after {WORKER_TIMEOUT_S:.0f}s; " + err
            result = _worker_result(out)
            if p.returncode != 0 or result is None:
                errors.append(f"worker {i}: exit {p.returncode}: {err.strip()[-600:]}")
                continue
            compiled += result["compiled"]
            errors += [f"worker {i}: {e}" for e in result["errors"]]
            if verbose:
                print(f"[dflash_kernels] precompile: compile process {i + 1}/{workers} done "
                      f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    return compiled, errors


def encode(value):
    """A spec's shape or dtype as JSON for a worker: torch dtypes as ``{"dtype": name}``, recursively."""
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).replace("torch.", "")}
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value):
    """The inverse of :func:`encode`."""
    if isinstance(value, dict):
        if set(value) == {"dtype"} and isinstance(value["dtype"], str):
            return getattr(torch, value["dtype"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _worker_result(out: str):
    for line in reversed((out or "").splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None
