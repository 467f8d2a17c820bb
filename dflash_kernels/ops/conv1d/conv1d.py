"""Causal depthwise conv1d: host launchers, custom ops with autograd, and the public functionals.

Three tiers, as everywhere in the library:
- launchers (``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` / ``causal_conv1d_update_fwd``): allocate,
  build the grid, launch through the runtime; no autograd;
- ``torch.library.custom_op`` wrappers with fake implementations and registered autograd, so the op
  runs inside a user's ``torch.compile`` without a graph break and under checkpoint;
- the public functionals, which validate arguments and pick the backend.
"""

from typing import Optional, Tuple

import torch
import triton

from dflash_kernels.ops.conv1d import cuda as _cuda  # the CUDA extension path (issue 5)
from dflash_kernels.ops.conv1d.kernels import (
    causal_conv1d_bwd_kernel,
    causal_conv1d_fwd_kernel,
    causal_conv1d_update_kernel,
)
from dflash_kernels.runtime import Config, TritonKernel, alloc, backends
from dflash_kernels.runtime.autograd import differentiable_op
from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor
from dflash_kernels.runtime.precompile import register_precompile

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_fwd", "causal_conv1d_bwd"]

OP = "conv1d"
backends.register_op(OP, peers={"causal_conv1d": "causal_conv1d"}, extra={"cuda": _cuda.available})

_ACTIVATIONS = (None, "silu", "swish")
_SEQ_DTYPES = (torch.int32, torch.int64)
_BWD_CHUNK, _BWD_CHUNK_MIN = 1024, 256  # powers of two, multiples of every config's BT

_fwd = TritonKernel(
    causal_conv1d_fwd_kernel, name="causal_conv1d_fwd",
    configs=[Config(BD=bd, BT=bt, num_warps=nw) for bd, bt, nw in
             [(16, 256, 4), (8, 512, 4), (32, 128, 4), (16, 512, 8), (64, 64, 4), (128, 32, 4), (64, 128, 8),
              (16, 128, 4), (8, 256, 4), (8, 128, 4), (16, 256, 8)]],
    interpret_config=Config(BD=16, BT=32),
)
# Backward: 16 elements per thread (BD * BT / threads) keep the kernel's registers low (sm_90: 80 with
# bf16, channel-first) with no spills; two 8-per-thread candidates trade work per thread for occupancy.
_bwd = TritonKernel(
    causal_conv1d_bwd_kernel, name="causal_conv1d_bwd",
    configs=[Config(BD=bd, BT=bt, num_warps=nw) for bd, bt, nw in
             [(16, 128, 4), (8, 256, 4), (32, 64, 4), (64, 32, 4), (32, 128, 8), (16, 256, 8),
              (8, 128, 4), (32, 32, 4)]],
    interpret_config=Config(BD=16, BT=32),
)
_update = TritonKernel(
    causal_conv1d_update_kernel, name="causal_conv1d_update",
    configs=[Config(BD=bd, num_warps=nw) for bd, nw in [(64, 2), (128, 4), (256, 4)]],
    interpret_config=Config(BD=16),
    restore=("state_ptr",),
)


def _bucket(n: int, cap: int) -> int:
    return triton.next_power_of_2(min(max(n, 1), cap))


def _is_channel_last(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.stride(2) != 1


def _with_unit_stride(t: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """``t`` ``[B, D, T]`` laid out densely, channel-last (a ``[B, T, D]`` view) or channel-first;
    copied only when it is not. Dense matters as much as the unit stride: the Triton launchers
    allocate outputs with ``empty_like`` and write them with the input's strides."""
    if channel_last:
        return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


# ---------------------------------------------------------------------------------------- launchers
# Backend "cuda" runs the CUDA extension's launchers (ops/conv1d/cuda.py, same signatures); under
# "auto" on a CUDA input with the extension built, the faster of the two per shape bucket runs.
def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu: bool, return_final_states: bool):
    """Forward on the chosen implementation; see ``_triton_fwd`` for the arguments and returns."""
    return _cuda.dispatch("fwd", backends.get_backend(OP), _triton_fwd, _cuda.cuda_causal_conv1d_fwd,
                          (x, weight, bias, seq_idx, initial_states, silu, return_final_states))


def causal_conv1d_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu: bool):
    """Backward on the chosen implementation; see ``_triton_bwd``."""
    return _cuda.dispatch("bwd", backends.get_backend(OP), _triton_bwd, _cuda.cuda_causal_conv1d_bwd,
                          (dy, dfinal, x, weight, bias, seq_idx, initial_states, silu))


