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

Kernels: ``solve`` (each chunk's first row holding a NaN / Inf, see below, then G and A) and ``wu``
(w, u), parallel over chunks; ``scan`` (the sequential S0 -> S1 scan, parallel over
sequences, heads and V blocks), which in the forward writes o as it goes and in the backward's
recompute stores S0 and U per chunk instead (``states``: the scan plus a K-split form of that storing
scan, KSPLIT, a tuning choice); ``output`` (the split forward, for few sequences and heads) computes o
from those stored S0 and U, parallel over chunks. Their TritonKernel wrappers and tuning candidates close
the module.

Non-finite inputs. Every product above is lower triangular inside the chunk (row i of A, w, u and
``tril(Q K^T * Gamma) U`` sums over rows <= i), but a dot also multiplies the exact zeros above the
diagonal, and 0 * NaN = NaN: a NaN / Inf at row t would reach the chunk's rows before t. Making each
product safe costs the hot loops time and registers; instead the forward first finds, per chunk and
value head, ``t_bad`` = the first row whose k (of its key head), v, g or beta, as the kernels use them
(the decay from a raw gate, beta from logits), is not finite, BT when there is none (the ``solve``
kernel's first step: one read of those inputs, no launch of its own). Then:

- ``solve`` and ``wu`` load the rows from t_bad on as 0 (g, beta, k, v, and G): with every value they
  meet finite, the rows before t_bad come out bit for bit as without the bad row (the masked entries
  are exact zeros times finite values), and the rows from t_bad on are finite (A's rows are those of
  the identity, w's and u's are 0);
- the forward ``scan`` stores o as NaN from t_bad on and makes the state after the chunk NaN when
  t_bad < BT, so the bad token's output and every later one of its sequence are non-finite, as in
  the recurrence. Its own loads need no mask: k enters o only through ``tril(Q K^T * Gamma)``, whose
  entries above the diagonal are selected (``tl.where``), not multiplied, and the state after the
  chunk is NaN anyway; U's rows from t_bad on are 0 (w, u are).

q is not checked: a non-finite q reaches its own output row only (its row of ``Q S0`` and of
``Q K^T``), and no state. The backward recomputes w, u and the states from its inputs without t_bad
(the forward's A and G): its gradients of a chunk with a bad row may be NaN, those of other sequences
stay exact. A non-finite value that arises inside the math from finite inputs (an overflowing state)
is not confined this way.

Layouts: tokens are flattened to rows ``bos + t`` (``bos`` = the sequence's first row), so a batch
of B equal sequences and a packed ``cu_seqlens`` batch share one code path. Per-chunk buffers
(states ``h``) are indexed by the global chunk number, sequence after sequence. v, as the
``solve`` and ``wu`` kernels read it, has its own row stride SV (a view of a wider projection is
read in place); every other tensor here is contiguous.
"""

import torch
import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel


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


# The in-kernel gate's log decay is floored at -GATE_DECAY_CAP: exp of anything below -104 is 0 in fp32,
# so no decay, product of decays or gradient changes, while the chunk's cumulative sum G of decays stays far
# from overflow (a sum of decays near -3e38 overflows to -inf, and exp(G_i - G_j) of two infinities is NaN).
LOG_GATE_DECAY_CAP = tl.constexpr(4.852030263919617)  # log(128)


@triton.jit
def gdn_gate_exponent(x, A_log):
    """``log(exp(A_log) * softplus(x))`` in fp32, as ``A_log + log(softplus(x))``: finite wherever the decay
    is, also where ``exp(A_log)`` alone overflows (A_log >= 88.7) or ``softplus(x)`` underflows (x < -88).
    softplus is the identity above 20 (fla's threshold, as torch's default); below -5 it is log1p's series
    ``t - t^2/2 + t^3/3`` of ``t = exp(x)`` (``log(1 + t)`` in fp32 loses t's low bits there), and its log is
    x itself below -15."""
    # NaN must propagate through the minimum: compiled, tl.minimum's default returns the other operand.
    t = tl.exp(tl.minimum(x, 20.0, propagate_nan=tl.PropagateNan.ALL))
    sp = tl.where(x < -5.0, t * (1.0 - t * (0.5 - t / 3.0)), tl.log(1.0 + t))
    return A_log + tl.where(x > 20.0, tl.log(x), tl.where(x < -15.0, x, tl.log(sp)))


@triton.jit
def gdn_gate(x, A_log_ptr, dt_bias_ptr, i_h, HAS_DT_BIAS: tl.constexpr):
    """The log decay from the raw gate (fp32): ``-exp(A_log[h]) * softplus(x + dt_bias[h])``, floored at
    ``-exp(LOG_GATE_DECAY_CAP)``; an infinite exponent (x or A_log +inf) stays -inf, a non-finite decay."""
    if HAS_DT_BIAS:
        x = x + tl.load(dt_bias_ptr + i_h).to(tl.float32)
    e = gdn_gate_exponent(x, tl.load(A_log_ptr + i_h).to(tl.float32))
    return tl.where(e == float("inf"), -e, -tl.exp(tl.minimum(e, LOG_GATE_DECAY_CAP, propagate_nan=tl.PropagateNan.ALL)))


@triton.jit
def gdn_beta(x, BETA_MODE: tl.constexpr):
    """beta from what was passed (fp32): as is (0), sigmoid of logits (1), 2 * sigmoid (2, negative
    eigenvalues allowed)."""
    if BETA_MODE == 1:
        x = tl.sigmoid(x)
    elif BETA_MODE == 2:
        x = 2.0 * tl.sigmoid(x)
    return x


@triton.jit
def load_state(ptr, o_k, o_v, m_kv, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """A [BK, BV] tile (K rows, V columns) of one [K, V] state, or of one stored [V, K] (V first)."""
    if STATE_V_FIRST:
        return tl.load(ptr + o_v[None, :] * K + o_k[:, None], mask=m_kv, other=0).to(tl.float32)
    else:
        return tl.load(ptr + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0).to(tl.float32)


@triton.jit
def store_state(ptr, x, o_k, o_v, m_kv, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Store the [BK, BV] tile ``x`` into a [K, V] state, or a [V, K] one (V first)."""
    if STATE_V_FIRST:
        tl.store(ptr + o_v[None, :] * K + o_k[:, None], x.to(ptr.dtype.element_ty), mask=m_kv)
    else:
        tl.store(ptr + o_k[:, None] * V + o_v[None, :], x.to(ptr.dtype.element_ty), mask=m_kv)


@triton.jit
def _mm(a, b):
    # The solve's products stay in full fp32: tf32 would cost A about three digits.
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tile(A_ptr, rows, m_rows, col0, SA: tl.constexpr, N: tl.constexpr):
    """Columns [col0, col0 + N) of the chunk's rows ``rows`` of A (row stride SA); invalid rows read 0."""
    return tl.load(A_ptr + rows[:, None] * SA + col0 + tl.arange(0, N)[None, :], mask=m_rows[:, None], other=0)


@triton.jit
def _put(A_ptr, rows, m_rows, col0, x, SA: tl.constexpr, N: tl.constexpr):
    tl.store(A_ptr + rows[:, None] * SA + col0 + tl.arange(0, N)[None, :], x, mask=m_rows[:, None])


@triton.jit
def _kk(k_ptr, r_i, m_i, r_j, m_j, i_hk, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, N: tl.constexpr):
    """K_i K_j^T (fp32) for the key rows ``r_i`` and ``r_j`` (N each), over K in steps of at most 32
    (fewer registers on sm_90 than 64 or all of K at once)."""
    KC: tl.constexpr = min(BK, 32)
    acc = tl.zeros([N, N], dtype=tl.float32)
    for i_k in tl.static_range(0, BK, KC):
        o_k = i_k + tl.arange(0, KC)
        p_k = k_ptr + i_hk * K + o_k[None, :]
        k_i = tl.load(p_k + r_i[:, None] * (HK * K), mask=m_i[:, None] & (o_k < K)[None, :], other=0)
        k_j = tl.load(p_k + r_j[:, None] * (HK * K), mask=m_j[:, None] & (o_k < K)[None, :], other=0)
        acc = tl.dot(k_i, tl.trans(k_j), acc)
    return acc


@triton.jit
def _l_tile(kk, beta_i, G_i, G_j, m_i, DIAG: tl.constexpr):
    """A tile of L = strictly_lower(diag(beta) K K^T * Gamma) from its tile ``kk`` of K K^T (fp32)."""
    keep = m_i[:, None]
    if DIAG:
        o = tl.arange(0, kk.shape[0])
        keep = keep & (o[:, None] > o[None, :])
    # G in log2 units; exp only where kept: above the diagonal G_i - G_j > 0 and could overflow
    gamma = tl.exp2(tl.where(keep, G_i[:, None] - G_j[None, :], 0.0))
    return tl.where(keep, kk * (beta_i[:, None] * gamma), 0.0)


@triton.jit
def _finite(x):
    """1 where x (fp32) is finite, 0 where it is NaN or infinite (NaN compares false)."""
    return tl.where(tl.abs(x) < float("inf"), 1, 0)


@triton.jit
def _bad_rows(ptr, rows, m_t, stride, D: tl.constexpr, BD: tl.constexpr):
    """[BT] int32: 1 for each row of ``rows`` (row stride ``stride``) whose D elements at ``ptr``
    hold a NaN or Inf, else 0; read in column blocks of BD."""
    bad = tl.zeros([rows.shape[0]], dtype=tl.int32)
    for i_d in tl.static_range(0, D, BD):
        o_d = i_d + tl.arange(0, BD)
        x = tl.load(ptr + rows[:, None] * stride + o_d[None, :], mask=m_t[:, None] & (o_d < D)[None, :], other=0)
        bad = tl.maximum(bad, 1 - tl.min(_finite(x.to(tl.float32)), 1))
    return bad


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_solve_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, t_bad_ptr, gcum_ptr, A_ptr,
                          cu_seqlens_ptr, chunk_indices_ptr, T, SV, HK: tl.constexpr, HV: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          IS_VARLEN: tl.constexpr, GATE: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False,
                          BETA_MODE: tl.constexpr = 0, BD: tl.constexpr = 32):
    """The chunk's t_bad for its value head (stored for the w/u and scan kernels), then G (cumulative gate)
    and A = (I + L)^-1 of the chunk.

    The first kernel to read g and beta: with GATE, g is the raw gate and its log decay
    (``gdn_gate``) is computed here, on the way into the cumulative sum, so no pass over g precedes
    this one; BETA_MODE applies beta's sigmoid as it is loaded (``gdn_beta``), as every later reader does.
    The rows from the chunk's t_bad on load as 0 (module docstring); G and A are stored for every row.

    t_bad: the index inside the chunk of the first row whose k (of the key head), v (row stride
    SV, read in column blocks of BD), g or beta is NaN or infinite, BT when every row is finite; g and
    beta checked as the kernels use them: with GATE the decay computed from the raw gate (a raw -inf gives
    decay 0, finite; +inf gives -inf, which the chunked form cannot take), with BETA_MODE the sigmoid of
    the logits (finite for +-inf logits). Rows past the sequence's end read as finite.

    L is built as three 32x32 tiles (the two diagonal halves and the lower-left E) and written to A's
    place, which then serves as scratch: the steps below read rows and blocks of L back and overwrite
    them with A's blocks (a barrier between a write and the reads of other threads). Everything is a
    substitution or a product of inverses: a series or repeated squaring would be shorter but its
    powers of L overflow for aligned keys.

    1. The four diagonal 16x16 blocks, inverted together by forward substitution: step i produces row i
       of all four (a [4, 16] tensor, one element per thread at 2 warps) as e_i - sum_{j<i} L_ij A_j,
       with each L_ij a broadcast load. No reductions or layout changes, and the dependent chain per
       step is one FMA: 16 short steps instead of four sequential 16-step loops.
    2. A10 = -A11 L10 A00 and A32 = -A33 L32 A22 (fp32 16x16 products).
    3. The lower-left 32x32 block, -Ahi E Alo, as P = E Alo and then -Ahi P, each split so that the zero
       upper-right 16x16 blocks of Alo and Ahi are skipped (48K instead of 64K multiply-adds).
    """
    tl.static_assert(BT == 64)
    BC: tl.constexpr = 16  # diagonal block
    H: tl.constexpr = 32  # half chunk
    SA: tl.constexpr = HV * BT  # row stride of A
    LOG2E: tl.constexpr = 1.4426950408889634
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    t0 = i_t * BT
    A_ptr += i_h * BT

    o_i = tl.arange(0, BT)
    m_t = t0 + o_i < seqlen
    rows = bos + t0 + o_i
    bad = tl.maximum(_bad_rows(k_ptr + i_hk * K, rows, m_t, HK * K, K, BD),
                     _bad_rows(v_ptr + i_h * V, rows, m_t, SV, V, BD))
    c_g = tl.load(g_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32)
    if GATE:
        c_g = gdn_gate(c_g, A_log_ptr, dt_bias_ptr, i_h, HAS_DT_BIAS)
    c_beta = gdn_beta(tl.load(beta_ptr + rows * HV + i_h, mask=m_t, other=0).to(tl.float32), BETA_MODE)
    bad = tl.maximum(bad, 2 - _finite(c_g) - _finite(c_beta))
    t_bad = tl.min(tl.where((bad > 0) & m_t, o_i, BT), 0)
    tl.store(t_bad_ptr + i_c * HV + i_h, t_bad)
    o_h = tl.arange(0, H)
    m_lo, m_hi = t0 + o_h < seqlen, t0 + H + o_h < seqlen
    # The rows read: valid and before the chunk's first non-finite row (module docstring).
    f_lo, f_hi = m_lo & (o_h < t_bad), m_hi & (H + o_h < t_bad)
    r_lo = bos + t0 + o_h
    r_hi = r_lo + H
    # Rows not read load g = 0, so their G repeats the last one read and every exp(G_i - G_j) <= 1.
    g_lo = tl.load(g_ptr + r_lo * HV + i_h, mask=f_lo, other=0).to(tl.float32)
    g_hi = tl.load(g_ptr + r_hi * HV + i_h, mask=f_hi, other=0).to(tl.float32)
    if GATE:
        g_lo = tl.where(f_lo, gdn_gate(g_lo, A_log_ptr, dt_bias_ptr, i_h, HAS_DT_BIAS), 0.0)
        g_hi = tl.where(f_hi, gdn_gate(g_hi, A_log_ptr, dt_bias_ptr, i_h, HAS_DT_BIAS), 0.0)
    G_lo = tl.cumsum(g_lo, 0)
    G_hi = tl.cumsum(g_hi, 0) + tl.sum(g_lo, 0)
    tl.store(gcum_ptr + r_lo * HV + i_h, G_lo, mask=m_lo)
    tl.store(gcum_ptr + r_hi * HV + i_h, G_hi, mask=m_hi)
    beta_lo = gdn_beta(tl.load(beta_ptr + r_lo * HV + i_h, mask=f_lo, other=0).to(tl.float32), BETA_MODE)
    beta_hi = gdn_beta(tl.load(beta_ptr + r_hi * HV + i_h, mask=f_hi, other=0).to(tl.float32), BETA_MODE)

    # L's rows and columns not read are 0 (their k read as 0; rows kept by f_lo / f_hi); stored for every
    # valid row, they make A's rows from t_bad on those of the identity.
    G2_lo, G2_hi = G_lo * LOG2E, G_hi * LOG2E
    L_lo = _l_tile(_kk(k_ptr, r_lo, f_lo, r_lo, f_lo, i_hk, HK, K, BK, H), beta_lo, G2_lo, G2_lo, f_lo, True)
    _put(A_ptr, r_lo, m_lo, 0, L_lo, SA, H)
    _put(A_ptr, r_lo, m_lo, H, tl.zeros([H, H], dtype=tl.float32), SA, H)
    L_hi = _l_tile(_kk(k_ptr, r_hi, f_hi, r_hi, f_hi, i_hk, HK, K, BK, H), beta_hi, G2_hi, G2_hi, f_hi, True)
    _put(A_ptr, r_hi, m_hi, H, L_hi, SA, H)
    E = _l_tile(_kk(k_ptr, r_hi, f_hi, r_lo, f_lo, i_hk, HK, K, BK, H), beta_hi, G2_hi, G2_lo, f_hi, False)
    _put(A_ptr, r_hi, m_hi, 0, E, SA, H)
    tl.debug_barrier()

    # 1. Diagonal blocks: X[i][b, :] = row i of A_bb, for the blocks b = 0..3 at once.
    o_b = tl.arange(0, 4)
    o_c = tl.arange(0, BC)
    r_b = t0 + BC * o_b[:, None]  # [4, 1] first row of each block, in the sequence
    p_b = A_ptr + (bos + r_b) * SA + BC * o_b[:, None]  # [4, 1] -> element (0, 0) of each block
    X = ()
    for i in tl.static_range(BC):
        m_i = r_b + i < seqlen
        x = tl.where(o_c[None, :] == i, 1.0, 0.0) + tl.zeros([4, BC], dtype=tl.float32)
        for j in tl.static_range(i):
            x -= tl.load(p_b + i * SA + j, mask=m_i, other=0) * X[j]
        X = X + (x,)
    tl.debug_barrier()
    for i in tl.static_range(BC):
        tl.store(p_b + i * SA + o_c[None, :], X[i], mask=r_b + i < seqlen)
    tl.debug_barrier()

    # 2. The blocks next to the diagonal.
    r0 = bos + t0 + tl.arange(0, BC)
    r1, r2, r3 = r0 + BC, r0 + 2 * BC, r0 + 3 * BC
    m0, m1, m2, m3 = r0 - bos < seqlen, r1 - bos < seqlen, r2 - bos < seqlen, r3 - bos < seqlen
    A00, A11 = _tile(A_ptr, r0, m0, 0, SA, BC), _tile(A_ptr, r1, m1, BC, SA, BC)
    A22, A33 = _tile(A_ptr, r2, m2, 2 * BC, SA, BC), _tile(A_ptr, r3, m3, 3 * BC, SA, BC)
    A10 = -_mm(A11, _mm(_tile(A_ptr, r1, m1, 0, SA, BC), A00))
    A32 = -_mm(A33, _mm(_tile(A_ptr, r3, m3, 2 * BC, SA, BC), A22))
    tl.debug_barrier()
    _put(A_ptr, r1, m1, 0, A10, SA, BC)
    _put(A_ptr, r3, m3, 2 * BC, A32, SA, BC)
    tl.debug_barrier()

    # 3. Lower-left block: P = E Alo = [E [A00; A10], E[:, 16:] A11], then -Ahi P by block rows.
    P0 = _mm(_tile(A_ptr, r_hi, m_hi, 0, SA, H), _tile(A_ptr, r_lo, m_lo, 0, SA, BC))
    P1 = _mm(_tile(A_ptr, r_hi, m_hi, BC, SA, BC), A11)
    tl.debug_barrier()
    _put(A_ptr, r_hi, m_hi, 0, P0, SA, BC)
    _put(A_ptr, r_hi, m_hi, BC, P1, SA, BC)
    tl.debug_barrier()
    X2 = -_mm(A22, _tile(A_ptr, r2, m2, 0, SA, H))
    X3 = -_mm(_tile(A_ptr, r3, m3, H, SA, H), _tile(A_ptr, r_hi, m_hi, 0, SA, H))  # [A32 A33] P
    tl.debug_barrier()
    _put(A_ptr, r2, m2, 0, X2, SA, H)
    _put(A_ptr, r3, m3, 0, X3, SA, H)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_wu_kernel(k_ptr, v_ptr, beta_ptr, gcum_ptr, A_ptr, t_bad_ptr, w_ptr, u_ptr, cu_seqlens_ptr,
                       chunk_indices_ptr, T, SV, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, BV: tl.constexpr,
                       BETA_MODE: tl.constexpr = 0, HAS_T_BAD: tl.constexpr = False):
    """w = A diag(beta exp(G)) K and u = A diag(beta) V of one chunk (forward, and the backward's recompute).

    HAS_T_BAD (the forward): the rows from the chunk's t_bad on load as 0 (module docstring), so their
    w and u are 0 (A's rows there are the identity's). Without it (the backward's recompute) every
    valid row is read.
    """
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
    if HAS_T_BAD:
        f_t = m_t & (o_i < tl.load(t_bad_ptr + i_c * HV + i_h))  # the rows read
    else:
        f_t = m_t
    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=f_t, other=0).to(tl.float32)
    b_beta = tl.where(f_t, gdn_beta(b_beta, BETA_MODE), 0.0)
    b_k = tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :],
                  mask=f_t[:, None] & m_k[None, :], other=0)
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=f_t, other=0)
    b_A = tl.load(A_ptr + rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :], mask=m_t[:, None], other=0)

    b_Ad = b_A.to(b_k.dtype)
    b_kw = (b_k * (b_beta * tl.exp(tl.where(f_t, b_G, 0.0)))[:, None]).to(b_k.dtype)
    b_w = tl.dot(b_Ad, b_kw)
    tl.store(w_ptr + rows[:, None] * (HV * K) + i_h * K + o_k[None, :], b_w.to(w_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v_ptr + rows[:, None] * SV + i_h * V + o_v[None, :], mask=f_t[:, None] & (o_v < V)[None, :],
                      other=0)
        b_u = tl.dot(b_Ad, (b_v * b_beta[:, None]).to(b_k.dtype))
        tl.store(u_ptr + rows[:, None] * (HV * V) + i_h * V + o_v[None, :], b_u.to(u_ptr.dtype.element_ty),
                 mask=m_tv)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_scan_kernel(q_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, t_bad_ptr, h0_ptr, h_ptr, vnew_ptr, o_ptr, ht_ptr,
                         cu_seqlens_ptr, chunk_offsets_ptr, T, scale,
                         HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                         HAS_H0: tl.constexpr, OUTPUT: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr = False,
                         LOOP_STAGES: tl.constexpr = None, STATE_V_FIRST: tl.constexpr = False,
                         HAS_T_BAD: tl.constexpr = False):
    """The S0 -> S1 scan, sequential over the chunks of one sequence (parallel over sequences, heads
    and V blocks), with the state and U cast to the input precision before their products.

    OUTPUT (the forward): o of each chunk from the formula above, written as the scan goes; the
    chunk's start state and U stay in registers (q_ptr, o_ptr used; h_ptr, vnew_ptr not).
    Not OUTPUT (the backward's recompute): each chunk's start state (h) and U (vnew) are stored.
    OUTPUT and SAVE (a training forward that keeps them for the backward): both.
    STATE_V_FIRST: the initial and final states (h0, ht) are [V, K] per head; the per-chunk h stays [K, V].
    HAS_T_BAD (with OUTPUT): o is NaN from each chunk's t_bad on, and the state after a chunk with
    t_bad < BT is NaN (module docstring): one scalar load and a select per chunk, no load masks.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    bos, seqlen, boh = sequence_bounds(i_n, T, cu_seqlens_ptr, chunk_offsets_ptr, BT, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    if HAS_H0:
        b_h = load_state(h0_ptr + i_nh.to(tl.int64) * (K * V), o_k, o_v, m_kv, K, V, STATE_V_FIRST)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    dt = k_ptr.dtype.element_ty
    # LOOP_STAGES: the chunk loop's own pipelining depth (None: the launch's num_stages).
    for i_t in tl.range(0, tl.cdiv(seqlen, BT), num_stages=LOOP_STAGES):
        if (not OUTPUT) or SAVE:
            tl.store(h_ptr + ((boh + i_t) * HV + i_h) * (K * V) + o_kv, b_h.to(h_ptr.dtype.element_ty),
                     mask=m_kv)
        o_t = i_t * BT + o_i
        m_t = o_t < seqlen
        rows = bos + o_t
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_k = rows[:, None] * (HK * K) + i_hk * K + o_k[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        last = tl.minimum(i_t * BT + BT, seqlen) - 1
        # The recompute loads k and G only after U, so they are not live across its product (fewer
        # registers on sm_90 builds).
        if OUTPUT:
            b_q = tl.load(q_ptr + p_k, mask=m_tk, other=0)
            b_k = tl.load(k_ptr + p_k, mask=m_tk, other=0)
        b_w = tl.load(w_ptr + rows[:, None] * (HV * K) + i_h * K + o_k[None, :], mask=m_tk, other=0)
        b_u = tl.load(u_ptr + p_v, mask=m_tv, other=0).to(tl.float32)
        if OUTPUT:
            b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
            b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)

        if HAS_T_BAD:
            t_bad = tl.load(t_bad_ptr + (boh + i_t) * HV + i_h)

        b_hd = b_h.to(dt)
        b_vnew = (b_u - tl.dot(b_w, b_hd)).to(dt)
        if OUTPUT:
            causal = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
            b_P = tl.dot(b_q, tl.trans(b_k))
            b_P = tl.where(causal, b_P * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
            b_o = tl.dot(b_q, b_hd) * tl.exp(b_G)[:, None]
            b_o += tl.dot(b_P.to(dt), b_vnew)
            if HAS_T_BAD:
                b_o = tl.where((o_i < t_bad)[:, None], b_o, float("nan"))
            tl.store(o_ptr + p_v, (b_o * scale).to(o_ptr.dtype.element_ty), mask=m_tv)
            if SAVE:
                tl.store(vnew_ptr + p_v, b_vnew.to(vnew_ptr.dtype.element_ty), mask=m_tv)
        else:
            tl.store(vnew_ptr + p_v, b_vnew.to(vnew_ptr.dtype.element_ty), mask=m_tv)
            b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
            b_Glast = tl.load(gcum_ptr + (bos + last) * HV + i_h)
            b_k = tl.load(k_ptr + p_k, mask=m_tk, other=0)

        b_kd = (b_k * tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))[:, None]).to(dt)
        b_h = b_h * tl.exp(b_Glast) + tl.dot(tl.trans(b_kd), b_vnew)
        if HAS_T_BAD:
            b_h = tl.where(t_bad < BT, float("nan"), b_h)
    store_state(ht_ptr + i_nh.to(tl.int64) * (K * V), b_h, o_k, o_v, m_kv, K, V, STATE_V_FIRST)


@triton.jit
def _states_khalves(k_ptr, w_ptr, u_ptr, gcum_ptr, t_bad_ptr, h0_ptr, h_ptr, vnew_ptr, ht_ptr, i_v, i_nh, i_h, i_hk,
                    bos, seqlen, boh, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                    LOOP_STAGES: tl.constexpr, STATE_V_FIRST: tl.constexpr, HAS_T_BAD: tl.constexpr):
    """The state scan (not OUTPUT) of ``_gdn_fwd_states_kernel`` with KSPLIT: what ``_gdn_fwd_scan_kernel``
    stores (h per chunk, U, the final state; NaN states after a chunk with t_bad < BT), written for fewer
    live registers and more of the chunk loop's loads staged ahead by its pipeliner:

    - the [BK, BV] state as two [BK/2, BV] halves, so each product is half as large and fewer registers
      are live around it; w and k are loaded in the matching column halves;
    - the decay exp(G_last - G) applied to U's rows (a [BT, BV] tile) instead of k's ([BT, BK]), so k,
      loaded K-major, feeds its product as loaded: like w, it does not depend on the state and the
      chunk loop's pipeliner stages it in shared memory ahead of use (LOOP_STAGES / num_stages);
    - with HAS_T_BAD the NaN enters through the decay factor of the old state (a scalar select) rather
      than a select over the new state after its product.

    U is stored in the input precision; its decayed copy is rounded once more for the product (where the
    one-tile scan rounds k's decayed rows): the two agree to a rounding. Needs BK >= 32.
    """
    KH: tl.constexpr = BK // 2
    o_k1 = tl.arange(0, KH)
    o_k2 = KH + o_k1
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    m_v = o_v < V
    m_kv1 = (o_k1 < K)[:, None] & m_v[None, :]
    m_kv2 = (o_k2 < K)[:, None] & m_v[None, :]
    if HAS_H0:
        b_h1 = load_state(h0_ptr + i_nh.to(tl.int64) * (K * V), o_k1, o_v, m_kv1, K, V, STATE_V_FIRST)
        b_h2 = load_state(h0_ptr + i_nh.to(tl.int64) * (K * V), o_k2, o_v, m_kv2, K, V, STATE_V_FIRST)
    else:
        b_h1 = tl.zeros([KH, BV], dtype=tl.float32)
        b_h2 = tl.zeros([KH, BV], dtype=tl.float32)
    dt = k_ptr.dtype.element_ty
    for i_t in tl.range(0, tl.cdiv(seqlen, BT), num_stages=LOOP_STAGES):
        p_h = h_ptr + ((boh + i_t) * HV + i_h) * (K * V)
        tl.store(p_h + o_k1[:, None] * V + o_v[None, :], b_h1.to(h_ptr.dtype.element_ty), mask=m_kv1)
        tl.store(p_h + o_k2[:, None] * V + o_v[None, :], b_h2.to(h_ptr.dtype.element_ty), mask=m_kv2)
        o_t = i_t * BT + o_i
        m_t = o_t < seqlen
        rows = bos + o_t
        p_w = w_ptr + rows[:, None] * (HV * K) + i_h * K
        b_w1 = tl.load(p_w + o_k1[None, :], mask=m_t[:, None] & (o_k1 < K)[None, :], other=0)
        b_w2 = tl.load(p_w + o_k2[None, :], mask=m_t[:, None] & (o_k2 < K)[None, :], other=0)
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_u = tl.load(u_ptr + p_v, mask=m_tv, other=0).to(tl.float32)
        b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
        b_Glast = tl.load(gcum_ptr + (bos + tl.minimum(i_t * BT + BT, seqlen) - 1) * HV + i_h)
        p_k = k_ptr + rows[None, :] * (HK * K) + i_hk * K
        b_k1 = tl.load(p_k + o_k1[:, None], mask=(o_k1 < K)[:, None] & m_t[None, :], other=0)  # [KH, BT]
        b_k2 = tl.load(p_k + o_k2[:, None], mask=(o_k2 < K)[:, None] & m_t[None, :], other=0)
        if HAS_T_BAD:
            t_bad = tl.load(t_bad_ptr + (boh + i_t) * HV + i_h)

        b_v = tl.dot(b_w1, b_h1.to(dt))
        b_v = tl.dot(b_w2, b_h2.to(dt), b_v)
        b_vnew = (b_u - b_v).to(dt)
        tl.store(vnew_ptr + p_v, b_vnew.to(vnew_ptr.dtype.element_ty), mask=m_tv)
        b_vs = (b_vnew.to(tl.float32) * tl.exp(tl.where(m_t, b_Glast - b_G, 0.0))[:, None]).to(dt)
        b_d = tl.exp(b_Glast)
        if HAS_T_BAD:  # a NaN decay makes the state after the chunk NaN (a scalar select, off the products)
            b_d = tl.where(t_bad < BT, float("nan"), b_d)
        b_h1 = tl.dot(b_k1, b_vs, b_h1 * b_d)
        b_h2 = tl.dot(b_k2, b_vs, b_h2 * b_d)
    store_state(ht_ptr + i_nh.to(tl.int64) * (K * V), b_h1, o_k1, o_v, m_kv1, K, V, STATE_V_FIRST)
    store_state(ht_ptr + i_nh.to(tl.int64) * (K * V), b_h2, o_k2, o_v, m_kv2, K, V, STATE_V_FIRST)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_states_kernel(q_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, t_bad_ptr, h0_ptr, h_ptr, vnew_ptr, o_ptr, ht_ptr,
                           cu_seqlens_ptr, chunk_offsets_ptr, T, scale,
                           HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                           HAS_H0: tl.constexpr, OUTPUT: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr = False,
                           LOOP_STAGES: tl.constexpr = None, STATE_V_FIRST: tl.constexpr = False,
                           HAS_T_BAD: tl.constexpr = False, KSPLIT: tl.constexpr = False):
    """``_gdn_fwd_scan_kernel`` (same arguments: a drop-in for its launcher ``_scan``) with one more tuning
    choice for the state scan: KSPLIT runs ``_states_khalves`` (the state as two K halves, U's rows
    decayed instead of k's; the same outputs and NaN rules, one rounding apart). With OUTPUT, or with
    BK < 32 (halves below a product's minimum of 16), KSPLIT is ignored. The kernel without KSPLIT is
    ``_gdn_fwd_scan_kernel`` itself, kept a separate function so that the fused forward's kernel (and its
    tuning results, keyed by its source) do not change.
    """
    if OUTPUT or (not KSPLIT) or BK < 32:
        _gdn_fwd_scan_kernel(q_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, t_bad_ptr, h0_ptr, h_ptr, vnew_ptr, o_ptr, ht_ptr,
                             cu_seqlens_ptr, chunk_offsets_ptr, T, scale, HK, HV, K, V, BT, BK, IS_VARLEN, HAS_H0,
                             OUTPUT, BV, SAVE, LOOP_STAGES, STATE_V_FIRST, HAS_T_BAD)
    else:
        i_v, i_nh = tl.program_id(0), tl.program_id(1)
        i_n, i_h = i_nh // HV, i_nh % HV
        i_hk = i_h // (HV // HK)
        bos, seqlen, boh = sequence_bounds(i_n, T, cu_seqlens_ptr, chunk_offsets_ptr, BT, IS_VARLEN)
        _states_khalves(k_ptr, w_ptr, u_ptr, gcum_ptr, t_bad_ptr, h0_ptr, h_ptr, vnew_ptr, ht_ptr, i_v, i_nh, i_h,
                        i_hk, bos, seqlen, boh, HK, HV, K, V, BT, BK, BV, HAS_H0, LOOP_STAGES, STATE_V_FIRST,
                        HAS_T_BAD)


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_output_kernel(q_ptr, k_ptr, gcum_ptr, t_bad_ptr, h_ptr, vnew_ptr, o_ptr, cu_seqlens_ptr,
                           chunk_indices_ptr, T, scale, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                           BV: tl.constexpr, HAS_T_BAD: tl.constexpr = False):
    """o of one chunk, ``scale (diag(exp(G)) Q S0 + tril(Q K^T * Gamma) U)``, from the start state S0 and U
    that the state scan stored (``h``, ``vnew``): the split forward, parallel over chunks, heads and V
    blocks, where the fused scan computes o inside its sequential loop. The same products and roundings
    as the fused scan (S0 and U in the input dtype). HAS_T_BAD: o is NaN from the chunk's t_bad on (the
    stored states after a bad chunk are NaN already)."""
    tl.static_assert(BK >= K)
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < seqlen
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    p_k = rows[:, None] * (HK * K) + i_hk * K + o_k[None, :]
    p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
    dt = k_ptr.dtype.element_ty
    b_q = tl.load(q_ptr + p_k, mask=m_tk, other=0)
    b_k = tl.load(k_ptr + p_k, mask=m_tk, other=0)
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=m_t, other=0)
    b_h = tl.load(h_ptr + (i_c * HV + i_h).to(tl.int64) * (K * V) + o_k[:, None] * V + o_v[None, :],
                  mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0).to(dt)
    b_vnew = tl.load(vnew_ptr + p_v, mask=m_tv, other=0).to(dt)
    causal = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
    b_P = tl.dot(b_q, tl.trans(b_k))
    b_P = tl.where(causal, b_P * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_o = tl.dot(b_q, b_h) * tl.exp(b_G)[:, None]
    b_o += tl.dot(b_P.to(dt), b_vnew)
    if HAS_T_BAD:
        b_o = tl.where((o_i < tl.load(t_bad_ptr + i_c * HV + i_h))[:, None], b_o, float("nan"))
    tl.store(o_ptr + p_v, (b_o * scale).to(o_ptr.dtype.element_ty), mask=m_tv)


class ByPrecision:
    """One kernel as two TritonKernels with their own candidates: ``default`` for bf16 / fp16 inputs
    and ``fp32`` (named ``<name>_fp32``) for fp32 inputs.

    fp32 inputs get 4-warp, single-stage configs only: on Hopper with triton 3.6 the backward's local
    kernel with fp32 (tf32) dots and 8 warps faults (illegal memory access, K=16) or needs more shared
    memory than the chip has (K=128), and a faulting tuning trial would poison the CUDA context, so
    such configs must never be candidates.
    """

    def __init__(self, fn, name, configs, fp32_configs, interpret_config=None):
        interpret_config = interpret_config or Config(BV=16)
        self.default = TritonKernel(fn, name=name, configs=configs, interpret_config=interpret_config)
        self.fp32 = TritonKernel(fn, name=name + "_fp32", configs=fp32_configs, interpret_config=interpret_config)

    def of(self, x: torch.Tensor) -> TritonKernel:
        """The kernel for inputs of ``x``'s dtype."""
        return self.fp32 if x.dtype == torch.float32 else self.default


# The fp32 candidates of the kernels tiled over V (ByPrecision says why so few).
FP32_CONFIGS = [Config(BV=32, num_warps=4, num_stages=1), Config(BV=16, num_warps=4, num_stages=1)]

# The solve's substitution holds one [4, 16] row per step: one element per thread at 2 warps.
gdn_fwd_solve_kernel = ByPrecision(_gdn_fwd_solve_kernel, "gdn_fwd_solve", [Config(num_warps=2), Config(num_warps=4)],
                                   [Config(num_warps=4, num_stages=1)], Config())
gdn_fwd_wu_kernel = ByPrecision(
    _gdn_fwd_wu_kernel, "gdn_fwd_wu",
    [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8)], FP32_CONFIGS)
# The same kernel for V <= 32 (``_prep`` picks it), without the 32-column candidate: on sm_90 with triton 3.6 its
# V loop of a single 32-column block at K >= 64 reads shared memory out of range at the u product (an illegal
# memory access; compute-sanitizer names kernels_fwd.py's ``b_u`` line). Forced alone on an H100 it faulted at
# K 64 and 128 with V 16 and 32, and was right at K = 32 and at V = 48 and 64 (two blocks); the 64-column
# candidates were right at every one of those shapes (benchmarks/results/README.md, Gated DeltaNet).
gdn_fwd_wu_narrow_kernel = ByPrecision(
    _gdn_fwd_wu_kernel, "gdn_fwd_wu_narrow", [Config(BV=64, num_warps=4), Config(BV=64, num_warps=8)], FP32_CONFIGS)
# The scan storing each chunk's start state and U (the backward's recompute, the split forward). Its
# 8-warp BV <= 32 candidates, as the forward's, are those that do not spill registers on sm_90 builds
# (tools/studies/sm90_resources.py); the tuner times them all. The K-split form (KSPLIT, ``_states_khalves``:
# fewer live registers, k and w staged ahead by the pipeliner): every config forced passes
# tests/ops/test_gdn_scan_variants.py and test_every_candidate.py on a GPU, and at the real target's shape the
# tuner's pick among them is faster than the one-tile scan (benchmarks/results/README.md).
GDN_FWD_STATE_KSPLIT_CONFIGS = [
    Config(BV=32, num_warps=4, KSPLIT=True, LOOP_STAGES=3), Config(BV=32, num_warps=4, num_stages=4, KSPLIT=True),
    Config(BV=64, num_warps=4, KSPLIT=True, LOOP_STAGES=3), Config(BV=16, num_warps=4, KSPLIT=True, LOOP_STAGES=3)]
gdn_fwd_scan_states_kernel = ByPrecision(
    _gdn_fwd_states_kernel, "gdn_fwd_state",
    [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
     Config(BV=16, num_warps=4), Config(BV=32, num_warps=8), Config(BV=16, num_warps=8),
     Config(BV=32, num_warps=4, LOOP_STAGES=3)] + GDN_FWD_STATE_KSPLIT_CONFIGS,
    FP32_CONFIGS)
# The forward: the scan with the output fused in. The first candidate (what an untuned run launches)
# is the tuner's pick at the benchmark shapes on Hopper. Single-stage chunk loops are no candidates:
# at BV=32 they fault there (illegal memory access), at BV=64 they are slower. The 3-stage loop at
# BV=64 is faster for a single long sequence and slower at larger batches: the tuner picks per bucket.
gdn_fwd_scan_kernel = ByPrecision(
    _gdn_fwd_scan_kernel, "gdn_fwd_state_output",
    [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
     Config(BV=16, num_warps=4), Config(BV=32, num_warps=8), Config(BV=16, num_warps=8),
     Config(BV=64, num_warps=4, LOOP_STAGES=3)], FP32_CONFIGS)
# The split forward's output (gated_delta_rule._split_forward): one chunk per program, no loop.
gdn_fwd_output_kernel = ByPrecision(
    _gdn_fwd_output_kernel, "gdn_fwd_output",
    [Config(BV=64, num_warps=4), Config(BV=128, num_warps=8), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8)],
    FP32_CONFIGS)
