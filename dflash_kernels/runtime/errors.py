"""Exceptions and warnings raised by the runtime."""

__all__ = ["KernelCacheMiss", "BackendUnavailable", "TuningCacheWarning"]


class KernelCacheMiss(RuntimeError):
    """A kernel was needed that is not compiled yet while strict mode is on."""


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here (missing package, wrong device, no interpreter)."""


class TuningCacheWarning(RuntimeWarning):
    """The tuning cache folder cannot be written, or one of its files was damaged: the op runs anyway."""
