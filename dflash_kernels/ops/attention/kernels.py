"""Triton kernels of block-sparse attention (forward, dq, dk/dv, the backward's preprocess) and their tuning candidates.

Layout ``[B, T, H, D]``. A forward / dq program's rows are ``GPB`` query groups of the mask
(``BQ`` positions each) times ``GH`` query heads of one GQA group; the mask is the same for every
head, so the heads share one key loop. Row ``r`` of a group's ``BM``-row block is position
``q0 + r // GH`` and head ``h0 + r % GH``; ``BM >= BQ * GH`` is rounded up to a power of two >= 16
for ``tl.dot`` and the extra rows are dead.

For each segment slot the key loop runs over the union of the rows' segments in ``BN`` steps
starting at the lowest ``lo``: tiles that every row sees entirely (inside its segment, left of its
diagonal) run with no mask at all; only the ragged edges evaluate the mask element-wise. With one
group per program (DFlash: one draft block) that is the last tile of each segment; with two, also
the keys between the two blocks' anchors.

Forward and dq programs run in reverse group order: with anchors sorted along the sequence (as a
trainer samples them) the last groups see the longest contexts, and starting them first keeps the
last wave of programs short. The grids are flat (one axis: no 65535 limit on batch x heads).

The dk/dv programs run their key tiles in ascending order (the first keys are seen by the most rows,
under a causal mask as under sorted DFlash anchors) with the (batch, head) index varying fastest:
GPUs start programs in grid order, and with the heads outermost the heaviest key tiles of the last
heads started only after every earlier head's light ones (the draft blocks' own keys, seen by one
block each). Heads fastest, every head's heavy tiles start first and the last wave is short (most so at
B=1, with the fewest programs). The forward's and dq's programs are lighter and many more per head; the
order makes little difference for them (row tiles fastest slightly ahead), so they keep it.

The dk/dv kernel runs per key tile over the reverse index (mask.py), unmasked entries first, with
the keys (QM=0) or the row tiles (QM=1, transposed dk / dv accumulators) on the matmuls' M side.

Softmax runs in base 2: scores are multiplied by ``scale * log2(e)`` once so that ``exp2`` (one
instruction) replaces ``exp``; the stored lse is converted back to the natural log.
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _visible(t, kv, q0, lo, hi, shift, tile, tiles, BQ: tl.constexpr, TW: tl.constexpr,
             HAS_TILES: tl.constexpr):
    """Element-wise mask of rows ``t`` [BM] x keys ``kv`` [BN] for one segment (see mask.py).

    The segment fields are scalars, or [BM, 1] columns when each row has its own segment (and
    ``q0`` then a [BM] vector)."""
    vis = (kv[None, :] >= lo) & (kv[None, :] < hi) & (kv[None, :] <= t[:, None] + shift)
    if HAS_TILES:
        off = tile.to(tl.int64) * (BQ * TW) + (t - q0)[:, None] * TW + (kv[None, :] - lo)
        bit = tl.load(tiles + off, mask=vis & (tile >= 0), other=1)
        vis = vis & (bit != 0)
    return vis


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, start, stop, kv_end,
               t, q0, lo, hi, shift, tile, tiles, qk_scale,
               D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, TW: tl.constexpr,
               HAS_TILES: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for n in range(start, stop, BN):
        kv = n + offs_n
        k_ptrs = k_base + kv[None, :] * stride_kt + offs_d[:, None]  # [D, BN]: K^T
        v_ptrs = v_base + kv[:, None] * stride_vt + offs_d[None, :]
        if MASK:
            kt = tl.load(k_ptrs, mask=(kv < kv_end)[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        if MASK:
            vis = _visible(t, kv, q0, lo, hi, shift, tile, tiles, BQ, TW, HAS_TILES)
            s = tl.where(vis, s, float("-inf"))
        # m_i starts finite (-1e30), so a fully masked tile gives p = 0 and alpha = 1, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            vt = tl.load(v_ptrs, mask=(kv < kv_end)[:, None], other=0.0)
            # A key a row does not see must add exactly 0 to it, but inside the dot p = 0 times a
            # non-finite value is NaN: the dot takes the finite values only, and the elements of the rows
            # that see a non-finite value are set to NaN after it (only in tiles that hold one).
            v_ok = tl.abs(vt) < float("inf")
            vt = tl.where(v_ok, vt, 0.0)
        else:
            vt = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        if MASK:
            acc = _poison_seen(acc, vis, v_ok)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _poison_seen(acc, vis, ok):
    """NaN where a row of ``vis`` [R, C] sees an element of ``ok`` [C, D] that is False (not finite):
    what the product would give without masking. A scalar test first: tiles of finite values skip it."""
    if tl.sum(tl.sum((ok == 0).to(tl.int32), 1), 0) > 0:
        hit = tl.dot(vis.to(tl.float16), (ok == 0).to(tl.float16), out_dtype=tl.float32)
        acc = tl.where(hit > 0.0, float("nan"), acc)
    return acc


@triton.jit
def _row_program(NBH):
    """(row-tile index, batch x head index) of a forward / dq program on the flat grid: row tiles fastest,
    in reverse (module docstring)."""
    pid = tl.program_id(0)
    n_tiles = tl.num_programs(0) // NBH
    return n_tiles - 1 - pid % n_tiles, pid // n_tiles


@triton.jit
def _program_rows(pid_g, pid_bh, Tq, NG, MB, Hkv, G: tl.constexpr, GH: tl.constexpr, BQ: tl.constexpr,
                  BM: tl.constexpr, GPB: tl.constexpr):
    """The rows of a forward / dq program: GPB consecutive query groups, BM rows each.

    Returns the batch, kv head, each row's group index into ``seg_count`` (groups past the end
    reuse the last one: their rows are dead), group start q0, position t, head h and liveness."""
    NC: tl.constexpr = G // GH
    b = pid_bh // (Hkv * NC)
    kvh = (pid_bh // NC) % Hkv
    h0 = kvh * G + (pid_bh % NC) * GH
    r = tl.arange(0, GPB * BM)
    rr = r % BM
    g = pid_g * GPB + r // BM
    q0 = g * BQ
    t = q0 + rr // GH
    h = h0 + rr % GH
    row_ok = (rr < BQ * GH) & (t < Tq)
    grp = (b % MB).to(tl.int64) * NG + tl.minimum(g, NG - 1)
    return b, kvh, grp, q0, t, h, row_ok


@triton.jit
def _segment_plan(segments, n_seg, grp, s_i, q0, MS, BQ: tl.constexpr, BN: tl.constexpr,
                  HAS_TILES: tl.constexpr):
    """Segment ``s_i`` of every row's group, as [R, 1] columns (empty where a group has fewer), and
    the key loop that covers them all: masked ``[start, mid0)``, unmasked ``[mid0, mid1)`` (keys that
    every row sees), masked ``[mid1, stop)``. With one group per program the first part is empty."""
    live = s_i < n_seg
    seg = segments + (grp * MS + s_i) * 4
    lo = tl.load(seg, mask=live, other=0)
    hi = tl.load(seg + 1, mask=live, other=0)
    shift = tl.load(seg + 2, mask=live, other=0)
    tile = tl.load(seg + 3, mask=live, other=-1)
    end = tl.minimum(hi, q0 + BQ + shift)  # keys right of the group's last diagonal are never seen
    full_end = tl.minimum(hi, q0 + 1 + shift)  # keys every row of the group sees
    some = end > lo
    stop = tl.max(tl.where(some, end, 0), 0)
    start = tl.minimum(tl.min(tl.where(some, lo, stop), 0), stop)
    head = tl.max(tl.where(some, lo, 0), 0) - start  # keys some rows' segments do not start until
    mid0 = tl.minimum(start + tl.cdiv(head, BN) * BN, stop)
    n_full = tl.maximum(tl.min(full_end, 0) - mid0, 0) // BN
    if HAS_TILES:
        n_full = tl.where(tl.max(tile, 0) >= 0, 0, n_full)
    return lo[:, None], hi[:, None], shift[:, None], tile[:, None], start, mid0, mid0 + n_full * BN, stop


@triton.jit(do_not_specialize=["Tq", "Tk", "NG", "MS", "MB", "NBH"])
def _attention_fwd_kernel(q, k, v, o, lse, segments, seg_count, tiles,
                     Tq, Tk, NG, MS, MB, Hq, Hkv, NBH,
                     stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                     stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                     qk_scale,
                     D: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, BQ: tl.constexpr,
                     BM: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr,
                     DOT_PREC: tl.constexpr, BN: tl.constexpr, GPB: tl.constexpr):
    tl.static_assert(BM >= BQ * GH)
    tl.static_assert(G % GH == 0)
    pid_g, pid_bh = _row_program(NBH)
    b, kvh, grp, q0, t, h, row_ok = _program_rows(pid_g, pid_bh, Tq, NG, MB, Hkv, G, GH, BQ, BM, GPB)
    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    q_ptrs = q + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    qt = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = k + b64 * stride_kb + kvh * stride_kh
    v_base = v + b64 * stride_vb + kvh * stride_vh

    m_i = tl.full([GPB * BM], -1.0e30, tl.float32)
    l_i = tl.zeros([GPB * BM], tl.float32)
    acc = tl.zeros([GPB * BM, D], tl.float32)
    n_seg = tl.load(seg_count + grp)
    for s_i in range(tl.max(n_seg, 0)):
        lo, hi, shift, tile, start, mid0, mid1, stop = _segment_plan(segments, n_seg, grp, s_i, q0, MS, BQ, BN,
                                                                     HAS_TILES)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, qt, k_base, v_base, stride_kt, stride_vt, start, mid0, stop,
                                   t, q0, lo, hi, shift, tile, tiles, qk_scale,
                                   D, BQ, BN, TW, HAS_TILES, True, DOT_PREC)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, qt, k_base, v_base, stride_kt, stride_vt, mid0, mid1, stop,
                                   t, q0, lo, hi, shift, tile, tiles, qk_scale,
                                   D, BQ, BN, TW, HAS_TILES, False, DOT_PREC)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, qt, k_base, v_base, stride_kt, stride_vt, mid1, stop, stop,
                                   t, q0, lo, hi, shift, tile, tiles, qk_scale,
                                   D, BQ, BN, TW, HAS_TILES, True, DOT_PREC)

    seen = l_i > 0.0  # rows that see no key: output 0, lse -inf
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = o + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=row_ok[:, None])
    lse_val = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(lse + (b64 * Hq + h) * Tq + t, lse_val, mask=row_ok)


@triton.jit(do_not_specialize=["Tq"])
def _attention_bwd_preprocess_kernel(o, do, delta, Tq, Hq, stride_ob, stride_ot, stride_oh,
                                stride_dob, stride_dot, stride_doh,
                                D: tl.constexpr, BT: tl.constexpr):
    """delta[b, h, t] = sum_d o * do: the softmax backward's row term."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    t = pid_t * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, D)
    ok = (t < Tq)[:, None]
    ov = tl.load(o + b * stride_ob + t[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=ok, other=0.0)
    dov = tl.load(do + b * stride_dob + t[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=ok, other=0.0)
    tl.store(delta + (b * Hq + h) * Tq + t, tl.sum(ov.to(tl.float32) * dov.to(tl.float32), 1), mask=t < Tq)


@triton.jit
def _load_rows(q, do, lse, delta, b64, t, h, row_ok, Tq, Hq, stride_qb, stride_qt, stride_qh,
               stride_dob, stride_dot, stride_doh, D: tl.constexpr):
    """q, do [BM, D] and the row terms lse (base 2; +inf where the row sees nothing) and delta."""
    offs_d = tl.arange(0, D)
    qt = tl.load(q + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    dot_ = tl.load(do + b64 * stride_dob + t[:, None] * stride_dot + h[:, None] * stride_doh + offs_d[None, :],
                   mask=row_ok[:, None], other=0.0)
    row = (b64 * Hq + h) * Tq + t
    lse2 = tl.load(lse + row, mask=row_ok, other=float("inf")) * LOG2E
    # lse = -inf (no key seen): +inf makes every p = exp2(s - lse) exactly 0 instead of inf.
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    dlt = tl.load(delta + row, mask=row_ok, other=0.0)
    return qt, dot_, lse2, dlt


@triton.jit
def _dq_inner(dq, q, do_, lse2, dlt, k_base, v_base, stride_kt, stride_vt, start, stop, kv_end,
              t, q0, lo, hi, shift, tile, tiles, qk_scale,
              D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, TW: tl.constexpr,
              HAS_TILES: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for n in range(start, stop, BN):
        kv = n + offs_n
        kT_ptrs = k_base + kv[None, :] * stride_kt + offs_d[:, None]
        vT_ptrs = v_base + kv[None, :] * stride_vt + offs_d[:, None]
        if MASK:
            kT = tl.load(kT_ptrs, mask=(kv < kv_end)[None, :], other=0.0)
            vT = tl.load(vT_ptrs, mask=(kv < kv_end)[None, :], other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            vis = _visible(t, kv, q0, lo, hi, shift, tile, tiles, BQ, TW, HAS_TILES)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do_, vT, input_precision=DOT_PREC)
        ds = p * (dp - dlt[:, None])
        if MASK:
            # Keys a row does not see add exactly 0 (p = 0 times a non-finite dp is NaN; 0 times a
            # non-finite key too, inside the dot): a non-finite key reaches the rows that see it
            # through their scores s, hence p and ds, so the dot may take the finite keys only.
            ds = tl.where(vis, ds, 0.0)
            kT = tl.where(tl.abs(kT) < float("inf"), kT, 0.0)
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["Tq", "Tk", "NG", "MS", "MB", "NBH"])
def _attention_bwd_dq_kernel(q, k, v, do, lse, delta, dq, segments, seg_count, tiles,
                        Tq, Tk, NG, MS, MB, Hq, Hkv, NBH,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                        qk_scale, sm_scale,
                        D: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, BQ: tl.constexpr,
                        BM: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr,
                        DOT_PREC: tl.constexpr, BN: tl.constexpr, GPB: tl.constexpr):
    """dq for the rows of GPB query groups; dq has q's strides."""
    pid_g, pid_bh = _row_program(NBH)
    b, kvh, grp, q0, t, h, row_ok = _program_rows(pid_g, pid_bh, Tq, NG, MB, Hkv, G, GH, BQ, BM, GPB)
    b64 = b.to(tl.int64)
    qt, do_, lse2, dlt = _load_rows(q, do, lse, delta, b64, t, h, row_ok, Tq, Hq, stride_qb, stride_qt,
                                    stride_qh, stride_dob, stride_dot, stride_doh, D)
    k_base = k + b64 * stride_kb + kvh * stride_kh
    v_base = v + b64 * stride_vb + kvh * stride_vh
    dqa = tl.zeros([GPB * BM, D], tl.float32)
    n_seg = tl.load(seg_count + grp)
    for s_i in range(tl.max(n_seg, 0)):
        lo, hi, shift, tile, start, mid0, mid1, stop = _segment_plan(segments, n_seg, grp, s_i, q0, MS, BQ, BN,
                                                                     HAS_TILES)
        dqa = _dq_inner(dqa, qt, do_, lse2, dlt, k_base, v_base, stride_kt, stride_vt, start, mid0, stop,
                        t, q0, lo, hi, shift, tile, tiles, qk_scale, D, BQ, BN, TW, HAS_TILES, True, DOT_PREC)
        dqa = _dq_inner(dqa, qt, do_, lse2, dlt, k_base, v_base, stride_kt, stride_vt, mid0, mid1, stop,
                        t, q0, lo, hi, shift, tile, tiles, qk_scale, D, BQ, BN, TW, HAS_TILES, False, DOT_PREC)
        dqa = _dq_inner(dqa, qt, do_, lse2, dlt, k_base, v_base, stride_kt, stride_vt, mid1, stop, stop,
                        t, q0, lo, hi, shift, tile, tiles, qk_scale, D, BQ, BN, TW, HAS_TILES, True, DOT_PREC)
    offs_d = tl.arange(0, D)
    dq_ptrs = dq + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    tl.store(dq_ptrs, (dqa * sm_scale).to(dq.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_step(dk, dv, kt, vt, q, do_, lse2, dlt, kv, t, q0, lo, hi, shift, tile, tiles, qk_scale,
               BQ: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr, MASK: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """Add one row tile's contribution to a key tile's dk, dv (transposed: keys are rows here)."""
    sT = tl.dot(kt, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BN, BM]
    pT = tl.math.exp2(sT - lse2[None, :])
    if MASK:
        vis = _visible(t, kv, q0, lo, hi, shift, tile, tiles, BQ, TW, HAS_TILES)
        pT = tl.where(tl.trans(vis), pT, 0.0)
        # Rows that do not see a key add exactly 0 to its dk, dv, also when their q, do or row terms
        # are not finite (0 times NaN inside the dots): dsT is masked after its product; q reaches the
        # keys its row sees through sT (hence pT, dsT), so the dk dot takes the finite q only; do
        # reaches dv through the dot alone: finite do in the dot, NaN set afterwards where seen.
        do_ok = tl.abs(do_) < float("inf")
        dv += tl.dot(pT.to(do_.dtype), tl.where(do_ok, do_, 0.0), input_precision=DOT_PREC)
        dv = _poison_seen(dv, tl.trans(vis), do_ok)
    else:
        dv += tl.dot(pT.to(do_.dtype), do_, input_precision=DOT_PREC)
    dpT = tl.dot(vt, tl.trans(do_), input_precision=DOT_PREC)
    dsT = pT * (dpT - dlt[None, :])
    if MASK:
        dsT = tl.where(tl.trans(vis), dsT, 0.0)
        q = tl.where(tl.abs(q) < float("inf"), q, 0.0)
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_step_qm(dkT, dvT, kt, vt, q, do_, lse2, dlt, kv, t, q0, lo, hi, shift, tile, tiles, qk_scale,
                  BQ: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr, MASK: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """``_dkdv_step`` with the row tile on the matmuls' M side: scores [BM, BN] and the transposed
    accumulators dk^T, dv^T [D, BN] (M = D). A BN = 32 key tile then still gives Hopper's warpgroup
    MMA its 64-row M, and the accumulators take half the registers of a [BN, D] pair at BN = 64."""
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        vis = _visible(t, kv, q0, lo, hi, shift, tile, tiles, BQ, TW, HAS_TILES)
        p = tl.where(vis, p, 0.0)
        # As in _dkdv_step: finite do in the dot, NaN set afterwards on the keys whose rows saw a
        # non-finite do (the transposed _poison_seen: hit^T = bad^T @ vis).
        bad = (tl.abs(do_) < float("inf")) == 0  # NaN compares False too
        dvT += tl.dot(tl.trans(tl.where(bad, 0.0, do_)), p.to(do_.dtype), input_precision=DOT_PREC)
        if tl.sum(tl.sum(bad.to(tl.int32), 1), 0) > 0:
            hit = tl.dot(tl.trans(bad.to(tl.float16)), vis.to(tl.float16), out_dtype=tl.float32)
            dvT = tl.where(hit > 0.0, float("nan"), dvT)
    else:
        dvT += tl.dot(tl.trans(do_), p.to(do_.dtype), input_precision=DOT_PREC)
    dp = tl.dot(do_, tl.trans(vt), input_precision=DOT_PREC)  # [BM, BN]
    ds = p * (dp - dlt[:, None])
    if MASK:
        ds = tl.where(vis, ds, 0.0)
        q = tl.where(tl.abs(q) < float("inf"), q, 0.0)
    dkT += tl.dot(tl.trans(q), ds.to(q.dtype), input_precision=DOT_PREC)
    return dkT, dvT


@triton.jit
def _dkdv_entries(dka, dva, kt, vt, q, do, lse, delta, segments, rev_entries, tiles, e_start, e_stop,
                  b64, bm, kvh, kv, Tq, NG, MS, Hq, stride_qb, stride_qt, stride_qh,
                  stride_dob, stride_dot, stride_doh, qk_scale,
                  D: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr,
                  EPI: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr, MASK: tl.constexpr,
                  DOT_PREC: tl.constexpr, QM: tl.constexpr):
    """Entries ``[e_start, e_stop)`` of the reverse index, EPI at a time: the row tiles of EPI entries are
    stacked into one ``EPI * BM``-row operand so each matmul is EPI times wider (each row keeps its own
    entry's segment for the element mask)."""
    NC: tl.constexpr = G // GH
    r = tl.arange(0, EPI * BM)
    rr = r % BM
    for e0 in range(e_start, e_stop, EPI):
        e = e0 + r // BM
        e_ok = e < e_stop
        g = tl.load(rev_entries + 2 * e, mask=e_ok, other=0)
        s_i = tl.load(rev_entries + 2 * e + 1, mask=e_ok, other=0)
        seg = segments + ((bm.to(tl.int64) * NG + g) * MS + s_i) * 4
        q0 = g * BQ
        t = q0 + rr // GH
        row_ok = (rr < BQ * GH) & (t < Tq) & e_ok
        if MASK:
            lo = tl.load(seg, mask=e_ok, other=0)[:, None]
            hi = tl.load(seg + 1, mask=e_ok, other=0)[:, None]
            shift = tl.load(seg + 2, mask=e_ok, other=0)[:, None]
            tile = tl.load(seg + 3, mask=e_ok, other=-1)[:, None]
        else:  # unused: these rows see the whole key tile
            lo, hi, shift, tile = 0, 0, 0, -1
        for c in tl.static_range(NC):
            h = kvh * G + c * GH + rr % GH
            qt, do_, lse2, dlt = _load_rows(q, do, lse, delta, b64, t, h, row_ok, Tq, Hq, stride_qb,
                                            stride_qt, stride_qh, stride_dob, stride_dot, stride_doh, D)
            if QM:
                dka, dva = _dkdv_step_qm(dka, dva, kt, vt, qt, do_, lse2, dlt, kv, t, q0, lo, hi, shift, tile,
                                         tiles, qk_scale, BQ, TW, HAS_TILES, MASK, DOT_PREC)
            else:
                dka, dva = _dkdv_step(dka, dva, kt, vt, qt, do_, lse2, dlt, kv, t, q0, lo, hi, shift, tile,
                                      tiles, qk_scale, BQ, TW, HAS_TILES, MASK, DOT_PREC)
    return dka, dva


@triton.jit(do_not_specialize=["Tq", "Tk", "NG", "MS", "MB", "NKV", "NBH"])
def _attention_bwd_dkdv_kernel(q, k, v, do, lse, delta, dk, dv, segments, rev_offsets, rev_full, rev_entries, tiles,
                          Tq, Tk, NG, MS, MB, NKV, Hq, Hkv, NBH,
                          stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                          qk_scale, sm_scale,
                          D: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, BQ: tl.constexpr,
                          BM: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr,
                          DOT_PREC: tl.constexpr, KVT: tl.constexpr, SPLIT: tl.constexpr, EPI: tl.constexpr,
                          QM: tl.constexpr):
    """dk, dv of one BN-key tile of one kv head, summed over the row tiles that the reverse index lists
    for it, in the index's fixed order (no atomics: deterministic). The index lists the row tiles that
    see the whole key tile first: they run without any element mask. dk/dv have k's / v's strides.

    The index is built for ``KVT``-wide key tiles; a program covers ``BN = KVT // SPLIT`` keys of one
    of them and walks that tile's entries (an entry unmasked for the whole tile is unmasked for any
    part of it; masked ones keep their element mask). SPLIT = 2 halves the per-program dk/dv tiles,
    which is what keeps this kernel's registers from spilling at D = 128 (sm_90 builds, cuobjdump:
    many local loads per step at BN = 64, a few at BN = 32; benchmarks/sm90_resources.py)."""
    BN: tl.constexpr = KVT // SPLIT
    tl.static_assert(BN >= 16)
    pid_n = tl.program_id(0) // NBH  # key tiles in order, the heads fastest (module docstring)
    pid_bh = tl.program_id(0) % NBH
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    bm = b % MB
    b64 = b.to(tl.int64)
    n0 = pid_n * BN
    kv = n0 + tl.arange(0, BN)
    kv_ok = kv < Tk
    offs_d = tl.arange(0, D)
    kt = tl.load(k + b64 * stride_kb + kv[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                 mask=kv_ok[:, None], other=0.0)
    vt = tl.load(v + b64 * stride_vb + kv[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                 mask=kv_ok[:, None], other=0.0)
    if QM:  # transposed accumulators (_dkdv_step_qm)
        dka = tl.zeros([D, BN], tl.float32)
        dva = tl.zeros([D, BN], tl.float32)
    else:
        dka = tl.zeros([BN, D], tl.float32)
        dva = tl.zeros([BN, D], tl.float32)
    key_tile = bm.to(tl.int64) * NKV + pid_n // SPLIT
    e_start = tl.load(rev_offsets + key_tile)
    e_mid = e_start + tl.load(rev_full + key_tile)
    e_stop = tl.load(rev_offsets + key_tile + 1)
    dka, dva = _dkdv_entries(dka, dva, kt, vt, q, do, lse, delta, segments, rev_entries, tiles, e_start, e_mid,
                             b64, bm, kvh, kv, Tq, NG, MS, Hq, stride_qb, stride_qt, stride_qh,
                             stride_dob, stride_dot, stride_doh, qk_scale,
                             D, G, GH, BQ, BM, EPI, TW, HAS_TILES, False, DOT_PREC, QM)
    dka, dva = _dkdv_entries(dka, dva, kt, vt, q, do, lse, delta, segments, rev_entries, tiles, e_mid, e_stop,
                             b64, bm, kvh, kv, Tq, NG, MS, Hq, stride_qb, stride_qt, stride_qh,
                             stride_dob, stride_dot, stride_doh, qk_scale,
                             D, G, GH, BQ, BM, EPI, TW, HAS_TILES, True, DOT_PREC, QM)
    if QM:
        dka = tl.trans(dka)
        dva = tl.trans(dva)
    dk_ptrs = dk + b64 * stride_kb + kv[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
    dv_ptrs = dv + b64 * stride_vb + kv[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
    tl.store(dk_ptrs, (dka * sm_scale).to(dk.dtype.element_ty), mask=kv_ok[:, None])
    tl.store(dv_ptrs, dva.to(dv.dtype.element_ty), mask=kv_ok[:, None])


# GPB: query groups stacked in one program (rows = GPB * BM). Two DFlash blocks x 4 heads make a
# 128-row tile; their rows keep their own key ranges, masked only where those differ.
_row_configs = [
    Config(BN=64, GPB=1, num_warps=4, num_stages=3),
    Config(BN=64, GPB=1, num_warps=4, num_stages=2),
    Config(BN=128, GPB=1, num_warps=8, num_stages=2),
    Config(BN=64, GPB=2, num_warps=8, num_stages=2),
    Config(BN=64, GPB=2, num_warps=8, num_stages=3),
    Config(BN=128, GPB=2, num_warps=8, num_stages=2),
    Config(BN=32, GPB=1, num_warps=4, num_stages=2),  # D=256: the only shared-memory fit for the backward
]
attention_fwd_kernel = TritonKernel(_attention_fwd_kernel, name="block_sparse_attn_fwd", configs=_row_configs,
                                    interpret_config=Config(BN=16, GPB=2))
# The same candidates for dq, with the one the tuner chose at the DFlash shapes on Hopper first: the
# first candidate is what an untuned run (DFLASH_KERNELS_TUNE=0) launches (the next that fits, if it
# does not).
attention_bwd_dq_kernel = TritonKernel(_attention_bwd_dq_kernel, name="block_sparse_attn_bwd_dq",
                                       configs=[_row_configs[4]] + _row_configs[:4] + _row_configs[5:],
                                       interpret_config=Config(BN=16, GPB=2))
# The dk/dv kernel's key tile is the mask's kv_tile (the reverse index is built for it) or, with
# SPLIT=2, half of it; tuned: that split, how many row tiles (EPI) one step stacks, which side of the
# matmuls the keys take (QM), launch options. First: the fastest at the DFlash training shape on Hopper
# (kv_tile 64, B=1, S=3072, 512 blocks, 32 / 8 heads, D=128; a QM=1 config, ahead of every QM=0 one with
# and without a window: the row tile on the M side fills the warpgroup MMA; benchmarks/results/README.md).
# The QM=0 SPLIT=2 candidates are the ones that do not spill registers at D=128 (see the kernel); a
# split that leaves fewer than 16 keys does not compile and is no candidate.
attention_bwd_dkdv_kernel = TritonKernel(
    _attention_bwd_dkdv_kernel, name="block_sparse_attn_bwd_dkdv",
    configs=[Config(EPI=e, SPLIT=sp, QM=qm, num_warps=w, num_stages=st) for e, sp, qm, w, st in (
        (2, 1, 1, 8, 2), (2, 1, 1, 8, 3), (1, 1, 1, 4, 2), (1, 2, 1, 4, 2), (2, 2, 1, 8, 2),
        (1, 1, 0, 4, 2), (2, 1, 0, 8, 2), (1, 2, 0, 8, 2), (1, 2, 0, 4, 2))],
    interpret_config=Config(EPI=2, SPLIT=1, QM=1))  # the stacked path, odd entry counts included
attention_bwd_preprocess_kernel = TritonKernel(_attention_bwd_preprocess_kernel, name="block_sparse_attn_bwd_pre",
                                               configs=[Config(BT=64, num_warps=4)], interpret_config=Config(BT=16))
