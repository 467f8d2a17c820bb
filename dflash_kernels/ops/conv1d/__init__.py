"""Causal depthwise conv1d (the short conv of Gated DeltaNet / Mamba layers)."""

from dflash_kernels.ops.conv1d.conv1d import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update"]
