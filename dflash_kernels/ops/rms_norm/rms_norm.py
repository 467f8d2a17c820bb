"""Fused RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim, fp32 math.

Backends ``triton`` / ``interpret``: one kernel pass forward (``y`` and the per-row fp32 ``rstd``), one
backward (``dx``, and the weight gradient as per-program fp32 partial rows summed by the host:
deterministic, no atomics); see ``kernels.py``. ``reference``: ``naive.py``'s fp32 torch code.

``x`` ``[..., D]`` in bf16 / fp16 / fp32, ``weight`` ``[D]`` in any of those (the drafter keeps fp32
weights under bf16 autocast); ``y`` in ``x``'s dtype, the weight gradient in ``weight``'s.
"""

from typing import Optional, Tuple

import torch

from dflash_kernels.ops.rms_norm.checks import check_gate, check_residual, check_rms_norm
from dflash_kernels.ops.rms_norm.kernels import (NARROW_D, rms_norm_bwd_narrow, rms_norm_bwd_wide,
                                                 rms_norm_fwd_narrow, rms_norm_fwd_wide)
from dflash_kernels.runtime import Op, alloc, bucket, cdiv, next_pow2
from dflash_kernels.runtime.autograd import differentiable_op, eager_call
from dflash_kernels.runtime.devices import device_index, sm_count
from dflash_kernels.runtime.precompile import register_precompile

__all__ = ["rms_norm", "rms_norm_gated", "fused_add_rms_norm", "rms_norm_fwd", "rms_norm_bwd"]

OP = "rms_norm"
_op = Op(OP)


def _bwd_programs(device: torch.device, N: int) -> int:
    """Programs of the backward (each one partial weight-gradient row): two per SM on a GPU."""
    if device.type != "cuda":
        return max(1, min(N, 4))
    return max(1, min(N, 2 * sm_count(device_index(device))))


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has a unit stride (rows read in place), else a contiguous copy; for the
    ``[D]`` weight, which the kernels read as ``w_ptr + cols``, a strided or expanded view is copied."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


# ---------------------------------------------------------------------------------------- launchers
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gate=None, round_mode: int = 0,
                 residual=None):
    """x ``[N, D]`` (unit column stride) -> ``(y [N, D] in x's dtype, rstd [N] fp32, h)``; ``gate`` ``[N, D]``
    (unit column stride) multiplies by ``silu(gate)``; ``round_mode`` is the kernels' ``ROUND``; ``residual``
    ``[N, D]`` (unit column stride) is added first: ``h = x + residual`` (x's dtype) is normalized and
    returned (None without a residual)."""
    N, D = x.shape
    y = alloc.empty((N, D), dtype=x.dtype, device=x.device)
    rstd = alloc.empty((N,), dtype=torch.float32, device=x.device)
    h = None if residual is None else alloc.empty((N, D), dtype=x.dtype, device=x.device)
    if N:
        kernel = rms_norm_fwd_narrow if D <= NARROW_D else rms_norm_fwd_wide
        kernel(lambda m: (cdiv(N, m["BM"]),), x, weight, x if gate is None else gate, y, rstd, N, x.stride(0),
               0 if gate is None else gate.stride(0), y.stride(0), eps, offset,
               x if residual is None else residual, y if h is None else h,
               0 if residual is None else residual.stride(0), 0 if h is None else h.stride(0),
               bucket=(bucket(N, cap=1 << 16),), D=D, BD=next_pow2(D), HAS_GATE=gate is not None,
               ROUND=round_mode, HAS_RES=residual is not None)
    return y, rstd, h


def rms_norm_bwd(dy, x, weight, rstd, offset: float, need_dw: bool, gate=None, dres=None, dx2: bool = False):
    """``(dx [N, D] in x's dtype, dw [D] in weight's dtype or None, dgate [N, D] in gate's dtype or None,
    dx2)``; ``dres`` ``[N, D]`` (unit column stride), a gradient that also reaches x, is added to dx;
    ``dx2``: also write a second copy of dx into a buffer of its own (else None)."""
    N, D = x.shape
    dx = alloc.empty((N, D), dtype=x.dtype, device=x.device)
    dx_copy = alloc.empty((N, D), dtype=x.dtype, device=x.device) if dx2 else None
    dgate = None if gate is None else alloc.empty((N, D), dtype=gate.dtype, device=x.device)
    P = _bwd_programs(x.device, N)
    partial = alloc.empty((P, D), dtype=torch.float32, device=x.device) if need_dw else None
    if N:
        kernel = rms_norm_bwd_narrow if D <= NARROW_D else rms_norm_bwd_wide
        kernel((P,), dy, x, weight, x if gate is None else gate, rstd, dx, dx if gate is None else dgate,
               partial if need_dw else rstd, N, cdiv(N, P), dy.stride(0), x.stride(0),
               0 if gate is None else gate.stride(0), dx.stride(0), 0 if gate is None else dgate.stride(0),
               offset, dy if dres is None else dres, 0 if dres is None else dres.stride(0),
               dx if dx_copy is None else dx_copy, 0 if dx_copy is None else dx_copy.stride(0),
               bucket=(bucket(N, cap=1 << 16),), D=D, BD=next_pow2(D), HAS_DW=need_dw,
               HAS_GATE=gate is not None, HAS_DRES=dres is not None, HAS_DX2=dx2)
    dw = None
    if need_dw:
        dw = (partial.sum(0) if N else torch.zeros(D, dtype=torch.float32, device=x.device)).to(weight.dtype)
    return dx, dw, dgate, dx_copy


