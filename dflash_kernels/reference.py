"""Plain fp32 PyTorch references of the ops, for tests and for users checking their own kernels.

Slow on purpose; no fast path imports this module. Each is the ``naive_*`` function of its op's
``naive.py``; ``sdpa_dense``, ``dense_mask``, ``causal_conv1d_ref`` and ``causal_conv1d_update_ref``
are further names of the attention and conv references.
"""

from dflash_kernels.ops.attention.naive import naive_block_sparse_attention, naive_dense_mask
from dflash_kernels.ops.conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update
from dflash_kernels.ops.gated_delta_rule.naive import naive_gdn_gate, naive_recurrent_gated_delta_rule
from dflash_kernels.ops.linear_cross_entropy.naive import naive_linear_cross_entropy
from dflash_kernels.ops.rms_norm.naive import naive_fused_add_rms_norm, naive_rms_norm, naive_rms_norm_gated
from dflash_kernels.ops.rope.naive import naive_apply_rope
from dflash_kernels.ops.swiglu.naive import naive_swiglu, naive_swiglu_packed

sdpa_dense = naive_block_sparse_attention
dense_mask = naive_dense_mask
causal_conv1d_ref = naive_causal_conv1d
causal_conv1d_update_ref = naive_causal_conv1d_update

__all__ = ["causal_conv1d_ref", "naive_apply_rope", "naive_fused_add_rms_norm", "naive_rms_norm", "naive_rms_norm_gated", "naive_swiglu", "naive_swiglu_packed", "causal_conv1d_update_ref", "dense_mask", "naive_block_sparse_attention",
           "naive_causal_conv1d", "naive_causal_conv1d_update", "naive_dense_mask", "naive_gdn_gate", "naive_linear_cross_entropy",
           "naive_recurrent_gated_delta_rule",
           "sdpa_dense"]