def causal_conv1d_update_fwd(x, conv_state, weight, bias, silu: bool):
    """Decode step on the chosen implementation; see ``_triton_update``."""
    return _cuda.dispatch("update", backends.get_backend(OP), _triton_update, _cuda.cuda_causal_conv1d_update,
                          (x, conv_state, weight, bias, silu))


def _aligned(channel_last: bool, *tensors) -> bool:
    """The kernels' ALIGNED flag: along the unit stride every tile row starts 16-byte aligned and the
    length is a multiple of 16 (T for channel-first, D for channel-last), so accesses vectorize."""
    for t in tensors:
        _, D, T = t.shape
        along = (D, t.stride(0), t.stride(2)) if channel_last else (T, t.stride(0), t.stride(1))
        if any(v % 16 for v in along) or t.data_ptr() % 16:
            return False
    return True


def _triton_fwd(x, weight, bias, seq_idx, initial_states, silu: bool, return_final_states: bool):
    """Launch the forward. x ``[B, D, T]`` with unit stride along T or D; weight contiguous ``[D, W]``.

    Returns ``(y, final_states)``; y has x's strides; final_states is ``[B, D, W-1]`` or empty.
    """
    B, D, T = x.shape
    W = weight.shape[1]
    channel_last = _is_channel_last(x)
    y = alloc.empty_like(x)
    final = alloc.empty((B, D, W - 1) if return_final_states else (0,), dtype=x.dtype, device=x.device)
    init = initial_states if initial_states is not None else x
    seq = seq_idx if seq_idx is not None else x
    _fwd(lambda m: (triton.cdiv(T, m["BT"]), triton.cdiv(D, m["BD"]), B),
         x, weight, bias if bias is not None else weight, seq, init, y, final if return_final_states else y,
         T, D, x.stride(0), x.stride(1), x.stride(2),
         init.stride(0), init.stride(1), init.stride(2), seq.stride(0),
         final.stride(0) if return_final_states else 0,
         final.stride(1) if return_final_states else 0,
         final.stride(2) if return_final_states else 0,
         bucket=(_bucket(T, 1 << 16), _bucket(B * D, 1 << 20)),
         W=W, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, HAS_INIT=initial_states is not None,
         HAS_FINAL=return_final_states, ACT=silu, CHANNEL_LAST=channel_last, ALIGNED=_aligned(channel_last, x))
    return y, final


def _triton_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu: bool):
    """Launch the backward. Returns ``(dx, dweight, dbias or None, dinitial_states or None)``."""
    B, D, T = x.shape
    W = weight.shape[1]
    channel_last = _is_channel_last(x)
    dy = _with_unit_stride(dy, channel_last)
    dx = alloc.empty_like(x)
    init = initial_states if initial_states is not None else x
    seq = seq_idx if seq_idx is not None else x
    df = dfinal if dfinal is not None else x

    # Partial dweight/dbias rows, one per chunk of times (a multiple of every config's BT),
    # so the buffer's size does not depend on which config the tuner picks.
    chunk = max(_BWD_CHUNK_MIN, min(_BWD_CHUNK, triton.next_power_of_2(T)))
    n_chunks = triton.cdiv(T, chunk)
    dw_part = alloc.empty((B * n_chunks, D, W), device=x.device, dtype=torch.float32)
    db_part = alloc.empty((B * n_chunks, D), device=x.device, dtype=torch.float32) if bias is not None else dw_part
    dinit = alloc.empty((B, D, W - 1), device=x.device, dtype=init.dtype) if initial_states is not None else dw_part
    _bwd(lambda m: (n_chunks, triton.cdiv(D, m["BD"]), B), x, weight, bias if bias is not None else weight,
         seq, init, dy, df, dx, dw_part, db_part, dinit,
         T, D, n_chunks, chunk, x.stride(0), x.stride(1), x.stride(2),
         init.stride(0), init.stride(1), init.stride(2), seq.stride(0),
         df.stride(0), df.stride(1), df.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
         bucket=(_bucket(T, 1 << 16), _bucket(B * D, 1 << 20)),
         W=W, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, HAS_INIT=initial_states is not None,
         HAS_DFINAL=dfinal is not None, ACT=silu, CHANNEL_LAST=channel_last,
         ALIGNED=_aligned(channel_last, x, dy))
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, (dinit if initial_states is not None else None)


