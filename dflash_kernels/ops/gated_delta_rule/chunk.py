"""Chunked gated delta rule: host launchers, the custom ops with their autograd, the public function.

Three tiers above the kernels of ``kernels_fwd.py`` / ``kernels_bwd.py``:
- launchers ``chunk_gated_delta_rule_fwd`` / ``chunk_gated_delta_rule_bwd`` (allocate, grid, launch),
- ``torch.library`` custom ops ``dflash_kernels::gdn_chunk_fwd`` / ``gdn_chunk_bwd`` (fake + autograd),
- ``chunk_gated_delta_rule``: fla's signature, argument checks, backend choice.
"""

from typing import Optional

import torch
import triton

from dflash_kernels.ops.gated_delta_rule.kernels_bwd import _gdn_bwd_local_kernel, _gdn_bwd_state_kernel
from dflash_kernels.ops.gated_delta_rule.kernels_fwd import (_gdn_fwd_scan_kernel, _gdn_fwd_solve_kernel,
                                                             _gdn_fwd_wu_kernel)
from dflash_kernels.ops.gated_delta_rule.kernels_l2norm import _l2norm_bwd_kernel, _l2norm_fwd_kernel
from dflash_kernels.runtime import Config, TritonKernel, alloc, register_op, register_precompile, resolve, settings
from dflash_kernels.runtime.autograd import differentiable_op
from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"]

OP = "gdn"
BT = 64  # chunk length: fixed, the per-chunk buffers (states, A) are laid out by it
MAX_HEAD_DIM = 256
L2NORM_EPS = 1e-6

register_op(OP, peers={"fla": "fla.ops.gated_delta_rule"})

_l2norm_fwd = TritonKernel(_l2norm_fwd_kernel, name="gdn_l2norm_fwd",
                           configs=[Config(BR=16, num_warps=4), Config(BR=32, num_warps=8)],
                           interpret_config=Config(BR=16))
_l2norm_bwd = TritonKernel(_l2norm_bwd_kernel, name="gdn_l2norm_bwd",
                           configs=[Config(BR=16, num_warps=4), Config(BR=32, num_warps=8)],
                           interpret_config=Config(BR=16))


class _Kernels:
    """The scan's kernels for one input precision.

    fp32 inputs get their own objects with 4-warp, single-stage configs only: on H200 with triton 3.6
    the backward's local kernel with fp32 (tf32) dots and 8 warps faults (illegal memory access, K=16)
    or needs more shared memory than the chip has (K=128), and a faulting tuning trial would poison
    the CUDA context, so such configs must never be candidates.
    """

    def __init__(self, fp32: bool):
        tag = "_fp32" if fp32 else ""

        def make(fn, name, configs, fp32_configs, interpret=Config(BV=16)):
            return TritonKernel(fn, name=name + tag, configs=fp32_configs if fp32 else configs,
                                interpret_config=interpret)

        one = [Config(num_warps=4, num_stages=1)]
        # The solve's substitution holds one [4, 16] row per step: one element per thread at 2 warps.
        self.solve = make(_gdn_fwd_solve_kernel, "gdn_fwd_solve",
                          [Config(num_warps=2), Config(num_warps=4)], one, Config())
        self.wu = make(_gdn_fwd_wu_kernel, "gdn_fwd_wu",
                       [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8)],
                       [Config(BV=32, num_warps=4, num_stages=1), Config(BV=16, num_warps=4, num_stages=1)])
        # The 8-warp BV <= 32 candidates of the scans are those that do not spill registers on sm_90
        # builds (benchmarks/sm90_resources.py); the tuner times them all.
        self.state = make(_gdn_fwd_scan_kernel, "gdn_fwd_state",
                          [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
                           Config(BV=16, num_warps=4), Config(BV=32, num_warps=8), Config(BV=16, num_warps=8)],
                          [Config(BV=32, num_warps=4, num_stages=1), Config(BV=16, num_warps=4, num_stages=1)])
        # Forward: the scan with the output fused in. The tuner's H200 pick at B=4, T=4096 first (untuned
        # runs launch it): BV=32 first read 1.555 / 1.822 ms untuned at B=4 / B=1 T=16384 against the
        # split state + output kernels' 1.503 / 1.678, while the tuned BV=64 scan took 667 us against
        # their 417 + 389.
        # Two single-stage candidates (BV=64/32, 4 warps) were tried: tuning at B=4, T=4096 on the H200
        # then died with an illegal memory access (2026-11-29, session 5), so they are not candidates
        # (session 8: forced alone, the BV=32 single-stage loops fault again, BV=64 ones are slower).
        # The 3-stage loop at BV=64: forced alone, 1.706 against 1.851 ms at B=1, T=16384 (one sequence:
        # 96 programs), 1.463 against 1.331 at B=4 (session 8); the tuner picks per bucket.
        self.state_output = make(_gdn_fwd_scan_kernel, "gdn_fwd_state_output",
                                 [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
                                  Config(BV=16, num_warps=4), Config(BV=32, num_warps=8), Config(BV=16, num_warps=8),
                                  Config(BV=64, num_warps=4, LOOP_STAGES=3)],
                                 [Config(BV=32, num_warps=4, num_stages=1), Config(BV=16, num_warps=4, num_stages=1)])
        # LOOP_STAGES=3: the chunk loop pipelined three deep (no register spills on sm_90, where the 2-stage
        # configs spill); forced alone on the H200 it took the forward+backward from 8.52 to 8.20 ms at B=1,
        # T=16384 and 7.27 to 7.24 at B=4, T=4096 (session 8). The other scans' 1- and 3-stage loops were
        # slower there, and the single-stage BV=32 bf16 scans faulted (illegal memory access): not candidates.
        self.bwd_state = make(_gdn_bwd_state_kernel, "gdn_bwd_state",
                              [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
                               Config(BV=16, num_warps=4), Config(BV=16, num_warps=8),
                               Config(BV=64, num_warps=8, LOOP_STAGES=3)],
                              [Config(BV=32, num_warps=4, num_stages=1), Config(BV=16, num_warps=4, num_stages=1)])
        self.bwd_local = make(_gdn_bwd_local_kernel, "gdn_bwd_local",
                              [Config(BV=32, BKB=64, num_warps=8), Config(BV=64, BKB=64, num_warps=8),
                               Config(BV=32, BKB=32, num_warps=8), Config(BV=64, BKB=32, num_warps=8)],
                              [Config(BV=16, BKB=64, num_warps=4, num_stages=1),
                               Config(BV=32, BKB=64, num_warps=4, num_stages=1)], Config(BV=16, BKB=16))


