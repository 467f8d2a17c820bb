"""Fused RMSNorm (``offset=1.0``: the ``(1 + weight)`` form of Qwen3.5 / Qwen3-Next), forward and backward."""

from dflash_kernels.ops.rms_norm.naive import naive_rms_norm
from dflash_kernels.ops.rms_norm.rms_norm import rms_norm

__all__ = ["rms_norm", "naive_rms_norm"]