def _triton_update(x, conv_state, weight, bias, silu: bool):
    """Launch the decode step: x ``[B, D, L]``, conv_state ``[B, D, S]`` updated in place."""
    B, D, L = x.shape
    S = conv_state.shape[2]
    W = weight.shape[1]
    y = alloc.empty_like(x)
    _update(lambda m: (triton.cdiv(D, m["BD"]), B),
            x, conv_state, weight, bias if bias is not None else weight, y,
            L, D, S, x.stride(0), x.stride(1), x.stride(2),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            y.stride(0), y.stride(1), y.stride(2),
            bucket=(_bucket(B * D, 1 << 20),), W=W, HAS_BIAS=bias is not None, ACT=silu)
    return y


# ------------------------------------------------------------------------------------- custom ops
def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor],
              initial_states: Optional[torch.Tensor], silu: bool,
              return_final_states: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu, return_final_states)


_fwd_op = torch.library.custom_op("dflash_kernels::causal_conv1d_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(x, weight, bias, seq_idx, initial_states, silu, return_final_states):
    B, D, _ = x.shape
    W = weight.shape[1]
    return torch.empty_like(x), x.new_empty((B, D, W - 1) if return_final_states else (0,))


@torch.library.custom_op("dflash_kernels::causal_conv1d_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, dfinal: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
            bias: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], initial_states: Optional[torch.Tensor],
            silu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, dbias, dinit = causal_conv1d_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu)
    # A custom op returns tensors only (and no two the same): absent gradients travel as empty tensors.
    return (dx, dweight, dbias if dbias is not None else x.new_empty((0,)),
            dinit if dinit is not None else x.new_empty((0,)))


@_bwd_op.register_fake
def _(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu):
    return (torch.empty_like(x), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty((0,)),
            torch.empty_like(initial_states) if initial_states is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, silu, return_final_states = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.silu = silu
    ctx.return_final_states = return_final_states


def _backward(ctx, dy, dfinal):
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    if not ctx.return_final_states:
        dfinal = None
    dx, dweight, dbias, dinit = _bwd_op(dy, dfinal, x, weight, bias, seq_idx, initial_states, ctx.silu)
    return (dx, dweight, dbias if bias is not None else None, None,
            dinit if initial_states is not None else None, None, None)


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_fwd_differentiable = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


@torch.library.custom_op("dflash_kernels::causal_conv1d_update", mutates_args=("conv_state",))
def _update_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               silu: bool) -> torch.Tensor:
    return causal_conv1d_update_fwd(x, conv_state, weight, bias, silu)


@_update_op.register_fake
def _(x, conv_state, weight, bias, silu):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------ public API
def _check_activation(activation):
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


