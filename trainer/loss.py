"""The DFlash objective: block inputs, labels at anchor + j, decaying position weights, weighted CE.

A block of ``bs`` positions starts at anchor ``a``: position 0 holds the real token at ``a``,
positions 1..bs-1 the mask token. Position j predicts the token at ``a + j``; its loss counts where
that token is a loss-mask token, with weight ``exp(-(j - 1) / gamma)`` (early positions matter most:
a draft is accepted only up to its first miss). The loss is the weighted mean over counted positions.
"""

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

__all__ = ["StepStats", "position_weights", "block_inputs", "block_labels", "predicted_positions", "dflash_loss",
           "dflash_head_loss", "dflash_fused_head_loss"]


IGNORE_INDEX = -100  # label of the rows the fused loss skips (positions not counted)


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


def predicted_positions(hidden: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor):
    """Block positions 1..bs-1 only: position 0 holds the anchor's own token and is never predicted
    (:func:`block_labels` never counts it), so the LM head need not see its rows. ``hidden [B, N * bs,
    H]`` (a copy of the kept rows), ``labels`` / ``counted [B, N, bs]`` -> ``[B, N * (bs - 1), H]``,
    ``[B, N, bs - 1]``, ``[B, N, bs - 1]``; pass ``first=1`` to the losses with them. Trainer code, the
    same for every loss path: 1/bs of the head's GEMMs (forward and input gradient) left out."""
    B, N, bs = labels.shape
    if hidden.shape[:2] != (B, N * bs):
        raise ValueError(f"hidden: expected [B, N * bs, H] = [{B}, {N * bs}, H], got {tuple(hidden.shape)}")
    h = hidden.reshape(B, N, bs, hidden.shape[-1])[:, :, 1:].reshape(B, N * (bs - 1), hidden.shape[-1])
    return h, labels[:, :, 1:], counted[:, :, 1:]


_WEIGHTS = {}  # (p, gamma, first, device) -> the weights on that device


def _weights(labels: torch.Tensor, gamma: float, first: int, device) -> torch.Tensor:
    """``[p]`` position weights of block positions ``first .. first + p - 1`` (``p = labels.shape[-1]``),
    made once per device: a copy from the host each step would be a host-to-device transfer inside the
    step (not allowed while a CUDA graph records it, ``trainer.step_graph``)."""
    key = (labels.shape[-1], float(gamma), first, torch.device(device))
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = position_weights(key[0] + first, gamma)[first:].to(device)
    return w


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor, gamma: float, first: int = 0):
    """Weighted cross-entropy and accuracy.

    Args:
        logits: ``[B, N * bs, V]`` (any float dtype; the CE is taken in fp32).
        labels: int ``[B, N, bs]``; counted: bool ``[B, N, bs]`` from :func:`block_labels`.
        gamma: position-weight decay.
        first: the block position of the first of ``bs`` positions given (1 after
            :func:`predicted_positions`; the stats still cover every position).
    Returns:
        ``(loss, stats)``: loss = sum(w * ce) / sum(w) over counted positions (0 with none), and
        ``stats`` with ``acc`` (unweighted top-1 accuracy), ``acc_by_pos`` ``[bs + first]`` and ``tokens``.
    """
    B, N, bs = labels.shape
    w = _weights(labels, gamma, first, logits.device)[None, None, :] * counted
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = ce.view(B, N, bs)
    wsum = w.sum()
    loss = (ce * w).sum() / wsum.clamp_min(1e-12)
    with torch.no_grad():
        hit = (logits.detach().argmax(-1).view(B, N, bs) == labels) & counted
    return loss, _stats(hit, counted, first)


class StepStats(Mapping):
    """A step's ``acc`` (top-1 accuracy over the counted positions), ``acc_by_pos`` (``[bs]``, on the CPU)
    and ``tokens`` (the counted positions), kept as device tensors until one is read: the first read
    copies them to the host (one synchronization, at the caller's logging point), so a step that does
    not log has none (``benchmarks/tok_s.py``; ``tools/audits/sync_audit.py`` checks the step for others)."""

    __slots__ = ("_hits", "_n", "_per_pos", "_host")

    def __init__(self, hit: torch.Tensor, counted: torch.Tensor):
        self._n = counted.sum()
        self._hits = hit.sum()
        self._per_pos = hit.sum((0, 1)).float() / counted.sum((0, 1)).clamp_min(1).float()
        self._host = None

    def clone(self) -> "StepStats":
        """A copy holding copies of the device tensors (a CUDA graph's outputs are overwritten by its next
        replay); nothing is read back."""
        out = StepStats.__new__(StepStats)
        out._n, out._hits, out._per_pos, out._host = self._n.clone(), self._hits.clone(), self._per_pos.clone(), None
        return out

    def _values(self) -> dict:
        if self._host is None:
            acc = self._hits.float() / self._n.clamp_min(1)
            self._host = {"acc": acc.item(), "acc_by_pos": self._per_pos.cpu(), "tokens": int(self._n)}
        return self._host

    def __getitem__(self, key):
        return self._values()[key]

    def __iter__(self):
        return iter(("acc", "acc_by_pos", "tokens"))

    def __len__(self):
        return 3


def _stats(hit: torch.Tensor, counted: torch.Tensor, first: int = 0) -> StepStats:
    """Top-1 accuracy over the counted positions, per block position, and their count (read lazily).
    ``first`` uncounted positions are put back in front (``acc_by_pos`` covers the whole block)."""
    if first:
        pad = counted.new_zeros(*counted.shape[:-1], first)
        hit, counted = torch.cat([pad, hit], -1), torch.cat([pad, counted], -1)
    return StepStats(hit, counted)


