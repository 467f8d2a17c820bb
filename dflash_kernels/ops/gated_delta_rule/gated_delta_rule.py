"""Gated delta rule: launchers, custom ops with their autograd, the public functions.

- chunked scan (training, prefill): the launchers ``chunk_gated_delta_rule_fwd`` / ``_bwd`` (allocate,
  grid, launch the kernels of ``kernels_fwd.py``, ``kernels_bwd.py`` and ``kernels_l2norm.py``), the
  custom ops ``dflash_kernels::gdn_chunk_fwd`` / ``gdn_chunk_bwd`` (fake + autograd) and
  ``chunk_gated_delta_rule``;
- token by token (decoding, forward only): the custom op ``dflash_kernels::gdn_recurrent_fwd`` over
  ``kernels_recurrent.py`` and ``fused_recurrent_gated_delta_rule``.

Both public functions take fla's signature, check their arguments (``checks.py``) and dispatch through
the op's backends (``runtime.Op``): the kernels, the fp32 recurrence of ``naive.py``, or fla.
"""

from typing import Optional

import torch
import triton

from dflash_kernels.ops.gated_delta_rule.checks import check_gdn_inputs
from dflash_kernels.ops.gated_delta_rule.kernels_bwd import gdn_bwd_local_kernel, gdn_bwd_state_kernel
from dflash_kernels.ops.gated_delta_rule.kernels_fwd import (gdn_fwd_scan_kernel, gdn_fwd_scan_states_kernel,
                                                             gdn_fwd_solve_kernel, gdn_fwd_wu_kernel)
from dflash_kernels.ops.gated_delta_rule.kernels_l2norm import gdn_l2norm_bwd_kernel, gdn_l2norm_fwd_kernel
from dflash_kernels.ops.gated_delta_rule.kernels_recurrent import gdn_recurrent_fwd_kernel
from dflash_kernels.runtime import Op, alloc, bucket, register_precompile, settings
from dflash_kernels.runtime.autograd import differentiable_op

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule_fwd",
           "chunk_gated_delta_rule_bwd"]

OP = "gdn"
BT = 64  # chunk length: fixed, the per-chunk buffers (states, A) are laid out by it
L2NORM_EPS = 1e-6

_gdn = Op(OP, peers={"fla": "fla.ops.gated_delta_rule"})
_gdn_recurrent = _gdn.function("fused_recurrent_gated_delta_rule")


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _varlen_layout(cu_seqlens, B, T, device):
    """(N, total chunks, cu_seqlens int32, chunk_indices [chunks, 2] int32, chunk_offsets [N+1] int32)."""
    if cu_seqlens is None:
        return B, B * triton.cdiv(T, BT), None, None, None
    bounds = cu_seqlens.to("cpu", torch.int64)  # one sync per call, as fla's prepare_chunk_indices
    counts = (bounds[1:] - bounds[:-1] + BT - 1) // BT
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    n_chunks = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    within = torch.arange(n_chunks) - offsets[:-1].repeat_interleave(counts)
    indices = torch.stack([seq, within], 1).to(device=device, dtype=torch.int32)
    return (len(counts), n_chunks, bounds.to(device=device, dtype=torch.int32), indices,
            offsets.to(device=device, dtype=torch.int32))


def l2norm_fwd(x: torch.Tensor):
    """x [..., D] -> (x / ||x||, rstd fp32 [...])."""
    D = x.shape[-1]
    R = x.numel() // D
    y = alloc.empty_like(x)
    rstd = alloc.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    gdn_l2norm_fwd_kernel(lambda m: (triton.cdiv(R, m["BR"]),), x, y, rstd, R, L2NORM_EPS,
                          bucket=(bucket(R),), D=D, BD=_block(D))
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, out_dtype, group: int = 1):
    """dx of ``x [..., D]``; ``dy [..., group, D]`` when each row's gradient arrives as ``group`` partial
    rows (one per value head of a query/key head), summed in the kernel in a fixed order."""
    D = x.shape[-1]
    R = x.numel() // D
    dx = alloc.empty(x.shape, dtype=out_dtype, device=x.device)
    gdn_l2norm_bwd_kernel(lambda m: (triton.cdiv(R, m["BR"]),), x, rstd, dy.contiguous(), dx, R,
                          bucket=(bucket(R),), D=D, BD=_block(D), G=group)
    return dx


