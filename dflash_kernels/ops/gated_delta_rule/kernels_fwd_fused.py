"""The GDN forward's per-chunk preparation in one kernel: kernels_fwd.py's ``solve`` (t_bad, G, A) and then, in
the same program, its ``wu`` products (w, u) from the A that program just wrote.

Opt-in through ``DFLASH_KERNELS_GDN_FWD_PREPARE=fused`` (``settings.gdn_fwd_prepare``; the default ``split``
launches the two kernels of kernels_fwd.py). The split path writes A (fp32, [T, Hv, 64]) and G to memory and
reads them back, with k, v and beta, in a second launch; here one program per chunk and value head reads its
own A while it is still in the caches, reads the chunk's k rows a second time right after the solve's reads
of them, and saves a launch. A and G are still stored: the backward reads the forward's.

How, and what is shared with kernels_fwd.py (whose kernels must keep their source and first line numbers:
Triton's cache keys and the shipped tuning results depend on them):

- the solve is ``_gdn_fwd_solve_kernel`` itself, called as a function (Triton inlines it): nothing of it is
  repeated, and its t_bad, G and A are those of the split path's solve, the same operations in the same order;
- a ``tl.debug_barrier()`` then makes the solve's last stores of A visible to every thread of the program (the
  solve ends with stores and no barrier; its own steps already read back what other threads stored);
- ``wu_products`` computes w and u as ``_gdn_fwd_wu_kernel`` does, from tiles the caller loaded: the same
  loads, masks, casts and products, so that w and u are the split path's (bit for bit under the interpreter;
  on a GPU the same instructions, though the compiler schedules them in a larger kernel). What is repeated
  from the w/u kernel is its short prologue (which rows are read, the loads of t_bad, beta, G and A) and its
  two products: that kernel's body cannot become a shared helper without editing kernels_fwd.py.

Not reused: the solve's registers (its beta, G and t_bad are locals of a kernel that returns nothing; reusing
them would mean a second copy of the solve's body). The w/u part loads them again: a scalar and two [64]
vectors that this program just wrote or read, cache hits beside the [64, 64] A tile.

One tuning choice more than the w/u kernel: w in column blocks of BKB (``wu_products``), so that the w product
needs no [64, K] fp32 accumulator at once (BKB >= K: one product, as the w/u kernel). Each element of w is the
same sum over the chunk's 64 rows whatever the block (a GPU's MMA instructions step through those rows in an
order that does not depend on the tile's width); under the interpreter numpy's BLAS may sum a narrower product
in another order, so there w with BKB < K can differ from the split path's in the last bits (the interpreter
config takes K whole: the split path's w bit for bit; the same holds for u and BV, in both paths).
"""

import triton
import triton.language as tl

from dflash_kernels.ops.gated_delta_rule.kernels_fwd import ByPrecision, _gdn_fwd_solve_kernel, chunk_bounds, gdn_beta
from dflash_kernels.runtime import Config


