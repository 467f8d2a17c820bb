"""Tuning results: timed once per key per GPU model, persisted to JSON, shared by processes.

One file per (GPU model, Triton version) under the cache directory. Entries are keyed by
``<kernel name>|<kernel source hash>|<key>`` so an edited kernel is tuned again. Writes take an
exclusive ``flock`` on a side lock file, re-read the file, merge, write a temporary file and
``os.replace`` it: concurrent processes never lose each other's entries and a reader never sees a
half-written file.

The cache never stops an op: when its folder cannot be created or written, one
:class:`~dflash_kernels.runtime.errors.TuningCacheWarning` says so and the results stay in the process's
memory (timed again by the next process). A damaged file (not JSON, or not an object of entries) is
moved aside to ``<name>.corrupt-<n>`` with a warning naming both paths, never overwritten, and the
store starts that file empty.

The package ships files of the same name and format in ``dflash_kernels/runtime/tuned/``: results timed
on that GPU model (the shapes of the main job), read-only, consulted for a key the cache directory does
not hold (``DFLASH_KERNELS_PACKAGED_TUNING=0`` ignores them). The cache's own entries win; an entry of an
edited kernel carries the old source hash and is never found. ``python -m dflash_kernels.runtime.tuning
ship FILE`` copies a cache file's entries of the current kernels into the package.
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import warnings

import triton

from dflash_kernels.runtime import settings
from dflash_kernels.runtime.devices import gpu_model
from dflash_kernels.runtime.errors import TuningCacheWarning

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["KeyLocks", "TuningStore", "store", "tuning_lock", "PACKAGED_DIR"]

# Entries named SIGNATURE_PREFIX + a kernel's tuning-entry name hold the launch signature a run compiled that
# kernel for (argument dtypes, alignment, ints, constexprs): enough to compile it again ahead of time on
# another machine of the same GPU model (runtime/precompile.py: precompile_recorded).
SIGNATURE_PREFIX = "compile|"
RUN_PREFIX = "run|"  # a shipped file's record of a run that filled it (tuning.ship's ``run``)
PACKAGED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def file_name(model: str) -> str:
    return f"tuning-{model}-triton{triton.__version__}.json"


def read_table(path: str):
    """The entries of the tuning file ``path``: ``{}`` when there is no such file, None when it is damaged
    (not JSON, or not an object whose values are objects). Other read errors (permissions) raise OSError."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    try:
        data = json.loads(raw)
    except ValueError:  # invalid JSON or invalid UTF-8
        return None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        return None
    return data


def _free_aside_name(path: str) -> str:
    n = 1
    while os.path.lexists(f"{path}.corrupt-{n}"):
        n += 1
    return f"{path}.corrupt-{n}"


