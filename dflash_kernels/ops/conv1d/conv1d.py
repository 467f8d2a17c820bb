"""Causal depthwise conv1d: launchers, custom ops with their autograd, the public functions.

- launchers (``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` / ``causal_conv1d_update_fwd``): allocate,
  build the grid, launch; no autograd. Each runs the Triton kernels or the CUDA extension
  (``cuda.py``, same signatures): backend ``cuda`` forces the extension; ``auto`` on a CUDA input with
  the extension built runs whichever of the two was timed faster for the shape bucket
  (``runtime/choice.py``); any other backend runs Triton;
- ``torch.library.custom_op`` wrappers with fake implementations and registered autograd, so the op
  runs inside a user's ``torch.compile`` without a graph break and under checkpoint;
- the public functions: argument checks (``checks.py``), then the op's dispatch (``runtime.Op``) to
  the configured backend's implementation.
"""

from typing import Optional, Tuple

import torch

from dflash_kernels.ops.conv1d import cuda
from dflash_kernels.ops.conv1d.checks import check_conv1d_inputs, check_conv1d_update_inputs, is_channel_last
from dflash_kernels.ops.conv1d.kernels import (BWD_CHUNK, BWD_CHUNK_MIN, conv1d_bwd_kernel, conv1d_fwd_kernel,
                                               conv1d_update_kernel)
from dflash_kernels.runtime import (Choice, Op, alloc, backends, bucket, cdiv, next_pow2, register_precompile,
                                    settings)
from dflash_kernels.runtime.autograd import differentiable_op, eager_call, traced

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_fwd", "causal_conv1d_bwd",
           "causal_conv1d_update_fwd"]

OP = "conv1d"
_conv = Op(OP, peers={"causal_conv1d": "causal_conv1d"}, extra={"cuda": cuda.available})
_conv_update = _conv.function("causal_conv1d_update")

# CUDA extension or Triton, per shape bucket. Untimed (tuning off) it is Triton: the two channel-first
# forwards are about as fast, the extension's channel-last forward is several times slower, and
# forward+backward goes either way by shape (benchmarks/results/README.md); the timed
# choice finds the faster per bucket, and untimed, the path without a slow layout is the safe one.
_impl_choice = Choice("conv1d_impl", default="triton", label="conv1d CUDA-vs-Triton choice",
                      version=cuda.source_hash)


def _with_unit_stride(t: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """``t`` ``[B, D, T]`` laid out densely, channel-last (a ``[B, T, D]`` view) or channel-first;
    copied only when it is not. Dense matters as much as the unit stride: the Triton launchers
    allocate outputs with ``empty_like`` and write them with the input's strides."""
    if channel_last:
        return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu: bool, return_final_states: bool):
    """Forward on the chosen implementation; see ``_triton_fwd`` for the arguments and returns."""
    return _run("fwd", _triton_fwd, cuda.cuda_causal_conv1d_fwd,
                (x, weight, bias, seq_idx, initial_states, silu, return_final_states))


def causal_conv1d_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu: bool):
    """Backward on the chosen implementation; see ``_triton_bwd``."""
    return _run("bwd", _triton_bwd, cuda.cuda_causal_conv1d_bwd,
                (dy, dfinal, x, weight, bias, seq_idx, initial_states, silu))


def causal_conv1d_update_fwd(x, conv_state, weight, bias, silu: bool, cache_seqlens=None, conv_state_indices=None):
    """Decode step on the chosen implementation; see ``_triton_update``. The CUDA extension's update
    has no circular buffer or state gather: with ``cache_seqlens`` or ``conv_state_indices`` the
    Triton kernel runs on every backend."""
    if cache_seqlens is not None or conv_state_indices is not None:
        return _triton_update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    return _run("update", _triton_update, cuda.cuda_causal_conv1d_update, (x, conv_state, weight, bias, silu))


