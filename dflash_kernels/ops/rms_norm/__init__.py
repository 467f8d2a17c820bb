"""Fused RMSNorm (``offset=1.0``: the ``(1 + weight)`` form of Qwen3.5 / Qwen3-Next), forward and backward;
the gated form of Gated DeltaNet layers and the residual-add form of pre-norm decoder layers."""

from dflash_kernels.ops.rms_norm.naive import naive_fused_add_rms_norm, naive_rms_norm, naive_rms_norm_gated
from dflash_kernels.ops.rms_norm.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_gated

__all__ = ["rms_norm", "rms_norm_gated", "fused_add_rms_norm", "naive_rms_norm", "naive_rms_norm_gated",
           "naive_fused_add_rms_norm"]
