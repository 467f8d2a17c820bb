"""Argument checks of the gated delta rule's public functions (both take the same arguments)."""

import math
import warnings

import torch

from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["MAX_HEAD_DIM", "check_gdn_inputs", "check_kernel_grid", "pop_fla_kwargs"]

MAX_HEAD_DIM = 256
# Token positions inside a sequence, cu_seqlens' values (int32 on the device) and the chunk loop run in
# int32 (row offsets are int64): T plus one 64-token chunk past the end must be int32 values.
MAX_TOKENS = 2**31 - 1 - 64
MAX_GRID_Y = 65535  # programs on a CUDA grid's second axis: sequences x value heads there
_INT_DTYPES = (torch.int64, torch.int32)


def pop_fla_kwargs(function: str, kwargs: dict, state_v_first: bool, recurrent: bool):
    """The keywords fla's function takes through ``**kwargs`` besides those named in the signature;
    returns (state_v_first, chunk_size). Any other keyword raises TypeError naming it (nothing is
    swallowed).

    - ``transpose_state_layout``: fla's deprecated name of ``state_v_first`` (a DeprecationWarning, as fla);
    - ``chunk_size`` (chunked only): 16, 32 or 64 accepted, as fla; the kernels' chunk is 64 whatever is
      asked (the result is the same recurrence);
    - ``gk``, ``gv`` (recurrent only): fla's per-key / per-value decays, accepted only as None.
    """
    chunk_size = 64
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("transpose_state_layout: cannot be passed with state_v_first (it is its deprecated name)")
        warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first", DeprecationWarning,
                      stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if not recurrent and "chunk_size" in kwargs:
        chunk_size = kwargs.pop("chunk_size")
        if chunk_size not in (16, 32, 64):
            raise ValueError(f"chunk_size: must be 16, 32 or 64 for the gated delta rule, got {chunk_size!r}")
    if recurrent:
        for name in ("gk", "gv"):
            if name in kwargs:
                if kwargs[name] is not None:
                    raise TypeError(f"{name}: fla's per-{'key' if name == 'gk' else 'value'} decay is not "
                                    f"supported by dflash_kernels' gated delta rule (one scalar gate g per head)")
                kwargs.pop(name)
    if kwargs:
        raise TypeError(f"{function}() got unexpected keyword argument(s): {', '.join(sorted(kwargs))}")
    return state_v_first, chunk_size


