"""Gated DeltaNet (gated delta rule): chunked scan for training and prefill, recurrent step for decoding."""

from dflash_kernels.ops.gated_delta_rule.gated_delta_rule import (chunk_gated_delta_rule,
                                                                  fused_recurrent_gated_delta_rule)

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
