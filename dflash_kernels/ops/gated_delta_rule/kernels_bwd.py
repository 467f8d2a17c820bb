"""Triton kernels of the chunked gated delta rule backward.

Notation of ``kernels_fwd.py`` (S0 = state at the chunk start, U = u - w S0, S1 = state at its end).
Two kernels, no atomics (deterministic):

``state`` (sequential, chunks in reverse, parallel over sequences, heads and V blocks). With dS1 the
gradient of the chunk's end state (dht for the last chunk):

    dU  = scale tril(Q K^T * Gamma)^T dO + (K * exp(G_last - G)) dS1     every path into U
    dS0 = exp(G_last) dS1 + scale (Q * exp(G))^T dO - w^T dU              passed to the chunk before

``local`` (parallel over chunks): every input gradient of one chunk from S0, dS1, U, dU and dO:

    dP  = scale tril(dO U^T)                  P_ij = q_i.k_j Gamma_ij
    dq  = scale exp(G) dO S0^T + (dP Gamma) K
    dk  = (dP Gamma)^T Q + exp(G_last - G) U dS1^T + diag(beta exp(G)) A^T dw + dR K + dR^T K
    dw  = -dU S0^T,  du = dU,  dA = dw X^T + du Y^T   (X = diag(beta e^G) K, Y = diag(beta) V)
    dL  = -A^T dA A^T (strictly lower),  dR = dL beta_i Gamma_ij
    Since U = u - w S0 = A (Y - X S0), Y - X S0 = (I + L) U = A^-1 U, so dA = dU U^T A^-T and
    dL = -(A^T dU) U^T: the same product from U alone, with no sum over the states' K columns.
    dv  = diag(beta) A^T dU
    dG  from every exp(G...) factor, then dg = the reverse cumulative sum of dG inside the chunk.

dq and dk are written per value head (fp32) and summed over each query/key head's group on the host.
To bound the registers, ``local`` runs one pass over V for what contracts over V only (dP, dv and dL),
then, with dL and dR known, one pass over column blocks of K (BKB wide): per block a V loop accumulates
its columns of dO S0^T, U dS1^T and dw, and the block's dq and dk (stored once) and its shares of dbeta
and dG follow.

The one-pass forms (comment above them) and the TritonKernel wrappers close the module (``ByPrecision``).
"""

import triton
import triton.language as tl

from dflash_kernels.ops.gated_delta_rule.kernels_fwd import (FP32_CONFIGS, ByPrecision, chunk_bounds, gdn_beta,
                                                             LOG_GATE_DECAY_CAP, gdn_gate_exponent, load_state,
                                                             sequence_bounds, store_state)
from dflash_kernels.runtime import Config


@triton.jit(do_not_specialize=["T"])
def _gdn_bwd_state_kernel(q_ptr, k_ptr, w_ptr, gcum_ptr, do_ptr, dht_ptr, dh_ptr, dvnew_ptr, dh0_ptr,
                          cu_seqlens_ptr, chunk_offsets_ptr, T, scale,
                          HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                          HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, BV: tl.constexpr,
                          LOOP_STAGES: tl.constexpr = None, STATE_V_FIRST: tl.constexpr = False):
    # STATE_V_FIRST: dht and dh0 are [V, K] per head, as the states they are gradients of.
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    bos, seqlen, boh = sequence_bounds(i_n, T, cu_seqlens_ptr, chunk_offsets_ptr, BT, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    if HAS_DHT:
        b_dh = load_state(dht_ptr + i_nh.to(tl.int64) * (K * V), o_k, o_v, m_kv, K, V, STATE_V_FIRST)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    dt = q_ptr.dtype.element_ty
    o_i = tl.arange(0, BT)
    NT = tl.cdiv(seqlen, BT)
    # LOOP_STAGES: the chunk loop's own pipelining depth (None: the launch's num_stages).
    for i_r in tl.range(0, NT, num_stages=LOOP_STAGES):
        i_t = NT - 1 - i_r
        tl.store(dh_ptr + ((boh + i_t) * HV + i_h) * (K * V) + o_kv, b_dh.to(dh_ptr.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < seqlen
        rows = bos + o_t
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_qk = rows[:, None] * (HK * K) + i_hk * K + o_k[None, :]
        b_q = tl.load(q_ptr + p_qk, mask=m_tk, other=0)
        b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0)
        b_w = tl.load(w_ptr + rows[:, None] * (HV * K) + i_h * K + o_k[None, :], mask=m_tk, other=0)
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_do = tl.load(do_ptr + p_v, mask=m_tv, other=0)
        last = tl.minimum(i_t * BT + BT, seqlen) - 1
        b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
        b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)

        causal = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
        b_P = tl.dot(b_q, tl.trans(b_k))
        b_P = tl.where(causal, b_P * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        b_dvnew = tl.dot(tl.trans(b_P.to(dt)), b_do) * scale
        b_kd = (b_k * tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))[:, None]).to(dt)
        b_dvnew += tl.dot(b_kd, b_dh.to(dt))
        tl.store(dvnew_ptr + p_v, b_dvnew.to(dvnew_ptr.dtype.element_ty), mask=m_tv)

        b_qg = (b_q * (tl.exp(tl.where(m_t, b_G, 0.0)) * scale)[:, None]).to(dt)
        b_dh = b_dh * tl.exp(b_Glast) + tl.dot(tl.trans(b_qg), b_do) - tl.dot(tl.trans(b_w), b_dvnew.to(dt))
    if HAS_H0:
        store_state(dh0_ptr + i_nh.to(tl.int64) * (K * V), b_dh, o_k, o_v, m_kv, K, V, STATE_V_FIRST)


