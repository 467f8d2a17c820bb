"""Model FLOPs of one DFlash training step, counted analytically, and the MFU they give.

The count is the work the model needs, not the work an implementation happens to do (recomputed
activations, masked-out tiles and chunked-scan overheads are not counted), so MFU compares
implementations fairly. A multiply-add is 2 FLOPs. With B sequences of S tokens, N draft blocks of
``bs`` positions per sequence (``Nd = B * N * bs`` draft positions), target hidden size H, vocabulary V:

- target forward (no gradient), over the decoder layers the features need (``Target`` stops after
  the deepest feature layer, so the layers above it are not run and not counted): ``2 * B * S * P_lin`` with
  ``P_lin`` the weights of every ``nn.Linear`` in those layers (the LM head is not run for features); full-attention
  layers ``4 * Hq * Dh * B * S (S + 1) / 2`` (causal QK^T and PV); Gated DeltaNet layers
  ``6 * Hv * Dk * Dv`` per token (the recurrent form's three state products: S k, the rank-1 update,
  q S); the short conv ``2 * W * channels`` per token.
- drafter forward: q/o projections and the SwiGLU MLP on the Nd draft rows; k/v projections on the
  Nd draft rows and the S context rows of every sequence; ``fc`` (k target layers -> H) on the
  context rows; attention ``4 * Hq * D`` per visible (query, key) pair, the pairs counted from the
  batch's anchors (context keys ``kv < anchor`` within the layer's window, plus the block's own keys).
- drafter backward: twice the forward (input and weight gradients), except ``fc``, whose input (the
  frozen target's features) needs no gradient: once.
- LM head (frozen, the target's): on the predicted positions only, ``Np = (bs - 1)`` per valid block
  (position 0 holds the anchor's own token, which is given, not predicted): forward ``2 * Np * H * V``;
  backward the input gradient only, the same again.

``mfu = flops / seconds / peak`` with the dense bf16 tensor-core peak of an H100 / H200 SXM (Hopper),
989 TFLOP/s: the GPUs the trainer targets.
"""

import torch
import torch.nn as nn

__all__ = ["PEAK_BF16_FLOPS", "step_flops", "mfu"]

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 tensor-core peak (datasheet)


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _visible_pairs(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, window) -> float:
    """Sum over valid draft queries of the keys they see (context below the anchor, within ``window``,
    plus the block's own ``block_size`` keys)."""
    a = anchors.double()
    ctx = a.clamp(max=window) if window is not None else a
    per_block = (ctx + block_size) * block_size
    return float((per_block * valid.double()).sum())


def target_flops(text_config, tokens_per_seq: int, batch: int, linear_weights: int, layers: int | None = None) -> float:
    """Forward FLOPs of the target's first ``layers`` decoder layers (None: all) over ``batch`` sequences of
    ``tokens_per_seq``; ``linear_weights`` are those layers' ``nn.Linear`` weights."""
    c = text_config
    T = batch * tokens_per_seq
    flops = 2.0 * T * linear_weights
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)[:layers]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    causal_pairs = batch * tokens_per_seq * (tokens_per_seq + 1) / 2
    for t in types:
        if t == "linear_attention":
            hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
            flops += 6.0 * T * hv * dk * dv
            channels = 2 * c.linear_num_key_heads * dk + hv * dv  # q, k, v go through the short conv
            flops += 2.0 * T * getattr(c, "linear_conv_kernel_dim", 4) * channels
        else:
            flops += 4.0 * c.num_attention_heads * head_dim * causal_pairs
    return flops


def step_flops(target_model, drafter, batch: dict, target_layers: int | None = None) -> dict:
    """Model FLOPs of one training step on ``batch`` (a ``trainer.data`` batch: ``input_ids [B, S]``,
    ``anchors [B, N]``, ``valid [B, N]``), the target running its first ``target_layers`` decoder layers
    (``Target.layers_run``; None: all). Returns each part and ``total``."""
    dc = drafter.config
    B, S = batch["input_ids"].shape
    anchors, valid = batch["anchors"], batch["valid"]
    N = anchors.shape[1]
    bs = dc.block_size
    Nd = B * N * bs
    H, V = dc.hidden_size, dc.vocab_size
    text = getattr(target_model.config, "text_config", None) or target_model.config
    base = target_model.base_model
    weights = _linear_weights(base)
    stack = getattr(base, "layers", None)
    if target_layers is not None:
        if not isinstance(stack, nn.ModuleList) or not 1 <= target_layers <= len(stack):
            raise ValueError(f"target_layers: {target_layers} is not a count of the target's decoder layers "
                             f"({len(stack) if isinstance(stack, nn.ModuleList) else 'none found'})")
        weights -= sum(_linear_weights(layer) for layer in stack[target_layers:])
    tgt = target_flops(text, S, B, weights, target_layers)

    D, Hq, Hkv = dc.head_dim, dc.num_heads, dc.num_kv_heads
    per_layer_rows = 2.0 * Nd * (H * Hq * D * 2 + 3 * H * dc.intermediate_size)  # q, o, gate, up, down
    per_layer_kv = 2.0 * (Nd + B * S) * (2 * H * Hkv * D)  # k and v on draft and context rows
    attn = 0.0
    for t in dc.layer_types:
        window = dc.sliding_window if t == "sliding_attention" else None
        attn += 4.0 * Hq * D * _visible_pairs(anchors, valid, bs, window)
    layers_fwd = dc.num_layers * (per_layer_rows + per_layer_kv) + attn
    fc_fwd = 2.0 * B * S * drafter.fc.weight.numel()
    head_fwd = 2.0 * float(valid.sum()) * (bs - 1) * H * V
    parts = {
        "target_fwd": tgt,
        "drafter_fwd": layers_fwd + fc_fwd,
        "drafter_bwd": 2.0 * layers_fwd + fc_fwd,
        "lm_head_fwd": head_fwd,
        "lm_head_bwd": head_fwd,
    }
    parts["total"] = sum(parts.values())
    return parts


def mfu(flops: float, seconds: float, peak: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the peak."""
    return flops / seconds / peak
