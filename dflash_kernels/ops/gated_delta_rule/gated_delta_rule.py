"""Gated delta rule: launchers, custom ops with their autograd, the public functions.

- chunked scan (training, prefill): the launchers ``chunk_gated_delta_rule_fwd`` / ``_bwd`` (allocate,
  grid, launch the kernels of ``kernels_fwd.py``, ``kernels_fwd_fused.py``, ``kernels_bwd.py`` and
  ``kernels_l2norm.py``), the custom ops ``dflash_kernels::gdn_chunk_fwd`` / ``gdn_chunk_bwd`` (fake +
  autograd) and ``chunk_gated_delta_rule``;
- token by token (decoding, forward only): the custom op ``dflash_kernels::gdn_recurrent_fwd`` over
  ``kernels_recurrent.py`` and ``fused_recurrent_gated_delta_rule``.

Both public functions take fla's signature, check their arguments (``checks.py``) and dispatch through
the op's backends (``runtime.Op``): the kernels, the fp32 recurrence of ``naive.py``, or fla.
"""

from typing import Optional

import torch

from dflash_kernels.ops.gated_delta_rule.checks import check_gdn_inputs, check_kernel_grid, pop_fla_kwargs
from dflash_kernels.ops.gated_delta_rule.kernels_bwd import (gdn_bwd_group_kernel, gdn_bwd_local_kernel,
                                                             gdn_bwd_onepass_kernel, gdn_bwd_state_kernel)
from dflash_kernels.ops.gated_delta_rule.kernels_fwd import (gdn_fwd_output_kernel, gdn_fwd_scan_kernel,
                                                             gdn_fwd_scan_states_kernel, gdn_fwd_solve_kernel,
                                                             gdn_fwd_wu_kernel, gdn_fwd_wu_narrow_kernel)
from dflash_kernels.ops.gated_delta_rule.kernels_fwd_fused import gdn_fwd_prepare_kernel
from dflash_kernels.ops.gated_delta_rule.kernels_gluon_sm90_fwd import gdn_fwd_gluon_sm90, gluon_forward_supports
from dflash_kernels.ops.gated_delta_rule.kernels_l2norm import gdn_l2norm_bwd_kernel, gdn_l2norm_fwd_kernel
from dflash_kernels.ops.gated_delta_rule.kernels_recurrent import gdn_recurrent_fwd_kernel
from dflash_kernels.runtime import Op, alloc, bucket, cdiv, next_pow2, register_precompile, settings
from dflash_kernels.runtime.autograd import differentiable_op, eager_call
from dflash_kernels.runtime.devices import device_index, sm_count

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule_fwd",
           "chunk_gated_delta_rule_bwd"]

OP = "gdn"
BT = 64  # chunk length: fixed, the per-chunk buffers (states, A) are laid out by it
L2NORM_EPS = 1e-6

_gdn = Op(OP, peers={"fla": "fla.ops.gated_delta_rule"})
_gdn_recurrent = _gdn.function("fused_recurrent_gated_delta_rule")


def _block(n: int) -> int:
    return max(16, next_pow2(n))


def _varlen_layout(cu_seqlens, B, T, device, cu_seqlens_cpu=None, chunk_indices=None):
    """(N, total chunks, cu_seqlens int32, chunk_indices [chunks, 2], chunk_offsets [N+1] int32).

    Built once per forward and kept for the backward. From fla's precomputed metadata when given:
    ``chunk_indices`` (64-token chunks) needs nothing from the host, and the chunk offsets are derived on
    the device; ``cu_seqlens_cpu`` builds the indices on the host from the host copy. Only with neither
    is cu_seqlens copied to the host (a synchronization, as fla's prepare_chunk_indices).
    """
    if cu_seqlens is None:
        return B, B * cdiv(T, BT), None, None, None
    cu = cu_seqlens.to(torch.int32).contiguous()  # the kernels read it densely: an int32 view is copied too
    if chunk_indices is not None:
        counts = (cu[1:] - cu[:-1] + (BT - 1)) // BT
        offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        return cu.numel() - 1, chunk_indices.shape[0], cu, chunk_indices.contiguous(), offsets
    bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).to("cpu", torch.int64)
    counts = (bounds[1:] - bounds[:-1] + BT - 1) // BT
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    n_chunks = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    within = torch.arange(n_chunks) - offsets[:-1].repeat_interleave(counts)
    indices = torch.stack([seq, within], 1).to(device=device, dtype=torch.int32)
    return len(counts), n_chunks, cu, indices, offsets.to(device=device, dtype=torch.int32)


def _layout(B, T, cu, indices, offsets):
    """The layout tuple of ``_varlen_layout`` from the tensors the custom ops carry."""
    if cu is None:
        return B, B * cdiv(T, BT), None, None, None
    return cu.numel() - 1, indices.shape[0], cu, indices, offsets


def _opt(t):
    """An absent optional output of a custom op travels as an empty tensor; None for the kernels."""
    return None if t is None or t.numel() == 0 else t


