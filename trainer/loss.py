"""The DFlash objective: block inputs, labels at anchor + j, decaying position weights, weighted CE.

A block of ``bs`` positions starts at anchor ``a``: position 0 holds the real token at ``a``,
positions 1..bs-1 the mask token. Position j predicts the token at ``a + j``; its loss counts where
that token is a loss-mask token, with weight ``exp(-(j - 1) / gamma)`` (early positions matter most:
a draft is accepted only up to its first miss). The loss is the weighted mean over counted positions.
"""

import math

import torch
import torch.nn.functional as F

__all__ = ["position_weights", "block_inputs", "block_labels", "dflash_loss"]


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """fp32 ``[block_size]``: 0 at position 0 (the anchor, not predicted), ``exp(-(j-1)/gamma)`` after."""
    j = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(j - 1) / gamma)
    w[0] = 0.0
    return w


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, mask_token_id: int, block_size: int):
    """Token ids ``[B, N * bs]`` of the draft blocks: the anchor's token, then ``bs - 1`` mask tokens."""
    B, N = anchors.shape
    out = torch.full((B, N, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return out.reshape(B, N * block_size)


def block_labels(input_ids, loss_mask, lengths, anchors, valid, block_size: int):
    """Labels ``[B, N, bs]`` (token at anchor + j) and a bool ``[B, N, bs]`` of the counted positions.

    Counted: j >= 1, the block valid, anchor + j inside the sequence and a loss-mask token there.
    """
    S = input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, N, bs]
    inside = pos < lengths[:, None, None]
    posc = pos.clamp(max=S - 1)
    labels = torch.gather(input_ids, 1, posc.flatten(1)).view_as(pos)
    lm = torch.gather(loss_mask, 1, posc.flatten(1)).view_as(pos)
    counted = lm & inside & valid[:, :, None]
    counted[:, :, 0] = False
    return labels, counted


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor, gamma: float):
    """Weighted cross-entropy and accuracy.

    Args:
        logits: ``[B, N * bs, V]`` (any float dtype; the CE is taken in fp32).
        labels: int ``[B, N, bs]``; counted: bool ``[B, N, bs]`` from :func:`block_labels`.
        gamma: position-weight decay.
    Returns:
        ``(loss, stats)``: loss = sum(w * ce) / sum(w) over counted positions (0 with none), and
        ``stats`` with ``acc`` (unweighted top-1 accuracy), ``acc_by_pos`` ``[bs]`` and ``tokens``.
    """
    B, N, bs = labels.shape
    w = position_weights(bs, gamma).to(logits.device)[None, None, :] * counted
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = ce.view(B, N, bs)
    wsum = w.sum()
    loss = (ce * w).sum() / wsum.clamp_min(1e-12)
    with torch.no_grad():
        hit = (logits.detach().argmax(-1).view(B, N, bs) == labels) & counted
        n = counted.sum()
        per_pos = hit.sum((0, 1)).float() / counted.sum((0, 1)).clamp_min(1).float()
        stats = {"acc": (hit.sum().float() / n.clamp_min(1)).item(), "acc_by_pos": per_pos.cpu(),
                 "tokens": int(n)}
    return loss, stats


def expected_accept_length(acc_by_pos: torch.Tensor) -> float:
    """A rough acceptance-length estimate from per-position accuracies (positions treated as independent)."""
    tau, run = 1.0, 1.0
    for p in acc_by_pos[1:].tolist():
        run *= p
        tau += run
    return tau if math.isfinite(tau) else float("nan")
