"""Fused LM head + weighted cross-entropy (the ``[N, V]`` logits never exist in memory)."""

from dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy import linear_cross_entropy
from dflash_kernels.ops.linear_cross_entropy.naive import naive_linear_cross_entropy

__all__ = ["linear_cross_entropy", "naive_linear_cross_entropy"]