@triton.jit(do_not_specialize=["T"])
def _gdn_bwd_local_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, gcum_ptr, A_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr,
                          do_ptr, dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr,
                          dA_log_ptr, ddt_bias_ptr, cu_seqlens_ptr, chunk_indices_ptr, T, scale,
                          HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, BV: tl.constexpr,
                          BKB: tl.constexpr, GATE: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False,
                          BETA_MODE: tl.constexpr = 0):
    # BETA_MODE (beta passed as logits): beta is their sigmoid wherever it is loaded, and dbeta is
    # stored as the logits' gradient. GATE (g passed raw): dg is stored as the raw gate's gradient,
    # and the chunk's sums of the A_log and dt_bias gradients go to dA_log[i_c, i_h] and
    # ddt_bias[i_c, i_h] (summed over the chunks on the host: deterministic, no atomics).
    # K is processed in column blocks of KB: every K-wide product is separable over them, so only one
    # block's [BT, KB] accumulators are live at a time (K-wide ones spill registers on sm_90 builds).
    KB: tl.constexpr = BKB if BKB < BK else BK
    # The V loops' block: 32 whenever K's block is 32. On sm_90 (triton 3.6) BK = 32 with a V block of 16 or
    # 64 over a single V iteration compiles to an out-of-range shared-memory access (compute-sanitizer: the
    # b_kf line below; garbage dk, dg and dbeta, or an illegal memory access that kills the CUDA context
    # when the tuner times the candidate), seen at V = 16, 32 and 64; BV = 32 was right at every such V.
    VB: tl.constexpr = 32 if BK == 32 else BV
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_i = tl.arange(0, BT)
    dt = q_ptr.dtype.element_ty

    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
    last = tl.minimum(i_t * BT + BT, seqlen) - 1
    b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)
    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.where(m_t, gdn_beta(b_beta, BETA_MODE), 0.0)
    b_Ad = tl.load(A_ptr + rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :], mask=m_t[:, None], other=0).to(dt)
    b_eG = tl.exp(tl.where(m_t, b_G, 0.0))
    b_edec = tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))
    b_bg = b_beta * b_eG

    # Pass over V for the products that contract over V only: dP, dv, dbeta's Y share and dL.
    # The products with dU run in the input precision, as the forward's u = A (beta V) does.
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)   # dO U^T
    b_dL = tl.zeros([BT, BT], dtype=tl.float32)   # -(A^T dU) U^T
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, VB)):
        o_v = i_v * VB + tl.arange(0, VB)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_vnew = tl.load(vnew_ptr + p_v, mask=m_tv, other=0)
        b_do = tl.load(do_ptr + p_v, mask=m_tv, other=0)
        b_dP += tl.dot(b_do, tl.trans(b_vnew))
        b_dvnew = tl.load(dvnew_ptr + p_v, mask=m_tv, other=0).to(dt)
        b_v = tl.load(v_ptr + p_v, mask=m_tv, other=0).to(tl.float32)
        b_dY = tl.dot(tl.trans(b_Ad), b_dvnew)
        tl.store(dv_ptr + p_v, (b_dY * b_beta[:, None]).to(dv_ptr.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_dY * b_v, 1)
        b_dL -= tl.dot(b_dY.to(dt), tl.trans(b_vnew.to(dt)))

    # Intra-chunk attention term.
    causal = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    gamma = tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0))
    b_dPG = tl.where(causal, b_dP * scale * gamma, 0.0)
    b_dPGd = b_dPG.to(dt)
    o_kw = tl.arange(0, BK)
    m_tkw = m_t[:, None] & (o_kw < K)[None, :]
    p_qkw = rows[:, None] * (HK * K) + i_hk * K + o_kw[None, :]
    b_kw = tl.load(k_ptr + p_qkw, mask=m_tkw, other=0)
    b_qk = tl.dot(tl.load(q_ptr + p_qkw, mask=m_tkw, other=0), tl.trans(b_kw))
    b_t = b_dPG * b_qk
    b_dG = tl.sum(b_t, 1) - tl.sum(b_t, 0)

    # The inverse's input L = strictly lower beta_i (K K^T)_ij Gamma_ij: its gradient's shares of dbeta
    # and dG now, of dk (dR K + dR^T K) in the K blocks below.
    strict = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_dL = tl.where(strict, b_dL, 0.0)
    gamma_s = tl.where(strict, tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_dLg = b_dL * gamma_s
    b_dR = b_dLg * b_beta[:, None]
    b_dRd = b_dR.to(dt)
    b_kk = tl.dot(b_kw, tl.trans(b_kw))
    b_dbeta += tl.sum(b_dLg * b_kk, 1)
    b_t3 = b_dR * b_kk
    b_dG += tl.sum(b_t3, 1) - tl.sum(b_t3, 0)

    b_hdh = tl.zeros([KB], dtype=tl.float32)      # partial sums of S0 * dS1 (for dG_last)
    b_t2s = tl.zeros([BT], dtype=tl.float32)      # the state path's share of dG_last
    p_h = (i_c.to(tl.int64) * HV + i_h) * (K * V)
    # Pass over the K blocks: each block's dq and dk (final), and its shares of dbeta, dG and dG_last.
    for i_kb in range(BK // KB):
        o_k = i_kb * KB + tl.arange(0, KB)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_qk = rows[:, None] * (HK * K) + i_hk * K + o_k[None, :]
        b_q = tl.load(q_ptr + p_qk, mask=m_tk, other=0)
        b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0)

        # The products that contract over V and involve the chunk's states.
        b_dq = tl.zeros([BT, KB], dtype=tl.float32)   # dO S0^T
        b_dks = tl.zeros([BT, KB], dtype=tl.float32)  # U dS1^T
        b_dw = tl.zeros([BT, KB], dtype=tl.float32)   # -dU S0^T
        for i_v in range(tl.cdiv(V, VB)):
            o_v = i_v * VB + tl.arange(0, VB)
            m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            o_kv = o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h_ptr + p_h + o_kv, mask=m_kv, other=0)
            b_dh = tl.load(dh_ptr + p_h + o_kv, mask=m_kv, other=0)
            p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
            b_vnew = tl.load(vnew_ptr + p_v, mask=m_tv, other=0)
            b_dvnew = tl.load(dvnew_ptr + p_v, mask=m_tv, other=0)
            b_do = tl.load(do_ptr + p_v, mask=m_tv, other=0)
            b_dq += tl.dot(b_do, tl.trans(b_h))
            b_dks += tl.dot(b_vnew, tl.trans(b_dh))
            b_dw -= tl.dot(b_dvnew.to(dt), tl.trans(b_h))
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)

        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        b_dq = b_dq * (scale * b_eG)[:, None]
        b_dG += tl.sum(b_dq * b_qf, 1)
        b_dq += tl.dot(b_dPGd, b_k)
        p_dqk = rows[:, None] * (HV * K) + i_h * K + o_k[None, :]
        tl.store(dq_ptr + p_dqk, b_dq, mask=m_tk)

        # State paths: S1 = exp(G_last) S0 + (K * exp(G_last - G))^T U.
        b_dk = tl.dot(tl.trans(b_dPGd), b_q) + b_dks * b_edec[:, None]
        b_t2 = tl.sum(b_dks * b_kf * b_edec[:, None], 1)
        b_dG -= b_t2
        b_t2s += b_t2

        # WY representation: w = A X, then A = (I + L)^-1 (L's share above).
        b_X = b_kf * b_bg[:, None]
        # A^T loaded per block: hoisted out of the loops, the transposed operand holds registers throughout.
        b_At = tl.load(A_ptr + rows[None, :] * (HV * BT) + i_h * BT + o_i[:, None], mask=m_t[None, :], other=0)
        b_dX = tl.dot(b_At.to(dt), b_dw.to(dt))
        b_dk += b_dX * b_bg[:, None]
        b_dk += tl.dot(b_dRd, b_k) + tl.dot(tl.trans(b_dRd), b_k)
        b_dbeta += tl.sum(b_dX * b_kf * b_eG[:, None], 1)
        b_dG += tl.sum(b_dX * b_X, 1)
        tl.store(dk_ptr + p_dqk, b_dk, mask=m_tk)
    b_dGlast = tl.exp(b_Glast) * tl.sum(b_hdh, 0) + tl.sum(b_t2s, 0)

    # Reloaded rather than kept live through the K blocks (registers).
    b_braw = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_dG += tl.where(o_t == last, b_dGlast, 0.0)
    b_dg = tl.sum(b_dG, 0) - tl.cumsum(b_dG, 0) + b_dG

    if BETA_MODE != 0:  # d beta / d logit = s * sigmoid * (1 - sigmoid), s = 1 or 2
        b_sig = tl.sigmoid(b_braw)
        b_dbeta = b_dbeta * (b_sig * (1.0 - b_sig) * BETA_MODE)
    tl.store(dbeta_ptr + rows * HV + i_h, b_dbeta, mask=m_t)
    if GATE:
        # decay = -exp(A_log) softplus(x), x = g + dt_bias: d/dx = -exp(A_log) sigmoid(x), d/dA_log = decay,
        # both 0 where the forward floored the decay. exp(A_log) sigmoid(x) is taken as
        # exp(A_log + logsigmoid(x)): below the floor it is at most exp(LOG_GATE_DECAY_CAP) (sigmoid <= softplus).
        b_x = tl.load(g_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
        if HAS_DT_BIAS:
            b_x = b_x + tl.load(dt_bias_ptr + i_h).to(tl.float32)
        b_A = tl.load(A_log_ptr + i_h).to(tl.float32)
        b_e = gdn_gate_exponent(b_x, b_A)
        b_free = m_t & ~(b_e > LOG_GATE_DECAY_CAP)  # NaN exponents stay: their gradients are NaN
        b_dA_log = tl.sum(tl.where(b_free, b_dg * -tl.exp(b_e), 0.0), 0)
        b_logsig = tl.minimum(b_x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(b_x)))
        b_dg = tl.where(b_free, b_dg * -tl.exp(b_A + b_logsig), 0.0)
        tl.store(dA_log_ptr + i_c * HV + i_h, b_dA_log)
        if HAS_DT_BIAS:
            tl.store(ddt_bias_ptr + i_c * HV + i_h, tl.sum(b_dg, 0))
    tl.store(dg_ptr + rows * HV + i_h, b_dg, mask=m_t)


