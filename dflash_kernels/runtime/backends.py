"""Which implementation runs each op: ``triton``, ``interpret``, ``reference`` or an installed peer.

- ``auto`` (the default): a CUDA input runs ``triton``; a CPU input runs ``interpret`` when
  ``TRITON_INTERPRET=1`` and ``reference`` otherwise.
- ``triton``: the compiled kernels; CUDA inputs only.
- ``interpret``: the same Triton kernels through Triton's CPU interpreter (tests).
- ``reference``: the plain fp32 PyTorch code in the op's folder; slow, any device.
- peers (``fla``, ``causal_conv1d``, ``flex``): the ecosystem's implementation, for comparison.

A backend that cannot run raises :class:`BackendUnavailable` with the reason (the pip extra for a
missing peer); nothing falls back silently to a slower path.

Choose with :func:`set_backend` or ``DFLASH_KERNELS_BACKEND="conv1d=reference,gdn=fla"``.
"""

import importlib
import os
import threading

from dflash_kernels.runtime import settings
from dflash_kernels.runtime.errors import BackendUnavailable

__all__ = ["Op", "bucket", "cdiv", "next_pow2", "configured", "register_op", "set_backend", "get_backend", "resolve",
           "backends", "BUILTIN"]

BUILTIN = ("auto", "triton", "interpret", "reference")

_ops = {}  # op -> {"peers": {name: module}, "extra": {name: callable -> bool}}
_chosen = {}
_lock = threading.Lock()


def register_op(op: str, peers: dict = None, extra: dict = None) -> None:
    """Declare an op and its peer backends ``{name: importable module}``.

    ``extra`` maps additional backend names (e.g. a compiled extension) to a zero-argument callable
    telling whether it is available.
    """
    with _lock:
        _ops[op] = {"peers": dict(peers or {}), "extra": dict(extra or {})}


def _env_choice(op: str):
    spec = os.environ.get("DFLASH_KERNELS_BACKEND", "")
    for item in spec.split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            if k.strip() == op:
                return v.strip()
    return None


def _names(op):
    entry = _ops[op]
    return BUILTIN + tuple(entry["extra"]) + tuple(entry["peers"])


def _check_can_run(op: str, name: str) -> None:
    """Raise :class:`BackendUnavailable` when backend ``name`` of ``op`` cannot run in this process, whatever
    the inputs' device (a missing extension or peer package, the interpreter's setting, no CUDA device)."""
    entry = _ops[op]
    if name == "interpret" and not settings.interpreting():
        raise BackendUnavailable(f"{op}: backend 'interpret' needs TRITON_INTERPRET=1 set before "
                                 f"dflash_kernels is imported")
    if name == "triton":
        if settings.interpreting():
            raise BackendUnavailable(f"{op}: backend 'triton' is not available under TRITON_INTERPRET=1")
        import torch
        if not torch.cuda.is_available():
            raise BackendUnavailable(f"{op}: backend 'triton' needs a CUDA device, and torch sees none; "
                                     f"use 'interpret' (with TRITON_INTERPRET=1) or 'reference' on the CPU")
    if name in entry["extra"] and not entry["extra"][name]():
        raise BackendUnavailable(f"{op}: backend {name!r} is not built in this installation "
                                 f"(see dflash_kernels.backends())")
    if name in entry["peers"] and not _peer_available(entry["peers"][name]):
        raise BackendUnavailable(f"{op}: peer backend {name!r} needs the package "
                                 f"{entry['peers'][name]!r}: pip install 'dflash_kernels[peers]'")


def set_backend(op: str, name: str) -> None:
    """Run ``op`` with backend ``name`` from now on, in every thread.

    Args:
        op: the op's name: ``attention``, ``gdn``, ``conv1d``, ``linear_cross_entropy``, ``rms_norm``,
            ``rms_norm_gated``, ``rms_norm_add``, ``rope``, ``swiglu`` or ``adamw`` (:func:`backends` lists them).
        name: ``auto``, ``triton``, ``interpret``, ``reference``, or one of the op's extra or peer backends
            (the conv's ``cuda`` and ``causal_conv1d``, the gated delta rule's ``fla``).

    ``auto`` drops the override: the environment's choice applies again, else automatic selection.
    Raises ``ValueError`` for an unknown op or backend name, and :class:`BackendUnavailable` (nothing
    changed) when the backend cannot run in this process: an extension that is not built, a peer that is
    not installed, ``interpret`` without ``TRITON_INTERPRET=1``, ``triton`` with no CUDA device. What
    depends on the inputs (``triton`` given CPU tensors) is checked at the call.

    Returns:
        None.
    """
    if op not in _ops:
        raise ValueError(f"op: unknown op {op!r}; known ops: {sorted(_ops)}")
    if name not in _names(op):
        raise ValueError(f"name: unknown backend {name!r} for op {op!r}; choose one of {list(_names(op))}")
    if name != "auto":
        _check_can_run(op, name)
    with _lock:
        if name == "auto":
            _chosen.pop(op, None)
        else:
            _chosen[op] = name


def get_backend(op: str) -> str:
    """The configured backend of ``op`` (``auto`` unless set or given by the environment).

    Args:
        op: the op's name (as :func:`set_backend` takes it).

    Returns:
        The backend's name: the :func:`set_backend` override, else ``DFLASH_KERNELS_BACKEND``'s entry for the
        op, else ``"auto"``. Raises ValueError for an unknown op.
    """
    if op not in _ops:
        raise ValueError(f"op: unknown op {op!r}; known ops: {sorted(_ops)}")
    return _chosen.get(op) or _env_choice(op) or "auto"


