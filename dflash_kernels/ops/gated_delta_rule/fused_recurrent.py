"""Token-by-token gated delta rule for decoding: one program per (sequence, value head, V block).

Forward only (state in, state out); the recurrence of ``naive.py`` with the state in fp32 registers.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from dflash_kernels.ops.gated_delta_rule.chunk import L2NORM_EPS, OP, check_gdn_inputs, run_reference
from dflash_kernels.ops.gated_delta_rule.kernels_fwd import sequence_bounds
from dflash_kernels.runtime import Config, TritonKernel, alloc, resolve

__all__ = ["fused_recurrent_gated_delta_rule"]


@triton.jit(do_not_specialize=["T"])
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, o_ptr, ht_ptr, cu_seqlens_ptr, T, scale,
                          eps, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
                          L2NORM: tl.constexpr, BV: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    bos, seqlen, _ = sequence_bounds(i_n, T, cu_seqlens_ptr, cu_seqlens_ptr, 1, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    if HAS_H0:
        b_h = tl.load(h0_ptr + i_nh.to(tl.int64) * (K * V) + o_kv, mask=m_kv, other=0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(seqlen):
        row = bos + t
        b_q = tl.load(q_ptr + row * (HK * K) + i_hk * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k_ptr + row * (HK * K) + i_hk * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v_ptr + row * (HV * V) + i_h * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g = tl.load(g_ptr + row * HV + i_h).to(tl.float32)
        b_beta = tl.load(beta_ptr + row * HV + i_h).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + eps)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + eps)
        b_h = b_h * tl.exp(b_g)
        b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h = b_h + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o_ptr + row * (HV * V) + i_h * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    tl.store(ht_ptr + i_nh.to(tl.int64) * (K * V) + o_kv, b_h, mask=m_kv)


_recurrent = TritonKernel(_gdn_recurrent_kernel, name="gdn_recurrent",
                          configs=[Config(BV=32, num_warps=4), Config(BV=16, num_warps=2), Config(BV=64, num_warps=8)],
                          interpret_config=Config(BV=16))


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
    _recurrent(lambda m: (triton.cdiv(V, m["BV"]), N * Hv), q, k, v, g, beta, initial_state, o, final_state, cu,
               T, scale, L2NORM_EPS, bucket=(N * Hv,), HK=Hk, HV=Hv, K=K, V=V,
               BK=max(16, triton.next_power_of_2(K)), IS_VARLEN=cu is not None,
               HAS_H0=initial_state is not None, L2NORM=use_qk_l2norm)
    return o, final_state


@_gdn_recurrent_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm):
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return q.new_empty(B, T, Hv, V), q.new_empty(N, Hv, K, V, dtype=torch.float32)


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
    backend = resolve(OP, q.device)
    if backend == "reference":
        return run_reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             cu_seqlens)
    if backend == "fla":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

        return fla_recurrent(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, final_state = _gdn_recurrent_op(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                       beta.contiguous(), initial_state, cu_seqlens, scale,
                                       bool(use_qk_l2norm_in_kernel))
    return o, (final_state if output_final_state else None)
