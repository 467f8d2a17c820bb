"""dflash_kernels: attention and linear-attention kernels with a thread-safe dispatch layer.

Tensor layouts: ``[B, T, H, D]`` for attention and the gated delta rule; ``[B, D, T]`` for the causal
conv1d (the layout of causal-conv1d's ``causal_conv1d_fn``).
"""

__version__ = "0.1.0"

from dflash_kernels.runtime import (  # noqa: E402
    BackendUnavailable,
    KernelCacheMiss,
    cache_info,
    get_backend,
    precompile,
    precompile_recorded,
    reset_cache,
    set_backend,
    strict,
)
from dflash_kernels.runtime.backends import backends  # noqa: E402
from dflash_kernels.ops.attention import (  # noqa: E402
    BlockSparseMask,
    block_sparse_attention,
    causal_block_mask,
    dflash_block_mask,
    from_flex_block_mask,
)
from dflash_kernels.ops.adamw import fused_adamw_  # noqa: E402
from dflash_kernels.ops.conv1d import causal_conv1d, causal_conv1d_update  # noqa: E402
from dflash_kernels.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from dflash_kernels.ops.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_gated  # noqa: E402
from dflash_kernels.ops.rope import apply_rope  # noqa: E402
from dflash_kernels.ops.swiglu import swiglu, swiglu_packed  # noqa: E402
from dflash_kernels.ops.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

__all__ = [
    "__version__", "BackendUnavailable", "apply_rope", "BlockSparseMask", "block_sparse_attention", "causal_block_mask",
    "dflash_block_mask", "from_flex_block_mask", "KernelCacheMiss", "backends", "cache_info", "causal_conv1d",
    "causal_conv1d_update", "chunk_gated_delta_rule", "fused_adamw_", "fused_add_rms_norm", "fused_recurrent_gated_delta_rule", "get_backend", "linear_cross_entropy", "precompile", "precompile_recorded", "reset_cache", "rms_norm", "rms_norm_gated", "set_backend", "strict", "swiglu",
    "swiglu_packed",
]
