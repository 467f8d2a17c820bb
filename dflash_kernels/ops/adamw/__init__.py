"""Fused AdamW step: fp32 master parameters, gradients in any float dtype, compute copies written in the
same pass (the trainer's opt-in ``compute_weights="copies"``, trainer/compute_weights.py)."""

from dflash_kernels.ops.adamw.adamw import fused_adamw_
from dflash_kernels.ops.adamw.naive import naive_adamw_

__all__ = ["fused_adamw_", "naive_adamw_"]