def _prep(k, v, g, beta, layout, A=None, gcum=None):
    """The per-chunk WY prep: (A, gcum) unless given (the backward passes the forward's), then w and U."""
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    N, n_chunks, cu, indices, offsets = layout
    load_a = A is not None
    if not load_a:
        A = alloc.empty(B, T, Hv, BT, dtype=torch.float32, device=k.device)
        gcum = alloc.empty(B, T, Hv, dtype=torch.float32, device=k.device)
    w = alloc.empty(B, T, Hv, K, dtype=k.dtype, device=k.device)
    u = alloc.empty(B, T, Hv, V, dtype=k.dtype, device=k.device)
    if not load_a:
        gdn_fwd_solve_kernel.of(k)((n_chunks, Hv), k, g, beta, gcum, A, cu, indices, T, bucket=(bucket(n_chunks),),
                                   HK=Hk, HV=Hv, K=K, BT=BT, BK=_block(K), IS_VARLEN=cu is not None)
    gdn_fwd_wu_kernel.of(k)((n_chunks, Hv), k, v, beta, gcum, A, w, u, cu, indices, T, bucket=(bucket(n_chunks),),
                            HK=Hk, HV=Hv, K=K, V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None)
    return A, gcum, w, u


def _wy_and_states(q, k, v, g, beta, initial_state, layout, A=None, gcum=None):
    """Run prep and the state scan; returns (A, gcum, w, h per chunk, U per token, final state)."""
    B, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    N, n_chunks, cu, indices, offsets = layout
    A, gcum, w, u = _prep(k, v, g, beta, layout, A, gcum)
    h = alloc.empty(n_chunks, Hv, K, V, dtype=k.dtype, device=k.device)
    v_new = alloc.empty_like(u)
    final_state = alloc.empty(N, Hv, K, V, dtype=torch.float32, device=k.device)
    _scan(gdn_fwd_scan_states_kernel.of(k), None, k, w, u, gcum, initial_state, h, v_new, None, final_state,
          layout, 1.0)
    return A, gcum, w, h, v_new, final_state


