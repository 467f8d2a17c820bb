"""Argument checks of the causal conv1d's public functions, and the layout test every launcher shares."""

import torch

from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["check_conv1d_inputs", "check_conv1d_update_inputs", "is_channel_last"]

_ACTIVATIONS = (None, "silu", "swish")
_SEQ_DTYPES = (torch.int32, torch.int64)


def is_channel_last(x: torch.Tensor) -> bool:
    """``x`` ``[B, D, T]`` is a channel-last view (unit stride along D) rather than channel-first."""
    return x.stride(1) == 1 and x.stride(2) != 1


def _check_activation(activation) -> bool:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    return activation is not None


def _check_weight(weight, bias, D):
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    if weight.shape[0] != D:
        raise ValueError(f"weight: expected shape [D={D}, W], got {tuple(weight.shape)}")
    if not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight: width W={weight.shape[1]} is not supported; W must be 2, 3 or 4")
    check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, optional=True)
    if bias is not None and bias.shape[0] != D:
        raise ValueError(f"bias: expected shape [D={D}], got {tuple(bias.shape)}")


def check_conv1d_inputs(x, weight, bias, activation, seq_idx, initial_states) -> bool:
    """Raise TypeError/ValueError naming the argument; returns whether the SiLU activation is on."""
    # The common valid call in a few cheap tests (this runs on every call); anything else, or any
    # doubt, takes the full checks below, which name the argument at fault.
    if (seq_idx is None and initial_states is None and isinstance(x, torch.Tensor)
            and isinstance(weight, torch.Tensor) and (activation is None or activation == "silu")):
        xs, ws = x.shape, weight.shape
        if (len(xs) == 3 and len(ws) == 2 and ws[0] == xs[1] and 2 <= ws[1] <= 4 and xs[2] > 0
                and 0 < xs[1] * xs[2] < _INT32 and xs[0] <= _MAX_GRID
                and x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES):
            dev = x.device
            if weight.device == dev and (bias is None or (
                    isinstance(bias, torch.Tensor) and bias.shape == ws[:1] and bias.dtype in FLOAT_DTYPES
                    and bias.device == dev)):
                return activation is not None
    return _check_conv1d_inputs_all(x, weight, bias, activation, seq_idx, initial_states)


def _check_conv1d_inputs_all(x, weight, bias, activation, seq_idx, initial_states) -> bool:
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    B, D, T = x.shape
    _check_weight(weight, bias, D)
    silu = _check_activation(activation)
    check_tensor("seq_idx", seq_idx, ndim=2, dtypes=_SEQ_DTYPES, optional=True)
    if seq_idx is not None and tuple(seq_idx.shape) != (B, T):
        raise ValueError(f"seq_idx: expected shape [B={B}, T={T}], got {tuple(seq_idx.shape)}")
    check_tensor("initial_states", initial_states, ndim=3, dtypes=FLOAT_DTYPES, optional=True)
    W = weight.shape[1]
    if initial_states is not None and tuple(initial_states.shape) != (B, D, W - 1):
        raise ValueError(f"initial_states: expected shape [B={B}, D={D}, W-1={W - 1}], "
                         f"got {tuple(initial_states.shape)}")
    check_same_device(x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states)
    if T == 0:
        raise ValueError(f"x: the time dimension is empty, shape {tuple(x.shape)}")
    _check_sizes(B, D, T)
    return silu


# The kernels index within one batch row in int32 (d * stride + t * stride < D * T) and put the batch
# on a grid axis that CUDA caps at 65535 programs.
_INT32 = 2 ** 31
_MAX_GRID = 65535


def _check_sizes(B, D, T):
    if D == 0:
        raise ValueError(f"x: the channel dimension D is empty, shape [B={B}, D=0, T={T}]")
    if D * T >= _INT32:
        raise ValueError(f"x: D * T = {D * T} elements per batch row overflow the kernels' int32 offsets "
                         f"(at most {_INT32 - 1}); split the channels or the sequence")
    if B > _MAX_GRID:
        raise ValueError(f"x: batch size B={B} exceeds the kernels' grid limit of {_MAX_GRID}; split the batch")


def _check_index_vector(name, t, B):
    check_tensor(name, t, ndim=1, dtypes=_SEQ_DTYPES, optional=True)
    if t is not None and t.shape[0] != B:
        raise ValueError(f"{name}: expected shape [B={B}], got {tuple(t.shape)}")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a stride-0 / expanded or overlapping view).

    Sufficient for every layout a permutation of a dense or sliced tensor has: along the dimensions
    of size > 1, sorted by stride, each stride must reach past the previous dimension's extent."""
    if t.is_contiguous():
        return False
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return True
        extent = st * n
    return False


def check_conv1d_update_inputs(x, conv_state, weight, bias, activation, cache_seqlens=None,
                               conv_state_indices=None) -> bool:
    """Raise TypeError/ValueError naming the argument; returns whether the SiLU activation is on."""
    check_tensor("x", x, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    B, D = x.shape[:2]
    _check_weight(weight, bias, D)
    silu = _check_activation(activation)
    check_tensor("conv_state", conv_state, ndim=3, dtypes=FLOAT_DTYPES)
    W = weight.shape[1]
    pool = conv_state_indices is not None
    if (not pool and conv_state.shape[0] != B) or conv_state.shape[1] != D or conv_state.shape[2] < W - 1:
        rows = "N (the pool)" if pool else f"B={B}"
        raise ValueError(f"conv_state: expected shape [{rows}, D={D}, S>={W - 1}], got {tuple(conv_state.shape)}")
    if _overlaps_itself(conv_state):
        raise ValueError(f"conv_state: updated in place, so its elements must not share memory; got a view "
                         f"with shape {tuple(conv_state.shape)} and strides {conv_state.stride()} "
                         f"(expanded or overlapping): pass a tensor of its own, e.g. conv_state.clone()")
    _check_sizes(B, D, x.shape[2] if x.dim() == 3 else 1)
    _check_index_vector("cache_seqlens", cache_seqlens, B)
    _check_index_vector("conv_state_indices", conv_state_indices, B)
    check_same_device(x=x, conv_state=conv_state, weight=weight, bias=bias, cache_seqlens=cache_seqlens,
                      conv_state_indices=conv_state_indices)
    return silu