@triton.jit
def wu_products(k_ptr, v_ptr, w_ptr, u_ptr, b_Ad, b_beta, b_kscale, rows, m_t, f_t, i_h, i_hk, SV,
                HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BKB: tl.constexpr, BV: tl.constexpr):
    """w = A diag(beta exp(G)) K and u = A diag(beta) V of one chunk and value head, from loaded tiles: ``b_Ad``
    (A [BT, BT] in the inputs' dtype), ``b_beta`` and ``b_kscale`` ([BT] fp32: beta, and beta exp(G), 0 on the
    rows not read), the chunk's ``rows``, ``m_t`` (valid) and ``f_t`` (read: valid and before t_bad).

    k is read in column blocks of min(BKB, BK), v (row stride SV) in blocks of BV; w and u are stored for every
    valid row. Each block's product is that of ``_gdn_fwd_wu_kernel`` restricted to the block's columns."""
    dt = k_ptr.dtype.element_ty
    KB: tl.constexpr = min(BKB, BK)
    for i_k in range(tl.cdiv(K, KB)):
        o_k = i_k * KB + tl.arange(0, KB)
        m_k = o_k < K
        b_k = tl.load(k_ptr + rows[:, None] * (HK * K) + i_hk * K + o_k[None, :], mask=f_t[:, None] & m_k[None, :],
                      other=0)
        b_w = tl.dot(b_Ad, (b_k * b_kscale[:, None]).to(dt))
        tl.store(w_ptr + rows[:, None] * (HV * K) + i_h * K + o_k[None, :], b_w.to(w_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v = tl.load(v_ptr + rows[:, None] * SV + i_h * V + o_v[None, :], mask=f_t[:, None] & m_v[None, :], other=0)
        b_u = tl.dot(b_Ad, (b_v * b_beta[:, None]).to(dt))
        tl.store(u_ptr + rows[:, None] * (HV * V) + i_h * V + o_v[None, :], b_u.to(u_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])


@triton.jit(do_not_specialize=["T"])
def _gdn_fwd_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, t_bad_ptr, gcum_ptr, A_ptr,
                            w_ptr, u_ptr, cu_seqlens_ptr, chunk_indices_ptr, T, SV, HK: tl.constexpr,
                            HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            IS_VARLEN: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr,
                            GATE: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False,
                            BETA_MODE: tl.constexpr = 0, BD: tl.constexpr = 32):
    """One chunk and value head: ``_gdn_fwd_solve_kernel`` (t_bad, G, A stored; the same arguments), a barrier,
    then w and u as ``_gdn_fwd_wu_kernel`` with HAS_T_BAD computes them (the rows from t_bad on read as 0)."""
    tl.static_assert(BK >= K)
    _gdn_fwd_solve_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, t_bad_ptr, gcum_ptr, A_ptr,
                          cu_seqlens_ptr, chunk_indices_ptr, T, SV, HK, HV, K, V, BT, BK, IS_VARLEN, GATE,
                          HAS_DT_BIAS, BETA_MODE, BD)
    tl.debug_barrier()  # the solve's last stores of A (and t_bad, G) before other threads read them

    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos, seqlen, i_t = chunk_bounds(i_c, T, cu_seqlens_ptr, chunk_indices_ptr, BT, IS_VARLEN)
    o_i = tl.arange(0, BT)
    m_t = i_t * BT + o_i < seqlen
    rows = bos + i_t * BT + o_i
    f_t = m_t & (o_i < tl.load(t_bad_ptr + i_c * HV + i_h))  # the rows read
    b_beta = tl.load(beta_ptr + rows * HV + i_h, mask=f_t, other=0).to(tl.float32)
    b_beta = tl.where(f_t, gdn_beta(b_beta, BETA_MODE), 0.0)
    b_G = tl.load(gcum_ptr + rows * HV + i_h, mask=f_t, other=0)
    b_A = tl.load(A_ptr + rows[:, None] * (HV * BT) + i_h * BT + o_i[None, :], mask=m_t[:, None], other=0)
    wu_products(k_ptr, v_ptr, w_ptr, u_ptr, b_A.to(k_ptr.dtype.element_ty), b_beta,
                b_beta * tl.exp(tl.where(f_t, b_G, 0.0)), rows, m_t, f_t, i_h, i_hk, SV, HK, HV, K, V, BK, BKB, BV)


# Candidates: 4 warps first (the solve runs at 2 or 4, the w/u products at 4 or 8 in the split path). At 2 warps
# a whole-K w tile spills on sm_90 builds, so the 2-warp candidates take w in column blocks of 32 or 64. None of
# these spills in a loop (tools/studies/sm90_resources.py, group gdn_prepare; one spill store outside the loops
# at 2 warps, BV=32, with the raw gate and beta logits). The first (what an untuned run launches) has the fewest
# registers of the 4-warp ones. fp32: the split path's rule (ByPrecision: 4 warps, one stage), w in blocks of 32
# (a whole-K fp32 w tile takes every register). Interpreted: K whole (BKB = 256, the largest K the op takes), u
# in blocks of 16, as the split path's interpreted w/u kernel.
gdn_fwd_prepare_kernel = ByPrecision(
    _gdn_fwd_prepare_kernel, "gdn_fwd_prepare",
    [Config(BV=64, BKB=64, num_warps=4), Config(BV=64, BKB=128, num_warps=4), Config(BV=32, BKB=32, num_warps=4),
     Config(BV=128, BKB=128, num_warps=4), Config(BV=64, BKB=64, num_warps=2), Config(BV=32, BKB=32, num_warps=2)],
    [Config(BV=32, BKB=32, num_warps=4, num_stages=1), Config(BV=16, BKB=32, num_warps=4, num_stages=1)],
    Config(BV=16, BKB=256))