def row_stride(t: torch.Tensor) -> Optional[int]:
    """The stride between the tokens of ``t [B, T, H, D]`` when its heads and features are dense
    (``[H, D]`` contiguous) and its tokens evenly spaced (``B`` rows of ``T`` at one stride), as a view
    ``[..., i:j]`` of a wider ``[B, T, W]`` projection is; else None (the launchers then copy it)."""
    B, T, H, D = t.shape
    if t.stride(3) != 1 and D > 1 or t.stride(2) != D and H > 1:
        return None
    st = t.stride(1) if T > 1 else H * D
    if B > 1 and t.stride(0) != T * st:
        return None
    return st


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` when the kernels that take a row stride can read it in place (``row_stride``), else a copy."""
    return t if row_stride(t) is not None else t.contiguous()


def l2norm_fwd(x: torch.Tensor):
    """x [B, T, H, D] (read in place: ``row_stride``) -> (x / ||x||, rstd fp32 [B, T, H]), contiguous."""
    H, D = x.shape[-2:]
    R = x.numel() // D
    y = alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = alloc.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    gdn_l2norm_fwd_kernel(lambda m: (cdiv(R, m["BR"]),), x, y, rstd, R, row_stride(x), L2NORM_EPS,
                          bucket=(bucket(R),), H=H, D=D, BD=_block(D))
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, out_dtype, group: int = 1):
    """dx (contiguous) of ``x [B, T, H, D]`` (read in place: ``row_stride``); ``dy [..., group, D]`` when
    each row's gradient arrives as ``group`` partial rows (one per value head of a query/key head),
    summed in the kernel in a fixed order."""
    H, D = x.shape[-2:]
    R = x.numel() // D
    dx = alloc.empty(x.shape, dtype=out_dtype, device=x.device)
    gdn_l2norm_bwd_kernel(lambda m: (cdiv(R, m["BR"]),), x, rstd, dy.contiguous(), dx, R, row_stride(x),
                          bucket=(bucket(R),), H=H, D=D, BD=_block(D), G=group)
    return dx


def _prep(k, v, g, beta, layout, A=None, gcum=None, gate=None, beta_mode=0, fused=False, wu=True):
    """The per-chunk WY prep: (A, gcum) unless given (the backward passes the forward's), then w and U;
    returns ``(A, gcum, w, u, t_bad)``. gate: (A_log, dt_bias or None) when g is the raw gate; beta_mode:
    1, 2 when beta holds logits. Without A the solve first finds t_bad [chunks, Hv] int32, per chunk and
    value head the first row (inside the chunk) whose k, v, g or beta is NaN / Inf, 64 where none is
    (kernels_fwd.py's docstring: the rows from it on are read as 0, and the scan's outputs from it on are
    NaN); the backward's recompute (A given) reads every row, and t_bad is None. fused (without A only;
    ``DFLASH_KERNELS_GDN_FWD_PREPARE=fused``): one kernel does the solve and w/u (kernels_fwd_fused.py),
    with the same results as the two. wu=False (the Gluon forward, without A): the solve only; w and u are None."""
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    N, n_chunks, cu, indices, offsets = layout
    load_a = A is not None
    t_bad = None
    if not load_a:
        A = alloc.empty(B, T, Hv, BT, dtype=torch.float32, device=k.device)
        gcum = alloc.empty(B, T, Hv, dtype=torch.float32, device=k.device)
        t_bad = alloc.empty(n_chunks, Hv, dtype=torch.int32, device=k.device)
    if not wu:
        assert not load_a and not fused, "_prep: wu=False is the Gluon forward's solve only"
    w = alloc.empty(B, T, Hv, K, dtype=k.dtype, device=k.device) if wu else None
    u = alloc.empty(B, T, Hv, V, dtype=k.dtype, device=k.device) if wu else None
    if not load_a:
        A_log, dt_bias = gate if gate is not None else (None, None)
        if fused:
            gdn_fwd_prepare_kernel.of(k)((n_chunks, Hv), k, v, g, beta, A_log, dt_bias, t_bad, gcum, A, w, u, cu,
                                         indices, T, row_stride(v), bucket=(bucket(n_chunks),), HK=Hk, HV=Hv, K=K,
                                         V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None, GATE=gate is not None,
                                         HAS_DT_BIAS=dt_bias is not None, BETA_MODE=beta_mode)
            return A, gcum, w, u, t_bad
        gdn_fwd_solve_kernel.of(k)((n_chunks, Hv), k, v, g, beta, A_log, dt_bias, t_bad, gcum, A, cu, indices, T,
                                   row_stride(v), bucket=(bucket(n_chunks),), HK=Hk, HV=Hv, K=K, V=V, BT=BT,
                                   BK=_block(K), IS_VARLEN=cu is not None, GATE=gate is not None,
                                   HAS_DT_BIAS=dt_bias is not None, BETA_MODE=beta_mode)
        if not wu:
            return A, gcum, None, None, t_bad
    wu_kernel = gdn_fwd_wu_narrow_kernel if V <= 32 else gdn_fwd_wu_kernel  # kernels_fwd.py says why
    wu_kernel.of(k)((n_chunks, Hv), k, v, beta, gcum, A, t_bad, w, u, cu, indices, T, row_stride(v),
                    bucket=(bucket(n_chunks),), HK=Hk, HV=Hv, K=K, V=V, BT=BT, BK=_block(K),
                    IS_VARLEN=cu is not None, BETA_MODE=beta_mode, HAS_T_BAD=t_bad is not None)
    return A, gcum, w, u, t_bad


def _wy_and_states(q, k, v, g, beta, initial_state, layout, A=None, gcum=None, beta_mode=0, state_v_first=False):
    """Run prep and the state scan; returns (A, gcum, w, h per chunk, U per token, final state)."""
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    N, n_chunks, cu, indices, offsets = layout
    A, gcum, w, u, _ = _prep(k, v, g, beta, layout, A, gcum, beta_mode=beta_mode)
    h = alloc.empty(n_chunks, Hv, K, V, dtype=k.dtype, device=k.device)
    v_new = alloc.empty_like(u)
    final_state = alloc.empty(N, Hv, K, V, dtype=torch.float32, device=k.device)
    _scan(gdn_fwd_scan_states_kernel.of(k), None, k, w, u, gcum, initial_state, h, v_new, None, final_state,
          layout, 1.0, state_v_first)
    return A, gcum, w, h, v_new, final_state


def _scan(kernel, q, k, w, u, gcum, h0, h, v_new, o, final_state, layout, scale: float, state_v_first=False,
          t_bad=None):
    """Launch ``_gdn_fwd_scan_kernel``: o given (forward), h and v_new given (the backward's recompute),
    or all three (a training forward keeping the states for its backward). t_bad (the forward's): o
    from each chunk's first non-finite row on and the states after such a chunk are NaN."""
    B, T, Hk, K = k.shape
    Hv, V = u.shape[2], u.shape[3]
    N, cu, offsets = layout[0], layout[2], layout[4]
    kernel(lambda m: (cdiv(V, m["BV"]), N * Hv), q, k, w, u, gcum, t_bad, h0, h, v_new, o, final_state, cu,
           offsets, T, scale, bucket=(bucket(N * Hv),), HAS_H0=h0 is not None, OUTPUT=o is not None, HK=Hk,
           HV=Hv, K=K, V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None, STATE_V_FIRST=state_v_first,
           HAS_T_BAD=t_bad is not None, **({"SAVE": True} if o is not None and h is not None else {}))


def _split_forward(N: int, Hv: int, device: torch.device) -> bool:
    """Whether the forward runs split (the state scan, then the output parallel over chunks) rather than
    the scan with the output fused in: ``DFLASH_KERNELS_GDN_FWD_SPLIT`` when set to 1 or 0, else on a GPU
    when the N * Hv sequence-heads fill at most a quarter of its SMs (the fused scan then runs at most
    two programs of BV=64 per head, half the SMs or fewer, and computes every output inside its sequential
    loop); once the fused scan's programs fill the GPU, the split form's output kernel costs more than it
    saves. The threshold comes from timing both forms (tools/studies/bench_gdn_fwd_paths.py; the numbers
    are in benchmarks/results/README.md). The CPU (Triton's interpreter) keeps the fused scan."""
    forced = settings.gdn_fwd_split()
    if forced is not None:
        return forced
    return device.type == "cuda" and 4 * N * Hv <= sm_count(device_index(device))


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale: float, use_qk_l2norm: bool,
                               save_states: bool = False, A_log=None, dt_bias=None, chunk_indices=None,
                               chunk_offsets=None, beta_mode: int = 0, state_v_first: bool = False):
    """Launch the forward; returns (o, final_state, A, gcum, w, h, v_new). Inputs checked by the caller,
    contiguous but for v and, with ``use_qk_l2norm``, q and k, which may be row-strided views
    (``row_stride``: a split of the layer's projection, read in place); q, k, v of one dtype.

    By default the per-chunk states are not kept (the backward recomputes them from A and gcum;
    w, h and v_new come back empty), so the scan writes the output directly (``_gdn_fwd_scan_kernel``
    with OUTPUT). With ``save_states`` (not for ``cu_seqlens``) the scan also stores each chunk's
    start state h and U (v_new), and w is returned, for the backward to skip its recompute: memory
    (h is one [K, V] state per chunk and value head, in the input dtype) for time.

    The split forward (``_split_forward``: few sequences and heads, or ``DFLASH_KERNELS_GDN_FWD_SPLIT=1``):
    the scan only stores h and v_new (as for ``save_states``) and ``_gdn_fwd_output_kernel`` then computes
    o over all chunks at once: the same products and roundings, more parallel work for few sequences and
    heads, two more buffers (h, v_new) written and read.

    A_log (and dt_bias): g is the raw gate, its decay computed where the solve kernel reads g.
    beta_mode 1 / 2: beta holds logits, beta = sigmoid / 2 * sigmoid, applied where beta is read.
    cu_seqlens (int32), chunk_indices, chunk_offsets: the layout of ``_varlen_layout``.
    state_v_first: initial_state and the final state are [N, Hv, V, K].

    A NaN / Inf in k, v, g or beta reaches no output before its token (kernels_fwd.py's docstring:
    the solve finds each chunk's first such row, which it and the w/u and scan kernels respect).

    ``DFLASH_KERNELS_GDN_FWD_PREPARE`` (``settings.gdn_fwd_prepare``): ``split`` (default) launches the solve and
    the w/u kernels, ``fused`` one kernel doing both per chunk and value head (kernels_fwd_fused.py): the same
    A, gcum, w and u, so the same outputs and gradients.

    Other splits of the forward were slower when timed and not kept (w and u folded into
    the scan; the l2norm inside the solve, w/u and scan kernels; an earlier kernel doing solve and w/u,
    "prep"; the output's terms precomputed for a shorter scan step): benchmarks/results/README.md.
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    prepare = settings.gdn_fwd_prepare()  # DFLASH_KERNELS_GDN_FWD_PREPARE: a bad value fails before any launch
    gluon = settings.gdn_fwd() == "gluon"  # DFLASH_KERNELS_GDN_FWD
    if use_qk_l2norm:
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
    layout = _layout(B, T, cu_seqlens, chunk_indices, chunk_offsets)
    gate = None if A_log is None else (A_log, dt_bias)
    if gluon:
        return _gluon_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, save_states, layout, gate,
                              beta_mode, state_v_first)
    A, gcum, w, u, t_bad = _prep(k, v, g, beta, layout, gate=gate, beta_mode=beta_mode, fused=prepare == "fused")
    o = alloc.empty(B, T, Hv, V, dtype=q.dtype, device=q.device)
    final_state = alloc.empty(layout[0], Hv, *((V, K) if state_v_first else (K, V)), dtype=torch.float32,
                              device=k.device)
    if save_states and cu_seqlens is not None:
        raise ValueError("save_states: not supported with cu_seqlens (the chunk count depends on its values)")
    split = _split_forward(layout[0], Hv, k.device)
    if save_states or split:
        h = alloc.empty(layout[1], Hv, K, V, dtype=k.dtype, device=k.device)
        v_new = alloc.empty_like(u)
    else:
        h = v_new = None
    if split:  # the state scan stores S0 and U per chunk; the output kernel runs over all chunks at once
        _scan(gdn_fwd_scan_states_kernel.of(k), None, k, w, u, gcum, initial_state, h, v_new, None, final_state,
              layout, 1.0, state_v_first, t_bad)
        N, n_chunks, cu, indices = layout[:4]
        gdn_fwd_output_kernel.of(q)(lambda m: (cdiv(V, m["BV"]), n_chunks, Hv), q, k, gcum, t_bad, h, v_new, o,
                                    cu, indices, T, scale, bucket=(bucket(n_chunks * Hv),), HK=Hk, HV=Hv, K=K,
                                    V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None,
                                    HAS_T_BAD=t_bad is not None)
    else:
        _scan(gdn_fwd_scan_kernel.of(q), q, k, w, u, gcum, initial_state, h, v_new, o, final_state, layout,
              scale, state_v_first, t_bad)
    if not save_states:  # three tensors: a custom op's outputs must not alias each other
        w, h, v_new = (alloc.empty(0, dtype=q.dtype, device=q.device) for _ in range(3))
    return o, final_state, A, gcum, w, h, v_new


def _gluon_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, save_states, layout, gate, beta_mode,
                   state_v_first):
    """``DFLASH_KERNELS_GDN_FWD=gluon``: the solve kernel, then the warp-specialized Gluon kernel
    (kernels_gluon_sm90_fwd.py) for the state scan, U and o; the forward's return values as
    ``chunk_gated_delta_rule_fwd``'s (w, h, v_new empty: the backward recomputes them from A and G). Inputs the
    kernel does not take raise ValueError: the switch asks for this kernel."""
    K, V = q.shape[3], v.shape[3]
    if not gluon_forward_supports(q, k, v, cu_seqlens, save_states):
        cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
        raise ValueError(
            f"DFLASH_KERNELS_GDN_FWD=gluon: the Gluon forward takes an sm_90 GPU, bf16 / fp16 q, k, v with K = 128, "
            f"V a multiple of 64, 16-byte aligned rows, no cu_seqlens and no save_states; got device {q.device} "
            f"(capability {cap}), dtypes {q.dtype} / {k.dtype} / {v.dtype}, K = {K}, V = {V}, cu_seqlens "
            f"{'given' if cu_seqlens is not None else None}, save_states {save_states}")
    A, gcum, _, _, t_bad = _prep(k, v, g, beta, layout, gate=gate, beta_mode=beta_mode, wu=False)
    o, final_state = gdn_fwd_gluon_sm90(q, k, v, beta, gcum, A, t_bad, initial_state, scale, beta_mode,
                                        state_v_first)
    w, h, v_new = (alloc.empty(0, dtype=q.dtype, device=q.device) for _ in range(3))
    return o, final_state, A, gcum, w, h, v_new


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, do, dht,
                               scale: float, use_qk_l2norm: bool, w=None, h=None, v_new=None, A_log=None,
                               dt_bias=None, chunk_indices=None, chunk_offsets=None, beta_mode: int = 0,
                               state_v_first: bool = False):
    """Launch the backward; returns (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) with dh0 empty when
    there is no h0, dA_log / ddt_bias empty without A_log / dt_bias. w, h, v_new: the forward's, when it
    kept them (non-empty); else they are recomputed here. dg and dbeta are the gradients of what was
    passed (the raw gate, the logits) when the forward applied the gate or the sigmoid.

    The local kernel (every input gradient of a chunk from its states, U and their gradients) is chosen by
    ``DFLASH_KERNELS_GDN_BWD_LOCAL`` (``settings.gdn_bwd_local``): ``twopass`` (default), ``onepass`` (one
    pass over V, K whole; the same products, kernels_bwd.py), or ``group`` (the one-pass kernel per key head,
    which sums the head's value heads' dq and dk and applies the l2norm backward itself)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    mode = settings.gdn_bwd_local()  # the local kernel (DFLASH_KERNELS_GDN_BWD_LOCAL): a bad value fails first
    v = v.contiguous()  # the backward kernels read v densely (the forward's may be a row-strided view)
    q_in, k_in = q, k
    if use_qk_l2norm:  # the l2norm kernel reads q and k in place and writes them contiguous
        q, q_rstd = l2norm_fwd(q_in)
        k, k_rstd = l2norm_fwd(k_in)
    else:
        q, k = q.contiguous(), k.contiguous()
    layout = _layout(B, T, cu_seqlens, chunk_indices, chunk_offsets)
    N, n_chunks, cu, indices, offsets = layout
    if h is None or h.numel() == 0:
        _, _, w, h, v_new, _ = _wy_and_states(q, k, v, g, beta, initial_state, layout, A=A, gcum=gcum,
                                              beta_mode=beta_mode, state_v_first=state_v_first)
    consts = dict(HK=Hk, HV=Hv, K=K, V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None)

    do = do.to(q.dtype).contiguous()
    dh = alloc.empty_like(h)
    dv_new = alloc.empty_like(v_new)
    has_h0 = initial_state is not None
    dh0 = alloc.empty(initial_state.shape, dtype=torch.float32, device=q.device) if has_h0 else None
    if dht is not None:
        dht = dht.float().contiguous()
    gdn_bwd_state_kernel.of(q)(lambda m: (cdiv(V, m["BV"]), N * Hv), q, k, w, gcum, do, dht, dh, dv_new,
                               dh0, cu, offsets, T, scale, bucket=(bucket(N * Hv),), HAS_DHT=dht is not None,
                               HAS_H0=has_h0, STATE_V_FIRST=state_v_first, **consts)

    dv = alloc.empty_like(v)
    dbeta = alloc.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    dg = alloc.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    gate = A_log is not None
    # Per-chunk partial sums of the A_log and dt_bias gradients, summed over the chunks below.
    dA_part = alloc.empty(n_chunks, Hv, dtype=torch.float32, device=q.device) if gate else None
    ddt_part = alloc.empty(n_chunks, Hv, dtype=torch.float32, device=q.device) if dt_bias is not None else None
    local = dict(GATE=gate, HAS_DT_BIAS=dt_bias is not None, BETA_MODE=beta_mode, **consts)
    if mode == "group":
        # One program per chunk and key head sums its value heads' dq and dk and applies the l2norm backward:
        # dq and dk written once, in the inputs' dtype.
        dq = alloc.empty(B, T, Hk, K, dtype=q_in.dtype, device=q.device)
        dk = alloc.empty(B, T, Hk, K, dtype=k_in.dtype, device=q.device)
        l2 = (q_in, k_in, q_rstd, k_rstd, row_stride(q_in), row_stride(k_in)) if use_qk_l2norm else (None,) * 4 + (0, 0)
        gdn_bwd_group_kernel.of(q)((n_chunks, Hk), q, k, v, beta, gcum, A, h, dh, v_new, dv_new, do, dq, dk, dv,
                                   dbeta, dg, g if gate else None, A_log, dt_bias, dA_part, ddt_part, l2[0], l2[1],
                                   l2[2], l2[3], cu, indices, T, scale, l2[4], l2[5], bucket=(bucket(n_chunks),),
                                   GROUP=True, L2NORM=use_qk_l2norm, **local)
    else:
        dq = alloc.empty(B, T, Hv, K, dtype=torch.float32, device=q.device)
        dk = alloc.empty(B, T, Hv, K, dtype=torch.float32, device=q.device)
        if mode == "onepass":
            gdn_bwd_onepass_kernel.of(q)((n_chunks, Hv), q, k, v, beta, gcum, A, h, dh, v_new, dv_new, do, dq, dk,
                                         dv, dbeta, dg, g if gate else None, A_log, dt_bias, dA_part, ddt_part, None,
                                         None, None, None, cu, indices, T, scale, 0, 0, bucket=(bucket(n_chunks),),
                                         **local)
        else:
            gdn_bwd_local_kernel.of(q)((n_chunks, Hv), q, k, v, beta, gcum, A, h, dh, v_new, dv_new, do, dq, dk, dv,
                                       dbeta, dg, g if gate else None, A_log, dt_bias, dA_part, ddt_part, cu, indices,
                                       T, scale, bucket=(bucket(n_chunks),), **local)
        # A query/key head serves Hv // Hk value heads: their gradients are summed in a fixed order, inside
        # the l2norm backward when there is one (no extra pass over the fp32 per-value-head gradients).
        if use_qk_l2norm:
            dq = l2norm_bwd(q_in, q_rstd, dq, q_in.dtype, group=Hv // Hk)
            dk = l2norm_bwd(k_in, k_rstd, dk, k_in.dtype, group=Hv // Hk)
        else:
            if Hv != Hk:
                dq = dq.view(B, T, Hk, Hv // Hk, K).sum(3)
                dk = dk.view(B, T, Hk, Hv // Hk, K).sum(3)
            dq, dk = dq.to(q_in.dtype), dk.to(k_in.dtype)
    empty = lambda: alloc.empty(0, dtype=torch.float32, device=q.device)  # noqa: E731
    dh0 = empty() if dh0 is None else dh0
    dA_log = dA_part.sum(0).view_as(A_log).to(A_log.dtype) if gate else empty()
    ddt_bias = ddt_part.sum(0).view_as(dt_bias).to(dt_bias.dtype) if ddt_part is not None else empty()
    return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0, dA_log, ddt_bias


def _gdn_chunk_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                        initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                        chunk_indices: Optional[torch.Tensor], chunk_offsets: Optional[torch.Tensor], scale: float,
                        use_qk_l2norm: bool, output_final_state: bool, save_states: bool, beta_mode: int,
                        state_v_first: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor]:
    return chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm,
                                      save_states, A_log, dt_bias, chunk_indices, chunk_offsets, beta_mode,
                                      state_v_first)


_gdn_chunk_fwd_op = torch.library.custom_op("dflash_kernels::gdn_chunk_fwd", mutates_args=())(_gdn_chunk_fwd_impl)


@_gdn_chunk_fwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets, scale,
      use_qk_l2norm, output_final_state, save_states, beta_mode, state_v_first):
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if save_states:  # never with cu_seqlens: the chunk count is B * ceil(T / BT)
        saved = (q.new_empty(B, T, Hv, K), q.new_empty(B * cdiv(T, BT), Hv, K, V), q.new_empty(B, T, Hv, V))
    else:
        saved = (q.new_empty(0), q.new_empty(0), q.new_empty(0))
    state = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    return (q.new_empty(B, T, Hv, V), q.new_empty(state, dtype=torch.float32),
            q.new_empty(B, T, Hv, BT, dtype=torch.float32), q.new_empty(B, T, Hv, dtype=torch.float32)) + saved


@torch.library.custom_op("dflash_kernels::gdn_chunk_bwd", mutates_args=())
def _gdn_chunk_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                      chunk_indices: Optional[torch.Tensor], chunk_offsets: Optional[torch.Tensor], A: torch.Tensor,
                      gcum: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor], scale: float,
                      use_qk_l2norm: bool, w: torch.Tensor, h: torch.Tensor, v_new: torch.Tensor, beta_mode: int,
                      state_v_first: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor, torch.Tensor]:
    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, do, dht,
                                      scale, use_qk_l2norm, w, h, v_new, A_log, dt_bias, chunk_indices,
                                      chunk_offsets, beta_mode, state_v_first)


@_gdn_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets, A, gcum, do, dht,
      scale, use_qk_l2norm, w, h, v_new, beta_mode, state_v_first):
    def like(t):
        return q.new_empty(0, dtype=torch.float32) if t is None else torch.empty_like(t)
    dh0 = (torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None
           else q.new_empty(0, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0, like(A_log), like(dt_bias))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets, scale,
     use_qk_l2norm, output_final_state, save_states, beta_mode, state_v_first) = inputs
    _, _, A, gcum, w, h, v_new = output
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                          A, gcum, w, h, v_new)
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.output_final_state = output_final_state
    ctx.beta_mode = beta_mode
    ctx.state_v_first = state_v_first


_gdn_chunk_bwd_op_eager = eager_call(_gdn_chunk_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, do, dht, dA, dgcum, dw, dh, dv_new):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
     A, gcum, w, h, v_new) = ctx.saved_tensors
    if not ctx.output_final_state:
        dht = None  # the public function dropped the final state: nothing flows back through it
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = _gdn_chunk_bwd_op_eager(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets, A, gcum, do, dht,
        ctx.scale, ctx.use_qk_l2norm, w, h, v_new, ctx.beta_mode, ctx.state_v_first)
    dh0 = None if initial_state is None else dh0.to(initial_state.dtype)
    dA_log = None if A_log is None else dA_log
    ddt_bias = None if dt_bias is None else ddt_bias
    return (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) + (None,) * 9


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_gdn_chunk_fwd = differentiable_op(_gdn_chunk_fwd_op, _gdn_chunk_fwd_impl, _setup_context, _backward)


@torch.library.custom_op("dflash_kernels::gdn_recurrent_fwd", mutates_args=())
def _gdn_recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                      use_qk_l2norm: bool, beta_mode: int, state_v_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # The output in v's dtype, as fla's fused_recurrent_gated_delta_rule; every input is read in fp32.
    o = alloc.empty(B, T, Hv, V, dtype=v.dtype, device=q.device)
    final_state = alloc.empty(N, Hv, *((V, K) if state_v_first else (K, V)), dtype=torch.float32, device=q.device)
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()  # read densely, as in the chunk
    gdn_recurrent_fwd_kernel(lambda m: (cdiv(V, m["BV"]), N * Hv), q, k, v, g, beta, A_log, dt_bias,
                             initial_state, o, final_state, cu, T, scale, L2NORM_EPS, bucket=(N * Hv,), HK=Hk,
                             HV=Hv, K=K, V=V, BK=_block(K), IS_VARLEN=cu is not None,
                             HAS_H0=initial_state is not None, L2NORM=use_qk_l2norm, GATE=A_log is not None,
                             HAS_DT_BIAS=dt_bias is not None, BETA_MODE=beta_mode, STATE_V_FIRST=state_v_first)
    return o, final_state


@_gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, use_qk_l2norm, beta_mode, state_v_first):
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    return v.new_empty(B, T, Hv, V), q.new_empty(state, dtype=torch.float32)


def _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval) -> int:
    return (2 if allow_neg_eigval else 1) if use_beta_sigmoid_in_kernel else 0


def _contiguous(t):
    return None if t is None else t.contiguous()


@_gdn.impl("triton", "interpret")
def _chunk_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                   cu_seqlens_cpu, chunk_indices, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, state_v_first):
    out_dtype = q.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    # Mixed q/k/v dtypes (fp32 q/k with bf16 v, as fla takes): the kernels run in the promoted dtype; the
    # casts are autograd ops, so each gradient comes back in its input's dtype. No pass when they agree.
    q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (q, k, v))
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    B, T = q.shape[:2]
    check_kernel_grid(B if cu_seqlens is None else cu_seqlens.numel() - 1, v.shape[2], cu_seqlens is not None)
    _, _, cu, indices, offsets = _varlen_layout(cu_seqlens, B, T, q.device, cu_seqlens_cpu, chunk_indices)
    # Keep the forward's states for the backward (DFLASH_KERNELS_GDN_SAVE_STATES=1, fixed-length batches,
    # when a gradient will be asked for): memory for the backward's recompute.
    save = (settings.gdn_save_states() and cu_seqlens is None and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)))
    # q, k (normalized by the l2norm kernel, which reads them in place) and v stay views of the layer's
    # projection where their rows are evenly strided: no copy
    qk = rows if use_qk_l2norm_in_kernel else torch.Tensor.contiguous
    o, final_state = _gdn_chunk_fwd(qk(q), qk(k), rows(v), g.contiguous(),
                                    beta.contiguous(), _contiguous(A_log), _contiguous(dt_bias),
                                    _contiguous(initial_state), cu, indices, offsets, scale,
                                    bool(use_qk_l2norm_in_kernel), bool(output_final_state), save,
                                    _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval), bool(state_v_first))[:2]
    return o.to(out_dtype), (final_state if output_final_state else None)


@_gdn_recurrent.impl("triton", "interpret")
def _recurrent_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, cu_seqlens_cpu, chunk_indices, use_gate_in_kernel, A_log, dt_bias,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first):
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    check_kernel_grid(q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1, v.shape[2], cu_seqlens is not None)
    o, final_state = _gdn_recurrent_op(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                       beta.contiguous(), _contiguous(A_log), _contiguous(dt_bias),
                                       _contiguous(initial_state), cu_seqlens, scale, bool(use_qk_l2norm_in_kernel),
                                       _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval),
                                       bool(state_v_first))
    return o, (final_state if output_final_state else None)


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
               cu_seqlens_cpu, chunk_indices, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
               allow_neg_eigval, state_v_first):
    from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    return naive_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first)


@_gdn.impl("reference")
def _chunk_reference(q, k, v, g, beta, *args):
    """The fp32 time loop of naive.py, output cast to q's dtype (fla's chunked function)."""
    o, final_state = _reference(q, k, v, g, beta, *args)
    return o.to(q.dtype), final_state


@_gdn_recurrent.impl("reference")
def _recurrent_reference(q, k, v, g, beta, *args):
    """The fp32 time loop of naive.py, output cast to v's dtype (fla's recurrent function)."""
    o, final_state = _reference(q, k, v, g, beta, *args)
    return o.to(v.dtype), final_state


def _fla_kwargs(scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
                chunk_indices, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                state_v_first):
    return dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                state_v_first=state_v_first)


@_gdn.impl("fla")
def _chunk_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
               cu_seqlens_cpu, chunk_indices, *args):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk  # the one place fla is imported

    kwargs = _fla_kwargs(scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                         cu_seqlens_cpu, chunk_indices, *args)
    return fla_chunk(q, k, v, g, beta, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, **kwargs)


@_gdn_recurrent.impl("fla")
def _recurrent_fla(q, k, v, g, beta, *args):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    return fla_recurrent(q, k, v, g=g, beta=beta, **_fla_kwargs(*args))


_FLA_KEYWORDS = """
        use_gate_in_kernel: g is the raw gate; the decay is ``-exp(A_log) * softplus(g + dt_bias)`` in fp32
            (softplus the identity above 20), computed inside. A_log (required) and dt_bias (optional):
            Hv elements each; both ignored without use_gate_in_kernel, as fla does.
        use_beta_sigmoid_in_kernel: beta holds logits; beta = sigmoid(logits) in fp32, computed inside.
        allow_neg_eigval: with use_beta_sigmoid_in_kernel (else ValueError), beta = 2 * sigmoid(logits).
        state_v_first: initial and final states in the ``[N, Hv, V, K]`` layout (fla's V-first).
        cu_seqlens_cpu: the host copy of cu_seqlens: its values are checked and the chunk metadata built
            from it, without a device-to-host copy.
        chunk_indices: fla's ``prepare_chunk_indices(cu_seqlens, 64)`` ([chunks, 2] on the device): no
            host work at all (cu_seqlens' values are then not checked unless cu_seqlens_cpu is given).
        cp_context: fla's context parallelism: not supported (NotImplementedError unless None).
        Also fla's ``transpose_state_layout`` (deprecated name of state_v_first){extra}; any other
        keyword raises TypeError naming it.

    q, k and v may differ in dtype (fla takes fp32 q/k with bf16 v): computed in their promoted dtype.
"""


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: Optional[torch.LongTensor] = None,
                           cu_seqlens_cpu: Optional[torch.LongTensor] = None,
                           chunk_indices: Optional[torch.LongTensor] = None, cp_context=None,
                           use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
                           dt_bias: Optional[torch.Tensor] = None, **kwargs):
    r"""Gated DeltaNet over whole sequences (training and prefill); fla 0.6.0's signature and semantics.

    Per value head: ``S_t = exp(g_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = scale S_t^T q_t``.

    Args:
        q, k: ``[B, T, Hk, K]`` queries and keys (bf16, fp16 or fp32; K <= 256).
        v: ``[B, T, Hv, V]`` values, Hv a multiple of Hk: q/k head ``h // (Hv // Hk)`` serves value head h.
        g: ``[B, T, Hv]`` log-space decay (any float dtype; used in fp32), or the raw gate (use_gate_in_kernel).
        beta: ``[B, T, Hv]`` write strengths, or their logits (use_beta_sigmoid_in_kernel).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` state per sequence (N = B, or len(cu_seqlens) - 1).
        output_final_state: also return the ``[N, Hv, K, V]`` fp32 state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6) inside, with its backward.
        cu_seqlens: ``[N + 1]`` LongTensor of sequence boundaries for a packed batch (then B = 1).
        {keywords}
    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, V]`` in q's dtype; final_state or None. Differentiable in
        q, k, v, g, beta, initial_state, A_log and dt_bias.
    """
    state_v_first, chunk_size = pop_fla_kwargs("chunk_gated_delta_rule", kwargs, state_v_first, recurrent=False)
    if chunk_size != BT:
        chunk_indices = None  # fla's indices for another chunk size: rebuilt for the kernels' 64
    _, scale = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                chunk_indices=chunk_indices, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cp_context=cp_context)
    return _gdn(q.device, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, cu_seqlens_cpu, chunk_indices, bool(use_gate_in_kernel), A_log, dt_bias,
                bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), bool(state_v_first))


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                                     scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                     use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
                                     dt_bias: Optional[torch.Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                                     allow_neg_eigval: bool = False, state_v_first: bool = False,
                                     cu_seqlens: Optional[torch.LongTensor] = None,
                                     cu_seqlens_cpu: Optional[torch.LongTensor] = None,
                                     chunk_indices: Optional[torch.LongTensor] = None, cp_context=None, **kwargs):
    r"""Gated delta rule one token after another (decoding); forward only.

    Same arguments, shapes and result as :func:`chunk_gated_delta_rule`: q, k ``[B, T, Hk, K]``,
    v ``[B, T, Hv, V]``, g and beta ``[B, T, Hv]``, initial_state ``[N, Hv, K, V]``; returns
    ``(o [B, T, Hv, V], final_state [N, Hv, K, V] fp32 or None)``, o in v's dtype (as fla's). Not
    differentiable. As fla: g None means no decay, beta None means beta = 1 (with
    use_gate_in_kernel, g is required); g and beta may also be passed by keyword.

    Args:
        q, k: ``[B, T, Hk, K]`` queries and keys (bf16, fp16 or fp32; K <= 256).
        v: ``[B, T, Hv, V]`` values, Hv a multiple of Hk (V <= 256).
        g: ``[B, T, Hv]`` log-space decay, the raw gate (use_gate_in_kernel, then required), or None
            (no decay).
        beta: ``[B, T, Hv]`` write strengths, their logits (use_beta_sigmoid_in_kernel), or None (beta = 1).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` state per sequence (N = B, or len(cu_seqlens) - 1), e.g. the
            final state of :func:`chunk_gated_delta_rule` over the prompt; zeros when None.
        output_final_state: also return the ``[N, Hv, K, V]`` fp32 state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6) inside.
        cu_seqlens: ``[N + 1]`` LongTensor of sequence boundaries for a packed batch (then B = 1).
        {keywords}

    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, V]`` in v's dtype; final_state fp32 (``[N, Hv, K, V]``, or
        ``[N, Hv, V, K]`` with state_v_first) or None.
    """
    state_v_first, _ = pop_fla_kwargs("fused_recurrent_gated_delta_rule", kwargs, state_v_first, recurrent=True)
    if use_gate_in_kernel and g is None:
        raise ValueError("g: the raw gate must be given when use_gate_in_kernel=True")
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4:
        if g is None:  # fla: no decay
            g = torch.zeros(q.shape[0], q.shape[1], v.shape[2], device=q.device, dtype=torch.float32)
        if beta is None:  # fla: beta = 1 (with the sigmoid applied to it if asked, as fla)
            beta = torch.ones(q.shape[0], q.shape[1], v.shape[2], device=q.device, dtype=q.dtype)
    _, scale = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                chunk_indices=chunk_indices, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cp_context=cp_context)
    return _gdn_recurrent(q.device, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                          bool(use_gate_in_kernel), A_log, dt_bias, bool(use_beta_sigmoid_in_kernel),
                          bool(allow_neg_eigval), bool(state_v_first))


chunk_gated_delta_rule.__doc__ = chunk_gated_delta_rule.__doc__.replace(
    "{keywords}", _FLA_KEYWORDS.format(extra=" and ``chunk_size`` (16, 32 or 64: the kernels' chunk is 64)").strip())
fused_recurrent_gated_delta_rule.__doc__ = fused_recurrent_gated_delta_rule.__doc__.replace(
    "{keywords}", _FLA_KEYWORDS.format(extra=", ``gk`` / ``gv`` as None").strip())


@register_precompile(OP)
def _precompile_gdn(shape: dict, dtype, device, backward: bool):
    """shape: B, T, Hk, Hv, K, V; optional flags (the kernels compiled differ with them):
    ``l2norm`` (default True), ``initial_state`` and ``output_final_state`` (default False, as in training),
    ``gate_in_kernel`` and ``beta_sigmoid`` (default False: fla's in-kernel gate and beta sigmoid), ``docs``
    (a packed batch: the documents' lengths, ``"3000+11000+..."`` or a sequence, summing to T with B = 1:
    varlen kernels through ``cu_seqlens``)."""
    B, T, Hk, Hv, K, V = (shape[n] for n in ("B", "T", "Hk", "Hv", "K", "V"))
    make = dict(device=device, dtype=dtype)
    docs = shape.get("docs")
    cu_seqlens = None
    if docs is not None:
        lengths = [int(n) for n in (docs.split("+") if isinstance(docs, str) else docs)]
        if B != 1 or sum(lengths) != T or min(lengths) < 1:
            raise ValueError(f"shape: docs {docs!r} must be positive lengths summing to T={T} with B=1, got B={B}")
        cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0)
    q = torch.randn(B, T, Hk, K, **make)
    k = torch.randn(B, T, Hk, K, **make)
    v = torch.randn(B, T, Hv, V, **make)
    gate = bool(shape.get("gate_in_kernel", False))
    extra = {}
    if gate:
        g = torch.randn(B, T, Hv, device=device, dtype=torch.float32)
        extra = dict(use_gate_in_kernel=True, A_log=torch.zeros(Hv, device=device),
                     dt_bias=torch.zeros(Hv, device=device))
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, device=device, dtype=torch.float32))
    if shape.get("beta_sigmoid"):
        beta = torch.randn(B, T, Hv, **make)
        extra["use_beta_sigmoid_in_kernel"] = True
    else:
        beta = torch.rand(B, T, Hv, **make)
    h0 = torch.zeros(B, Hv, K, V, device=device, dtype=torch.float32) if shape.get("initial_state") else None
    final = bool(shape.get("output_final_state", False))
    tensors = [t for t in (q, k, v, g, beta, h0, extra.get("A_log"), extra.get("dt_bias")) if t is not None]
    if backward:
        for t in tensors:
            t.requires_grad_(True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=final,
                                   use_qk_l2norm_in_kernel=shape.get("l2norm", True), cu_seqlens=cu_seqlens,
                                   **extra)
    if backward:
        loss = o.float().sum() + (ht.sum() if final else 0)
        torch.autograd.grad(loss, tensors)