def _run(kind: str, run_triton, run_cuda, args: tuple):
    """Run launcher ``kind`` (``fwd`` / ``bwd`` / ``update``) with ``args`` on the implementation that
    the conv's backend setting picks (module docstring). Forced ``cuda`` without the extension is a
    clear :class:`BackendUnavailable` from the CUDA launcher, never a silent Triton run."""
    backend = backends.configured(OP)
    if backend == "cuda":
        return run_cuda(*args)
    if backend != "auto" or not cuda.available():
        return run_triton(*args)
    x = args[2] if kind == "bwd" else args[0]
    if x.device.type != "cuda" or settings.interpreting():
        return run_triton(*args)
    key = _impl_bucket(kind, args)
    impl = _impl_choice.get(x.device, key)
    if impl is None:
        # The decode step updates conv_state in place: it is timed on a scratch copy.
        trial = (args[0], args[1].clone()) + tuple(args[2:]) if kind == "update" else args
        impl = _impl_choice.choose(key, x.device, {"cuda": lambda: run_cuda(*trial),
                                                   "triton": lambda: run_triton(*trial)})
    return run_cuda(*args) if impl == "cuda" else run_triton(*args)


def _impl_bucket(kind: str, args: tuple) -> tuple:
    """The key of the CUDA-vs-Triton choice: what changes the kernels run, and the shape buckets."""
    if kind == "update":
        x, weight = args[0], args[2]
        B, D, L = x.shape
        return ("update", str(x.dtype), weight.shape[1], bucket(L, 64), bucket(B * D, 1 << 20))
    if kind == "fwd":
        x, weight, _, seq_idx, initial_states = args[:5]
    else:
        x, weight, _, seq_idx, initial_states = args[2], args[3], args[4], args[5], args[6]
    B, D, T = x.shape
    return (kind, str(x.dtype), weight.shape[1], is_channel_last(x), seq_idx is not None,
            initial_states is not None, bucket(T, 1 << 16), bucket(B * D, 1 << 20))


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
    channel_last = is_channel_last(x)
    y = alloc.empty_like(x)
    final = alloc.empty((B, D, W - 1) if return_final_states else (0,), dtype=x.dtype, device=x.device)
    init = initial_states if initial_states is not None else x
    seq = seq_idx if seq_idx is not None else x
    conv1d_fwd_kernel(lambda m: (cdiv(T, m["BT"]), cdiv(D, m["BD"]), B),
         x, weight, bias if bias is not None else weight, seq, init, y, final if return_final_states else y,
         T, D, x.stride(0), x.stride(1), x.stride(2),
         init.stride(0), init.stride(1), init.stride(2), seq.stride(0),
         final.stride(0) if return_final_states else 0,
         final.stride(1) if return_final_states else 0,
         final.stride(2) if return_final_states else 0,
         bucket=(bucket(T, 1 << 16), bucket(B * D, 1 << 20)),
         W=W, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, HAS_INIT=initial_states is not None,
         HAS_FINAL=return_final_states, ACT=silu, CHANNEL_LAST=channel_last, ALIGNED=_aligned(channel_last, x))
    return y, final


def _triton_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu: bool):
    """Launch the backward. Returns ``(dx, dweight, dbias or None, dinitial_states or None)``."""
    B, D, T = x.shape
    W = weight.shape[1]
    channel_last = is_channel_last(x)
    dy = _with_unit_stride(dy, channel_last)
    dx = alloc.empty_like(x)
    init = initial_states if initial_states is not None else x
    seq = seq_idx if seq_idx is not None else x
    df = dfinal if dfinal is not None else x

    # Partial dweight/dbias rows, one per chunk of times (kernels.py: BWD_CHUNK).
    chunk = max(BWD_CHUNK_MIN, min(BWD_CHUNK, next_pow2(T)))
    n_chunks = cdiv(T, chunk)
    dw_part = alloc.empty((B * n_chunks, D, W), device=x.device, dtype=torch.float32)
    db_part = alloc.empty((B * n_chunks, D), device=x.device, dtype=torch.float32) if bias is not None else dw_part
    dinit = alloc.empty((B, D, W - 1), device=x.device, dtype=init.dtype) if initial_states is not None else dw_part
    conv1d_bwd_kernel(lambda m: (n_chunks, cdiv(D, m["BD"]), B), x, weight, bias if bias is not None else weight,
         seq, init, dy, df, dx, dw_part, db_part, dinit,
         T, D, n_chunks, chunk, x.stride(0), x.stride(1), x.stride(2),
         init.stride(0), init.stride(1), init.stride(2), seq.stride(0),
         df.stride(0), df.stride(1), df.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
         bucket=(bucket(T, 1 << 16), bucket(B * D, 1 << 20)),
         W=W, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, HAS_INIT=initial_states is not None,
         HAS_DFINAL=dfinal is not None, ACT=silu, CHANNEL_LAST=channel_last,
         ALIGNED=_aligned(channel_last, x, dy))
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, (dinit if initial_states is not None else None)


