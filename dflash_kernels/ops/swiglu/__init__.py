"""Fused SwiGLU ``silu(gate) * up``, forward and backward, on two tensors or one concatenated one."""

from dflash_kernels.ops.swiglu.naive import naive_swiglu, naive_swiglu_packed
from dflash_kernels.ops.swiglu.swiglu import swiglu, swiglu_packed

__all__ = ["swiglu", "swiglu_packed", "naive_swiglu", "naive_swiglu_packed"]
