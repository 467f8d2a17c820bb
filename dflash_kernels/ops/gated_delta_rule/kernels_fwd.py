"""Triton kernels of the chunked gated delta rule forward (one chunk = BT = 64 tokens).

Per value head, with the state S [K, V] at the start of a chunk (S0), G = the cumulative sum of g
inside the chunk and Gamma_ij = exp(G_i - G_j), the recurrence of ``naive.py`` unrolled over one
chunk reads (the WY / UT transform of the DeltaNet chunkwise papers):

    L  = strictly_lower(diag(beta) K K^T * Gamma)        [BT, BT]
    A  = (I + L)^-1                                       unit lower triangular
    w  = A diag(beta exp(G)) K,   u = A diag(beta) V      [BT, K], [BT, V]
    U  = u - w S0                                         the delta-rule "new values"
    o  = scale (diag(exp(G)) Q S0 + tril(Q K^T * Gamma) U)
    S1 = exp(G_last) S0 + (K * exp(G_last - G))^T U       the state at the chunk end

Three kernels: ``prep`` (G, A, w, u; parallel over chunks), ``state`` (the sequential S0 -> S1 scan,
parallel over sequences, heads and V blocks) and ``output`` (parallel over chunks).

Layouts: tokens are flattened to rows ``bos + t`` (``bos`` = the sequence's first row), so a batch
of B equal sequences and a packed ``cu_seqlens`` batch share one code path. Per-chunk buffers
(states ``h``) are indexed by the global chunk number, sequence after sequence.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row of the sequence, its length, index of the chunk inside it) for global chunk ``i_c``."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices_ptr + 2 * i_c)
        i_t = tl.load(chunk_indices_ptr + 2 * i_c + 1)
        bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
        seqlen = (tl.load(cu_seqlens_ptr + i_n + 1) - tl.load(cu_seqlens_ptr + i_n)).to(tl.int32)
    else:
        NT = tl.cdiv(T, BT)
        i_n = i_c // NT
        i_t = i_c % NT
        bos = i_n.to(tl.int64) * T
        seqlen = T + 0 * i_c
    return bos, seqlen, i_t


@triton.jit
def sequence_bounds(i_n, T, cu_seqlens_ptr, chunk_offsets_ptr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row, length, global index of the first chunk) of sequence ``i_n``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
        seqlen = (tl.load(cu_seqlens_ptr + i_n + 1) - tl.load(cu_seqlens_ptr + i_n)).to(tl.int32)
        boh = tl.load(chunk_offsets_ptr + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        seqlen = T + 0 * i_n
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, seqlen, boh


@triton.jit
def unit_lower_inverse(L, BT: tl.constexpr):
    """(I + L)^-1 for a strictly lower triangular [BT, BT] fp32 tile, by forward substitution.

    Row i of the inverse is e_i - sum_{j<i} L_ij A_j; rows are produced one after another. A series
    or repeated squaring would be shorter but its intermediate powers of L overflow for aligned keys.
    """
    o_i = tl.arange(0, BT)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(BT):
        l_row = tl.sum(tl.where(o_i[:, None] == i, L, 0.0), 0)
        row = -tl.sum(l_row[:, None] * A, 0)
        row = tl.where(o_i == i, 1.0, row)
        A = tl.where(o_i[:, None] == i, row[None, :], A)
    return A


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, gcum_ptr, A_ptr, w_ptr, u_ptr,
                         cu_seqlens_ptr, chunk_indices_ptr, T,
                         HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, LOAD_A: tl.constexpr,
                         BV: tl.constexpr):
    """G, A, w and u of one chunk. With LOAD_A (the backward's recompute) G and A are read, not made."""
    tl.static_assert(BK >= K)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_k = tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0)
    o_i = tl.arange(0, BT)
    o_a = rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :]
    if LOAD_A:
        b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
        b_A = tl.load(A_ptr + o_a, mask=m_t[:, None], other=0)
    else:
        b_g = tl.load(g_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
        b_G = tl.cumsum(b_g, 0)
        tl.store(gcum_ptr + rows * HV + i_h, b_G, mask=m_t)
        strict = (o_i[:, None] > o_i[None, :]) & m_t[:, None]
        gamma = tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], 0.0))
        b_kk = tl.dot(b_k, tl.trans(b_k))
        b_L = tl.where(strict, b_kk * gamma * b_beta[:, None], 0.0)
        b_A = unit_lower_inverse(b_L, BT)
        tl.store(A_ptr + o_a, b_A, mask=m_t[:, None])

    b_Ad = b_A.to(b_k.dtype)
    b_kw = (b_k * (b_beta * tl.exp(tl.where(m_t, b_G, 0.0)))[:, None]).to(b_k.dtype)
    b_w = tl.dot(b_Ad, b_kw)
    tl.store(w_ptr + rows[:, None] * (HV * K) + i_h * K + o_k[None, :], b_w.to(w_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v_ptr + p_v, mask=m_tv, other=0)
        b_u = tl.dot(b_Ad, (b_v * b_beta[:, None]).to(b_k.dtype))
        tl.store(u_ptr + p_v, b_u.to(u_ptr.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_state_kernel(k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, h_ptr, vnew_ptr, ht_ptr,
                          cu_seqlens_ptr, chunk_offsets_ptr, T,
                          HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                          HAS_H0: tl.constexpr, BV: tl.constexpr):
    """Sequential over the chunks of one sequence: stores each chunk's start state and its U."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    bos, seqlen, boh = sequence_bounds(i_n, T, cu_seqlens_ptr, chunk_offsets_ptr, BT, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    if HAS_H0:
        b_h = tl.load(h0_ptr + i_nh.to(tl.int64) * (K * V) + o_kv, mask=m_kv, other=0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    dt = k_ptr.dtype.element_ty
    for i_t in range(tl.cdiv(seqlen, BT)):
        tl.store(h_ptr + ((boh + i_t) * HV + i_h) * (K * V) + o_kv, b_h.to(h_ptr.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < seqlen
        rows = bos + o_t
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_w = tl.load(w_ptr + rows[:, None] * (HV * K) + i_h * K + o_k[None, :], mask=m_tk, other=0)
        p_u = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_u = tl.load(u_ptr + p_u, mask=m_tv, other=0).to(tl.float32)
        b_vnew = b_u - tl.dot(b_w, b_h.to(dt))
        tl.store(vnew_ptr + p_u, b_vnew.to(vnew_ptr.dtype.element_ty), mask=m_tv)

        last = tl.minimum(i_t * BT + BT, seqlen) - 1
        b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
        b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)
        b_k = tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_tk, other=0)
        b_kd = (b_k * tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))[:, None]).to(dt)
        b_h = b_h * tl.exp(b_Glast) + tl.dot(tl.trans(b_kd), b_vnew.to(dt))
    tl.store(ht_ptr + i_nh.to(tl.int64) * (K * V) + o_kv, b_h, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_output_kernel(q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr, o_ptr,
                           cu_seqlens_ptr, chunk_indices_ptr, T, scale,
                           HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, BV: tl.constexpr):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]

    b_q = tl.load(q_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_tk, other=0)
    b_k = tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=m_tk, other=0)
    b_h = tl.load(h_ptr + (i_c.to(tl.int64) * HV + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0)
    p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
    b_vnew = tl.load(vnew_ptr + p_v, mask=m_tv, other=0)
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)

    o_i = tl.arange(0, BT)
    causal = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
    b_P = tl.dot(b_q, tl.trans(b_k))
    b_P = tl.where(causal, b_P * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_o = tl.dot(b_q, b_h) * tl.exp(b_G)[:, None]
    b_o += tl.dot(b_P.to(b_vnew.dtype), b_vnew)
    tl.store(o_ptr + p_v, (b_o * scale).to(o_ptr.dtype.element_ty), mask=m_tv)
