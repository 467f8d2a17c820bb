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

__all__ = ["register_op", "set_backend", "get_backend", "resolve", "backends", "BUILTIN"]

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


def set_backend(op: str, name: str) -> None:
    """Run ``op`` with backend ``name`` from now on, in every thread.

    ``auto`` drops the override: the environment's choice applies again, else automatic selection.
    """
    if op not in _ops:
        raise ValueError(f"op: unknown op {op!r}; known ops: {sorted(_ops)}")
    if name not in _names(op):
        raise ValueError(f"name: unknown backend {name!r} for op {op!r}; choose one of {list(_names(op))}")
    with _lock:
        if name == "auto":
            _chosen.pop(op, None)
        else:
            _chosen[op] = name


def get_backend(op: str) -> str:
    """The configured backend of ``op`` (``auto`` unless set or given by the environment)."""
    if op not in _ops:
        raise ValueError(f"op: unknown op {op!r}; known ops: {sorted(_ops)}")
    return _chosen.get(op) or _env_choice(op) or "auto"


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
    if name == "interpret" and not settings.interpreting():
        raise BackendUnavailable(f"{op}: backend 'interpret' needs TRITON_INTERPRET=1 set before "
                                 f"dflash_kernels is imported")
    if name == "triton" and settings.interpreting():
        raise BackendUnavailable(f"{op}: backend 'triton' is not available under TRITON_INTERPRET=1")
    if name in entry["extra"] and not entry["extra"][name]():
        raise BackendUnavailable(f"{op}: backend {name!r} is not built in this installation "
                                 f"(see dflash_kernels.backends())")
    if name in entry["peers"]:
        if not _peer_available(entry["peers"][name]):
            raise BackendUnavailable(f"{op}: peer backend {name!r} needs the package "
                                     f"{entry['peers'][name]!r}: pip install 'dflash_kernels[peers]'")
        if not on_cuda:
            raise BackendUnavailable(f"{op}: peer backend {name!r} needs CUDA tensors, got {device}")
    return name


def backends() -> dict:
    """Per op: the configured backend and which backends can run in this process."""
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
