"""Triton kernel of the token-by-token gated delta rule for decoding, and its tuning candidates.

One program per (sequence, value head, V block) walks the sequence's tokens with the state in fp32
registers: the recurrence of ``naive.py``, forward only (state in, state out). The raw gate's decay
(GATE), beta's sigmoid (BETA_MODE) and the V-first state layout (STATE_V_FIRST) are applied as each
value is loaded: no pass over memory of their own.
"""

import triton
import triton.language as tl

from dflash_kernels.ops.gated_delta_rule.kernels_fwd import gdn_beta, gdn_gate, load_state, sequence_bounds, store_state
from dflash_kernels.runtime import Config, TritonKernel


@triton.jit(do_not_specialize=["T"])
def _gdn_recurrent_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, h0_ptr, o_ptr, ht_ptr,
                              cu_seqlens_ptr, T, scale, eps, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
                              L2NORM: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr = False,
                              HAS_DT_BIAS: tl.constexpr = False, BETA_MODE: tl.constexpr = 0,
                              STATE_V_FIRST: tl.constexpr = False):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    bos, seqlen, _ = sequence_bounds(i_n, T, cu_seqlens_ptr, cu_seqlens_ptr, 1, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    if HAS_H0:
        b_h = load_state(h0_ptr + i_nh.to(tl.int64) * (K * V), o_k, o_v, m_kv, K, V, STATE_V_FIRST)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(seqlen):
        row = bos + t
        b_q = tl.load(q_ptr + row * (HK * K) + i_hk * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k_ptr + row * (HK * K) + i_hk * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v_ptr + row * (HV * V) + i_h * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_g = tl.load(g_ptr + row * HV + i_h).to(tl.float32)
        if GATE:
            b_g = gdn_gate(b_g, A_log_ptr, dt_bias_ptr, i_h, HAS_DT_BIAS)
        b_beta = gdn_beta(tl.load(beta_ptr + row * HV + i_h).to(tl.float32), BETA_MODE)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + eps)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + eps)
        b_h = b_h * tl.exp(b_g)
        b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h = b_h + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o_ptr + row * (HV * V) + i_h * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
    store_state(ht_ptr + i_nh.to(tl.int64) * (K * V), b_h, o_k, o_v, m_kv, K, V, STATE_V_FIRST)


gdn_recurrent_fwd_kernel = TritonKernel(
    _gdn_recurrent_fwd_kernel, name="gdn_recurrent",
    configs=[Config(BV=32, num_warps=4), Config(BV=16, num_warps=2), Config(BV=64, num_warps=8)],
    interpret_config=Config(BV=16))
