"""No silent failures: a run log that opens first, logged stages, supervised worker threads, a watchdog.

This module imports only the standard library, so an entry point can open the log with it before
torch, transformers or the kernels are imported (a run that dies while importing them still leaves
a log saying so).

- :func:`open_run_log` opens ``OUT_DIR/train.log`` (``train.rank<R>.log`` under torchrun), copies
  everything written to stdout and stderr into it, and points :mod:`faulthandler` at it, so a native
  crash (segfault, abort) leaves every thread's Python stack there too.
- :meth:`RunLog.stage` logs the start and end (or failure, with the traceback) of each set-up stage.
- :class:`Supervisor` runs the worker threads: the first exception in any of them is logged with its
  traceback, every worker is told to stop, and :meth:`Supervisor.wait` raises :class:`WorkerFailed`;
  a worker that does not stop within ``stop_grace_s`` gets its stack dumped (the caller then exits).
- :class:`Watchdog`: no :meth:`RunLog.progress` call for ``watchdog_s`` seconds dumps every thread's
  stack to the log and exits the process with :data:`EXIT_HANG`.
- SIGTERM / SIGINT (:func:`install_signal_handlers`) ask for a graceful stop: the training loop
  finishes its step, writes a checkpoint and the process exits with status 0. A second signal exits
  at once with :data:`EXIT_SIGNAL`.
- ``DFLASH_TRAINER_FAULT`` injects a failure for tests (:func:`fault_point`).
"""

import faulthandler
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

__all__ = ["RunLog", "open_run_log", "get_log", "Supervisor", "WorkerFailed", "Watchdog", "StopRequest",
           "Stopped", "install_signal_handlers", "dump_stacks", "fault_point", "InjectedFault", "hard_exit",
           "EXIT_OK", "EXIT_FAILED", "EXIT_HANG", "EXIT_SIGNAL"]

EXIT_OK = 0  # finished, or stopped by SIGTERM / SIGINT after writing a checkpoint
EXIT_FAILED = 1  # an exception in set-up or in a worker (traceback in the log)
EXIT_HANG = 3  # the watchdog saw no progress (every thread's stack in the log)
EXIT_SIGNAL = 130  # a second SIGTERM / SIGINT while the graceful stop was under way

_FAULT_ENV = "DFLASH_TRAINER_FAULT"


