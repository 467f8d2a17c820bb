"""Exceptions raised by the runtime."""

__all__ = ["KernelCacheMiss", "BackendUnavailable"]


class KernelCacheMiss(RuntimeError):
    """A kernel was needed that is not compiled yet while strict mode is on."""


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here (missing package, wrong device, no interpreter)."""
