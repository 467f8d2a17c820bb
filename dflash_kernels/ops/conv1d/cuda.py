"""The CUDA-extension path of the causal conv1d: the one module that imports ``dflash_kernels._C``.

The extension is optional: setup.py builds it only where a CUDA torch and nvcc exist. Its launchers
here have the signatures and returns of the Triton launchers in ``conv1d.py``; they allocate the
outputs (through ``alloc``, so poisoned test runs cover them) and hand raw pointers and strides to
the kernels in ``csrc/causal_conv1d``.

Backend ``cuda`` forces these launchers; under ``auto`` on a CUDA input, ``conv1d.py`` runs whichever
of them and the Triton launchers was timed faster for the shape bucket (``runtime/choice.py``).
"""

import torch

from dflash_kernels.runtime import alloc
from dflash_kernels.runtime.errors import BackendUnavailable

try:
    from dflash_kernels import _C
    _IMPORT_ERROR = None
except ImportError as e:  # a CPU-only or pure-Triton install
    _C = None
    _IMPORT_ERROR = e

__all__ = ["available", "cuda_causal_conv1d_fwd", "cuda_causal_conv1d_bwd", "cuda_causal_conv1d_update",
           "source_hash"]


def available() -> bool:
    """True when the CUDA extension ``dflash_kernels._C`` was built and imports."""
    return _C is not None


def _require(x: torch.Tensor):
    if _C is None:
        raise BackendUnavailable(
            f"conv1d: backend 'cuda' needs the CUDA extension dflash_kernels._C, which is not built "
            f"({_IMPORT_ERROR}); reinstall on a machine with a CUDA torch and nvcc: "
            f"pip install -e . --no-build-isolation (see README, 'CUDA extension')")
    if x.device.type != "cuda":
        raise BackendUnavailable(f"conv1d: backend 'cuda' needs CUDA tensors, got device {x.device}")


def _seq_int32(seq_idx):
    # The kernels read int32 ids with stride 1 along T (the Triton kernel also narrows to int32).
    if seq_idx is None:
        return None
    if seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)
    return seq_idx if seq_idx.stride(1) == 1 else seq_idx.contiguous()


def cuda_causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu: bool, return_final_states: bool):
    """As ``conv1d.causal_conv1d_fwd``: returns ``(y, final_states)``, final_states empty unless asked."""
    _require(x)
    B, D, _ = x.shape
    W = weight.shape[1]
    y = alloc.empty_like(x)
    final = alloc.empty((B, D, W - 1) if return_final_states else (0,), dtype=x.dtype, device=x.device)
    _C.causal_conv1d_fwd(x, weight, bias, _seq_int32(seq_idx), initial_states, y,
                         final if return_final_states else None, bool(silu))
    return y, final


def cuda_causal_conv1d_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu: bool):
    """As ``conv1d.causal_conv1d_bwd``: returns ``(dx, dweight, dbias or None, dinitial_states or None)``."""
    _require(x)
    B, D, _ = x.shape
    W = weight.shape[1]
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    dx = alloc.empty_like(x)
    # One fp32 partial row per block, summed here: deterministic, no float atomics in the kernel.
    parts = _C.causal_conv1d_bwd_partials(x, weight)
    dw_part = alloc.empty((parts, D, W), dtype=torch.float32, device=x.device)
    db_part = alloc.empty((parts, D), dtype=torch.float32, device=x.device) if bias is not None else None
    dinit = (alloc.empty((B, D, W - 1), dtype=initial_states.dtype, device=x.device)
             if initial_states is not None else None)
    _C.causal_conv1d_bwd(dy, dfinal, x, weight, bias, _seq_int32(seq_idx), initial_states, dx,
                         dw_part, db_part, dinit, bool(silu))
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinit


def cuda_causal_conv1d_update(x, conv_state, weight, bias, silu: bool):
    """As ``conv1d.causal_conv1d_update_fwd``: x ``[B, D, L]``; conv_state ``[B, D, S]`` updated in place."""
    _require(x)
    y = alloc.empty_like(x)
    _C.causal_conv1d_update(x, conv_state, weight, bias, y, bool(silu))
    return y


def source_hash() -> str:
    """The hash of the CUDA sources the extension was built from (``none`` without the extension)."""
    return _C.source_hash() if _C is not None else "none"
