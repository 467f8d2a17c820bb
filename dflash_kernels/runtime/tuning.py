"""Tuning results: timed once per key per GPU model, persisted to JSON, shared by processes.

One file per (GPU model, Triton version) under the cache directory. Entries are keyed by
``<kernel name>|<kernel source hash>|<key>`` so an edited kernel is tuned again. Writes take an
exclusive ``flock`` on a side lock file, re-read the file, merge, write a temporary file and
``os.replace`` it: concurrent processes never lose each other's entries and a reader never sees a
half-written file.

The package ships files of the same name and format in ``dflash_kernels/runtime/tuned/``: results timed
on that GPU model (the shapes of the main job), read-only, consulted for a key the cache directory does
not hold (``DFLASH_KERNELS_PACKAGED_TUNING=0`` ignores them). The cache's own entries win; an entry of an
edited kernel carries the old source hash and is never found. ``python -m dflash_kernels.runtime.tuning
ship FILE`` copies a cache file's entries of the current kernels into the package.
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

__all__ = ["KeyLocks", "TuningStore", "store", "tuning_lock", "PACKAGED_DIR"]

PACKAGED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def file_name(model: str) -> str:
    return f"tuning-{model}-triton{triton.__version__}.json"


class TuningStore:
    def __init__(self, directory: str, packaged_dir: str = None):
        self.directory = directory
        self.packaged_dir = PACKAGED_DIR if packaged_dir is None else packaged_dir
        self._memory = {}  # path -> dict, loaded lazily
        self._packaged = {}  # file name -> dict, loaded lazily
        self._lock = threading.Lock()

    def path(self, device: int) -> str:
        return os.path.join(self.directory, file_name(gpu_model(device)))

    def _load(self, path: str) -> dict:
        try:
            with open(path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, device: int, entry: str):
        """The saved result of ``entry``: the cache directory's, else the package's (when enabled), else None."""
        return self.lookup(device, entry)[0]

    def lookup(self, device: int, entry: str) -> tuple:
        """``(saved result, "disk" or "packaged")`` of ``entry``, or ``(None, None)``."""
        path = self.path(device)
        with self._lock:
            table = self._memory.get(path)
            if table is None:
                table = self._memory[path] = self._load(path)
            found = table.get(entry)
            if found is not None:
                return found, "disk"
            if settings.packaged_tuning():
                name = os.path.basename(path)
                shipped = self._packaged.get(name)
                if shipped is None:
                    shipped = self._packaged[name] = self._load(os.path.join(self.packaged_dir, name))
                found = shipped.get(entry)
                if found is not None:
                    return found, "packaged"
            return None, None

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


def ship(cache_file: str, kernels=None, packaged_dir: str = PACKAGED_DIR) -> tuple:
    """Merge ``cache_file``'s entries into the packaged file of the same name, keeping only entries whose
    kernel source hash is that of a kernel in ``kernels`` (``{name: source hash}``; default: every kernel of
    the ops now registered), and entries of other names (the implementation choices, versioned in their key).
    The packaged file's own entries of older kernel sources are removed (never found again). Returns
    ``(path, entries kept, entries dropped)``, both counts of ``cache_file``'s entries."""
    if kernels is None:
        kernels = current_kernel_hashes()
    with open(cache_file) as f:
        table = json.load(f)

    def current(entry):  # False: timed on an older source of its kernel
        name, _, rest = entry.partition("|")
        return name not in kernels or kernels[name] == rest.partition("|")[0]

    kept = {entry: value for entry, value in table.items() if current(entry)}
    dropped = len(table) - len(kept)
    os.makedirs(packaged_dir, exist_ok=True)
    path = os.path.join(packaged_dir, os.path.basename(cache_file))
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = {entry: value for entry, value in json.load(f).items() if current(entry)}  # stale ones go
    old.update(kept)
    with open(path, "w") as f:
        json.dump(old, f, indent=1, sort_keys=True)
        f.write("\n")
    return path, len(kept), dropped


def current_kernel_hashes() -> dict:
    """``{kernel name: source hash}`` of every :class:`~dflash_kernels.runtime.kernel.TritonKernel` the
    package's ops define."""
    import dflash_kernels  # noqa: F401 - imports every op, which defines its kernels
    from dflash_kernels.runtime.kernel import all_kernels

    return {k.name: k._source_hash for k in all_kernels()}


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "ship":
        raise SystemExit("usage: python -m dflash_kernels.runtime.tuning ship CACHE_FILE")
    where, n_kept, n_dropped = ship(sys.argv[2])
    print(f"{where}: {n_kept} entries merged, {n_dropped} of edited kernels left out")
