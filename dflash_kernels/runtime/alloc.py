"""Output allocation for launchers. With ``DFLASH_KERNELS_POISON=1`` (the test suite sets it) every
buffer is NaN-filled (integers: -1) before the kernel runs, so an element the kernel fails to write
shows up as NaN instead of as whatever the allocator left there."""

import os

import torch

from dflash_kernels.runtime import settings

__all__ = ["empty", "empty_like", "poisoning"]


def poisoning() -> bool:
    return os.environ.get("DFLASH_KERNELS_POISON", "0") == "1"


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.numel():
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)
    return t


def _filled(t: torch.Tensor) -> torch.Tensor:
    if settings.compile_shard() is not None:
        # A precompile compile worker launches no kernel: outputs read back by the host (counts, sizes) are
        # zeros there, never what the allocator left.
        return t.zero_()
    return _poison(t) if poisoning() else t


def empty(*shape, dtype, device) -> torch.Tensor:
    return _filled(torch.empty(*shape, dtype=dtype, device=device))


def empty_like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """Like ``torch.empty_like``: keeps x's strides when x is dense (channel-last views included)."""
    return _filled(torch.empty_like(x, dtype=dtype))