_configured_memo = {}  # (op, set_backend override, DFLASH_KERNELS_BACKEND) -> get_backend(op)


def configured(op: str) -> str:
    """:func:`get_backend`, memoized on everything it reads (the :func:`set_backend` override and
    ``DFLASH_KERNELS_BACKEND``): the per-call form for hot paths, which must not parse the environment
    on every call."""
    key = (op, _chosen.get(op), os.environ.get("DFLASH_KERNELS_BACKEND"))
    name = _configured_memo.get(key)
    if name is None:
        name = _configured_memo[key] = get_backend(op)
    return name


def _peer_available(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def resolve(op: str, device) -> str:
    """The backend that runs ``op`` for inputs on ``device``; raises if the configured one cannot."""
    name = get_backend(op)
    entry = _ops[op]
    if name not in _names(op):
        raise BackendUnavailable(f"DFLASH_KERNELS_BACKEND: unknown backend {name!r} for op {op!r}; "
                                 f"choose one of {list(_names(op))}")
    on_cuda = device.type == "cuda"
    if name == "auto":
        if on_cuda:
            return "triton"
        return "interpret" if settings.interpreting() else "reference"
    if name == "triton" and not on_cuda:
        raise BackendUnavailable(f"{op}: backend 'triton' needs CUDA tensors, got device {device}; "
                                 f"use 'interpret' (with TRITON_INTERPRET=1) or 'reference' on the CPU")
    _check_can_run(op, name)
    if name in entry["peers"] and not on_cuda:
        raise BackendUnavailable(f"{op}: peer backend {name!r} needs CUDA tensors, got {device}")
    return name


def backends() -> dict:
    """Per op: the configured backend and which backends can run in this process.

    Returns:
        ``{op: {"configured": name, "available": [names]}}`` for every op, e.g.
        ``{"conv1d": {"configured": "auto", "available": ["reference", "triton", "cuda"]}, ...}``.
    """
    out = {}
    for op in sorted(_ops):
        entry = _ops[op]
        available = ["reference"]
        if settings.interpreting():
            available.append("interpret")
        else:
            import torch
            if torch.cuda.is_available():
                available.append("triton")
        available += [n for n, ok in entry["extra"].items() if ok()]
        available += [n for n, m in entry["peers"].items() if _peer_available(m)]
        out[op] = {"configured": get_backend(op), "available": available}
    return out


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host side of a launch (grids, block counts). ``triton.cdiv`` is a
    ``ConstexprFunction`` whose Python call costs several microseconds; launchers run it on every call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``, without its call cost."""
    n = int(n)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def bucket(n: int, cap: int = None) -> int:
    """The shape bucket of a length: the next power of two of ``n`` (at least 1), at most ``cap``.

    Kernels are compiled and tuned once per bucket, so every op buckets its lengths the same way.
    """
    n = max(int(n), 1)
    if cap is not None:
        n = min(n, int(cap))
    return 1 << (n - 1).bit_length()


class Op:
    """One public op's dispatch: its backends, and the implementation registered for each.

    Usage, once per op at import::

        _conv = Op("conv1d", peers={"causal_conv1d": "causal_conv1d"}, extra={"cuda": _cuda.available})

        @_conv.impl("triton", "interpret")
        def _fast(x, weight): ...

        @_conv.impl("reference")
        def _reference(x, weight): ...

        def causal_conv1d(x, weight):
            check(...)                         # argument checks first
            return _conv(x.device, x, weight)  # resolve the backend for x's device, call its impl

    ``impl`` registers one function for one or more backend names (``triton``, ``interpret``,
    ``reference``, a peer or an ``extra`` name). An op with several public functions (the conv's
    ``causal_conv1d`` and ``causal_conv1d_update``) takes one more dispatch per function from
    :meth:`function`; all of them share the op's backend setting. :meth:`backend` gives the name that
    would run; calling raises :class:`BackendUnavailable` with the reason when the configured backend
    cannot run (never a silent fallback) or has no implementation of the function.
    """

    def __init__(self, name: str, peers: dict = None, extra: dict = None, *, _label: str = None):
        self.name = name
        self.label = _label or name
        self._impls = {}
        self._memo = {}  # (device type, backend setting) -> implementation; read without a lock
        if _label is None:
            register_op(name, peers=peers, extra=extra)

    def function(self, label: str) -> "Op":
        """Another public function of this op: its own implementations, the op's backends."""
        return Op(self.name, _label=label)

    def impl(self, *names):
        known = _names(self.name)
        for n in names:
            if n not in known or n == "auto":
                raise ValueError(f"names: {n!r} is not a backend of op {self.name!r}; choose from {list(known[1:])}")

        def register(fn):
            for n in names:
                self._impls[n] = fn
            self._memo.clear()
            return fn
        return register

    def backend(self, device) -> str:
        """The backend that runs this op for inputs on ``device``."""
        return resolve(self.name, device)

    def implementation(self, device):
        """The function that runs this op's call for inputs on ``device``. Resolved once per (device
        type, backend setting) and remembered, since the host path of a call is as long as a small
        input's kernel; a backend that cannot run raises on every call and is never remembered."""
        key = (device.type, configured(self.name))
        fn = self._memo.get(key)
        if fn is None:
            name = resolve(self.name, device)
            fn = self._impls.get(name)
            if fn is None:
                raise BackendUnavailable(f"{self.label}: backend {name!r} has no implementation of this "
                                         f"function; implemented: {sorted(self._impls)}")
            self._memo[key] = fn
        return fn

    def __call__(self, device, *args, **kwargs):
        return self.implementation(device)(*args, **kwargs)