def _triton_update(x, conv_state, weight, bias, silu: bool, cache_seqlens=None, conv_state_indices=None):
    """Launch the decode step: x ``[B, D, L]``; conv_state ``[B, D, S]`` (or a pool ``[N, D, S]``
    gathered by ``conv_state_indices`` ``[B]``) updated in place; ``cache_seqlens`` ``[B]`` makes it a
    circular buffer (``naive_causal_conv1d_update`` has the semantics)."""
    B, D, L = x.shape
    S = conv_state.shape[2]
    W = weight.shape[1]
    y = alloc.empty_like(x)
    conv1d_update_kernel(lambda m: (cdiv(D, m["BD"]), B),
            x, conv_state, weight, bias if bias is not None else weight, y,
            cache_seqlens if cache_seqlens is not None else y,
            conv_state_indices if conv_state_indices is not None else y,
            L, D, S, conv_state.shape[0], x.stride(0), x.stride(1), x.stride(2),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            y.stride(0), y.stride(1), y.stride(2),
            bucket=(bucket(B * D, 1 << 20),), W=W, HAS_BIAS=bias is not None, ACT=silu,
            CIRCULAR=cache_seqlens is not None, HAS_INDEX=conv_state_indices is not None)
    return y


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


_bwd_op_eager = eager_call(_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, dy, dfinal):
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    if not ctx.return_final_states:
        dfinal = None
    if not traced((dy, x)):
        # Eager: the launcher directly. A traced backward (torch.compile's fake / functional tensor
        # subclasses, make_fx) goes through the custom op, which the graph can hold.
        dx, dweight, dbias, dinit = causal_conv1d_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, ctx.silu)
    else:
        dx, dweight, dbias, dinit = _bwd_op_eager(dy, dfinal, x, weight, bias, seq_idx, initial_states, ctx.silu)
    return (dx, dweight, dbias if bias is not None else None, None,
            dinit if initial_states is not None else None, None, None)


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_fwd_differentiable = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


@torch.library.custom_op("dflash_kernels::causal_conv1d_update", mutates_args=("conv_state",))
def _update_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               silu: bool, cache_seqlens: Optional[torch.Tensor],
               conv_state_indices: Optional[torch.Tensor]) -> torch.Tensor:
    return causal_conv1d_update_fwd(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)


@_update_op.register_fake
def _(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    return torch.empty_like(x)


@_conv.impl("triton", "interpret", "cuda")
def _conv_kernels(x, weight, bias, activation, seq_idx, initial_states, return_final_states):
    if not x.is_contiguous():  # a dense channel-last view is kept; anything else is copied
        x = _with_unit_stride(x, is_channel_last(x))
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if seq_idx is not None and not seq_idx.is_contiguous():
        seq_idx = seq_idx.contiguous()
    args = (x, weight, bias, seq_idx, initial_states, activation is not None, bool(return_final_states))
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad) or
                                    (initial_states is not None and initial_states.requires_grad)):
        y, final = _fwd_differentiable(*args)
    elif traced(args):
        y, final = _fwd_op(*args)
    else:  # nothing to differentiate: the launcher directly, without the autograd.Function's cost
        y, final = causal_conv1d_fwd(*args)
    return (y, final) if return_final_states else y


@_conv.impl("reference")
def _conv_reference(x, weight, bias, activation, seq_idx, initial_states, return_final_states):
    from dflash_kernels.ops.conv1d.naive import naive_causal_conv1d

    return naive_causal_conv1d(x, weight, bias, activation, seq_idx, initial_states, return_final_states)


@_conv.impl("causal_conv1d")
def _conv_peer(x, weight, bias, activation, seq_idx, initial_states, return_final_states):
    from causal_conv1d import causal_conv1d_fn  # the one place the peer's conv is imported

    return causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, initial_states=initial_states,
                            return_final_states=return_final_states, activation=activation)