# ------------------------------------------------------------------------------------- custom ops
def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_fwd(x, weight, eps, offset)[:2]


_fwd_op = torch.library.custom_op("dflash_kernels::rms_norm_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(x, weight, eps, offset):
    return x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("dflash_kernels::rms_norm_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
            need_dw: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    dx, dw, _, _ = rms_norm_bwd(_unit_rows(dy), x, weight, rstd, offset, need_dw)
    return dx, dw if dw is not None else weight.new_empty((0,))


@_bwd_op.register_fake
def _(dy, x, weight, rstd, offset, need_dw):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if need_dw else (0,))


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.offset = offset
    ctx.save_for_backward(x, weight, rstd)


_bwd_op_eager = eager_call(_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dx or need_dw):
        return None, None, None, None
    dx, dw = _bwd_op_eager(dy, x, weight, rstd, ctx.offset, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


_fwd = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


# ------------------------------------------------------------------------ custom ops, gated form
def _gated_fwd_impl(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    round_mode: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_fwd(x, weight, eps, offset, gate=gate, round_mode=round_mode)[:2]


_gated_fwd_op = torch.library.custom_op("dflash_kernels::rms_norm_gated_fwd", mutates_args=())(_gated_fwd_impl)


@_gated_fwd_op.register_fake
def _(x, gate, weight, eps, offset, round_mode):
    return x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("dflash_kernels::rms_norm_gated_bwd", mutates_args=())
def _gated_bwd_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                  offset: float, need_dw: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, dgate, _ = rms_norm_bwd(_unit_rows(dy), x, weight, rstd, offset, need_dw, gate=gate)
    return dx, dgate, dw if dw is not None else weight.new_empty((0,))


@_gated_bwd_op.register_fake
def _(dy, x, gate, weight, rstd, offset, need_dw):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape if need_dw else (0,))


def _gated_setup_context(ctx, inputs, output):
    x, gate, weight, eps, offset, round_mode = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.offset = offset
    ctx.save_for_backward(x, gate, weight, rstd)


_gated_bwd_op_eager = eager_call(_gated_bwd_op)


def _gated_backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None, None, None, None
    x, gate, weight, rstd = ctx.saved_tensors
    need_dx, need_dg, need_dw = ctx.needs_input_grad[:3]
    if not (need_dx or need_dg or need_dw):
        return None, None, None, None, None, None
    dx, dgate, dw = _gated_bwd_op_eager(dy, x, gate, weight, rstd, ctx.offset, need_dw)
    return (dx if need_dx else None), (dgate if need_dg else None), (dw if need_dw else None), None, None, None


_gated_fwd = differentiable_op(_gated_fwd_op, _gated_fwd_impl, _gated_setup_context, _gated_backward)

# ---------------------------------------------------------------------- custom ops, residual form
def _add_fwd_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  offset: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, rstd, h = rms_norm_fwd(x, weight, eps, offset, residual=residual)
    return y, h, rstd


_add_fwd_op = torch.library.custom_op("dflash_kernels::rms_norm_add_fwd", mutates_args=())(_add_fwd_impl)


@_add_fwd_op.register_fake
def _(x, residual, weight, eps, offset):
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("dflash_kernels::rms_norm_add_bwd", mutates_args=())
def _add_bwd_op(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor, weight: torch.Tensor,
                rstd: torch.Tensor, offset: float, need_dw: bool,
                need_both: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dresidual or empty, dw or empty)``: with ``need_both`` the kernel stores the one gradient
    into two buffers, so x's and residual's gradients never share storage."""
    dx, dw, _, dr = rms_norm_bwd(_unit_rows(dy), h, weight, rstd, offset, need_dw,
                                 dres=None if dh is None else _unit_rows(dh), dx2=need_both)
    return dx, dr if dr is not None else h.new_empty((0,)), dw if dw is not None else weight.new_empty((0,))


@_add_bwd_op.register_fake
def _(dy, dh, h, weight, rstd, offset, need_dw, need_both):
    return (h.new_empty(h.shape), h.new_empty(h.shape if need_both else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def _add_setup_context(ctx, inputs, output):
    x, residual, weight, eps, offset = inputs
    _, h, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.offset = offset
    ctx.save_for_backward(h, weight, rstd)


_add_bwd_op_eager = eager_call(_add_bwd_op)


def _add_backward(ctx, dy, dh, _drstd):
    need_x, need_r, need_dw = ctx.needs_input_grad[:3]
    h, weight, rstd = ctx.saved_tensors
    if dy is None:  # only h was used: its gradient goes to x and residual as it is, no weight gradient
        if need_x and need_r:  # one buffer each: a shared one would be accumulated into twice
            return dh, dh.clone(), None, None, None
        return (dh if need_x else None), (dh if need_r else None), None, None, None
    if not (need_x or need_r or need_dw):
        return None, None, None, None, None
    dx, dr, dw = _add_bwd_op_eager(dy, dh, h, weight, rstd, ctx.offset, need_dw, need_x and need_r)
    if not need_x:
        dx, dr = None, (dx if need_r else None)
    elif not need_r:
        dr = None
    return dx, dr, (dw if need_dw else None), None, None


_add_fwd = differentiable_op(_add_fwd_op, _add_fwd_impl, _add_setup_context, _add_backward)


# ------------------------------------------------------------------------------------ public API
@_op.impl("reference")
def _reference(x, weight, eps, offset):
    from dflash_kernels.ops.rms_norm.naive import naive_rms_norm
    return naive_rms_norm(x, weight, eps, offset)


@_op.impl("triton", "interpret")
def _fast(x, weight, eps, offset):
    D = x.shape[-1]
    y, _ = _fwd(_unit_rows(x.reshape(-1, D)), _unit_rows(weight), eps, offset)
    return y.view(x.shape)


def rms_norm(x, weight, eps=1e-6, offset=0.0):
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``, fp32 math.

    Args:
        x: ``[..., D]``, fp32 / bf16 / fp16, any strides (rows with a unit column stride are read in
            place, others copied once). D at most 16384.
        weight: ``[D]``, any of those dtypes (fp32 weights with bf16 activations are fine).
        eps: added to the mean square.
        offset: ``0.0`` gives ``x_hat * weight`` (Llama, Qwen3); ``1.0`` gives ``x_hat * (1 + weight)``
            (Qwen3.5, Qwen3-Next, Gemma), all in fp32 before the one rounding to ``x``'s dtype.

    Returns:
        ``y``, ``x``'s shape and dtype (contiguous). Differentiable in ``x`` and ``weight``; the weight
        gradient is reduced deterministically, in fp32, and returned in ``weight``'s dtype.
    """
    eps, offset = check_rms_norm(x, weight, eps, offset)
    return _op(x.device, x, weight, eps, offset)


_gated_op = Op(OP + "_gated")


@_gated_op.impl("reference")
def _gated_reference(x, gate, weight, eps, offset, round_mode):
    from dflash_kernels.ops.rms_norm.naive import naive_rms_norm_gated
    return naive_rms_norm_gated(x, gate, weight, eps, offset, round_normed=round_mode > 0)


@_gated_op.impl("triton", "interpret")
def _gated_fast(x, gate, weight, eps, offset, round_mode):
    D = x.shape[-1]
    y, _ = _gated_fwd(_unit_rows(x.reshape(-1, D)), _unit_rows(gate.reshape(-1, D)), _unit_rows(weight), eps, offset,
                      round_mode)
    return y.view(x.shape)


def rms_norm_gated(x, gate, weight, eps=1e-6, offset=0.0, round_normed=False):
    """The gated RMSNorm of Gated DeltaNet layers: ``rms_norm(x, weight, eps, offset) * silu(gate)``.

    Args:
        x: ``[..., D]``, fp32 / bf16 / fp16, any strides (rows with a unit column stride are read in place).
        gate: ``x``'s shape, any of those dtypes; ``silu`` of it in fp32 multiplies the normed rows.
        weight: ``[D]``, any of those dtypes. eps, offset: as :func:`rms_norm`.
        round_normed: reproduce transformers' ``RMSNormGated`` (Qwen3.5 / Qwen3-Next): ``x_hat`` is
            rounded to ``x``'s dtype before the weight, and the product with a weight of ``x``'s dtype
            rounded to it, before the gate. False: fp32 throughout, one rounding (fla's form).

    Returns:
        ``y``, ``x``'s shape and dtype (contiguous). Differentiable in ``x``, ``gate`` and ``weight`` (the
        roundings of ``round_normed`` pass gradients through unchanged, as autograd's casts do).
    """
    eps, offset = check_rms_norm(x, weight, eps, offset)
    check_gate(x, gate)
    round_mode = 0
    if round_normed and x.dtype != torch.float32:
        round_mode = 2 if weight.dtype == x.dtype else 1
    return _gated_op(x.device, x, gate, weight, eps, offset, round_mode)


_add_op = Op(OP + "_add")


@_add_op.impl("reference")
def _add_reference(x, residual, weight, eps, offset):
    from dflash_kernels.ops.rms_norm.naive import naive_fused_add_rms_norm
    return naive_fused_add_rms_norm(x, residual, weight, eps, offset)


@_add_op.impl("triton", "interpret")
def _add_fast(x, residual, weight, eps, offset):
    D = x.shape[-1]
    y, h, _ = _add_fwd(_unit_rows(x.reshape(-1, D)), _unit_rows(residual.reshape(-1, D)), _unit_rows(weight), eps,
                       offset)
    return y.view(x.shape), h.view(x.shape)


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0):
    """The pre-norm decoder layer's residual add and the next RMSNorm in one pass:
    ``h = x + residual; y = rms_norm(h, weight, eps, offset)`` (vLLM's ``fused_add_rms_norm``, fla's and
    flash-attention's ``rms_norm(x, weight, residual=residual, prenorm=True)``, Liger's ``LigerFusedAddRMSNorm``).

    Args:
        x: ``[..., D]``, fp32 / bf16 / fp16, any strides (the sublayer's output).
        residual: ``x``'s shape and dtype (the residual stream).
        weight, eps, offset: as :func:`rms_norm`.

    Returns:
        ``(y, h)``, both ``x``'s shape and dtype (contiguous): ``h`` is ``x + residual`` rounded once to
        ``x``'s dtype, as a plain add gives, and ``y`` its norm (fp32 math, one rounding). Differentiable in
        ``x``, ``residual`` and ``weight``; the backward writes one gradient for ``x`` and ``residual`` (the
        norm's plus the one that reaches ``h`` from its other readers) in one pass.
    """
    eps, offset = check_rms_norm(x, weight, eps, offset)
    check_residual(x, residual)
    return _add_op(x.device, x, residual, weight, eps, offset)


# ------------------------------------------------------------------------------------- precompile
@register_precompile(OP)
def _precompile(shape, dtype, device, backward):
    """shape: ``N`` rows of ``D``; optional ``weight_dtype`` (default: ``dtype``) and ``offset`` (0.0)."""
    N, D = shape["N"], shape["D"]
    x = torch.randn(N, D, device=device, dtype=dtype).requires_grad_(backward)
    w = torch.randn(D, device=device, dtype=shape.get("weight_dtype", dtype)).requires_grad_(backward)
    y = rms_norm(x, w, 1e-6, shape.get("offset", 0.0))
    if backward:
        torch.autograd.grad(y, (x, w), torch.randn_like(y))


@register_precompile("rms_norm_gated")
def _precompile_gated(shape, dtype, device, backward):
    """shape: ``N`` rows of ``D``; optional ``weight_dtype``, ``gate_dtype`` (default: ``dtype``), ``offset``
    (0.0) and ``round_normed`` (False)."""
    N, D = shape["N"], shape["D"]
    x = torch.randn(N, D, device=device, dtype=dtype).requires_grad_(backward)
    g = torch.randn(N, D, device=device, dtype=shape.get("gate_dtype", dtype)).requires_grad_(backward)
    w = torch.randn(D, device=device, dtype=shape.get("weight_dtype", dtype)).requires_grad_(backward)
    y = rms_norm_gated(x, g, w, 1e-6, shape.get("offset", 0.0), shape.get("round_normed", False))
    if backward:
        torch.autograd.grad(y, (x, g, w), torch.randn_like(y))


@register_precompile("fused_add_rms_norm")
def _precompile_add(shape, dtype, device, backward):
    """shape: ``N`` rows of ``D``; optional ``weight_dtype`` (default: ``dtype``) and ``offset`` (0.0). The
    backward is compiled in the decoder layer's form: both outputs read, x and residual both needing
    gradients."""
    N, D = shape["N"], shape["D"]
    x, r = (torch.randn(N, D, device=device, dtype=dtype).requires_grad_(backward) for _ in range(2))
    w = torch.randn(D, device=device, dtype=shape.get("weight_dtype", dtype)).requires_grad_(backward)
    y, h = fused_add_rms_norm(x, r, w, 1e-6, shape.get("offset", 0.0))
    if backward:
        torch.autograd.grad((y, h), (x, r, w), (torch.randn_like(y), torch.randn_like(h)))