def _scan(kernel, q, k, w, u, gcum, h0, h, v_new, o, final_state, layout, scale: float):
    """Launch ``_gdn_fwd_scan_kernel``: o given (forward), h and v_new given (the backward's recompute),
    or all three (a training forward keeping the states for its backward)."""
    B, T, Hk, K = k.shape
    Hv, V = u.shape[2], u.shape[3]
    N, cu, offsets = layout[0], layout[2], layout[4]
    kernel(lambda m: (triton.cdiv(V, m["BV"]), N * Hv), q, k, w, u, gcum, h0, h, v_new, o, final_state, cu,
           offsets, T, scale, bucket=(bucket(N * Hv),), HAS_H0=h0 is not None, OUTPUT=o is not None, HK=Hk,
           HV=Hv, K=K, V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None,
           **({"SAVE": True} if o is not None and h is not None else {}))


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale: float, use_qk_l2norm: bool,
                               save_states: bool = False):
    """Launch the forward; returns (o, final_state, A, gcum, w, h, v_new). Inputs contiguous, checked
    by the caller.

    By default the per-chunk states are not kept (the backward recomputes them from A and gcum;
    w, h and v_new come back empty), so the scan writes the output directly (``_gdn_fwd_scan_kernel``
    with OUTPUT). With ``save_states`` (not for ``cu_seqlens``) the scan also stores each chunk's
    start state h and U (v_new), and w is returned, for the backward to skip its recompute: memory
    (h is one [K, V] state per chunk and value head, in the input dtype) for time.

    Other splits of the forward were measured slower on the H200 and not kept (w and u folded into
    the scan; the l2norm inside the solve, w/u and scan kernels; solve and w/u in one kernel; the
    output's terms precomputed for a shorter scan step): benchmarks/results/README.md.
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if use_qk_l2norm:
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
    layout = _varlen_layout(cu_seqlens, B, T, q.device)
    A, gcum, w, u = _prep(k, v, g, beta, layout)
    o = alloc.empty(B, T, Hv, V, dtype=q.dtype, device=q.device)
    final_state = alloc.empty(layout[0], Hv, K, V, dtype=torch.float32, device=k.device)
    if save_states:
        if cu_seqlens is not None:
            raise ValueError("save_states: not supported with cu_seqlens (the chunk count depends on its values)")
        h = alloc.empty(layout[1], Hv, K, V, dtype=k.dtype, device=k.device)
        v_new = alloc.empty_like(u)
    else:
        h = v_new = None
    _scan(gdn_fwd_scan_kernel.of(q), q, k, w, u, gcum, initial_state, h, v_new, o, final_state, layout, scale)
    if not save_states:  # three tensors: a custom op's outputs must not alias each other
        w, h, v_new = (alloc.empty(0, dtype=q.dtype, device=q.device) for _ in range(3))
    return o, final_state, A, gcum, w, h, v_new


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, do, dht,
                               scale: float, use_qk_l2norm: bool, w=None, h=None, v_new=None):
    """Launch the backward; returns (dq, dk, dv, dg, dbeta, dh0) with dh0 empty when there is no h0.
    w, h, v_new: the forward's, when it kept them (non-empty); else they are recomputed here."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    q_in, k_in = q, k
    if use_qk_l2norm:
        q, q_rstd = l2norm_fwd(q_in)
        k, k_rstd = l2norm_fwd(k_in)
    layout = _varlen_layout(cu_seqlens, B, T, q.device)
    N, n_chunks, cu, indices, offsets = layout
    if h is None or h.numel() == 0:
        _, _, w, h, v_new, _ = _wy_and_states(q, k, v, g, beta, initial_state, layout, A=A, gcum=gcum)
    consts = dict(HK=Hk, HV=Hv, K=K, V=V, BT=BT, BK=_block(K), IS_VARLEN=cu is not None)

    do = do.to(q.dtype).contiguous()
    dh = alloc.empty_like(h)
    dv_new = alloc.empty_like(v_new)
    has_h0 = initial_state is not None
    dh0 = alloc.empty(N, Hv, K, V, dtype=torch.float32, device=q.device) if has_h0 else None
    if dht is not None:
        dht = dht.float().contiguous()
    gdn_bwd_state_kernel.of(q)(lambda m: (triton.cdiv(V, m["BV"]), N * Hv), q, k, w, gcum, do, dht, dh, dv_new,
                               dh0, cu, offsets, T, scale, bucket=(bucket(N * Hv),), HAS_DHT=dht is not None,
                               HAS_H0=has_h0, **consts)

    dq = alloc.empty(B, T, Hv, K, dtype=torch.float32, device=q.device)
    dk = alloc.empty(B, T, Hv, K, dtype=torch.float32, device=q.device)
    dv = alloc.empty_like(v)
    dbeta = alloc.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    dg = alloc.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    gdn_bwd_local_kernel.of(q)((n_chunks, Hv), q, k, v, beta, gcum, A, h, dh, v_new, dv_new, do, dq, dk, dv, dbeta,
                               dg, cu, indices, T, scale, bucket=(bucket(n_chunks),), **consts)
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
    if dh0 is None:
        dh0 = alloc.empty(0, dtype=torch.float32, device=q.device)
    return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0


