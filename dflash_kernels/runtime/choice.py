"""Choosing among implementations of one launch by timing them, once per key per GPU model.

Where an op has two implementations of the same launch (the conv's CUDA extension and its Triton
kernels), a :class:`Choice` says which one runs an input. It follows the rules of a kernel's config
tuning (``kernel.py``): the first call of a key (a shape bucket) on a GPU model warms every candidate,
times them under the device's tuning lock and persists the fastest in the tuning store, where later
processes read it; threads that miss the same key wait for the one timing it (a per-key lock, checked
twice); in strict mode a key that would have to be timed raises :class:`KernelCacheMiss`; with tuning
off (``DFLASH_KERNELS_TUNE=0`` or ``compile``) an untimed key takes the choice's default.
"""

import threading
import time
import weakref

import torch
import triton

from dflash_kernels.runtime import settings, tuning
from dflash_kernels.runtime.devices import device_index, on_device
from dflash_kernels.runtime.errors import KernelCacheMiss

__all__ = ["Choice", "reset_choices"]

_registry = weakref.WeakSet()  # every Choice, for reset_choices
_registry_lock = threading.Lock()


def _time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


class Choice:
    """Which of several implementations of one launch runs a key, decided by timing them.

    Args:
        name: prefix of the persisted entries, ``<name>|<version>|<key>``.
        default: the implementation an untimed key takes when tuning is off.
        label: names the choice in errors and messages (default: ``name``).
        version: zero-argument callable giving a string that changes when an implementation's code
            changes, so that an edited implementation is timed again (the Triton version is part of
            the store's file name already).

    Usage: ``impl = choice.get(device, key) or choice.choose(key, device, candidates)``, where
    ``candidates`` maps each implementation's name to a zero-argument callable running one call of
    it on scratch outputs; on a tie the first listed wins.
    """

    def __init__(self, name: str, default: str, *, label: str = None, version=None):
        self.name = name
        self.default = default
        self.label = label or name
        self._version = version
        self._memory = {}  # (device index, key) -> implementation; read without a lock
        self._locks = tuning.KeyLocks()
        with _registry_lock:
            _registry.add(self)

    def persist_name(self, key) -> str:
        version = self._version() if self._version is not None else ""
        return f"{self.name}|{version}|{key!r}"

    def get(self, device, key):
        """The implementation already chosen for ``key`` on ``device`` in this process, else None."""
        return self._memory.get((device_index(device), key))

    def choose(self, key, device, candidates: dict, timer=_time_ms) -> str:
        """The implementation that runs ``key`` on ``device``: remembered, persisted, or timed now."""
        dev = device_index(device)
        hit = self._memory.get((dev, key))
        if hit is not None:
            return hit
        with self._locks((dev, key)):
            hit = self._memory.get((dev, key))
            if hit is not None:  # another thread chose it while we waited
                return hit
            store = tuning.store()
            name = self.persist_name(key)
            saved = store.get(dev, name)
            if settings.compile_shard() is not None:
                # A precompile compile worker: every implementation runs once, so each compiles its kernels
                # (nothing launches there, so nothing is timed or stored).
                for run in candidates.values():
                    run()
                impl = saved["impl"] if saved is not None else self.default
            elif saved is not None:
                impl = saved["impl"]
            elif not settings.tuning_enabled():
                impl = self.default
            else:
                if settings.is_strict():
                    raise KernelCacheMiss(f"strict mode: the {self.label} for bucket {key!r} is not measured yet; "
                                          f"precompile this shape first or leave strict mode")
                impl, ms, seconds = self._time(dev, candidates, timer)
                store.put(dev, name, {"impl": impl, "ms": ms, "seconds": seconds})
                if settings.verbose():
                    times = ", ".join(f"{n} {t:.4f} ms" for n, t in ms.items())
                    print(f"[dflash_kernels] {self.label} {key!r}: {impl} ({times})")
            self._memory[(dev, key)] = impl
            return impl

    @staticmethod
    def _time(dev, candidates, timer):
        with on_device(dev):
            # Each candidate runs once first, outside the tuning lock: a Triton path compiles and
            # tunes its own configs under that lock, so it must not be held here yet.
            for run in candidates.values():
                run()
            if dev >= 0:
                torch.cuda.synchronize(dev)
            with tuning.tuning_lock(dev):
                t0 = time.perf_counter()
                ms = {n: timer(run) for n, run in candidates.items()}
                seconds = time.perf_counter() - t0
        return min(ms, key=ms.get), ms, seconds

    def reset(self) -> None:
        """Forget the choices made in this process (the persisted ones stay on disk)."""
        self._memory.clear()
        self._locks.clear()


def reset_choices() -> None:
    """Forget every choice made in this process (part of :func:`dflash_kernels.reset_cache`)."""
    with _registry_lock:
        choices = list(_registry)
    for c in choices:
        c.reset()
