"""The plain fp32 PyTorch reference of the fused LM head + cross-entropy (the ``reference`` backend).

Materializes the whole ``[N, V]`` logits in fp32: slow and memory-hungry on purpose, for tests and for
users checking the kernels. Same arguments, semantics and returns as
:func:`dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy`; gradients through plain autograd.
"""

import torch

__all__ = ["naive_linear_cross_entropy"]


def naive_linear_cross_entropy(hidden, weight, labels, bias=None, weights=None, ignore_index=-100,
                               reduction="mean", softcap=None, return_lse=False, return_argmax=False):
    """fp32 logits ``hidden @ weight.T + bias`` (softcapped), then the weighted cross-entropy.

    Returns ``loss`` or ``(loss, lse?, argmax?)`` as the fused op does. The loss is fp32; gradients
    reach ``hidden``, ``weight`` and ``bias`` in their own dtypes (``weights`` gets none).
    """
    shape = labels.shape
    H = hidden.shape[-1]
    h = hidden.reshape(-1, H).float()
    lab = labels.reshape(-1).long()
    logits = h @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits, dim=-1)
    valid = lab != ignore_index
    safe = torch.where(valid, lab, torch.zeros_like(lab))
    ce = lse - logits.gather(1, safe[:, None]).squeeze(1)
    w = torch.ones_like(lse) if weights is None else weights.reshape(-1).float().detach()
    wv = torch.where(valid, w, torch.zeros_like(w))
    per_row = torch.where(valid, ce * wv, torch.zeros_like(ce))
    if reduction == "none":
        loss = per_row.view(shape)
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        denom = wv.sum()
        nonzero = denom != 0
        loss = torch.where(nonzero, per_row.sum() / torch.where(nonzero, denom, torch.ones_like(denom)),
                           torch.zeros_like(denom))
    if not (return_lse or return_argmax):
        return loss
    out = (loss,)
    if return_lse:
        out += (lse.detach().view(shape),)
    if return_argmax:
        out += (logits.detach().argmax(-1).view(shape),)
    return out