# The one-pass forms of ``local`` (DFLASH_KERNELS_GDN_BWD_LOCAL=onepass / group). They follow the kernels above
# rather than sharing helpers with them or text in the module docstring: the two-pass kernels' sources and line
# numbers (their Triton cache keys, by which the shipped tuning results are found) stay as they were.
#
# ``onepass``: the same outputs as ``local``, parallel over chunks, K whole and one pass over V: each V tile of U,
# dO, dU, S0 and dS1 is read once and every product over V is taken from it: dP, dv and dL as in ``local``, and
# the [BT, K] accumulators dO S0^T, U dS1^T and A^T dw. The last needs neither dw nor a second use of A:
# A^T dw = -(A^T dU) S0^T = -dY S0^T with dY = A^T dU, formed for dv already. dq, dk, dbeta and dG follow the
# loop as in ``local``.
#
# ``group`` (GROUP): one program per chunk and key head, over its HV // HK value heads in order, summing their
# dq and dk in registers (deterministic, no atomics), then, with the in-kernel l2norm, its backward; dq and dk
# are stored once, [B, T, HK, K] in the inputs' dtype (no fp32 per-value-head dq / dk, no l2norm backward
# launches). To hold the sums in the V loop's own accumulators, each product's row scaling goes onto its V tile
# first: dq += (scale e^G dO) S0^T and dk += (e^(G_last - G) U) dS1^T - (beta e^G dY) S0^T. The row sums that
# dG and dbeta take from one head's products are taken over V instead: rowsum((dO S0^T) * Q) = rowsum(dO * (Q S0)),
# rowsum((U dS1^T) * K) = rowsum(U * (K dS1)), rowsum((dY S0^T) * K) = rowsum(dY * (K S0)).


