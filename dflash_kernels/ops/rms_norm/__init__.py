"""Fused RMSNorm (``offset=1.0``: the ``(1 + weight)`` form of Qwen3.5 / Qwen3-Next), forward and backward."""

from dflash_kernels.ops.rms_norm.naive import naive_rms_norm, naive_rms_norm_gated
from dflash_kernels.ops.rms_norm.rms_norm import rms_norm, rms_norm_gated

__all__ = ["rms_norm", "rms_norm_gated", "naive_rms_norm", "naive_rms_norm_gated"]
