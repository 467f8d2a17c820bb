"""Fused rotate-half RoPE (optionally partial rotary), forward and backward."""

from dflash_kernels.ops.rope.naive import naive_apply_rope
from dflash_kernels.ops.rope.rope import apply_rope

__all__ = ["apply_rope", "naive_apply_rope"]
