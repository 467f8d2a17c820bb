"""The plain fp32 PyTorch reference of the fused RMSNorm (the ``reference`` backend)."""

import torch

__all__ = ["naive_rms_norm", "naive_rms_norm_gated", "naive_fused_add_rms_norm"]


def naive_rms_norm(x, weight, eps=1e-6, offset=0.0):
    """``(x / sqrt(mean(x^2) + eps) * (offset + weight))`` over the last dim, in fp32, returned in ``x``'s
    dtype. ``offset=1.0`` is Qwen3.5 / Qwen3-Next's ``(1 + weight)`` form. Differentiable by autograd."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + weight.float())).to(x.dtype)


def naive_rms_norm_gated(x, gate, weight, eps=1e-6, offset=0.0, round_normed=False):
    """``naive_rms_norm(x, weight) * silu(gate)`` in fp32, returned in ``x``'s dtype. ``round_normed``:
    transformers' ``RMSNormGated`` order of roundings (x_hat to x's dtype, times the weight in the
    promoted dtype, then the fp32 SiLU of the gate)."""
    xf = x.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_normed:
        w = weight + offset if offset else weight
        n = w * xhat.to(x.dtype)
    else:
        n = xhat * (offset + weight.float())
    return (n * torch.nn.functional.silu(gate.float())).to(x.dtype)


def naive_fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0):
    """``(naive_rms_norm(h), h)`` with ``h = x + residual`` computed in fp32 and rounded to ``x``'s dtype."""
    h = (x.float() + residual.float()).to(x.dtype)
    return naive_rms_norm(h, weight, eps, offset), h
