"""Fused AdamW step: fp32 master parameters, gradients in any float dtype, compute copies written in the
same pass (work in progress on branch wip/adamw-bf16-copies: not wired into the trainer yet)."""

from dflash_kernels.ops.adamw.adamw import fused_adamw_
from dflash_kernels.ops.adamw.naive import naive_adamw_

__all__ = ["fused_adamw_", "naive_adamw_"]