class _HeadCrossEntropy(torch.autograd.Function):
    """sum_r w_r * CE(hidden_r @ W^T + b, label_r) over row chunks; the hidden gradient is made in forward.

    Per chunk: the logits in W's dtype (what ``lm_head`` gives), an fp32 copy for log-sum-exp and the
    softmax, then (softmax - onehot) * w cast to W's dtype times W: the same products and casts as
    autograd through ``lm_head`` + :func:`dflash_loss`, with one chunk of logits alive at a time
    instead of the whole ``[rows, vocab]`` in two precisions and their gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, w, chunk_rows: int):
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        pred = torch.empty_like(labels)
        dhidden = torch.empty_like(hidden) if need_grad else None
        for r0 in range(0, hidden.shape[0], chunk_rows):
            r1 = min(r0 + chunk_rows, hidden.shape[0])
            logits = F.linear(hidden[r0:r1].to(weight.dtype), weight, bias)
            pred[r0:r1] = logits.argmax(-1)
            lab = labels[r0:r1, None]
            lf = logits.float()
            del logits
            lse = torch.logsumexp(lf, -1, keepdim=True)
            loss += ((lse - lf.gather(1, lab)).squeeze(1) * w[r0:r1]).sum()
            if need_grad:
                p = lf.sub_(lse).exp_()  # the softmax, in place of the fp32 logits
                p.scatter_add_(1, lab, torch.full_like(lab, -1, dtype=p.dtype))
                p.mul_(w[r0:r1, None])
                dhidden[r0:r1] = (p.to(weight.dtype) @ weight).to(hidden.dtype)
            del lf
        ctx.save_for_backward(dhidden)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, dloss, dpred):
        (dhidden,) = ctx.saved_tensors
        return dhidden * dloss.to(dhidden.dtype), None, None, None, None, None


def dflash_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor,
                     gamma: float, bias=None, chunk_rows: int = 2048, fused: bool = False, first: int = 0):
    """:func:`dflash_loss` of ``logits = hidden @ weight^T + bias`` without materializing the logits.

    Args:
        hidden: ``[B, N * bs, H]`` draft states (differentiable); weight ``[V, H]`` (and bias ``[V]``) the
            frozen LM head. Only the counted rows are projected: the others have weight 0.
        chunk_rows: rows per chunk (each chunk holds ``chunk_rows x V`` logits in fp32 and W's dtype).
        fused: use ``dflash_kernels``' fused LM head + cross-entropy (:func:`dflash_fused_head_loss`)
            instead of the row chunks here; ``chunk_rows`` is then unused.
        first: as :func:`dflash_loss`'s.
    Returns:
        ``(loss, stats)`` as :func:`dflash_loss`.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    B, N, bs = labels.shape
    if hidden.shape[:2] != (B, N * bs):
        raise ValueError(f"hidden: expected [B, N * bs, H] = [{B}, {N * bs}, H], got {tuple(hidden.shape)}")
    if fused:
        return dflash_fused_head_loss(hidden, weight, labels, counted, gamma, bias=bias, first=first)
    wpos = _weights(labels, gamma, first, hidden.device)[None, None, :] * counted
    rows = counted.reshape(-1).nonzero().squeeze(1)
    wsum = wpos.sum()
    w = (wpos.reshape(-1)[rows] / wsum.clamp_min(1e-12)).float()
    loss, pred = _HeadCrossEntropy.apply(hidden.reshape(B * N * bs, -1)[rows], weight, bias,
                                         labels.reshape(-1)[rows], w, chunk_rows)
    with torch.no_grad():
        hit = torch.zeros(B * N * bs, dtype=torch.bool, device=hidden.device)
        hit[rows] = pred == labels.reshape(-1)[rows]
    return loss, _stats(hit.view(B, N, bs), counted, first)


def dflash_fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor,
                           gamma: float, bias=None, first: int = 0):
    """:func:`dflash_head_loss` through ``dflash_kernels``' ``linear_cross_entropy`` (fused LM head + CE).

    Every row given (:func:`predicted_positions` leaves out the never-counted position 0 before), hidden
    cast to the head's dtype (what ``lm_head`` does), per-row weights ``exp(-(j - 1) / gamma)`` and ``reduction="mean"``: the op's
    ``sum(w * ce) / sum(w)`` over those rows is exactly :func:`dflash_loss`'s normalization (0 with no
    counted row). The accuracy comes from the op's argmax: no logits anywhere. A frozen head (the
    trainer's) costs no weight-gradient GEMM.
    """
    import dflash_kernels as dk

    B, N, bs = labels.shape
    # Every row goes in; rows not counted are ignored through ignore_index rather than gathered out, so
    # the step has no host synchronization (a gather by nonzero() would need the count).
    lab = torch.where(counted, labels, IGNORE_INDEX).reshape(-1)
    w = _weights(labels, gamma, first, hidden.device).expand(B, N, bs).reshape(-1)
    h = hidden.reshape(B * N * bs, -1)
    if h.dtype != weight.dtype:
        h = h.to(weight.dtype)
    loss, pred = dk.linear_cross_entropy(h, weight, lab, bias=bias, weights=w, ignore_index=IGNORE_INDEX,
                                         reduction="mean", return_argmax=True)
    with torch.no_grad():
        hit = (pred.view(B, N, bs) == labels) & counted
    return loss, _stats(hit, counted, first)


def expected_accept_length(acc_by_pos: torch.Tensor) -> float:
    """A rough acceptance-length estimate from per-position accuracies (positions treated as independent)."""
    tau, run = 1.0, 1.0
    for p in acc_by_pos[1:].tolist():
        run *= p
        tau += run
    return tau if math.isfinite(tau) else float("nan")
