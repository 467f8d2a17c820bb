"""Block-sparse attention for DFlash training masks (Triton forward and backward, GQA)."""

from dflash_kernels.ops.attention.attention import attention_bwd, attention_fwd, block_sparse_attention
from dflash_kernels.ops.attention.mask import (BlockSparseMask, causal_block_mask, dflash_block_mask,
                                               from_flex_block_mask)

__all__ = ["BlockSparseMask", "attention_bwd", "attention_fwd", "block_sparse_attention", "causal_block_mask",
           "dflash_block_mask", "from_flex_block_mask"]
