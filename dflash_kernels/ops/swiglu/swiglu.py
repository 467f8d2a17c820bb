"""Fused SwiGLU: ``silu(gate) * up``, forward and backward, fp32 math.

Backends ``triton`` / ``interpret``: one streaming kernel each way (``kernels.py``; the backward
recomputes ``silu`` from the saved inputs instead of saving it). ``reference``: ``naive.py``.
``swiglu_packed(x)`` takes one ``[..., 2C]`` tensor (a fused gate/up projection) and reads both halves
in place; its gradient is one ``[..., 2C]`` tensor written by the same kernel.
"""

import math
from typing import Tuple

import torch

from dflash_kernels.ops.swiglu.checks import check_swiglu, check_swiglu_packed
from dflash_kernels.ops.swiglu.kernels import swiglu_bwd_kernel, swiglu_fwd_kernel
from dflash_kernels.runtime import Op, alloc, bucket, cdiv
from dflash_kernels.runtime.autograd import differentiable_op, eager_call
from dflash_kernels.runtime.precompile import register_precompile

__all__ = ["swiglu", "swiglu_packed", "swiglu_fwd", "swiglu_bwd"]

OP = "swiglu"
_op = Op(OP)
_op_packed = _op.function("swiglu_packed")


def _grid(N, C):
    return lambda m: (cdiv(N, m["BM"]), cdiv(C, m["BC"]))


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[N, C]`` (unit column stride) -> ``y [N, C]`` contiguous, gate's dtype."""
    N, C = gate.shape
    y = alloc.empty((N, C), dtype=gate.dtype, device=gate.device)
    if y.numel():
        swiglu_fwd_kernel(_grid(N, C), gate, up, y, N, C, gate.stride(0), up.stride(0), y.stride(0),
                          bucket=(bucket(N * C, cap=1 << 24),))
    return y


def swiglu_bwd(dy, gate, up, dgate, dup) -> None:
    """Writes ``dgate``, ``dup`` ``[N, C]`` (unit column strides; may be the halves of one buffer)."""
    N, C = gate.shape
    if N * C:
        swiglu_bwd_kernel(_grid(N, C), dy, gate, up, dgate, dup, N, C, dy.stride(0), gate.stride(0), up.stride(0),
                          dgate.stride(0), dup.stride(0), bucket=(bucket(N * C, cap=1 << 24),))


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: ambiguous for an empty last dim
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------- two inputs
def _fwd_impl(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_fwd(gate, up)


_fwd_op = torch.library.custom_op("dflash_kernels::swiglu_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("dflash_kernels::swiglu_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    dgate = alloc.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = alloc.empty(up.shape, dtype=up.dtype, device=up.device)
    swiglu_bwd(dy if dy.stride(-1) == 1 else dy.contiguous(), gate, up, dgate, dup)
    return dgate, dup


@_bwd_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs)


_bwd_op_eager = eager_call(_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, dy):
    if dy is None or not any(ctx.needs_input_grad):
        return None, None
    gate, up = ctx.saved_tensors
    dgate, dup = _bwd_op_eager(dy, gate, up)
    return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None)


_fwd = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


# ---------------------------------------------------------------------------------- one input
def _packed_fwd_impl(x: torch.Tensor) -> torch.Tensor:
    C = x.shape[1] // 2
    return swiglu_fwd(x[:, :C], x[:, C:])


_packed_fwd_op = torch.library.custom_op("dflash_kernels::swiglu_packed_fwd", mutates_args=())(_packed_fwd_impl)


@_packed_fwd_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("dflash_kernels::swiglu_packed_bwd", mutates_args=())
def _packed_bwd_op(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    C = x.shape[1] // 2
    dx = alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    swiglu_bwd(dy if dy.stride(-1) == 1 else dy.contiguous(), x[:, :C], x[:, C:], dx[:, :C], dx[:, C:])
    return dx


@_packed_bwd_op.register_fake
def _(dy, x):
    return x.new_empty(x.shape)


_packed_bwd_op_eager = eager_call(_packed_bwd_op)  # the plain function outside torch.compile


def _packed_backward(ctx, dy):
    if dy is None or not ctx.needs_input_grad[0]:
        return (None,)
    (x,) = ctx.saved_tensors
    return (_packed_bwd_op_eager(dy, x),)


_packed_fwd = differentiable_op(_packed_fwd_op, _packed_fwd_impl, _setup_context, _packed_backward)


# ------------------------------------------------------------------------------------ public API
@_op.impl("reference")
def _reference(gate, up):
    from dflash_kernels.ops.swiglu.naive import naive_swiglu
    return naive_swiglu(gate, up)


@_op.impl("triton", "interpret")
def _fast(gate, up):
    return _fwd(_rows(gate), _rows(up)).view(gate.shape)


@_op_packed.impl("reference")
def _packed_reference(x):
    from dflash_kernels.ops.swiglu.naive import naive_swiglu_packed
    return naive_swiglu_packed(x)


@_op_packed.impl("triton", "interpret")
def _packed_fast(x):
    return _packed_fwd(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)


def swiglu(gate, up):
    """``silu(gate) * up`` (the SwiGLU MLP's activation), fp32 math, one rounding.

    Args:
        gate, up: same shape ``[..., C]`` and dtype (fp32 / bf16 / fp16), any strides.

    Returns:
        ``[..., C]`` in their dtype (contiguous). Differentiable in both; the backward recomputes
        ``silu(gate)`` from the inputs (nothing extra is saved).
    """
    check_swiglu(gate, up)
    return _op(gate.device, gate, up)


def swiglu_packed(x):
    """``silu(x[..., :C]) * x[..., C:]`` for ``x`` ``[..., 2C]`` (one fused gate/up projection): both
    halves read in place, the gradient written as one ``[..., 2C]`` tensor.

    Args:
        x: ``[..., 2C]``, fp32 / bf16 / fp16, any strides: the gate in ``x[..., :C]``, the up projection
            in ``x[..., C:]``. An odd last dim raises ValueError.

    Returns:
        ``[..., C]`` in x's dtype (contiguous), fp32 math with one rounding. Differentiable in ``x``.
    """
    check_swiglu_packed(x)
    return _op_packed(x.device, x)


@register_precompile(OP)
def _precompile(shape, dtype, device, backward):
    """shape: ``N`` rows of ``C``; ``packed`` (False): ``swiglu_packed`` on one ``[N, 2C]`` input instead."""
    N, C = shape["N"], shape["C"]
    if shape.get("packed", False):
        x = torch.randn(N, 2 * C, device=device, dtype=dtype).requires_grad_(backward)
        ins, y = (x,), swiglu_packed(x)
    else:
        ins = tuple(torch.randn(N, C, device=device, dtype=dtype).requires_grad_(backward) for _ in range(2))
        y = swiglu(*ins)
    if backward:
        torch.autograd.grad(y, ins, torch.randn_like(y))