_KERNELS = {False: _Kernels(fp32=False), True: _Kernels(fp32=True)}


def _kernels(x: torch.Tensor) -> _Kernels:
    return _KERNELS[x.dtype == torch.float32]


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _bucket(rows: int) -> tuple:
    return (triton.next_power_of_2(max(rows, 1)),)


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
    _l2norm_fwd(lambda m: (triton.cdiv(R, m["BR"]),), x, y, rstd, R, L2NORM_EPS,
                bucket=_bucket(R), D=D, BD=_block(D))
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, out_dtype, group: int = 1):
    """dx of ``x [..., D]``; ``dy [..., group, D]`` when each row's gradient arrives as ``group`` partial
    rows (one per value head of a query/key head), summed in the kernel in a fixed order."""
    D = x.shape[-1]
    R = x.numel() // D
    dx = alloc.empty(x.shape, dtype=out_dtype, device=x.device)
    _l2norm_bwd(lambda m: (triton.cdiv(R, m["BR"]),), x, rstd, dy.contiguous(), dx, R,
                bucket=_bucket(R), D=D, BD=_block(D), G=group)
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
    kn = _kernels(k)
    if not load_a:
        kn.solve((n_chunks, Hv), k, g, beta, gcum, A, cu, indices, T, bucket=_bucket(n_chunks),
                 HK=Hk, HV=Hv, K=K, BT=BT, BK=_block(K), IS_VARLEN=cu is not None)
    kn.wu((n_chunks, Hv), k, v, beta, gcum, A, w, u, cu, indices, T, bucket=_bucket(n_chunks),
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
    _scan(_kernels(k).state, None, k, w, u, gcum, initial_state, h, v_new, None, final_state, layout, 1.0)
    return A, gcum, w, h, v_new, final_state


def _scan(kernel, q, k, w, u, gcum, h0, h, v_new, o, final_state, layout, scale: float):
    """Launch ``_gdn_fwd_scan_kernel``: o given (forward), h and v_new given (the backward's recompute),
    or all three (a training forward keeping the states for its backward)."""
    B, T, Hk, K = k.shape
    Hv, V = u.shape[2], u.shape[3]
    N, cu, offsets = layout[0], layout[2], layout[4]
    kernel(lambda m: (triton.cdiv(V, m["BV"]), N * Hv), q, k, w, u, gcum, h0, h, v_new, o, final_state, cu,
           offsets, T, scale, bucket=_bucket(N * Hv), HAS_H0=h0 is not None, OUTPUT=o is not None, HK=Hk,
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
    for time (B=4, T=4096, Hv=48, K=V=128, bf16: 0.8 GB).

    Measured on the H200 and dropped (session 7, B=4, T=4096, tuned): one scan kernel with w and u
    folded in (U = A (diag(beta) V - diag(beta exp(G)) K S0)), 1.665 against 1.324 ms (the scan is
    latency-bound: the fold put two more products on its step-to-step chain); the l2norm inside the
    solve, w/u and scan kernels instead of its own kernels, 2.027 against 1.319 ms (the scan spilled).
    Session 8: solve and w/u in one kernel, 1.451 against 1.335 ms; and with qt = exp(G) Q - P w and
    ou = P u precomputed there so that the scan's output is qt S0 + ou (its chunk step 3 products instead
    of 5: scan 544 against 670 us), 1.838 ms (branch ``wip/gdn-fwd-prep``).
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
    _scan(_kernels(q).state_output, q, k, w, u, gcum, initial_state, h, v_new, o, final_state, layout, scale)
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
    _kernels(q).bwd_state(lambda m: (triton.cdiv(V, m["BV"]), N * Hv), q, k, w, gcum, do, dht, dh, dv_new, dh0,
                          cu, offsets, T, scale, bucket=_bucket(N * Hv), HAS_DHT=dht is not None, HAS_H0=has_h0,
                          **consts)

    dq = alloc.empty(B, T, Hv, K, dtype=torch.float32, device=q.device)
    dk = alloc.empty(B, T, Hv, K, dtype=torch.float32, device=q.device)
    dv = alloc.empty_like(v)
    dbeta = alloc.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    dg = alloc.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    _kernels(q).bwd_local((n_chunks, Hv), q, k, v, beta, gcum, A, h, dh, v_new, dv_new, do, dq, dk, dv, dbeta, dg,
                          cu, indices, T, scale, bucket=_bucket(n_chunks), **consts)
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


def run_reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """The ``reference`` backend of both functionals: the fp32 time loop, output cast to q's dtype."""
    from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    o, final_state = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
                                                      output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return o.to(q.dtype), final_state


def _fla_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk  # the one place fla is imported

    return fla_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
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
    N, scale = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    backend = resolve(OP, q.device)
    if backend == "reference":
        return run_reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             cu_seqlens)
    if backend == "fla":
        return _fla_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens)
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
