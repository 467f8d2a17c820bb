"""Fused LM head + weighted cross-entropy: ``CE(hidden @ weight.T + bias, labels)`` without the ``[N, V]`` logits.

Algorithm (backends ``triton`` and ``interpret``). Rows are processed in chunks of ``C`` rows
(:func:`chunk_rows`: the largest multiple of ``CHUNK_ROWS_MULTIPLE`` whose logits fit ``CHUNK_BYTES``,
512 MiB by default, i.e. C = 1024 at V = 248,320 in bf16); one ``[C, V]`` buffer in the input dtype is
reused by every chunk. Per chunk:

1. ``logits = hidden_c @ weight.T (+ bias)``: cuBLAS (``torch.mm`` / ``torch.addmm``) into the buffer,
   fp32 accumulation, rounded to the input dtype (what ``F.linear`` gives);
2. one Triton program per row (``kernels.py``): log-sum-exp, loss, argmax in fp32 and, when a gradient
   is wanted, ``G = (softmax - onehot) * softcap'`` written in place over the logits (unscaled);
3. ``dX_c = (G @ weight) * r`` with the row factor ``r = w / sum(w)`` (mean) or ``w`` (sum, none);
   if ``weight`` requires grad ``dW += G.T @ (hidden_c * r / max|r|)`` into an fp32 accumulator
   (scaled by ``max|r|`` at the end: the factor never underflows or overflows in fp16); if ``bias``
   requires grad ``db += G.T @ (r / max|r|)``, fp32 too.

The gradient is made in the forward and saved; the backward multiplies it by the loss's gradient (a
scalar for mean and sum). With ``reduction="none"`` the per-row upstream gradient only exists in the
backward: the hidden gradient is still made in the forward (row scaling commutes with the GEMM) but a
weight or bias gradient is made in the backward, recomputing the chunk's logits. With a frozen head
(``weight.requires_grad`` False, the DFlash case) no weight-gradient GEMM runs; without any input
requiring grad (eval) only steps 1 and 2's first sweep run. The mean's denominator is a device-side
reduction made before the loop: no host sync anywhere.

Memory above inputs and outputs: the chunk buffer, the per-row fp32 vectors and, only when the head
is trained, an fp32 ``[V, H]`` accumulator (precision over memory: bf16 accumulation over chunks would
round once per chunk).

Fast path = ``torch.library.custom_op`` ``dflash_kernels::linear_ce_fwd`` / ``linear_ce_bwd`` with fake
implementations, so a user's ``torch.compile`` traces it without a graph break; eager calls take the
cheaper ``autograd.Function`` (``runtime/autograd.py``). ``reference`` is ``naive.py``'s fp32 torch code.
"""

import os
from typing import Optional, Tuple

import torch

from dflash_kernels.ops.linear_cross_entropy.checks import check_arguments, check_label_range
from dflash_kernels.ops.linear_cross_entropy.kernels import linear_ce_rows
from dflash_kernels.ops.linear_cross_entropy import naive
from dflash_kernels.runtime import Op, alloc, bucket, cdiv
from dflash_kernels.runtime.autograd import differentiable_op, eager_call
from dflash_kernels.runtime.precompile import register_precompile

__all__ = ["linear_cross_entropy", "linear_ce_forward", "chunk_rows", "CHUNK_BYTES", "CHUNK_ROWS_MULTIPLE"]

OP = "linear_cross_entropy"
_op = Op(OP)

# Bytes of one chunk of logits (the only [rows, V] buffer). 512 MiB keeps the op's extra memory near
# 0.5 GiB; with chunks of half that size the hidden-gradient GEMMs were slower when timed
# (benchmarks/results/README.md). DFLASH_KERNELS_LINEAR_CE_CHUNK_MIB overrides it (read at import).
CHUNK_BYTES = int(os.environ.get("DFLASH_KERNELS_LINEAR_CE_CHUNK_MIB", "512")) << 20
# Chunk row counts are multiples of this (GEMM tile friendly; keeps every chunk's row slices of the
# per-row vectors 16-byte aligned, so all chunks share one compiled kernel).
CHUNK_ROWS_MULTIPLE = 128


