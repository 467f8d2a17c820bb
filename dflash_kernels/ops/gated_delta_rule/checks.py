"""Argument checks of the gated delta rule's public functions (both take the same arguments)."""

import torch

from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["MAX_HEAD_DIM", "check_gdn_inputs"]

MAX_HEAD_DIM = 256


def check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Raise TypeError/ValueError naming the argument; returns (N, scale)."""
    check_tensor("q", q, 4, FLOAT_DTYPES)
    check_tensor("k", k, 4, FLOAT_DTYPES)
    check_tensor("v", v, 4, FLOAT_DTYPES)
    check_tensor("g", g, 3, FLOAT_DTYPES)
    check_tensor("beta", beta, 3, FLOAT_DTYPES)
    check_tensor("initial_state", initial_state, 4, FLOAT_DTYPES, optional=True)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: dtypes must match q's {q.dtype}, got k {k.dtype} and v {v.dtype}")
    B, T, Hk, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)} [B, T, Hk, K], got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected [B={B}, T={T}, Hv, V], got shape {tuple(v.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    if Hv % Hk != 0:
        raise ValueError(f"v: its head count Hv={Hv} must be a multiple of q/k's Hk={Hk}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"{name}: expected shape [B, T, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}")
    if T == 0:
        raise ValueError(f"q: T must be at least 1, got shape {tuple(q.shape)}")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"q, v: head dims K={K}, V={V}: at most {MAX_HEAD_DIM} supported")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a LongTensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int64, torch.int32) or cu_seqlens.numel() < 2:
            raise TypeError(f"cu_seqlens: expected a 1-D integer tensor [N+1], got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"q: with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != T or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens: must rise from 0 to T={T} without decreasing, got {bounds}")
        N = len(bounds) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, Hv, K, V):
        raise ValueError(f"initial_state: expected shape [N, Hv, K, V] = {(N, Hv, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    return N, float(scale)