def _gdn_chunk_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                        use_qk_l2norm: bool, output_final_state: bool, save_states: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor]:
    return chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm,
                                      save_states)


_gdn_chunk_fwd_op = torch.library.custom_op("dflash_kernels::gdn_chunk_fwd", mutates_args=())(_gdn_chunk_fwd_impl)


@_gdn_chunk_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state, save_states):
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if save_states:  # never with cu_seqlens: the chunk count is B * ceil(T / BT)
        saved = (q.new_empty(B, T, Hv, K), q.new_empty(B * triton.cdiv(T, BT), Hv, K, V), q.new_empty(B, T, Hv, V))
    else:
        saved = (q.new_empty(0), q.new_empty(0), q.new_empty(0))
    return (q.new_empty(B, T, Hv, V), q.new_empty(N, Hv, K, V, dtype=torch.float32),
            q.new_empty(B, T, Hv, BT, dtype=torch.float32), q.new_empty(B, T, Hv, dtype=torch.float32)) + saved


@torch.library.custom_op("dflash_kernels::gdn_chunk_bwd", mutates_args=())
def _gdn_chunk_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], A: torch.Tensor,
                      gcum: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor], scale: float,
                      use_qk_l2norm: bool, w: torch.Tensor, h: torch.Tensor, v_new: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, do, dht,
                                      scale, use_qk_l2norm, w, h, v_new)


@_gdn_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, do, dht, scale, use_qk_l2norm, w, h, v_new):
    dh0 = (torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None
           else q.new_empty(0, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state, save_states = inputs
    _, _, A, gcum, w, h, v_new = output
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, w, h, v_new)
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht, dA, dgcum, dw, dh, dv_new):
    q, k, v, g, beta, initial_state, cu_seqlens, A, gcum, w, h, v_new = ctx.saved_tensors
    if not ctx.output_final_state:
        dht = None  # the public function dropped the final state: nothing flows back through it
    dq, dk, dv, dg, dbeta, dh0 = _gdn_chunk_bwd_op(q, k, v, g, beta, initial_state, cu_seqlens, A, gcum,
                                                   do, dht, ctx.scale, ctx.use_qk_l2norm, w, h, v_new)
    if initial_state is None:
        dh0 = None
    else:
        dh0 = dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_gdn_chunk_fwd = differentiable_op(_gdn_chunk_fwd_op, _gdn_chunk_fwd_impl, _setup_context, _backward)


@torch.library.custom_op("dflash_kernels::gdn_recurrent_fwd", mutates_args=())
def _gdn_recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                      use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = alloc.empty(B, T, Hv, V, dtype=q.dtype, device=q.device)
    final_state = alloc.empty(N, Hv, K, V, dtype=torch.float32, device=q.device)
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32)
    gdn_recurrent_fwd_kernel(lambda m: (triton.cdiv(V, m["BV"]), N * Hv), q, k, v, g, beta, initial_state, o,
                             final_state, cu, T, scale, L2NORM_EPS, bucket=(N * Hv,), HK=Hk, HV=Hv, K=K, V=V,
                             BK=_block(K), IS_VARLEN=cu is not None, HAS_H0=initial_state is not None,
                             L2NORM=use_qk_l2norm)
    return o, final_state


@_gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm):
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return q.new_empty(B, T, Hv, V), q.new_empty(N, Hv, K, V, dtype=torch.float32)


@_gdn.impl("triton", "interpret")
def _chunk_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    # Keep the forward's states for the backward (DFLASH_KERNELS_GDN_SAVE_STATES=1, fixed-length batches,
    # when a gradient will be asked for): memory for the backward's recompute.
    save = (settings.gdn_save_states() and cu_seqlens is None and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)))
    o, final_state = _gdn_chunk_fwd(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                    beta.contiguous(), initial_state, cu_seqlens, scale,
                                    bool(use_qk_l2norm_in_kernel), bool(output_final_state), save)[:2]
    return o, (final_state if output_final_state else None)


