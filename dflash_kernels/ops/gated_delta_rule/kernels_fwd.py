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

Four kernels: ``solve`` (G and A) and ``wu`` (w, u), parallel over chunks; ``state`` (the sequential
S0 -> S1 scan, parallel over sequences, heads and V blocks); ``output`` (parallel over chunks).

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
    """(I + L)^-1 for a strictly lower triangular [BT, BT] fp32 tile (BT = 16 here), by forward substitution.

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


@triton.jit
def _sub_rows(ptr, rows, mask, HV: tl.constexpr, i_h):
    return tl.load(ptr + rows * HV + i_h, mask=mask, other=0).to(tl.float32)


@triton.jit
def _sub_keys(k_ptr, rows, mask, i_hk, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    o_k = tl.arange(0, BK)
    return tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :],
                   mask=mask[:, None] & (o_k < K)[None, :], other=0)


@triton.jit
def _l_block(kb_i, k_j, G_i, G_j, m_i, BC: tl.constexpr, DIAG: tl.constexpr):
    """Block (i, j) of L = strictly_lower(diag(beta) K K^T * Gamma); kb_i = beta_i k_i."""
    b_l = tl.dot(kb_i, tl.trans(k_j)) * tl.exp(G_i[:, None] - G_j[None, :])
    keep = m_i[:, None]
    if DIAG:
        o = tl.arange(0, BC)
        keep = keep & (o[:, None] > o[None, :])
    return tl.where(keep, b_l, 0.0)


@triton.jit
def _mm(a, b):
    # The solve's 16x16 products stay in full fp32: tf32 would cost A about three digits.
    return tl.dot(a, b, input_precision="ieee")


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_solve_kernel(k_ptr, g_ptr, beta_ptr, gcum_ptr, A_ptr, cu_seqlens_ptr, chunk_indices_ptr, T,
                          HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """G (cumulative gate) and A = (I + L)^-1 of one chunk, in four 16-row blocks.

    Each diagonal 16x16 block is inverted by forward substitution; the blocks below the diagonal
    follow from A_ij = -A_ii sum_{j<=m<i} L_im A_mj, a handful of 16x16 products.
    """
    tl.static_assert(BT == 64)
    BC: tl.constexpr = 16
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_s = tl.arange(0, BC)
    t0 = i_t * BT
    m0, m1, m2, m3 = (t0 + o_s) < seqlen, (t0 + BC + o_s) < seqlen, (t0 + 2 * BC + o_s) < seqlen, \
        (t0 + 3 * BC + o_s) < seqlen
    r0 = bos + t0 + o_s
    r1, r2, r3 = r0 + BC, r0 + 2 * BC, r0 + 3 * BC
    # Padded rows load g = 0, so their G repeats the last valid one and every exp(G_i - G_j) <= 1.
    g0, g1, g2, g3 = (_sub_rows(g_ptr, r0, m0, HV, i_h), _sub_rows(g_ptr, r1, m1, HV, i_h),
                      _sub_rows(g_ptr, r2, m2, HV, i_h), _sub_rows(g_ptr, r3, m3, HV, i_h))
    G0 = tl.cumsum(g0, 0)
    G1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    G2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
    G3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
    tl.store(gcum_ptr + r0 * HV + i_h, G0, mask=m0)
    tl.store(gcum_ptr + r1 * HV + i_h, G1, mask=m1)
    tl.store(gcum_ptr + r2 * HV + i_h, G2, mask=m2)
    tl.store(gcum_ptr + r3 * HV + i_h, G3, mask=m3)

    k0, k1 = _sub_keys(k_ptr, r0, m0, i_hk, HK, K, BK), _sub_keys(k_ptr, r1, m1, i_hk, HK, K, BK)
    k2, k3 = _sub_keys(k_ptr, r2, m2, i_hk, HK, K, BK), _sub_keys(k_ptr, r3, m3, i_hk, HK, K, BK)
    dt = k0.dtype
    kb0 = (k0 * _sub_rows(beta_ptr, r0, m0, HV, i_h)[:, None]).to(dt)
    kb1 = (k1 * _sub_rows(beta_ptr, r1, m1, HV, i_h)[:, None]).to(dt)
    kb2 = (k2 * _sub_rows(beta_ptr, r2, m2, HV, i_h)[:, None]).to(dt)
    kb3 = (k3 * _sub_rows(beta_ptr, r3, m3, HV, i_h)[:, None]).to(dt)

    A00 = unit_lower_inverse(_l_block(kb0, k0, G0, G0, m0, BC, True), BC)
    A11 = unit_lower_inverse(_l_block(kb1, k1, G1, G1, m1, BC, True), BC)
    A22 = unit_lower_inverse(_l_block(kb2, k2, G2, G2, m2, BC, True), BC)
    A33 = unit_lower_inverse(_l_block(kb3, k3, G3, G3, m3, BC, True), BC)
    L10 = _l_block(kb1, k0, G1, G0, m1, BC, False)
    L20 = _l_block(kb2, k0, G2, G0, m2, BC, False)
    L21 = _l_block(kb2, k1, G2, G1, m2, BC, False)
    L30 = _l_block(kb3, k0, G3, G0, m3, BC, False)
    L31 = _l_block(kb3, k1, G3, G1, m3, BC, False)
    L32 = _l_block(kb3, k2, G3, G2, m3, BC, False)
    A10 = -_mm(A11, _mm(L10, A00))
    A21 = -_mm(A22, _mm(L21, A11))
    A32 = -_mm(A33, _mm(L32, A22))
    A20 = -_mm(A22, _mm(L20, A00) + _mm(L21, A10))
    A31 = -_mm(A33, _mm(L31, A11) + _mm(L32, A21))
    A30 = -_mm(A33, _mm(L30, A00) + _mm(L31, A10) + _mm(L32, A20))

    zero = tl.zeros([BC, BC], dtype=tl.float32)
    c = i_h * BT + o_s[None, :]
    p0, p1, p2, p3 = (A_ptr + r0[:, None] * (HV * BT) + c, A_ptr + r1[:, None] * (HV * BT) + c,
                      A_ptr + r2[:, None] * (HV * BT) + c, A_ptr + r3[:, None] * (HV * BT) + c)
    M0, M1, M2, M3 = m0[:, None], m1[:, None], m2[:, None], m3[:, None]
    tl.store(p0, A00, mask=M0)
    tl.store(p0 + BC, zero, mask=M0)
    tl.store(p0 + 2 * BC, zero, mask=M0)
    tl.store(p0 + 3 * BC, zero, mask=M0)
    tl.store(p1, A10, mask=M1)
    tl.store(p1 + BC, A11, mask=M1)
    tl.store(p1 + 2 * BC, zero, mask=M1)
    tl.store(p1 + 3 * BC, zero, mask=M1)
    tl.store(p2, A20, mask=M2)
    tl.store(p2 + BC, A21, mask=M2)
    tl.store(p2 + 2 * BC, A22, mask=M2)
    tl.store(p2 + 3 * BC, zero, mask=M2)
    tl.store(p3, A30, mask=M3)
    tl.store(p3 + BC, A31, mask=M3)
    tl.store(p3 + 2 * BC, A32, mask=M3)
    tl.store(p3 + 3 * BC, A33, mask=M3)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_wu_kernel(k_ptr, v_ptr, beta_ptr, gcum_ptr, A_ptr, w_ptr, u_ptr, cu_seqlens_ptr, chunk_indices_ptr, T,
                       HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, BV: tl.constexpr):
    """w = A diag(beta exp(G)) K and u = A diag(beta) V of one chunk (forward, and the backward's recompute)."""
    tl.static_assert(BK >= K)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seqlen
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_i = tl.arange(0, BT)
    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_k = tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0)
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
    b_A = tl.load(A_ptr + rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :], mask=m_t[:, None], other=0)

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