def chunk_rows(N: int, V: int, element_size: int) -> int:
    """Rows per chunk: the largest multiple of ``CHUNK_ROWS_MULTIPLE`` with ``C * V * element_size <=
    CHUNK_BYTES`` (at least ``CHUNK_ROWS_MULTIPLE``), and at most ``N``."""
    c = CHUNK_BYTES // max(V * element_size, 1) // CHUNK_ROWS_MULTIPLE * CHUNK_ROWS_MULTIPLE
    return max(1, min(max(c, CHUNK_ROWS_MULTIPLE), N))


# ---------------------------------------------------------------------------------------- launchers
def _row_pass(logits, labels, weights, loss, lse, argmax, ignore_index: int, softcap, grad: bool):
    """The per-row pass over ``logits`` ``[rows, V]``, ``BR`` rows per program (see kernels.py)."""
    rows, V = logits.shape
    if rows == 0:
        return
    linear_ce_rows(lambda m: (cdiv(rows, m["BR"]),), logits, labels,
                   weights if weights is not None else loss, loss, lse, argmax if argmax is not None else lse,
                   rows, V, logits.stride(0), ignore_index, float(softcap) if softcap is not None else 1.0,
                   bucket=(bucket(V),), HAS_WEIGHTS=weights is not None, SOFTCAP=softcap is not None,
                   ARGMAX=argmax is not None, GRAD=grad)


_addmm_out_dtype = [True]  # torch.addmm(..., out_dtype=fp32) on CUDA (torch >= 2.8); cleared if refused


