"""Dense fp32 reference for block-sparse attention: materialize the mask, call PyTorch SDPA.

Slow and memory-hungry on purpose (it is what the kernels are checked against); never imported by
the fast path.
"""

import math

import torch
import torch.nn.functional as F

from dflash_kernels.ops.attention.mask import BlockSparseMask

__all__ = ["naive_dense_mask", "naive_block_sparse_attention", "masked_block_sparse_attention", "DEFAULT_MEMORY_BUDGET"]

DEFAULT_MEMORY_BUDGET = 4 << 30  # bytes


def naive_dense_mask(mask: BlockSparseMask) -> torch.Tensor:
    """The boolean ``[MB, Tq, Tk]`` matrix that ``mask`` describes (True = visible)."""
    seg = mask.segments.long()
    MB, NG, MS, _ = seg.shape
    dev = seg.device
    t = torch.arange(mask.q_len, device=dev)
    kv = torch.arange(mask.kv_len, device=dev)[None, None, :]
    g = t // mask.q_block
    r = (t - g * mask.q_block)[None, :, None]
    out = torch.zeros(MB, mask.q_len, mask.kv_len, dtype=torch.bool, device=dev)
    for s in range(MS):
        lo, hi, shift, tile = (x[:, :, None] for x in seg[:, g, s].unbind(-1))  # [MB, Tq, 1]
        live = (mask.seg_count.long()[:, g] > s)[..., None]
        vis = live & (kv >= lo) & (kv < hi) & (kv <= t[None, :, None] + shift)
        if mask.tiles.shape[0]:
            col = (kv - lo).clamp(0, mask.tile_width - 1)
            bits = mask.tiles[tile.clamp_min(0), r, col].bool()
            vis &= (tile < 0) | bits
        out |= vis
    return out


def _check_budget(mask, B, Tq, Tk, Hq, D, memory_budget):
    """A ValueError before anything large is allocated when the dense forms would take over the budget."""
    need = (mask.batch_size * Tq * Tk  # bool mask
            + 3 * 4 * B * Hq * Tq * Tk  # fp32 scores, probabilities and one temporary
            + 4 * (2 * B * Tq * Hq * D + 2 * B * Tk * Hq * D))  # fp32 q, o and GQA-expanded k, v
    if need > memory_budget:
        raise ValueError(f"memory_budget: naive_block_sparse_attention needs about {need / 2**30:.2f} GiB for "
                         f"B={B}, Tq={Tq}, Tk={Tk}, Hq={Hq}, D={D}, over the budget of {memory_budget / 2**30:.2f} GiB; "
                         f"use smaller shapes or pass a larger memory_budget")


def naive_block_sparse_attention(q, k, v, mask: BlockSparseMask, scale=None, return_lse=False,
                                 memory_budget=DEFAULT_MEMORY_BUDGET):
    """Block-sparse attention the slow way: dense mask + ``F.scaled_dot_product_attention`` in fp32.

    Args:
        q: ``[B, Tq, Hq, D]``; k, v: ``[B, Tk, Hkv, D]`` with Hq a multiple of Hkv.
        mask: a :class:`BlockSparseMask` with batch size 1 or B.
        scale: softmax scale (default ``1 / sqrt(D)``).
        return_lse: also return the log-sum-exp ``[B, Hq, Tq]`` (fp32, -inf for rows seeing no key).
        memory_budget: bytes the dense mask, scores and fp32 copies may take; above it a ValueError
            is raised before anything large is allocated.

    Returns the output ``[B, Tq, Hq, D]`` in q's dtype (rows that see no key are 0), and the lse.
    Differentiable through PyTorch autograd.
    """
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _check_budget(mask, B, Tq, Tk, Hq, D, memory_budget)
    vis = naive_dense_mask(mask).expand(B, -1, -1)[:, None]  # [B, 1, Tq, Tk]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    seen = vis.any(-1, keepdim=True)  # rows with no key: SDPA would give NaN
    attn_mask = vis | ~seen
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=attn_mask, scale=scale)
    o = torch.where(seen, o, 0.0).transpose(1, 2).to(q.dtype)
    if not return_lse:
        return o
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~vis, float("-inf")), -1)
    return o, lse


