"""Plain fp32 PyTorch references of the ops, for tests and for users checking their own kernels.

Slow on purpose; no fast path imports this module.
"""

from dflash_kernels.ops.attention.reference import dense_mask, sdpa_dense
from dflash_kernels.ops.conv1d.naive import causal_conv1d_ref, causal_conv1d_update_ref
from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from dflash_kernels.ops.linear_cross_entropy.naive import naive_linear_cross_entropy

__all__ = ["causal_conv1d_ref", "causal_conv1d_update_ref", "dense_mask", "naive_linear_cross_entropy", "naive_recurrent_gated_delta_rule",
           "sdpa_dense"]