class TuningStore:
    def __init__(self, directory: str, packaged_dir: str = None):
        self.directory = directory
        self.packaged_dir = PACKAGED_DIR if packaged_dir is None else packaged_dir
        self._memory = {}  # path -> dict, loaded lazily; holds this process's results when writes fail
        self._packaged = {}  # file name -> dict, loaded lazily
        self._lock = threading.Lock()
        self._write_error = None  # the OSError that stopped writes to ``directory``; warned about once
        self._warned = set()

    def path(self, device: int) -> str:
        return os.path.join(self.directory, file_name(gpu_model(device)))

    def _warn(self, what, message: str) -> None:
        """One warning per ``what`` (a hashable naming the event) per store; called under ``self._lock``."""
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, TuningCacheWarning, stacklevel=2)

    @contextlib.contextmanager
    def _file_lock(self, path: str):
        """The lock every process holds while it reads, moves aside or replaces ``path``."""
        os.makedirs(self.directory, exist_ok=True)
        with open(path + ".lock", "a+") as lock_file:
            if fcntl is not None:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _read_locked(self, path: str) -> dict:
        """``path``'s entries, read under its file lock; a damaged file is moved aside first. Raises
        OSError when the file cannot be read or moved: the caller then must not write over it."""
        table = read_table(path)
        if table is None:
            aside = _free_aside_name(path)
            os.rename(path, aside)  # under the lock: no other process picks the same name or moves a good file
            self._warn(("moved", aside), f"tuning file {path} is damaged (not a JSON object of entries); "
                                         f"moved it to {aside} and started it empty")
            table = {}
        return table

    def _load(self, path: str) -> dict:
        """The cache file's entries for this process's memory (called under ``self._lock``). A file that
        cannot be read, or is damaged and cannot be moved aside, is ignored and never written over."""
        try:
            table = read_table(path)
        except OSError as e:
            self._write_error = self._write_error or e
            self._warn(("read", path), f"cannot read the tuning file {path} ({e}); it is ignored in this process "
                                       f"and not written over")
            return {}
        if table is None:  # damaged, seen without the file lock: look again under it, and move it aside
            try:
                with self._file_lock(path):
                    table = self._read_locked(path)
            except OSError as e:
                self._write_error = self._write_error or e
                self._warn(("damaged", path), f"tuning file {path} is damaged (not a JSON object of entries) and "
                                              f"cannot be moved aside ({e}); it is ignored in this process and "
                                              f"not written over")
                return {}
        return table

    def _shipped(self, name: str) -> dict:
        table = self._packaged.get(name)
        if table is None:
            path = os.path.join(self.packaged_dir, name)
            try:
                table = read_table(path)
            except OSError:
                table = {}
            if table is None:
                self._warn(("packaged", path), f"the packaged tuning file {path} is damaged; it is ignored")
                table = {}
            self._packaged[name] = table
        return table

    def get(self, device: int, entry: str):
        """The saved result of ``entry``: the cache directory's, else the package's (when enabled), else None."""
        return self.lookup(device, entry)[0]

    def lookup(self, device: int, entry: str) -> tuple:
        """``(saved result, "disk" or "packaged")`` of ``entry``, or ``(None, None)``. "disk" includes this
        process's results kept in memory when the cache folder cannot be written."""
        path = self.path(device)
        with self._lock:
            table = self._memory.get(path)
            if table is None:
                table = self._memory[path] = self._load(path)
            found = table.get(entry)
            if found is not None:
                return found, "disk"
            if settings.packaged_tuning():
                found = self._shipped(os.path.basename(path)).get(entry)
                if found is not None:
                    return found, "packaged"
            return None, None

    def entries(self, device: int, prefix: str) -> dict:
        """Every saved entry whose name starts with ``prefix``: the package's (when enabled), then the cache
        directory's over them."""
        path = self.path(device)
        with self._lock:
            table = self._memory.get(path)
            if table is None:
                table = self._memory[path] = self._load(path)
            found = {}
            if settings.packaged_tuning():
                found.update((k, v) for k, v in self._shipped(os.path.basename(path)).items() if k.startswith(prefix))
            found.update((k, v) for k, v in table.items() if k.startswith(prefix))
            return found

    def put(self, device: int, entry: str, value: dict) -> None:
        """Save ``entry``: in memory, and merged into the cache file unless the cache folder cannot be
        written (then it stays in memory for this process; one warning, and no further write is tried)."""
        path = self.path(device)
        with self._lock:
            table = self._memory.get(path)
            if table is None:
                table = self._memory[path] = self._load(path)
            table[entry] = value
            if self._write_error is not None:
                return
            try:
                with self._file_lock(path):
                    merged = self._read_locked(path)
                    merged[entry] = value
                    self._replace(path, merged)
            except OSError as e:
                self._write_error = e
                self._warn("write", f"cannot write tuning results to {self.directory} ({e}); they are kept in "
                                    f"memory for this process only (set DFLASH_KERNELS_CACHE_DIR to a writable "
                                    f"folder to persist them)")
                return
            table.update(merged)  # other processes' entries too

    def _replace(self, path: str, table: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tuning-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
                f.flush()
                # on disk before the rename: after a crash the file is the old or the new one, never empty
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


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


def ship(cache_file: str, kernels=None, packaged_dir: str = PACKAGED_DIR, run: str = None) -> tuple:
    """Merge ``cache_file``'s entries into the packaged file of the same name, keeping only entries whose
    kernel source hash is that of a kernel in ``kernels`` (``{name: source hash}``; default: every kernel of
    the ops now registered), and entries of other names (the implementation choices, versioned in their key).
    The packaged file's own entries of older kernel sources are removed (never found again). ``run`` (the
    command and machine that filled the cache) is recorded in the file as an entry ``run|<UTC time>``, which no
    lookup ever matches. Returns ``(path, entries kept, entries dropped)``, both counts of ``cache_file``'s
    entries."""
    if kernels is None:
        kernels = current_kernel_hashes()
    with open(cache_file) as f:
        table = json.load(f)

    def current(entry):
        return _current_entry(entry, kernels)

    kept = {entry: value for entry, value in table.items() if current(entry)}
    dropped = len(table) - len(kept)
    os.makedirs(packaged_dir, exist_ok=True)
    path = os.path.join(packaged_dir, os.path.basename(cache_file))
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = {entry: value for entry, value in json.load(f).items() if current(entry)}  # stale ones go
    old.update(kept)
    if run:
        import datetime

        import torch

        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        old[f"{RUN_PREFIX}{now}"] = {"run": run, "entries": len(kept), "torch": torch.__version__,
                                     "triton": triton.__version__}
    with open(path, "w") as f:
        json.dump(old, f, indent=1, sort_keys=True)
        f.write("\n")
    return path, len(kept), dropped


def _current_entry(entry: str, kernels: dict) -> bool:
    """False for an entry timed on (or, for a ``compile|`` signature, recorded from) an older source of its kernel
    (``kernels``: ``{name: source hash}``); True for the rest (other names: implementation choices, run records)."""
    if entry.startswith(RUN_PREFIX):
        return True
    name, _, rest = entry.removeprefix(SIGNATURE_PREFIX).partition("|")
    return name not in kernels or kernels[name] == rest.partition("|")[0]


def prune(kernels=None, packaged_dir: str = PACKAGED_DIR) -> list:
    """Remove from every shipped tuning file (``packaged_dir``) the entries of kernels edited since they were
    timed or recorded (``kernels``: ``{name: source hash}``, default: the ops' kernels now), which no lookup can
    find again: what a contributor runs after editing a kernel, before the next ``ship`` re-times it on a GPU.
    Returns ``[(path, entries kept, entries removed)]`` per file; a file with nothing to remove is not rewritten."""
    if kernels is None:
        kernels = current_kernel_hashes()
    report = []
    for name in sorted(os.listdir(packaged_dir)):
        if not (name.startswith("tuning-") and name.endswith(".json")):
            continue
        path = os.path.join(packaged_dir, name)
        with open(path) as f:
            table = json.load(f)
        kept = {entry: value for entry, value in table.items() if _current_entry(entry, kernels)}
        if len(kept) < len(table):
            with open(path, "w") as f:
                json.dump(kept, f, indent=1, sort_keys=True)
                f.write("\n")
        report.append((path, len(kept), len(table) - len(kept)))
    return report


def current_kernel_hashes() -> dict:
    """``{kernel name: source hash}`` of every :class:`~dflash_kernels.runtime.kernel.TritonKernel` the
    package's ops define, as the compiled path keys its tuning entries (Triton's ``cache_key`` of the
    kernel: its source, the jit functions it calls and its first line number).

    Under ``TRITON_INTERPRET=1`` the kernels are interpreted functions without that key (``TritonKernel``
    hashes their Python source instead), so the hashes come from a Python process run without it."""
    if settings.interpreting():
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        code = ("import json\nfrom dflash_kernels.runtime.tuning import current_kernel_hashes\n"
                "print(json.dumps(current_kernel_hashes()))\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"computing the compiled kernels' source hashes failed:\n{out.stderr}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    import dflash_kernels  # noqa: F401 - imports every op, which defines its kernels
    from dflash_kernels.runtime.kernel import all_kernels

    return {k.name: k._source_hash for k in all_kernels()}


if __name__ == "__main__":
    usage = ("usage: python -m dflash_kernels.runtime.tuning ship CACHE_FILE [--run 'COMMAND ON GPU']\n"
             "       python -m dflash_kernels.runtime.tuning prune   (the shipped files' entries of edited kernels)")
    if sys.argv[1:] == ["prune"]:
        for where, n_kept, n_removed in prune():
            print(f"{where}: {n_removed} entries of edited kernels removed, {n_kept} kept")
    elif len(sys.argv) in (3, 5) and sys.argv[1] == "ship" and (len(sys.argv) == 3 or sys.argv[3] == "--run"):
        where, n_kept, n_dropped = ship(sys.argv[2], run=sys.argv[4] if len(sys.argv) == 5 else None)
        print(f"{where}: {n_kept} entries merged, {n_dropped} of edited kernels left out")
    else:
        raise SystemExit(usage)