@_conv_update.impl("triton", "interpret", "cuda")
def _update_kernels(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices):
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    # Outside torch.compile the custom op's dispatch is skipped: the launcher directly (no autograd).
    run = _update_op if traced((x3, conv_state)) else causal_conv1d_update_fwd
    # x and the state are read at their strides; the kernel reads the others densely (row b at b).
    weight, bias, cache_seqlens, conv_state_indices = (
        t if t is None or t.is_contiguous() else t.contiguous() for t in (weight, bias, cache_seqlens,
                                                                          conv_state_indices))
    y = run(x3, conv_state, weight, bias, activation is not None, cache_seqlens, conv_state_indices)
    return y.squeeze(-1) if squeeze else y


@_conv_update.impl("reference")
def _update_reference(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices):
    from dflash_kernels.ops.conv1d.naive import naive_causal_conv1d_update

    return naive_causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)


@_conv_update.impl("causal_conv1d")
def _update_peer(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices):
    from causal_conv1d import causal_conv1d_update as peer_update

    kwargs = {}
    if cache_seqlens is not None:
        kwargs["cache_seqlens"] = cache_seqlens
    if conv_state_indices is not None:
        kwargs["conv_state_indices"] = conv_state_indices
    return peer_update(x, conv_state, weight, bias, activation, **kwargs)


def causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None, initial_states=None,
                  return_final_states=False):
    """Causal depthwise conv1d, a drop-in for causal-conv1d's ``causal_conv1d_fn``.

    Args:
        x: ``[B, D, T]``; channel-first (contiguous) or a channel-last view of a ``[B, T, D]`` tensor.
        weight: ``[D, W]``, W in 2..4; may be fp32 beside a bf16 / fp16 x (gradients in its dtype).
        bias: ``[D]`` or None.
        activation: None, ``"silu"`` or ``"swish"`` (the same).
        seq_idx: ``[B, T]`` int32/int64 sequence ids of packed sequences; a time only sees earlier
            times of its own sequence. Times before 0 (the initial state) belong to the sequence of t = 0.
            A negative id (-1) marks padding: the output there is 0 and no gradient flows to or from it.
        initial_states: ``[B, D, W-1]``, the W-1 inputs before t = 0 (zeros when None).
        return_final_states: also return the last W-1 inputs ``[B, D, W-1]``, the next call's state.

    Returns:
        y ``[B, D, T]`` in x's dtype and layout, or ``(y, final_states)``. Differentiable in x,
        weight, bias and initial_states.
    """
    check_conv1d_inputs(x, weight, bias, activation, seq_idx, initial_states)
    return _conv(x.device, x, weight, bias, activation, seq_idx, initial_states, return_final_states)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """One decode step (or L steps) against a rolling state, a drop-in for causal-conv1d's
    ``causal_conv1d_update``.

    Args:
        x: ``[B, D]`` or ``[B, D, L]`` new inputs (channel-last views accepted).
        conv_state: ``[B, D, S]`` with S >= W-1, updated in place; with ``conv_state_indices`` a pool
            ``[N, D, S]``. Without ``cache_seqlens`` it holds the last S inputs and is shifted by L.
            Must not overlap itself (no stride-0 / expanded views).
        weight: ``[D, W]``; bias: ``[D]`` or None; activation: None, ``"silu"`` or ``"swish"``.
        cache_seqlens: ``[B]`` int32/int64 or None: ``conv_state`` is a circular buffer, not shifted;
            the L new inputs are written at ``(cache_seqlens + l) % S`` and the W-1 inputs before them
            read at ``(cache_seqlens - (W-1) + j) % S``.
        conv_state_indices: ``[B]`` int32/int64 or None: row b uses ``conv_state[conv_state_indices[b]]``;
            a negative index marks a padding row (output 0, no state read or written). Indices must
            be distinct; an index >= N is treated like a negative one.

    Returns:
        y with x's shape and dtype.
    """
    check_conv1d_update_inputs(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
    return _conv_update(x.device, x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)


@register_precompile(OP)
def _precompile(shape, dtype, device, backward):
    """shape: ``B, D, T, W`` and optionally ``activation`` ('silu'), ``bias`` (True), ``channel_last`` (False).

    The kernels specialize on the layout's alignment (ALIGNED: T a multiple of 16 for channel-first
    input), so a length of the other class in the same bucket is run too: strict mode then covers
    the whole bucket."""
    T = shape["T"]
    other_T = T - 1 if T % 16 == 0 else -(-T // 16) * 16
    _run_once(shape, dtype, device, backward)
    if other_T >= 2 and bucket(other_T, 1 << 16) == bucket(T, 1 << 16):
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
