"""The plain fp32 PyTorch references of SwiGLU (the ``reference`` backend)."""

import torch
import torch.nn.functional as F

__all__ = ["naive_swiglu", "naive_swiglu_packed"]


def naive_swiglu(gate, up):
    """``silu(gate) * up`` in fp32, returned in ``gate``'s dtype. Differentiable by autograd."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def naive_swiglu_packed(x):
    """``x`` ``[..., 2C]`` = ``[gate | up]`` -> ``silu(gate) * up`` ``[..., C]``."""
    gate, up = x.chunk(2, -1)
    return naive_swiglu(gate, up)