class _Tee:
    """A text stream that writes to the original stream and to the log file."""

    def __init__(self, stream, log: "RunLog"):
        self._stream, self._log = stream, log

    def write(self, s):
        with self._log.lock:
            try:
                self._stream.write(s)
            except (OSError, ValueError):  # a closed terminal must not take the run down
                pass
            self._log.file.write(s)
            if "\n" in s:
                self._log.file.flush()
        return len(s)

    def flush(self):
        with self._log.lock:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                pass
            self._log.file.flush()

    def isatty(self):
        return self._stream.isatty()

    def fileno(self):
        return self._stream.fileno()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class RunLog:
    """Timestamped lines to the console and (once :meth:`attach` ran) a log file; thread-safe."""

    def __init__(self):
        self.lock = threading.RLock()
        self.file = None
        self.path = None
        self.console = sys.stdout
        self._last_progress = time.monotonic()
        self.progress_note = "start"
        self.phase = "setup"  # "train" once the workers run: the watchdog's tighter limit applies

    def attach(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self.file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
        self.path = path
        self.console = sys.__stdout__
        sys.stdout = _Tee(sys.__stdout__, self)
        sys.stderr = _Tee(sys.__stderr__, self)
        # A native crash (segfault, abort, a fatal signal) dumps every thread's stack here.
        faulthandler.enable(file=self.file, all_threads=True)

    def __call__(self, msg: str) -> None:
        self.log(msg)

    def log(self, msg: str) -> None:
        t = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
        line = f"{stamp} [{threading.current_thread().name}] {msg}\n"
        with self.lock:
            if self.file is not None:
                self.file.write(line)
                self.file.flush()
            try:
                (sys.__stdout__ if self.file is not None else sys.stdout).write(line)
                (sys.__stdout__ if self.file is not None else sys.stdout).flush()
            except (OSError, ValueError):
                pass

    def progress(self, note: str = "") -> None:
        """Tell the watchdog that the run moved (a step, a batch, a stage)."""
        self._last_progress = time.monotonic()
        if note:
            self.progress_note = note

    def idle_seconds(self) -> float:
        return time.monotonic() - self._last_progress

    def stage(self, name: str):
        return _Stage(self, name)

    def flush(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.flush()
                try:
                    os.fsync(self.file.fileno())
                except OSError:
                    pass


class _Stage:
    def __init__(self, log: RunLog, name: str):
        self.log, self.name = log, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.log.progress(f"stage {self.name}")
        self.log(f"stage {self.name}: start")
        return self

    def __exit__(self, typ, exc, tb):
        dt = time.perf_counter() - self.t0
        self.log.progress(f"stage {self.name} done")
        if exc is None:
            self.log(f"stage {self.name}: end ({dt:.1f}s)")
        else:
            text = "".join(traceback.format_exception(typ, exc, tb))
            self.log(f"stage {self.name}: FAILED after {dt:.1f}s: {typ.__name__}: {exc}\n{text.rstrip()}")
            exc._dflash_logged = True  # the entry point does not log this traceback a second time
        return False


_LOG = RunLog()


def get_log() -> RunLog:
    """The process's run log (console only until :func:`open_run_log` attached a file)."""
    return _LOG


def _peek(argv, flag, default=None):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def log_path_for(argv) -> str:
    """``--log-file`` if given, else ``OUT_DIR/train.log`` (``train.rank<R>.log`` for ranks of a
    multi-process run), read from the raw argv without importing anything."""
    explicit = _peek(argv, "--log-file")
    if explicit:
        return explicit
    out_dir = _peek(argv, "--out-dir", "runs/dflash")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    name = f"train.rank{os.environ.get('RANK', '0')}.log" if world > 1 else "train.log"
    return os.path.join(out_dir, name)


def open_run_log(argv) -> RunLog:
    """The entry point's first act: open the log file and say what is starting."""
    path = log_path_for(argv)
    _LOG.attach(path)
    _LOG.log(f"run log opened: {os.path.abspath(path)}; pid {os.getpid()} on {socket.gethostname()}; "
             f"python {sys.version.split()[0]}; torch imported: {'torch' in sys.modules}; "
             f"argv: {' '.join(argv)}")
    env = {k: v for k, v in os.environ.items() if k.startswith(("DFLASH_", "CUDA_VISIBLE", "RANK", "WORLD_SIZE",
                                                                 "LOCAL_RANK", "MASTER_", "TRITON_", "NCCL_"))}
    _LOG.log(f"environment: {env}")
    return _LOG


def dump_stacks(log: RunLog, why: str) -> None:
    """Every thread's Python stack, with thread names, into the log."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"thread stacks ({why}):"]
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} (ident {ident}) ---")
        parts.append("".join(traceback.format_stack(frame)).rstrip())
    log.log("\n".join(parts))


def hard_exit(code: int, log: RunLog = None, msg: str = "") -> None:
    """Exit now, whatever the other threads are doing (a thread stuck in a CUDA or collective call
    cannot be joined); the log is flushed first."""
    log = log or _LOG
    if msg:
        log.log(msg)
    log.log(f"exit status {code}")
    log.flush()
    try:
        sys.__stdout__.flush()
        sys.__stderr__.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


class Watchdog:
    """A daemon thread: no progress for ``timeout_s`` seconds -> stacks to the log, exit ``EXIT_HANG``.

    Until :attr:`RunLog.phase` becomes ``"train"`` the limit is ``setup_timeout_s`` (loading a large
    model or tuning kernels legitimately takes minutes between progress marks).
    """

    def __init__(self, log: RunLog, timeout_s: float, setup_timeout_s: float = None, on_hang=None,
                 poll_s: float = None):
        self.log, self.timeout_s = log, float(timeout_s)
        self.setup_timeout_s = max(float(setup_timeout_s or 0), self.timeout_s)
        self.on_hang = on_hang or (lambda: hard_exit(EXIT_HANG, self.log))
        self.poll_s = poll_s or max(min(self.timeout_s / 10, 5.0), 0.05)
        self._stop = threading.Event()
        self.thread = None

    def start(self) -> "Watchdog":
        if self.timeout_s > 0:
            self.log.progress("watchdog start")
            self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self.thread.start()
            self.log(f"watchdog: exits with status {EXIT_HANG} after {self.timeout_s:g}s without progress in "
                     f"training ({self.setup_timeout_s:g}s during set-up)")
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self):
        while not self._stop.wait(self.poll_s):
            idle = self.log.idle_seconds()
            limit = self.timeout_s if self.log.phase == "train" else self.setup_timeout_s
            if idle > limit:
                self.log.log(f"watchdog: no progress for {idle:.1f}s (limit {limit:g}s; last: "
                             f"{self.log.progress_note}); dumping all thread stacks")
                dump_stacks(self.log, "watchdog")
                self.on_hang()
                return


class WorkerFailed(RuntimeError):
    """A worker thread raised; ``.worker`` names it and ``.tb`` is its traceback text."""

    def __init__(self, worker: str, exc: BaseException, tb: str):
        super().__init__(f"worker {worker} failed: {type(exc).__name__}: {exc}")
        self.worker, self.exc, self.tb = worker, exc, tb


class StopRequest:
    """A graceful stop asked for by a signal (or a test); read by the training loop at step ends."""

    def __init__(self):
        self.reason = None
        self.count = 0

    def request(self, reason: str) -> None:
        self.count += 1
        self.reason = self.reason or reason

    def __bool__(self):
        return self.reason is not None


class Supervisor:
    """Starts worker threads, turns the first exception in any of them into a stop of all of them.

    Workers take ``(sup, *args)`` and check :attr:`stop` at every blocking point (queues with
    timeouts, raising :class:`Stopped`); blocking points that cannot poll (a barrier) register
    their release (``barrier.abort``) with :meth:`add_abort`.
    """

    def __init__(self, log: RunLog, stop_grace_s: float = 20.0):
        self.log = log
        self.stop = threading.Event()
        self.stop_grace_s = stop_grace_s
        self.threads = []
        self.failure = None
        self._lock = threading.Lock()
        self._aborts = []

    def add_abort(self, fn) -> None:
        self._aborts.append(fn)

    def spawn(self, name: str, fn, *args) -> threading.Thread:
        def run():
            self.log(f"worker {name}: start")
            t0 = time.perf_counter()
            try:
                fn(self, *args)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the log
                if _is_consequence(e):  # the worker that broke the barrier may still be logging its failure
                    self.stop.wait(2.0)
                if self.stop.is_set() and _is_consequence(e):
                    why = f"after {self.failure.worker} failed" if self.failure is not None else "on request"
                    self.log(f"worker {name}: stopped {why} ({type(e).__name__})")
                else:
                    self.fail(name, e)
                return
            self.log(f"worker {name}: end ({time.perf_counter() - t0:.1f}s)")

        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def fail(self, name: str, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = WorkerFailed(name, exc, tb)
        self.log(f"worker {name}: FAILED: {type(exc).__name__}: {exc}\n{tb.rstrip()}")
        if first:
            self.log(f"stopping all workers after the failure of {name}")
            self.shutdown()

    def shutdown(self) -> None:
        self.stop.set()
        for fn in self._aborts:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                self.log(f"abort callback {fn!r} raised {type(e).__name__}: {e}")

    def wait(self, poll_s: float = 0.1) -> None:
        """Block until every worker ended; raise :class:`WorkerFailed` if one failed.

        After a failure the others get ``stop_grace_s`` seconds to stop; stragglers get their stacks
        dumped and :class:`WorkerFailed` is raised anyway (they are daemon threads: the caller exits).
        """
        deadline = None
        while True:
            alive = [t for t in self.threads if t.is_alive()]
            if not alive:
                break
            if self.stop.is_set() and deadline is None:
                deadline = time.monotonic() + self.stop_grace_s
            if deadline is not None and time.monotonic() > deadline:
                self.log(f"workers still running {self.stop_grace_s:g}s after the stop: "
                         f"{[t.name for t in alive]}")
                dump_stacks(self.log, "workers did not stop")
                if self.failure is None:
                    self.failure = WorkerFailed(alive[0].name, TimeoutError(
                        f"still running {self.stop_grace_s:g}s after the stop"), "")
                break
            alive[0].join(poll_s)
        if self.failure is not None:
            raise self.failure


def _is_consequence(e: BaseException) -> bool:
    """Errors a worker sees because another one failed first (an aborted barrier, a closed peer)."""
    return isinstance(e, (threading.BrokenBarrierError, Stopped))


class Stopped(Exception):
    """Raised inside a worker that noticed the supervisor's stop at a blocking point."""


def install_signal_handlers(log: RunLog, stop: StopRequest, on_second=None) -> None:
    """SIGTERM / SIGINT: the first asks for a graceful stop (checkpoint, exit 0); a second exits now."""
    def handler(signum, frame):
        name = signal.Signals(signum).name
        stop.request(name)
        if stop.count == 1:
            log.log(f"{name} received: stopping after the current step and writing a checkpoint "
                    f"(send it again to exit at once)")
            log.progress(f"{name} received")
        else:
            dump_stacks(log, f"second {name}")
            (on_second or (lambda: hard_exit(EXIT_SIGNAL, log)))()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


class InjectedFault(RuntimeError):
    """The failure asked for by ``DFLASH_TRAINER_FAULT`` (tests)."""


_FAULT_RE = re.compile(r"^(target|drafter)(\d*):(raise|hang|slow)@(\d+)(?:/rank(\d+))?$")


def parse_fault(spec: str):
    """``ROLE[INDEX]:KIND@N[/rankR]``: ROLE ``target`` or ``drafter``, INDEX the worker (default 0),
    KIND ``raise`` (an exception), ``hang`` (block forever, ignoring stops) or ``slow`` (0.5 s per
    item from N on); N the worker's item count (a drafter's step, a target's batch) at which it
    fires; R the only torchrun rank it fires in (default: every rank)."""
    m = _FAULT_RE.match(spec.strip())
    if not m:
        raise ValueError(f"{_FAULT_ENV}: expected ROLE[INDEX]:raise|hang|slow@N[/rankR] (e.g. drafter:raise@3), "
                         f"got {spec!r}")
    role, idx, kind, at, rank = m.groups()
    return role, int(idx or 0), kind, int(at), (None if rank is None else int(rank))


def fault_point(role: str, index: int, n: int, log: RunLog = None) -> None:
    """Fire the injected fault if ``DFLASH_TRAINER_FAULT`` names this worker and item count."""
    spec = os.environ.get(_FAULT_ENV)
    if not spec:
        return
    frole, fidx, kind, at, rank = parse_fault(spec)
    if frole != role or fidx != index or (rank is not None and rank != int(os.environ.get("RANK", "0") or 0)):
        return
    log = log or _LOG
    if kind == "slow" and n >= at:
        time.sleep(0.5)
    elif kind == "raise" and n == at:
        log.log(f"fault injected: {role}{index} raises at {n}")
        raise InjectedFault(f"injected by {_FAULT_ENV}={spec}")
    elif kind == "hang" and n == at:
        log.log(f"fault injected: {role}{index} hangs at {n}")
        _hang_forever()


def _hang_forever():
    while True:  # deliberately deaf to stop requests: a stuck CUDA call or collective behaves like this
        time.sleep(1.0)
