"""Fused rotate-half RoPE (Qwen3 / Llama layout), optionally partial rotary, forward and backward.

Backends ``triton`` / ``interpret``: one kernel pass (``kernels.py``) reads ``x`` and cos / sin once and
writes ``y``; the backward is the same kernel rotating the gradient by ``-sin`` (cos / sin get no
gradient: they come from integer positions). ``reference``: ``naive.py``'s fp32 torch code.
"""

import torch

from dflash_kernels.ops.rope.checks import check_rope
from dflash_kernels.ops.rope.kernels import rope_kernel
from dflash_kernels.runtime import Op, alloc, bucket, cdiv, next_pow2
from dflash_kernels.runtime.autograd import differentiable_op, eager_call
from dflash_kernels.runtime.precompile import register_precompile

__all__ = ["apply_rope", "rope_launch"]

OP = "rope"
_op = Op(OP)


def rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x ``[B, T, H, D]`` (unit feature stride), cos / sin ``[B, T, R]`` (unit feature stride and the same
    strides: sin is read at cos's; batch stride 0 broadcasts) -> the rotated (``backward``: inversely
    rotated) ``[B, T, H, D]``, contiguous."""
    B, T, H, D = x.shape
    R = cos.shape[-1]
    y = alloc.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    if y.numel():
        bp = next_pow2(D - R) if D > R else 0
        rope_kernel(lambda m: (cdiv(T, m["BT"]), B), x, cos, sin, y, T, x.stride(0), x.stride(1), x.stride(2),
                    cos.stride(0), cos.stride(1), y.stride(0), y.stride(1), y.stride(2),
                    bucket=(bucket(B * T, cap=1 << 16),), H=H, D=D, R=R, BH=next_pow2(H),
                    BR=next_pow2(R // 2), BP=bp, BACKWARD=backward)
    return y


def _prep_cos_sin(cos: torch.Tensor, sin: torch.Tensor, B: int):
    """cos, sin ``[B or 1, T, R]`` -> ``[B, T, R]`` views with a unit feature stride and one layout: the
    kernel reads both at cos's strides. Copied only when they are not so (a batch of 1 is expanded, not
    copied)."""
    same = all(a == b for a, b, n in zip(cos.stride(), sin.stride(), cos.shape) if n > 1)
    if not same or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape[0] != B:
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    return cos, sin


def _fwd_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope_launch(x, cos, sin, False)


_fwd_op = torch.library.custom_op("dflash_kernels::rope_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@torch.library.custom_op("dflash_kernels::rope_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope_launch(dy if dy.stride(-1) == 1 else dy.contiguous(), cos, sin, True)


@_bwd_op.register_fake
def _(dy, cos, sin):
    return dy.new_empty(dy.shape)


def _setup_context(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(cos, sin)


_bwd_op_eager = eager_call(_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, dy):
    if dy is None or not ctx.needs_input_grad[0]:
        return None, None, None
    cos, sin = ctx.saved_tensors
    return _bwd_op_eager(dy, cos, sin), None, None


_fwd = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


@_op.impl("reference")
def _reference(x, cos, sin):
    from dflash_kernels.ops.rope.naive import naive_apply_rope
    return naive_apply_rope(x, cos, sin)


@_op.impl("triton", "interpret")
def _fast(x, cos, sin):
    B = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _fwd(x, *_prep_cos_sin(cos.detach(), sin.detach(), B))


def apply_rope(x, cos, sin):
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin`` on the first ``R`` features of each head.

    Args:
        x: ``[B, T, H, D]`` (q or k), fp32 / bf16 / fp16, any strides (a head-major ``[B, H, T, D]``
            tensor transposed to this shape is read in place).
        cos, sin: ``[B, T, R]`` or ``[B, T, 1, R]`` (a batch of 1 broadcasts), fp32 / bf16 / fp16, with
            ``R`` even, ``R <= D``: the first ``R`` features are rotated (halves ``[0, R/2)`` and
            ``[R/2, R)``), the other ``D - R`` pass through unchanged (partial rotary, as Qwen3.5's
            ``apply_rotary_pos_emb`` with ``cos.shape[-1] < head_dim``).

    Returns:
        ``[B, T, H, D]`` in ``x``'s dtype (contiguous), computed in fp32 with one rounding.
        Differentiable in ``x``; cos and sin get no gradient.
    """
    cos, sin = check_rope(x, cos, sin)
    return _op(x.device, x, cos, sin)


@register_precompile(OP)
def _precompile(shape, dtype, device, backward):
    """shape: ``B, T, H, D`` and optionally ``R`` (default ``D``) and ``cos_dtype`` (default fp32)."""
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    R = shape.get("R", D)
    x = torch.randn(B, T, H, D, device=device, dtype=dtype).requires_grad_(backward)
    cos = torch.randn(B, T, R, device=device, dtype=shape.get("cos_dtype", torch.float32))
    y = apply_rope(x, cos, cos)
    if backward:
        torch.autograd.grad(y, (x,), torch.randn_like(y))
