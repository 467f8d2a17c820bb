"""Tuning results: timed once per key per GPU model, persisted to JSON, shared by processes.

One file per (GPU model, Triton version) under the cache directory. Entries are keyed by
``<kernel name>|<kernel source hash>|<key>`` so an edited kernel is tuned again. Writes take an
exclusive ``flock`` on a side lock file, re-read the file, merge, write a temporary file and
``os.replace`` it: concurrent processes never lose each other's entries and a reader never sees a
half-written file.
"""

import json
import os
import tempfile
import threading

import triton

from dflash_kernels.runtime import settings
from dflash_kernels.runtime.devices import gpu_model

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["KeyLocks", "TuningStore", "store", "tuning_lock"]


class TuningStore:
    def __init__(self, directory: str):
        self.directory = directory
        self._memory = {}  # path -> dict, loaded lazily
        self._lock = threading.Lock()

    def path(self, device: int) -> str:
        return os.path.join(self.directory, f"tuning-{gpu_model(device)}-triton{triton.__version__}.json")

    def _load(self, path: str) -> dict:
        try:
            with open(path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, device: int, entry: str):
        path = self.path(device)
        with self._lock:
            table = self._memory.get(path)
            if table is None:
                table = self._memory[path] = self._load(path)
            return table.get(entry)

    def put(self, device: int, entry: str, value: dict) -> None:
        path = self.path(device)
        os.makedirs(self.directory, exist_ok=True)
        with self._lock:
            with open(path + ".lock", "a+") as lock_file:
                if fcntl is not None:
                    fcntl.flock(lock_file, fcntl.LOCK_EX)
                try:
                    table = self._load(path)
                    table[entry] = value
                    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tuning-", suffix=".tmp")
                    with os.fdopen(fd, "w") as f:
                        json.dump(table, f, indent=1, sort_keys=True)
                    os.replace(tmp, path)
                finally:
                    if fcntl is not None:
                        fcntl.flock(lock_file, fcntl.LOCK_UN)
            self._memory[path] = table


_store = None
_store_lock = threading.Lock()


def store() -> TuningStore:
    """The store for the current cache directory (re-created if ``DFLASH_KERNELS_CACHE_DIR`` changes)."""
    global _store
    directory = settings.cache_dir()
    with _store_lock:
        if _store is None or _store.directory != directory:
            _store = TuningStore(directory)
        return _store


class KeyLocks:
    """One lock per key, created on first use: work on one key (a compile, a timing) runs once while
    other keys proceed, and threads asking for the same key wait for that one run."""

    def __init__(self):
        self._locks = {}
        self._guard = threading.Lock()

    def __call__(self, key) -> threading.Lock:
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock

    def clear(self) -> None:
        with self._guard:
            self._locks.clear()


_tuning_locks = KeyLocks()


def tuning_lock(device: int) -> threading.Lock:
    """The lock every timing on ``device`` runs under: two candidates timed at once on one GPU would
    skew both."""
    return _tuning_locks(device)
