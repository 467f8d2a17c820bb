"""The plain fp32 PyTorch reference of rotate-half RoPE (the ``reference`` backend)."""

import torch

__all__ = ["naive_apply_rope"]


def naive_apply_rope(x, cos, sin):
    """x ``[B, T, H, D]``; cos / sin ``[B, T, R]`` or ``[B, T, 1, R]`` (``R <= D`` even; a batch of 1
    broadcasts). The first ``R`` features of each head become ``x * cos + rotate_half(x) * sin``, the
    rest pass through; fp32 math, returned in ``x``'s dtype. Differentiable by autograd."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    R = cos.shape[-1]
    xf = x.float()
    xr, xp = xf[..., :R], xf[..., R:]
    x1, x2 = xr.chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    y = xr * cos.float() + rot * sin.float()
    return torch.cat([y, xp], -1).to(x.dtype)