@_gdn_recurrent.impl("triton", "interpret")
def _recurrent_kernels(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens):
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, final_state = _gdn_recurrent_op(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                       beta.contiguous(), initial_state, cu_seqlens, scale,
                                       bool(use_qk_l2norm_in_kernel))
    return o, (final_state if output_final_state else None)


@_gdn.impl("reference")
@_gdn_recurrent.impl("reference")
def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """The fp32 time loop of naive.py, output cast to q's dtype."""
    from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    o, final_state = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
                                                      output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return o.to(q.dtype), final_state


@_gdn.impl("fla")
def _chunk_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk  # the one place fla is imported

    return fla_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=cu_seqlens)


@_gdn_recurrent.impl("fla")
def _recurrent_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   cu_seqlens):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    return fla_recurrent(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=cu_seqlens)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.LongTensor] = None):
    r"""Gated DeltaNet over whole sequences (training and prefill); fla's signature and semantics.

    Per value head: ``S_t = exp(g_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = scale S_t^T q_t``.

    Args:
        q, k: ``[B, T, Hk, K]`` queries and keys (bf16, fp16 or fp32; K <= 256).
        v: ``[B, T, Hv, V]`` values, Hv a multiple of Hk: q/k head ``h // (Hv // Hk)`` serves value head h.
        g: ``[B, T, Hv]`` log-space decay (any float dtype; used in fp32).
        beta: ``[B, T, Hv]`` write strengths.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` state per sequence (N = B, or len(cu_seqlens) - 1).
        output_final_state: also return the ``[N, Hv, K, V]`` fp32 state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6) inside, with its backward.
        cu_seqlens: ``[N + 1]`` LongTensor of sequence boundaries for a packed batch (then B = 1).

    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, V]`` in q's dtype; final_state or None.
    """
    _, scale = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return _gdn(q.device, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: Optional[float] = None,
                                     initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens: Optional[torch.LongTensor] = None):
    r"""Gated delta rule one token after another (decoding); forward only.

    Same arguments, shapes and result as :func:`chunk_gated_delta_rule`: q, k ``[B, T, Hk, K]``,
    v ``[B, T, Hv, V]``, g and beta ``[B, T, Hv]``, initial_state ``[N, Hv, K, V]``; returns
    ``(o [B, T, Hv, V], final_state [N, Hv, K, V] fp32 or None)``. Not differentiable.
    """
    _, scale = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return _gdn_recurrent(q.device, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, cu_seqlens)


@register_precompile(OP)
def _precompile_gdn(shape: dict, dtype, device, backward: bool):
    """shape: B, T, Hk, Hv, K, V; optional flags (the kernels compiled differ with them):
    ``l2norm`` (default True), ``initial_state`` and ``output_final_state`` (default False, as in training)."""
    B, T, Hk, Hv, K, V = (shape[n] for n in ("B", "T", "Hk", "Hv", "K", "V"))
    make = dict(device=device, dtype=dtype)
    q = torch.randn(B, T, Hk, K, **make)
    k = torch.randn(B, T, Hk, K, **make)
    v = torch.randn(B, T, Hv, V, **make)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, device=device, dtype=torch.float32))
    beta = torch.rand(B, T, Hv, **make)
    h0 = torch.zeros(B, Hv, K, V, device=device, dtype=torch.float32) if shape.get("initial_state") else None
    final = bool(shape.get("output_final_state", False))
    tensors = [t for t in (q, k, v, g, beta, h0) if t is not None]
    if backward:
        for t in tensors:
            t.requires_grad_(True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=final,
                                   use_qk_l2norm_in_kernel=shape.get("l2norm", True))
    if backward:
        loss = o.float().sum() + (ht.sum() if final else 0)
        torch.autograd.grad(loss, tensors)