def check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, *, cu_seqlens_cpu=None, chunk_indices=None,
                     use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, state_v_first=False, cp_context=None):
    """Raise TypeError/ValueError naming the argument; returns (N, scale).

    q, k and v may differ in dtype (fla's kernels take fp32 q/k with bf16 v): the callers compute in
    their promoted dtype. The values of cu_seqlens are checked on the host from ``cu_seqlens_cpu`` when
    given, else from cu_seqlens (a device-to-host copy) unless ``chunk_indices`` is given: precomputed
    metadata is there to avoid that synchronization, so then they are trusted.
    """
    if cp_context is not None:
        raise NotImplementedError("cp_context: context parallelism (fla's FLACPContext) is not supported by "
                                  "dflash_kernels' gated delta rule; pass cp_context=None, or run fla's "
                                  "function for context-parallel training")
    check_tensor("q", q, 4, FLOAT_DTYPES)
    check_tensor("k", k, 4, FLOAT_DTYPES)
    check_tensor("v", v, 4, FLOAT_DTYPES)
    check_tensor("g", g, 3, FLOAT_DTYPES)
    check_tensor("beta", beta, 3, FLOAT_DTYPES)
    check_tensor("initial_state", initial_state, 4, FLOAT_DTYPES, optional=True)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: must be given when use_gate_in_kernel=True (g is then the raw gate)")
        check_tensor("A_log", A_log, None, FLOAT_DTYPES)
        check_tensor("dt_bias", dt_bias, None, FLOAT_DTYPES, optional=True)
    else:
        A_log = dt_bias = None  # ignored without use_gate_in_kernel, as fla does
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: True requires use_beta_sigmoid_in_kernel=True "
                         "(beta = 2 * sigmoid(logits)), as in fla")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      chunk_indices=chunk_indices, A_log=A_log, dt_bias=dt_bias)
    B, T, Hk, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)} [B, T, Hk, K], got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected [B={B}, T={T}, Hv, V], got shape {tuple(v.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    if Hk == 0 or K == 0:
        raise ValueError(f"q, k: the head count Hk and head dim K must be at least 1, got shape {tuple(q.shape)}")
    if Hv == 0 or V == 0:
        raise ValueError(f"v: the head count Hv and head dim V must be at least 1, got shape {tuple(v.shape)}")
    if Hv % Hk != 0:
        raise ValueError(f"v: its head count Hv={Hv} must be a multiple of q/k's Hk={Hk}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"{name}: expected shape [B, T, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.numel() != Hv:
            raise ValueError(f"{name}: expected Hv={Hv} elements (one per value head), got shape {tuple(t.shape)}")
    if T == 0:
        raise ValueError(f"q: T must be at least 1, got shape {tuple(q.shape)}")
    if T > MAX_TOKENS:
        raise ValueError(f"q: T={T} tokens exceed the int32 positions of the gated delta rule kernels "
                         f"(at most {MAX_TOKENS}); split the sequence and pass the state along")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"q, v: head dims K={K}, V={V}: at most {MAX_HEAD_DIM} supported")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale: must be finite, got {scale}")
    N = B
    if cu_seqlens is None:
        for name, t in (("cu_seqlens_cpu", cu_seqlens_cpu), ("chunk_indices", chunk_indices)):
            if t is not None:
                raise ValueError(f"{name}: given without cu_seqlens (it describes a packed batch)")
    else:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a LongTensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _INT_DTYPES or cu_seqlens.numel() < 2:
            raise TypeError(f"cu_seqlens: expected a 1-D integer tensor [N+1], got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"q: with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        N = cu_seqlens.numel() - 1
        if cu_seqlens_cpu is not None:
            if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
                raise TypeError("cu_seqlens_cpu: expected a CPU tensor (the host copy of cu_seqlens), got "
                                f"{cu_seqlens_cpu.device if isinstance(cu_seqlens_cpu, torch.Tensor) else type(cu_seqlens_cpu).__name__}")
            if cu_seqlens_cpu.dtype not in _INT_DTYPES or tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
                raise ValueError(f"cu_seqlens_cpu: expected an integer tensor of cu_seqlens' shape "
                                 f"{tuple(cu_seqlens.shape)}, got {cu_seqlens_cpu.dtype} of shape "
                                 f"{tuple(cu_seqlens_cpu.shape)}")
        if chunk_indices is not None:
            if (not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dim() != 2
                    or chunk_indices.shape[1] != 2 or chunk_indices.dtype not in _INT_DTYPES):
                raise TypeError("chunk_indices: expected an integer tensor [chunks, 2] (fla's prepare_chunk_indices "
                                f"with chunk size 64), got {getattr(chunk_indices, 'dtype', type(chunk_indices))} "
                                f"of shape {tuple(getattr(chunk_indices, 'shape', ()))}")
        source = cu_seqlens_cpu if cu_seqlens_cpu is not None else (cu_seqlens if chunk_indices is None else None)
        if source is not None:
            bounds = source.tolist()
            if bounds[0] != 0 or bounds[-1] != T or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
                raise ValueError(f"cu_seqlens: must rise from 0 to T={T} without decreasing, got {bounds}")
            if chunk_indices is not None:
                chunks = sum((b - a + 63) // 64 for a, b in zip(bounds[:-1], bounds[1:]))
                if chunk_indices.shape[0] != chunks:
                    raise ValueError(f"chunk_indices: expected {chunks} rows (64-token chunks of cu_seqlens), "
                                     f"got {chunk_indices.shape[0]}")
    shape = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    if initial_state is not None and tuple(initial_state.shape) != shape:
        layout = "[N, Hv, V, K] (state_v_first)" if state_v_first else "[N, Hv, K, V]"
        raise ValueError(f"initial_state: expected shape {layout} = {shape}, got {tuple(initial_state.shape)}")
    return N, float(scale)


def check_kernel_grid(N, Hv, varlen):
    """The kernels' scans run one program per (V block, sequence x value head): the second count must
    fit a CUDA grid's second axis."""
    if N * Hv > MAX_GRID_Y:
        raise ValueError(f"{'cu_seqlens' if varlen else 'q'}: N * Hv = {N} sequences * {Hv} value heads exceed "
                         f"{MAX_GRID_Y}, the programs a CUDA grid's second axis holds; split the batch")
