"""Host-side helpers of the Gluon (sm_90) kernels' TMA descriptors, shared by the ops' launchers."""

import functools

import torch

__all__ = ["smem_layout"]


def smem_layout(block_shape, torch_dtype):
    """The NVMMA shared layout (128-byte swizzle for 64 or 128 16-bit elements per row) of a TMA box: what a
    kernel's TMA copies and warpgroup MMAs read. Made once per box and dtype (the layout is immutable): Triton's
    ``get_default_for`` costs about as much host time as the rest of a descriptor, and launchers build their
    descriptors on every call."""
    return _smem_layout(tuple(block_shape), torch_dtype)


@functools.lru_cache(maxsize=None)
def _smem_layout(block_shape, torch_dtype):
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}.get(torch_dtype)
    if gl_dtype is None:
        raise ValueError(f"smem_layout: torch_dtype must be torch.bfloat16 or torch.float16, got {torch_dtype}")
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype)