def _dw_update(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc`` fp32 ``[V, H]`` += ``g.T @ h`` (``g`` ``[C, V]``, ``h`` ``[C, H]`` in the input dtype),
    accumulated in fp32. The weight-gradient GEMM: never called for a frozen head."""
    if g.dtype == torch.float32:
        acc.addmm_(g.t(), h)
    elif acc.is_cuda and _addmm_out_dtype[0]:
        try:
            torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
        except (TypeError, RuntimeError):  # an older torch: a low-precision product, added in fp32
            _addmm_out_dtype[0] = False
            acc.add_(torch.mm(g.t(), h))
    elif acc.is_cuda:
        acc.add_(torch.mm(g.t(), h))
    else:  # CPU (interpreter runs): fp32 math
        acc.addmm_(g.t().float(), h.float())


def linear_ce_forward(hidden, weight, bias, labels, weights, ignore_index: int, softcap, want_argmax: bool,
                      factor, need_dx: bool, need_dw: bool, need_db: bool):
    """The chunk loop (no autograd).

    Args:
        hidden ``[N, H]`` (unit column stride), weight ``[V, H]``, bias ``[V]`` or None, labels ``[N]``
        int32/int64 contiguous, weights ``[N]`` fp32 contiguous or None, factor ``[N]`` fp32: each
        row's gradient factor (required when a gradient is asked).
    Returns:
        ``(loss_rows [N] fp32 = w * ce (0 at ignored rows), lse [N] fp32, argmax [N] int64 or None,
        dx [N, H] or None, dw [V, H] or None, db [V] or None)``; the gradients are of
        ``sum(factor * ce)`` in the parameters' dtypes.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    grad = need_dx or need_dw or need_db
    loss = alloc.empty((N,), dtype=torch.float32, device=dev)
    lse = alloc.empty((N,), dtype=torch.float32, device=dev)
    argmax = alloc.empty((N,), dtype=torch.int64, device=dev) if want_argmax else None
    dx = alloc.empty((N, H), dtype=dtype, device=dev) if need_dx else None
    dw_acc = torch.zeros((V, H), dtype=torch.float32, device=dev) if need_dw else None
    db_acc = torch.zeros((V,), dtype=torch.float32, device=dev) if need_db else None
    if need_dw or need_db:
        fmax = factor.abs().max() if N else torch.zeros((), dtype=torch.float32, device=dev)
        fnorm = torch.where(fmax > 0, factor / fmax, torch.zeros_like(factor))
    if N:
        with torch.autocast(dev.type, enabled=False):  # the GEMMs run in the input dtype into our buffers
            _chunk_loop(hidden, weight, bias, labels, weights, ignore_index, softcap, factor, loss, lse, argmax,
                        dx, dw_acc, db_acc, fnorm if (need_dw or need_db) else None, grad)
    dw = (dw_acc * fmax).to(weight.dtype) if need_dw else None
    db = (db_acc * fmax).to(bias.dtype) if need_db else None
    return loss, lse, argmax, dx, dw, db


def _chunk_loop(hidden, weight, bias, labels, weights, ignore_index, softcap, factor, loss, lse, argmax, dx,
                dw_acc, db_acc, fnorm, grad):
    """Steps 1-3 of the module doc per chunk, into the outputs and accumulators allocated by the caller."""
    N, H = hidden.shape
    V = weight.shape[0]
    dtype = hidden.dtype
    need_dx, need_dw, need_db = dx is not None, dw_acc is not None, db_acc is not None
    C = chunk_rows(N, V, hidden.element_size())
    buf = alloc.empty((C, V), dtype=dtype, device=hidden.device)
    for r0 in range(0, N, C):
        r1 = min(r0 + C, N)
        hc = hidden[r0:r1]
        logits = buf[: r1 - r0]
        if bias is None:
            torch.mm(hc, weight.t(), out=logits)
        else:
            torch.addmm(bias, hc, weight.t(), out=logits)
        _row_pass(logits, labels[r0:r1], weights[r0:r1] if weights is not None else None, loss[r0:r1],
                  lse[r0:r1], argmax[r0:r1] if argmax is not None else None, ignore_index, softcap, grad)
        if need_dx:
            dxc = dx[r0:r1]
            torch.mm(logits, weight, out=dxc)
            dxc.mul_(factor[r0:r1, None])
        if need_dw:
            _dw_update(dw_acc, logits, (hc.float() * fnorm[r0:r1, None]).to(dtype))
        if need_db:
            db_acc.add_(torch.mv(logits.t(), fnorm[r0:r1].to(dtype)).float())


def _mean_factor(labels, weights, ignore_index):
    """``(1 / sum of w over counted rows, or 0 when that sum is 0)`` as a device scalar: no host sync."""
    valid = labels != ignore_index
    if weights is None:
        denom = valid.sum().to(torch.float32)
    else:
        denom = torch.where(valid, weights, torch.zeros_like(weights)).sum()
    return torch.where(denom != 0, denom.reciprocal(), torch.zeros_like(denom))


# ------------------------------------------------------------------------------------- custom ops
def _defers(reduction: str, need_dw: bool, need_db: bool) -> bool:
    """``reduction="none"`` with a weight or bias gradient: made in the backward (see module doc)."""
    return reduction == "none" and (need_dw or need_db)


def _fwd_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
              weights: Optional[torch.Tensor], ignore_index: int, reduction: str, softcap: Optional[float],
              want_argmax: bool, need_dx: bool, need_dw: bool,
              need_db: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    """Returns ``(loss, lse, argmax, dx, dw, db)``; absent ones as empty tensors (a custom op returns
    tensors only). The gradients are of the loss itself (the backward scales them)."""
    if _defers(reduction, need_dw, need_db):
        need_dx = need_dw = need_db = False
    factor = None
    inv = None
    if reduction == "mean":
        inv = _mean_factor(labels, weights, ignore_index)
    if need_dx or need_dw or need_db:
        factor = weights if weights is not None else torch.ones(labels.shape, dtype=torch.float32,
                                                                  device=labels.device)
        if inv is not None:
            factor = factor * inv
    loss_rows, lse, argmax, dx, dw, db = linear_ce_forward(hidden, weight, bias, labels, weights, ignore_index,
                                                           softcap, want_argmax, factor, need_dx, need_dw,
                                                           need_db)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() * inv
    empty = hidden.new_empty
    return (loss, lse, argmax if argmax is not None else empty((0,), dtype=torch.int64),
            dx if dx is not None else empty((0,)), dw if dw is not None else empty((0,)),
            db if db is not None else empty((0,)))


_fwd_op = torch.library.custom_op("dflash_kernels::linear_ce_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(hidden, weight, bias, labels, weights, ignore_index, reduction, softcap, want_argmax, need_dx, need_dw,
      need_db):
    N, H = hidden.shape
    V = weight.shape[0]
    if _defers(reduction, need_dw, need_db):
        need_dx = need_dw = need_db = False
    f32 = torch.float32
    return (hidden.new_empty((N,) if reduction == "none" else (), dtype=f32), hidden.new_empty((N,), dtype=f32),
            hidden.new_empty((N,) if want_argmax else (0,), dtype=torch.int64),
            hidden.new_empty((N, H) if need_dx else (0,)),
            hidden.new_empty((V, H) if need_dw else (0,), dtype=weight.dtype),
            hidden.new_empty((V,) if need_db else (0,), dtype=weight.dtype))


@torch.library.custom_op("dflash_kernels::linear_ce_bwd", mutates_args=())
def _bwd_op(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            labels: torch.Tensor, weights: Optional[torch.Tensor], ignore_index: int, softcap: Optional[float],
            need_dx: bool, need_dw: bool, need_db: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_rows * w * ce)`` (``reduction="none"`` with a weight or bias gradient),
    recomputing each chunk's logits; absent ones as empty tensors."""
    factor = grad_rows.to(torch.float32)
    if weights is not None:
        factor = factor * weights
    _, _, _, dx, dw, db = linear_ce_forward(hidden, weight, bias, labels, weights, ignore_index, softcap, False,
                                            factor.contiguous(), need_dx, need_dw, need_db)
    empty = hidden.new_empty
    return (dx if dx is not None else empty((0,)), dw if dw is not None else empty((0,)),
            db if db is not None else empty((0,)))


@_bwd_op.register_fake
def _(grad_rows, hidden, weight, bias, labels, weights, ignore_index, softcap, need_dx, need_dw, need_db):
    return (hidden.new_empty(hidden.shape if need_dx else (0,)),
            hidden.new_empty(weight.shape if need_dw else (0,), dtype=weight.dtype),
            hidden.new_empty((weight.shape[0],) if need_db else (0,), dtype=weight.dtype))


def _setup_context(ctx, inputs, output):
    (hidden, weight, bias, labels, weights, ignore_index, reduction, softcap, want_argmax,
     need_dx, need_dw, need_db) = inputs
    _, lse, argmax, dx, dw, db = output
    # Only the loss is differentiable; the others' gradients are never materialized as zeros.
    ctx.mark_non_differentiable(lse, argmax, dx, dw, db)
    ctx.set_materialize_grads(False)
    ctx.deferred = _defers(reduction, need_dw, need_db)
    ctx.options = (ignore_index, reduction, softcap, need_dx, need_dw, need_db)
    if ctx.deferred:
        ctx.save_for_backward(hidden, weight, bias, labels, weights)
    else:
        ctx.save_for_backward(dx if need_dx else None, dw if need_dw else None, db if need_db else None)


_bwd_op_eager = eager_call(_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, g_loss, g_lse, g_argmax, g_dx, g_dw, g_db):
    nothing = (None,) * 12
    if g_loss is None:
        return nothing
    ignore_index, reduction, softcap, need_dx, need_dw, need_db = ctx.options
    if ctx.deferred:
        hidden, weight, bias, labels, weights = ctx.saved_tensors
        dx, dw, db = _bwd_op_eager(g_loss, hidden, weight, bias, labels, weights, ignore_index, softcap,
                             need_dx, need_dw, need_db)
    else:
        dx, dw, db = ctx.saved_tensors
        if reduction == "none":  # per-row upstream gradient; only dx is made here (see _defers)
            dx = (dx.float() * g_loss[:, None]).to(dx.dtype) if need_dx else None
        else:  # a 0-dim fp32 factor: the products keep the gradients' dtypes, computed in fp32
            dx = dx * g_loss if need_dx else None
            dw = dw * g_loss if need_dw else None
            db = db * g_loss if need_db else None
    return ((dx if need_dx else None), (dw if need_dw else None), (db if need_db else None)) + (None,) * 9


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_fwd = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


# ------------------------------------------------------------------------------------ public API
@_op.impl("reference")
def _reference(hidden, weight, labels, bias, weights, ignore_index, reduction, softcap, return_lse, return_argmax):
    return naive.naive_linear_cross_entropy(hidden, weight, labels, bias=bias, weights=weights,
                                            ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                                            return_lse=return_lse, return_argmax=return_argmax)


@_op.impl("triton", "interpret")
def _fast(hidden, weight, labels, bias, weights, ignore_index, reduction, softcap, return_lse, return_argmax):
    shape = labels.shape
    H = hidden.shape[-1]
    h2 = hidden.reshape(-1, H)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    lab = labels.reshape(-1).contiguous()
    w = weights.detach().reshape(-1).to(torch.float32).contiguous() if weights is not None else None
    grad = torch.is_grad_enabled()
    need_dx = grad and hidden.requires_grad
    need_dw = grad and weight.requires_grad
    need_db = grad and bias is not None and bias.requires_grad
    loss, lse, argmax, _, _, _ = _fwd(h2, weight, bias, lab, w, int(ignore_index), reduction, softcap,
                                      bool(return_argmax), need_dx, need_dw, need_db)
    if reduction == "none":
        loss = loss.view(shape)
    if not (return_lse or return_argmax):
        return loss
    out = (loss,)
    if return_lse:
        out += (lse.view(shape),)
    if return_argmax:
        out += (argmax.view(shape),)
    return out


def linear_cross_entropy(hidden, weight, labels, bias=None, weights=None, ignore_index=-100, reduction="mean",
                         softcap=None, return_lse=False, return_argmax=False):
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, never holding the ``[N, V]`` logits.

    Args:
        hidden: ``[N, H]`` or ``[..., H]`` (flattened to rows), fp32 / bf16 / fp16.
        weight: ``[V, H]``, the LM head, same dtype as ``hidden``. A frozen head (``requires_grad``
            False) costs no weight-gradient GEMM.
        labels: int64 / int32, ``hidden``'s shape without ``H``; values in ``[0, V)`` or ``ignore_index``.
            Checked on the CPU; on a GPU a value out of range is not checked (that would sync the host
            every call): its row's loss and hidden gradient are NaN instead.
        bias: ``[V]`` or None, same dtype as ``weight``.
        weights: per-row loss weights, ``labels``' shape, any float dtype (used in fp32); no gradient.
        ignore_index: rows with this label count for nothing (loss 0, gradient 0, not in the mean's
            denominator).
        reduction: ``"mean"``: ``sum(w * ce) / sum(w)`` over the rows not ignored (w = 1 without
            ``weights``; 0, with zero gradients, when that sum is 0); ``"sum"``: ``sum(w * ce)``;
            ``"none"``: ``w * ce`` per row (``labels``' shape, 0 at ignored rows).
        softcap: None or a positive finite number: logits become ``softcap * tanh(logits / softcap)``
            before the softmax (Gemma-style).
        return_lse: also return each row's log-sum-exp (fp32, ``labels``' shape; no gradient).
        return_argmax: also return each row's argmax token id over the (softcapped) logits (int64,
            ``labels``' shape; the first index of a tie), e.g. for accuracy without logits.

    Returns:
        ``loss`` (fp32) alone, or the tuple ``(loss, lse, argmax)`` with only the asked entries, in
        that order. Differentiable in ``hidden``, ``weight`` and ``bias``. The logits are made in the
        input dtype with fp32 accumulation and everything after them in fp32, as
        ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)``.
    """
    _, _, V, softcap = check_arguments(hidden, weight, labels, bias, weights, ignore_index, reduction, softcap)
    check_label_range(labels, V, ignore_index)
    return _op(hidden.device, hidden, weight, labels, bias, weights, int(ignore_index), reduction, softcap,
               bool(return_lse), bool(return_argmax))


# ------------------------------------------------------------------------------------- precompile
@register_precompile(OP)
def _precompile(shape, dtype, device, backward):
    """shape: ``N, H, V`` and optionally ``bias`` (False), ``weights`` (True), ``softcap`` (None),
    ``argmax`` (True), ``train_head`` (False: the frozen-head case)."""
    N, H, V = shape["N"], shape["H"], shape["V"]
    hidden = torch.randn(N, H, device=device, dtype=dtype).requires_grad_(backward)
    weight = (torch.randn(V, H, device=device, dtype=dtype) / H ** 0.5).requires_grad_(
        backward and shape.get("train_head", False))
    bias = torch.zeros(V, device=device, dtype=dtype) if shape.get("bias", False) else None
    labels = torch.randint(0, V, (N,), device=device)
    weights = torch.rand(N, device=device) if shape.get("weights", True) else None
    out = linear_cross_entropy(hidden, weight, labels, bias=bias, weights=weights, softcap=shape.get("softcap"),
                               return_argmax=shape.get("argmax", True))
    loss = out[0] if isinstance(out, tuple) else out
    if backward:
        loss.backward()
