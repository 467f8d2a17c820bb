"""Gated DeltaNet (gated delta rule): chunked scan for training and prefill, recurrent step for decoding."""

from dflash_kernels.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from dflash_kernels.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