def _contract(p: torch.Tensor, x: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """``p @ x`` (``p`` ``[B, H, M, N]`` exactly 0 where ``vis`` ``[B, 1, M, N]`` is False, ``x`` ``[B, H, N, D]``),
    where a non-finite element of x reaches only the rows m with ``vis[m, n]``: the plain product would
    multiply its NaN / Inf by the exact zeros of every other row. The finite part is one product; the
    non-finite part is what the plain product gives over the visible pairs, from counts of NaN, +Inf and -Inf
    per (row, column) (products of 0/1 matrices: exact), with no host synchronization (it runs inside CUDA
    graph capture)."""
    finite = x.isfinite()
    out = torch.matmul(p, torch.where(finite, x, 0.0))
    seen = vis.to(p.dtype)
    pos = (vis & (p > 0)).to(p.dtype)  # p * inf is +-inf where p > 0, NaN where p underflowed to 0
    n_nan = torch.matmul(seen, x.isnan().to(p.dtype)) + torch.matmul(seen - pos, x.isinf().to(p.dtype))
    n_pinf = torch.matmul(pos, x.isposinf().to(p.dtype))
    n_ninf = torch.matmul(pos, x.isneginf().to(p.dtype))
    bad = torch.where((n_nan > 0) | ((n_pinf > 0) & (n_ninf > 0)), float("nan"),
                      torch.where(n_pinf > 0, float("inf"), torch.where(n_ninf > 0, float("-inf"), 0.0)))
    return out + bad  # rows that see no non-finite element add exactly 0


class _MaskedAttention(torch.autograd.Function):
    """Softmax attention over a dense visibility mask, fp32 ``[B, H, T, D]``, with the backward written out
    so that every product that sums over keys (o, dq) or over queries (dk, dv) leaves out the pairs the
    mask hides (``_contract``): a NaN / Inf reaches exactly the outputs and gradients of the rows and keys
    that see it."""

    @staticmethod
    def forward(ctx, q, k, v, vis, scale):
        s = torch.where(vis, torch.matmul(q, k.transpose(-1, -2)) * scale, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)  # -inf for rows that see no key
        p = torch.where(vis, torch.exp(s - lse), 0.0)
        o = _contract(p, v, vis)
        ctx.save_for_backward(q, k, v, vis, p)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return o, lse.squeeze(-1)

    @staticmethod
    @torch.autocast("cuda", enabled=False)
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, do, _dlse):
        q, k, v, vis, p = ctx.saved_tensors
        do = do.float()
        vis_t, p_t = vis.transpose(-1, -2), p.transpose(-1, -2)
        dv = _contract(p_t, do, vis_t)
        dp = torch.where(vis, torch.matmul(do, v.transpose(-1, -2)), 0.0)
        ds = torch.where(vis, p * (dp - (p * dp).sum(-1, keepdim=True)), 0.0) * ctx.scale
        dq = _contract(ds, k, vis)
        dk = _contract(ds.transpose(-1, -2), q, vis_t)

        def token_major(t):  # [B, H, T, D] values in [B, T, H, D] memory: the caller's layout after its transpose
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        return token_major(dq), token_major(dk), token_major(dv), None, None


def masked_block_sparse_attention(q, k, v, mask: BlockSparseMask, scale=None, return_lse=False,
                                  memory_budget=DEFAULT_MEMORY_BUDGET):
    """:func:`naive_block_sparse_attention`'s result (fp32 math, the dense mask), computed so that a masked
    key contributes exactly zero also when it is non-finite: a NaN / Inf in a key, value, query or upstream
    gradient reaches only the rows and keys that see it, forward and backward, as the kernels guarantee.
    The ``reference`` backend's form. Same arguments and returns."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    _check_budget(mask, B, Tq, Tk, Hq, D, memory_budget)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    vis = naive_dense_mask(mask).expand(B, -1, -1)[:, None]  # [B, 1, Tq, Tk]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    with torch.autocast(q.device.type, enabled=False):  # fp32 math, also inside an autocast region
        o, lse = _MaskedAttention.apply(qf, kf, vf, vis, scale)
    o = o.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format)  # [B, Tq, Hq, D] as q
    return (o, lse) if return_lse else o