def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None, initial_states=None,
                  return_final_states=False):
    """Causal depthwise conv1d, a drop-in for causal-conv1d's ``causal_conv1d_fn``.

    Args:
        x: ``[B, D, T]``; channel-first (contiguous) or a channel-last view of a ``[B, T, D]`` tensor.
        weight: ``[D, W]``, W in 2..4.
        bias: ``[D]`` or None.
        activation: None, ``"silu"`` or ``"swish"`` (the same).
        seq_idx: ``[B, T]`` int32/int64 sequence ids of packed sequences; a time only sees earlier
            times of its own sequence. Times before 0 (the initial state) belong to the sequence of t = 0.
        initial_states: ``[B, D, W-1]``, the W-1 inputs before t = 0 (zeros when None).
        return_final_states: also return the last W-1 inputs ``[B, D, W-1]``, the next call's state.

    Returns:
        y ``[B, D, T]`` in x's dtype and layout, or ``(y, final_states)``. Differentiable in x,
        weight, bias and initial_states.
    """
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

    backend = backends.resolve(OP, x.device)
    if backend == "reference":
        from dflash_kernels.ops.conv1d.naive import causal_conv1d_ref
        return causal_conv1d_ref(x, weight, bias, activation, seq_idx, initial_states, return_final_states)
    if backend == "causal_conv1d":
        from causal_conv1d import causal_conv1d_fn
        return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, initial_states=initial_states,
                                return_final_states=return_final_states, activation=activation)
    x = _with_unit_stride(x, _is_channel_last(x))
    y, final = _fwd_differentiable(x, weight.contiguous(), bias.contiguous() if bias is not None else None,
                       seq_idx.contiguous() if seq_idx is not None else None, initial_states,
                       silu, bool(return_final_states))
    return (y, final) if return_final_states else y


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """One decode step (or L steps) against a rolling state, a drop-in for ``causal_conv1d_update``.

    Args:
        x: ``[B, D]`` or ``[B, D, L]`` new inputs.
        conv_state: ``[B, D, S]`` with S >= W-1: the last S inputs; updated in place (shifted by L).
        weight: ``[D, W]``; bias: ``[D]`` or None; activation: None, ``"silu"`` or ``"swish"``.

    Returns:
        y with x's shape and dtype.
    """
    check_tensor("x", x, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    B, D, _ = x3.shape
    _check_weight(weight, bias, D)
    silu = _check_activation(activation)
    check_tensor("conv_state", conv_state, ndim=3, dtypes=FLOAT_DTYPES)
    W = weight.shape[1]
    if conv_state.shape[0] != B or conv_state.shape[1] != D or conv_state.shape[2] < W - 1:
        raise ValueError(f"conv_state: expected shape [B={B}, D={D}, S>={W - 1}], got {tuple(conv_state.shape)}")
    check_same_device(x=x, conv_state=conv_state, weight=weight, bias=bias)
    backend = backends.resolve(OP, x.device)
    if backend == "reference":
        from dflash_kernels.ops.conv1d.naive import causal_conv1d_update_ref
        return causal_conv1d_update_ref(x, conv_state, weight, bias, activation)
    if backend == "causal_conv1d":
        from causal_conv1d import causal_conv1d_update as peer_update
        return peer_update(x, conv_state, weight, bias, activation)
    y = _update_op(x3, conv_state, weight.contiguous(), bias.contiguous() if bias is not None else None, silu)
    return y.squeeze(-1) if squeeze else y


# ------------------------------------------------------------------------------------- precompile
@register_precompile(OP)
def _precompile(shape, dtype, device, backward):
    """shape: ``B, D, T, W`` and optionally ``activation`` ('silu'), ``bias`` (True), ``channel_last`` (False).

    The kernels specialize on the layout's alignment (ALIGNED: T a multiple of 16 for channel-first
    input), so a length of the other class in the same bucket is run too: strict mode then covers
    the whole bucket."""
    T = shape["T"]
    other_T = T - 1 if T % 16 == 0 else -(-T // 16) * 16
    _run_once(shape, dtype, device, backward)
    if other_T >= 2 and _bucket(other_T, 1 << 16) == _bucket(T, 1 << 16):
        _run_once({**shape, "T": other_T}, dtype, device, backward)


def _run_once(shape, dtype, device, backward):
    B, D, T, W = shape["B"], shape["D"], shape["T"], shape.get("W", 4)
    if shape.get("channel_last", False):
        x = torch.randn(B, T, D, device=device, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(B, D, T, device=device, dtype=dtype)
    x.requires_grad_(backward)
    weight = torch.randn(D, W, device=device, dtype=dtype, requires_grad=backward)
    bias = torch.randn(D, device=device, dtype=dtype, requires_grad=backward) if shape.get("bias", True) else None
    y = causal_conv1d(x, weight, bias, activation=shape.get("activation", "silu"))
    if backward:
        y.sum().backward()