@triton.jit
def _store_dbeta_dg(b_dbeta, b_dG, rows, m_t, i_c, i_h, beta_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr,
                    dA_log_ptr, ddt_bias_ptr, HV: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                    BETA_MODE: tl.constexpr):
    """The two-pass kernel's tail (its copy), for the one-pass forms: store one chunk's and value head's dbeta
    and dg from dbeta (of beta) and dG (of the cumulative log decay G): dg is dG's reverse cumulative sum inside the
    chunk; with BETA_MODE / GATE, the gradients of the logits / of the raw gate, and the chunk's shares of the
    A_log and dt_bias gradients."""
    # beta reloaded rather than kept live through the kernel's loops (registers).
    b_braw = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_dg = tl.sum(b_dG, 0) - tl.cumsum(b_dG, 0) + b_dG

    if BETA_MODE != 0:  # d beta / d logit = s * sigmoid * (1 - sigmoid), s = 1 or 2
        b_sig = tl.sigmoid(b_braw)
        b_dbeta = b_dbeta * (b_sig * (1.0 - b_sig) * BETA_MODE)
    tl.store(dbeta_ptr + rows * HV + i_h, b_dbeta, mask=m_t)
    if GATE:
        # decay = -exp(A_log) softplus(x), x = g + dt_bias: d/dx = -exp(A_log) sigmoid(x), d/dA_log = decay,
        # both 0 where the forward floored the decay. exp(A_log) sigmoid(x) is taken as
        # exp(A_log + logsigmoid(x)): below the floor it is at most exp(LOG_GATE_DECAY_CAP) (sigmoid <= softplus).
        b_x = tl.load(g_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
        if HAS_DT_BIAS:
            b_x = b_x + tl.load(dt_bias_ptr + i_h).to(tl.float32)
        b_A = tl.load(A_log_ptr + i_h).to(tl.float32)
        b_e = gdn_gate_exponent(b_x, b_A)
        b_free = m_t & ~(b_e > LOG_GATE_DECAY_CAP)  # NaN exponents stay: their gradients are NaN
        b_dA_log = tl.sum(tl.where(b_free, b_dg * -tl.exp(b_e), 0.0), 0)
        b_logsig = tl.minimum(b_x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(b_x)))
        b_dg = tl.where(b_free, b_dg * -tl.exp(b_A + b_logsig), 0.0)
        tl.store(dA_log_ptr + i_c * HV + i_h, b_dA_log)
        if HAS_DT_BIAS:
            tl.store(ddt_bias_ptr + i_c * HV + i_h, tl.sum(b_dg, 0))
    tl.store(dg_ptr + rows * HV + i_h, b_dg, mask=m_t)


