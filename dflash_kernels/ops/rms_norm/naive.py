"""The plain fp32 PyTorch reference of the fused RMSNorm (the ``reference`` backend)."""

import torch

__all__ = ["naive_rms_norm"]


def naive_rms_norm(x, weight, eps=1e-6, offset=0.0):
    """``(x / sqrt(mean(x^2) + eps) * (offset + weight))`` over the last dim, in fp32, returned in ``x``'s
    dtype. ``offset=1.0`` is Qwen3.5 / Qwen3-Next's ``(1 + weight)`` form. Differentiable by autograd."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + weight.float())).to(x.dtype)