@triton.jit
def _gdn_bwd_attn_terms(b_dP, b_q, b_k, b_G, m_t, scale, BT: tl.constexpr):
    """The intra-chunk attention term of one chunk and value head from dP = dO U^T: (dP Gamma in the input
    precision, its share of dG)."""
    o_i = tl.arange(0, BT)
    causal = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    gamma = tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0))
    b_dPG = tl.where(causal, b_dP * scale * gamma, 0.0)
    b_t = b_dPG * tl.dot(b_q, tl.trans(b_k))
    return b_dPG.to(b_q.dtype), tl.sum(b_t, 1) - tl.sum(b_t, 0)


@triton.jit
def _gdn_bwd_inverse_terms(b_dL, b_k, b_G, b_beta, m_t, BT: tl.constexpr):
    """The terms of the inverse's input L = strictly lower beta_i (K K^T)_ij Gamma_ij of one chunk and value head
    from dL = -(A^T dU) U^T: (dR = dL beta_i Gamma_ij in the input precision, its share of dG, of dbeta)."""
    o_i = tl.arange(0, BT)
    strict = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_dL = tl.where(strict, b_dL, 0.0)
    gamma_s = tl.where(strict, tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_dLg = b_dL * gamma_s
    b_dR = b_dLg * b_beta[:, None]
    b_kk = tl.dot(b_k, tl.trans(b_k))
    b_t3 = b_dR * b_kk
    return b_dR.to(b_k.dtype), tl.sum(b_t3, 1) - tl.sum(b_t3, 0), tl.sum(b_dLg * b_kk, 1)


@triton.jit
def _gdn_bwd_chunk_terms(b_dP, b_dL, b_q, b_k, b_G, b_beta, m_t, scale, BT: tl.constexpr):
    """``_gdn_bwd_attn_terms`` then ``_gdn_bwd_inverse_terms``: (dP Gamma, dR, their shares of dG, dL's of dbeta)."""
    b_dPGd, b_dG = _gdn_bwd_attn_terms(b_dP, b_q, b_k, b_G, m_t, scale, BT)
    b_dRd, b_dGL, b_dbL = _gdn_bwd_inverse_terms(b_dL, b_k, b_G, b_beta, m_t, BT)
    return b_dPGd, b_dRd, b_dG + b_dGL, b_dbL


@triton.jit
def _gdn_bwd_onepass_head(q_ptr, k_ptr, v_ptr, beta_ptr, gcum_ptr, A_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr, do_ptr,
                          dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr, dA_log_ptr,
                          ddt_bias_ptr, i_c, i_h, i_hk, bos, seqlen, i_t, scale, HK: tl.constexpr, HV: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, VB: tl.constexpr,
                          GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_MODE: tl.constexpr):
    """One chunk and value head of ``_gdn_bwd_onepass_kernel`` without GROUP: stores dv, dbeta, dg (and the
    gate's shares), and dq, dk per value head (fp32 [B, T, HV, K])."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    dt = q_ptr.dtype.element_ty

    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.where(m_t, gdn_beta(b_beta, BETA_MODE), 0.0)
    b_Ad = tl.load(A_ptr + rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :], mask=m_t[:, None], other=0).to(dt)

    # The one pass over V: every product that contracts over V, each tile of U, dO, dU, S0 and dS1 read once.
    # The products with dU run in the input precision, as the forward's u = A (beta V) does.
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)   # dO U^T
    b_dL = tl.zeros([BT, BT], dtype=tl.float32)   # -(A^T dU) U^T
    b_dqs = tl.zeros([BT, BK], dtype=tl.float32)  # dO S0^T
    b_dks = tl.zeros([BT, BK], dtype=tl.float32)  # U dS1^T
    b_dX = tl.zeros([BT, BK], dtype=tl.float32)   # A^T dw = -(A^T dU) S0^T: dY's product, no second use of A
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)      # partial sums of S0 * dS1 (for dG_last)
    p_h = (i_c.to(tl.int64) * HV + i_h) * (K * V)
    for i_v in range(tl.cdiv(V, VB)):
        o_v = i_v * VB + tl.arange(0, VB)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        o_kv = o_k[:, None] * V + o_v[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_vnew = tl.load(vnew_ptr + p_v, mask=m_tv, other=0)
        b_do = tl.load(do_ptr + p_v, mask=m_tv, other=0)
        b_dvnew = tl.load(dvnew_ptr + p_v, mask=m_tv, other=0).to(dt)
        b_h = tl.load(h_ptr + p_h + o_kv, mask=m_kv, other=0)
        b_dh = tl.load(dh_ptr + p_h + o_kv, mask=m_kv, other=0)
        b_dP += tl.dot(b_do, tl.trans(b_vnew))
        b_dqs += tl.dot(b_do, tl.trans(b_h))
        b_dks += tl.dot(b_vnew, tl.trans(b_dh))
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
        b_dY = tl.dot(tl.trans(b_Ad), b_dvnew)
        tl.store(dv_ptr + p_v, (b_dY * b_beta[:, None]).to(dv_ptr.dtype.element_ty), mask=m_tv)
        b_v = tl.load(v_ptr + p_v, mask=m_tv, other=0).to(tl.float32)
        b_dbeta += tl.sum(b_dY * b_v, 1)
        b_dYd = b_dY.to(dt)
        b_dL -= tl.dot(b_dYd, tl.trans(b_vnew))
        b_dX -= tl.dot(b_dYd, tl.trans(b_h))

    # What the V loop does not need is loaded after it (registers).
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
    last = tl.minimum(i_t * BT + BT, seqlen) - 1
    b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)
    b_eG = tl.exp(tl.where(m_t, b_G, 0.0))
    b_edec = tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))
    b_bg = b_beta * b_eG
    p_qk = rows[:, None] * (HK * K) + i_hk * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q_ptr + p_qk, mask=m_tk, other=0)
    b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0)
    b_kf = b_k.to(tl.float32)
    b_dPGd, b_dRd, b_dG, b_dbL = _gdn_bwd_chunk_terms(b_dP, b_dL, b_q, b_k, b_G, b_beta, m_t, scale, BT)
    b_dbeta += b_dbL
    p_d = rows[:, None] * (HV * K) + i_h * K + o_k[None, :]

    b_dq = b_dqs * (scale * b_eG)[:, None]
    b_dG += tl.sum(b_dq * b_q.to(tl.float32), 1)
    b_dq += tl.dot(b_dPGd, b_k)
    tl.store(dq_ptr + p_d, b_dq, mask=m_tk)

    # State paths: S1 = exp(G_last) S0 + (K * exp(G_last - G))^T U.
    b_dk = tl.dot(tl.trans(b_dPGd), b_q) + b_dks * b_edec[:, None]
    b_t2 = tl.sum(b_dks * b_kf, 1) * b_edec
    b_dG -= b_t2
    # WY representation: w = A X, X = diag(beta e^G) K.
    b_dk += b_dX * b_bg[:, None]
    b_dXk = tl.sum(b_dX * b_kf, 1)
    b_dbeta += b_dXk * b_eG
    b_dG += b_dXk * b_bg
    # A = (I + L)^-1: L's gradient.
    b_dk += tl.dot(b_dRd, b_k) + tl.dot(tl.trans(b_dRd), b_k)
    tl.store(dk_ptr + p_d, b_dk, mask=m_tk)

    b_dGlast = tl.exp(b_Glast) * tl.sum(b_hdh, 0) + tl.sum(b_t2, 0)
    b_dG += tl.where(o_t == last, b_dGlast, 0.0)
    _store_dbeta_dg(b_dbeta, b_dG, rows, m_t, i_c, i_h, beta_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr,
                    dA_log_ptr, ddt_bias_ptr, HV, GATE, HAS_DT_BIAS, BETA_MODE)


@triton.jit
def _gdn_bwd_group_head(b_q, b_k, b_dq, b_dk, v_ptr, beta_ptr, gcum_ptr, A_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr,
                        do_ptr, dv_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr, dA_log_ptr, ddt_bias_ptr,
                        i_c, i_h, bos, seqlen, i_t, scale, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, VB: tl.constexpr, GATE: tl.constexpr,
                        HAS_DT_BIAS: tl.constexpr, BETA_MODE: tl.constexpr):
    """One chunk and value head of ``_gdn_bwd_onepass_kernel`` with GROUP: stores dv, dbeta, dg (and the gate's
    shares) and returns the key head's running dq and dk with this head's added.

    dq and dk are summed over the group in the V loop's own accumulators: their products' row scalings
    (scale e^G, e^(G_last - G), beta e^G) are applied to the V tiles before the products, so the products of
    every head add up in one [BT, K] accumulator each. What dG and dbeta need from a single head, the row sums
    of (dO S0^T) * q, (U dS1^T) * k and (dY S0^T) * k, are taken over V instead: dO * (q S0), U * (k dS1) and
    dY * (k S0), from [BT, V] tiles (more products, two [BT, K] accumulators fewer)."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    dt = b_q.dtype

    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.where(m_t, gdn_beta(b_beta, BETA_MODE), 0.0)
    b_Ad = tl.load(A_ptr + rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :], mask=m_t[:, None], other=0).to(dt)
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
    last = tl.minimum(i_t * BT + BT, seqlen) - 1
    b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)
    b_eG = tl.exp(tl.where(m_t, b_G, 0.0))
    b_edec = tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))
    b_bg = b_beta * b_eG
    b_sq = b_eG * scale

    b_dP = tl.zeros([BT, BT], dtype=tl.float32)   # dO U^T
    b_dL = tl.zeros([BT, BT], dtype=tl.float32)   # -(A^T dU) U^T
    b_rq = tl.zeros([BT], dtype=tl.float32)       # row sums of (dO S0^T) * q
    b_rk = tl.zeros([BT], dtype=tl.float32)       # row sums of (U dS1^T) * k
    b_rx = tl.zeros([BT], dtype=tl.float32)       # row sums of (dY S0^T) * k, dY = A^T dU
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)      # partial sums of S0 * dS1 (for dG_last)
    p_h = (i_c.to(tl.int64) * HV + i_h) * (K * V)
    for i_v in range(tl.cdiv(V, VB)):
        o_v = i_v * VB + tl.arange(0, VB)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        m_kv = m_k[:, None] & (o_v < V)[None, :]
        o_kv = o_k[:, None] * V + o_v[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_vnew = tl.load(vnew_ptr + p_v, mask=m_tv, other=0)
        b_do = tl.load(do_ptr + p_v, mask=m_tv, other=0)
        b_dvnew = tl.load(dvnew_ptr + p_v, mask=m_tv, other=0).to(dt)
        b_h = tl.load(h_ptr + p_h + o_kv, mask=m_kv, other=0)
        b_dh = tl.load(dh_ptr + p_h + o_kv, mask=m_kv, other=0)
        b_dP += tl.dot(b_do, tl.trans(b_vnew))
        b_dq += tl.dot((b_do * b_sq[:, None]).to(dt), tl.trans(b_h))
        b_rq += tl.sum(b_do.to(tl.float32) * tl.dot(b_q, b_h), 1)
        b_dk += tl.dot((b_vnew * b_edec[:, None]).to(dt), tl.trans(b_dh))
        b_rk += tl.sum(b_vnew.to(tl.float32) * tl.dot(b_k, b_dh), 1)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
        b_dY = tl.dot(tl.trans(b_Ad), b_dvnew)
        tl.store(dv_ptr + p_v, (b_dY * b_beta[:, None]).to(dv_ptr.dtype.element_ty), mask=m_tv)
        b_v = tl.load(v_ptr + p_v, mask=m_tv, other=0).to(tl.float32)
        b_dbeta += tl.sum(b_dY * b_v, 1)
        b_dL -= tl.dot(b_dY.to(dt), tl.trans(b_vnew))
        b_dk -= tl.dot((b_dY * b_bg[:, None]).to(dt), tl.trans(b_h))
        b_rx += tl.sum(b_dY * tl.dot(b_k, b_h), 1)

    b_dPGd, b_dG = _gdn_bwd_attn_terms(b_dP, b_q, b_k, b_G, m_t, scale, BT)
    b_dq += tl.dot(b_dPGd, b_k)
    b_dk += tl.dot(tl.trans(b_dPGd), b_q)
    b_dRd, b_dGL, b_dbL = _gdn_bwd_inverse_terms(b_dL, b_k, b_G, b_beta, m_t, BT)
    b_dk += tl.dot(b_dRd, b_k) + tl.dot(tl.trans(b_dRd), b_k)
    b_dbeta += b_dbL - b_rx * b_eG
    b_t2 = b_rk * b_edec
    b_dG += b_dGL + b_rq * b_sq - b_t2 - b_rx * b_bg

    b_dGlast = tl.exp(b_Glast) * tl.sum(b_hdh, 0) + tl.sum(b_t2, 0)
    b_dG += tl.where(o_t == last, b_dGlast, 0.0)
    _store_dbeta_dg(b_dbeta, b_dG, rows, m_t, i_c, i_h, beta_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr,
                    dA_log_ptr, ddt_bias_ptr, HV, GATE, HAS_DT_BIAS, BETA_MODE)
    return b_dq, b_dk


@triton.jit(do_not_specialize=["T"])
def _gdn_bwd_onepass_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, gcum_ptr, A_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr,
                            do_ptr, dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr,
                            dA_log_ptr, ddt_bias_ptr, q_in_ptr, k_in_ptr, q_rstd_ptr, k_rstd_ptr, cu_seqlens_ptr,
                            chunk_indices_ptr, T, scale, SQ, SK,
                            HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, BV: tl.constexpr,
                            GATE: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False,
                            BETA_MODE: tl.constexpr = 0, GROUP: tl.constexpr = False, L2NORM: tl.constexpr = False):
    # Without GROUP: one program per (chunk, value head), dq and dk stored per value head in fp32 ([B, T, HV, K],
    # summed over each key head's group by the launcher's l2norm backward, or on the host), as the two-pass kernel.
    # GROUP: one program per (chunk, key head) running its HV // HK value heads in order and summing their dq
    # and dk in registers (a fixed order: deterministic, no atomics); with L2NORM the l2norm backward follows
    # (q_in, k_in: the raw inputs, rows SQ / SK apart; q_rstd, k_rstd [B, T, HK]), and dq, dk are stored once,
    # in their dtype, [B, T, HK, K]. Both store dv, dbeta and dg (and the gate's shares) per value head.
    # The V loop's block: 32 whenever K's block is 32, as in the two-pass kernel, whose sm_90 build at BK = 32
    # with one V iteration of 16 or 64 accessed shared memory out of range (see there).
    VB: tl.constexpr = 32 if BK == 32 else BV
    G: tl.constexpr = HV // HK
    i_c, i_hd = tl.program_id(0), tl.program_id(1)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    if GROUP:
        # q and k once for the group; dq and dk summed over its value heads in order (_gdn_bwd_group_head).
        p_qk = rows[:, None] * (HK * K) + i_hd * K + o_k[None, :]
        b_q = tl.load(q_ptr + p_qk, mask=m_tk, other=0)
        b_k = tl.load(k_ptr + p_qk, mask=m_tk, other=0)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        for i_g in range(G):
            b_dq, b_dk = _gdn_bwd_group_head(
                b_q, b_k, b_dq, b_dk, v_ptr, beta_ptr, gcum_ptr, A_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr, do_ptr,
                dv_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr, dA_log_ptr, ddt_bias_ptr, i_c,
                i_hd * G + i_g, bos, seqlen, i_t, scale, HV, K, V, BT, BK, VB, GATE, HAS_DT_BIAS, BETA_MODE)
        if L2NORM:
            # dx = rstd (dy - y sum(dy y)), y = x rstd in fp32 (kernels_l2norm.py).
            p_r = rows * HK + i_hd
            b_rstd = tl.load(q_rstd_ptr + p_r, mask=m_t, other=0)
            b_y = tl.load(q_in_ptr + rows[:, None] * SQ + i_hd * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
            b_y = b_y * b_rstd[:, None]
            b_dq = b_rstd[:, None] * (b_dq - b_y * tl.sum(b_dq * b_y, 1)[:, None])
            b_rstd = tl.load(k_rstd_ptr + p_r, mask=m_t, other=0)
            b_y = tl.load(k_in_ptr + rows[:, None] * SK + i_hd * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
            b_y = b_y * b_rstd[:, None]
            b_dk = b_rstd[:, None] * (b_dk - b_y * tl.sum(b_dk * b_y, 1)[:, None])
        tl.store(dq_ptr + p_qk, b_dq.to(dq_ptr.dtype.element_ty), mask=m_tk)
        tl.store(dk_ptr + p_qk, b_dk.to(dk_ptr.dtype.element_ty), mask=m_tk)
    else:
        _gdn_bwd_onepass_head(q_ptr, k_ptr, v_ptr, beta_ptr, gcum_ptr, A_ptr, h_ptr, dh_ptr, vnew_ptr, dvnew_ptr,
                              do_ptr, dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, g_ptr, A_log_ptr, dt_bias_ptr,
                              dA_log_ptr, ddt_bias_ptr, i_c, i_hd, i_hd // G, bos, seqlen, i_t, scale, HK, HV, K, V,
                              BT, BK, VB, GATE, HAS_DT_BIAS, BETA_MODE)

# LOOP_STAGES=3: the chunk loop pipelined three deep (no register spills on sm_90, where the 2-stage
# configs spill); forced alone it made the forward+backward faster (benchmarks/results/README.md).
gdn_bwd_state_kernel = ByPrecision(
    _gdn_bwd_state_kernel, "gdn_bwd_state",
    [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
     Config(BV=16, num_warps=4), Config(BV=16, num_warps=8), Config(BV=64, num_warps=8, LOOP_STAGES=3)],
    FP32_CONFIGS)
gdn_bwd_local_kernel = ByPrecision(
    _gdn_bwd_local_kernel, "gdn_bwd_local",
    [Config(BV=32, BKB=64, num_warps=8), Config(BV=64, BKB=64, num_warps=8),
     Config(BV=32, BKB=32, num_warps=8), Config(BV=64, BKB=32, num_warps=8),
     Config(BV=64, BKB=64, num_warps=8, num_stages=3), Config(BV=64, BKB=128, num_warps=8)],
    [Config(BV=16, BKB=64, num_warps=4, num_stages=1), Config(BV=32, BKB=64, num_warps=4, num_stages=1)],
    Config(BV=16, BKB=16))
# The one-pass local backward (DFLASH_KERNELS_GDN_BWD_LOCAL=onepass / group): K whole, so only the V block and
# the pipelining depth are tuned, at 8 warps: the V loop's fp32 accumulators ([BT, K] three, [BT, BT] two) take
# about half the register file there. The candidates are those whose sm_90 build spills no register, or only a
# few, inside the V loop (tools/studies/sm90_resources.py); the group form's extra [BT, V] products spill
# heavily there at BV=64. fp32 inputs: 4 warps, one stage, as every fp32 list (ByPrecision says why).
gdn_bwd_onepass_kernel = ByPrecision(
    _gdn_bwd_onepass_kernel, "gdn_bwd_onepass",
    [Config(BV=32, num_warps=8), Config(BV=64, num_warps=8), Config(BV=32, num_warps=8, num_stages=3),
     Config(BV=16, num_warps=8)],
    [Config(BV=16, num_warps=4, num_stages=1), Config(BV=32, num_warps=4, num_stages=1)],
    Config(BV=16))
gdn_bwd_group_kernel = ByPrecision(
    _gdn_bwd_onepass_kernel, "gdn_bwd_onepass_group",
    [Config(BV=16, num_warps=8), Config(BV=32, num_warps=8), Config(BV=16, num_warps=8, num_stages=3),
     Config(BV=32, num_warps=8, num_stages=3)],
    [Config(BV=16, num_warps=4, num_stages=1), Config(BV=32, num_warps=4, num_stages=1)],
    Config(BV=16))
