"""Warp-specialized Hopper (sm_90) attention forward in Gluon: a prototype of FlashAttention-3's structure.

Dense attention (non-causal, or causal aligned top-left like ``F.scaled_dot_product_attention(is_causal=True)``:
query ``i`` sees keys ``j <= i``) over q ``[B, Lq, H, D]``, k / v ``[B, Lk, Hkv, D]`` (query head ``h`` reads kv
head ``h // (H // Hkv)``), bf16 or fp16, D = 64 or 128. Outputs o ``[B, Lq, H, D]`` in the input dtype and lse
``[B, H, Lq]`` fp32, the natural-log logsumexp of the scaled scores (the portable forward's convention:
``-inf`` for a row that sees no key, whose o is 0).

Why Gluon: Triton 3.6 lowers the portable kernels' ``tl.dot`` loops to one warpgroup pipeline in which the
two matmuls and the softmax of a tile run one after the other; its ``warp_specialize=True`` does not split
an attention loop into partitions on sm_90 (tools/studies/sm90_autows_probe.py). Gluon states the partitions
and the synchronisation explicitly.

One program (CTA) owns ``BM = 128`` query rows of one (batch, head), split between two consumer warpgroups of
64 rows each, and three partitions share its shared memory:

- producer (1 warp, few registers): TMA loads of the two Q halves, then of every K and V tile of the key
  range into a ring of ``NUM_STAGES`` stages. Each stage has, for K and for V separately, a ``ready``
  mbarrier (completed by the TMA's byte count) and an ``empty`` mbarrier (both consumers arrive once when
  their matmul no longer reads the stage), so a K tile is recycled as soon as the scores are computed,
  before the V tile of the same step.
- consumer 0 (the default partition, 4 warps) and consumer 1 (a worker partition, 4 warps), the same code
  on different rows: ``S = Q K^T`` with an asynchronous warpgroup MMA from shared memory, the online
  softmax in registers (base 2: the row max over the raw scores, each exponent ``s * sm_scale * log2(e) -
  max`` one fused multiply-add, then ``exp2``, one instruction), then ``O += P V`` with P from registers.
- ping-pong: a consumer issues its matmuls only while it holds a turn (two mbarriers handing the turn back
  and forth), so the tensor cores run one warpgroup's matmuls while the other computes its softmax.
  Inside a consumer the matmuls of consecutive tiles overlap too: step ``j`` issues ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` together, then waits for ``S_j`` alone and computes its softmax while ``P V``
  still runs.
- registers: ``setmaxnreg`` moves registers from the producer's warpgroup (24 per thread) to the consumers
  (``CONSUMER_REGS``), which hold a 64 x D fp32 accumulator, a 64 x BN score tile and the previous P.

Both consumers run every key tile of the program's range (under the causal mask the range ends at the last
row of the 128-row tile), as the producer loads each stage once for both. Scores of keys at or past ``Lk``
and, causal, right of a row's diagonal are set to -inf; only tiles that contain such keys compute the mask.

The epilogue writes o through the consumer's Q buffer (Q is no longer read) and a TMA store, which clips rows
past ``Lq``; lse goes through plain masked stores.

Non-finite keys and values stay with the rows that see them, as in the portable forward. A non-finite K element
makes only its key's scores non-finite, and the mask's selects replace those of rows that do not see it. V needs
more under the causal mask: a diagonal tile's ``P V`` multiplies every row with every key of the tile, a row's P
being 0 on keys right of its diagonal, and ``0 * NaN`` is NaN. So each consumer copies its diagonal tiles' V into
a slot of its own with the non-finite elements set to 0 (``_finite_values``: two more V slots, 229,736 bytes of
shared memory at D = 128), and sets o to NaN on the rows at or after the first key it found there. Every row sees
the other tiles' keys whole, so a non-finite value there reaches every row through the product itself.

Descriptors are rank 3 over views ``[B, L, heads * D]`` with ``[1, rows, D]`` boxes, so a box never crosses
into the next batch: rows past ``Lq`` and keys past ``Lk`` read as zeros, and o's rows past ``Lq`` are not
written. TMA needs the base addresses and every stride but the last to be multiples of 16 bytes, and the
head dim contiguous: the launcher takes contiguous q, k, v (``[B, L, heads, D]`` row-major) with D = 64 or
128, which meet it whenever the base pointers are 16-byte aligned (torch allocations are; it checks).

The consumer's key loop (``_attend``), the producer's K / V loop (``_load_kv``), the softmax step and the
epilogue's normalisation walk keys in up to two ranges (segment slots) with a per-range element mask; the
dense kernel uses one range ``[0, Lk)``, the DFlash-mask forward (kernels_gluon_sm90_dflash.py) both.

The op's dispatch (attention.py) runs this kernel for ``causal_block_mask`` masks on sm_90 GPUs (bf16 / fp16,
D 64 / 128).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dflash_kernels.runtime import Config, TritonKernel, alloc, bucket, cdiv

__all__ = ["attention_fwd_gluon_sm90", "attention_fwd_gluon_kernel"]

LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)

BM = 128  # query rows per program: two consumer warpgroups of 64 (a warpgroup MMA is 64 rows tall)
BMW = 64  # query rows per consumer warpgroup
PRODUCER_REGS = 24  # the fewest setmaxnreg allows: the producer only issues TMA copies and waits on barriers
CONSUMER_REGS = 240  # (65536 - 128 * 24) / (2 * 128), rounded down to a multiple of 8
# Registers per thread at launch, before setmaxnreg moves them: 65536 over the 12 warps the three partitions
# occupy (the producer's one warp takes a whole warpgroup of register file), rounded down to a multiple of 8.
MAXNREG = 168


@gluon.constexpr_function
def score_layout(N):
    """The fp32 accumulator layout of a warpgroup MMA with N columns in one warpgroup (warps stacked along the
    rows, 16 rows each; K per instruction is 32 bytes of the 16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


@gluon.jit
def _issue_scores(q, k_smem, k_ready, stage, phase, ROWS: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
                  s_layout: gl.constexpr):
    """Wait for the K tile in ``stage`` and start ``S = Q K^T`` on it (asynchronous, fp32 [ROWS, BN])."""
    mbarrier.wait(k_ready.index(stage), phase)
    kt = k_smem.index(stage).reshape([BN, D]).permute((1, 0))  # [D, BN], a view: no copy
    s = gl.zeros([ROWS, BN], gl.float32, s_layout)
    return warpgroup_mma(q, kt, s, use_acc=False, is_async=True)


@gluon.jit
def _tile_keys(j, start0, n0, start1, lo0, hi0, lo1, hi1, BN: gl.constexpr):
    """Tile ``j`` of a program's key walk: its first key and the consumer's segment ``[lo, hi)`` it is masked
    against. The walk is ``n0`` tiles from ``start0`` (segment slot 0), then tiles from ``start1`` (slot 1)."""
    first = j < n0
    n = gl.where(first, start0 + j * BN, start1 + (j - n0) * BN)
    return n, gl.where(first, lo0, lo1), gl.where(first, hi0, hi1)


@gluon.jit
def _masked_scores(s, n, lo, hi, row0, rows, BN: gl.constexpr, CAUSAL: gl.constexpr,
                   s_layout: gl.constexpr):
    """Scores of the key tile ``[n, n + BN)``, unscaled, -inf at keys outside ``[lo, hi)`` and (causal) right of
    the row's diagonal. The element mask is computed only for tiles that hold such keys."""
    ragged = (n < lo) | (n + BN > hi)
    if CAUSAL:
        ragged = ragged | (n + BN - 1 > row0)  # some key right of the first row's diagonal
    if ragged:
        cols = n + gl.arange(0, BN, gl.SliceLayout(0, s_layout))
        vis = gl.expand_dims((cols >= lo) & (cols < hi), 0)
        if CAUSAL:
            vis = vis & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(vis, s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """One online-softmax step on unscaled scores ``s``: the new base-2 row max (of ``s * qk_scale``), P, the
    rescale factor of the old accumulator and the new row sums. The max is taken over the unscaled scores
    (``qk_scale > 0`` keeps their order), so each exponent ``s * qk_scale - max`` is one fused multiply-add.
    A row that has seen no key yet keeps max -inf; its exponents are taken against 0 so that P and alpha are
    0, not NaN."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return m_new, p, alpha, l_i


@gluon.jit
def _visible_values(v_smem, stage, dst, n, lo, hi, BN: gl.constexpr, D: gl.constexpr):
    """Copy the V tile of keys ``[n, n + BN)`` in ring slot ``stage`` into slot ``dst`` of ``v_smem`` with the
    rows of keys outside ``[lo, hi)`` set to 0 (a select: a NaN or Inf there does not survive), for a
    warpgroup MMA to read. The caller has waited for the tile and for every MMA that read ``dst``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    # 32 keys at a time (16 registers a thread at D = 128): the whole tile at once spills at D = 128.
    CH: gl.constexpr = 32
    src = v_smem.index(stage).reshape([BN, D])
    dst_buf = v_smem.index(dst).reshape([BN, D])
    r = gl.arange(0, CH, gl.SliceLayout(1, layout))  # the same registers for every piece
    for c in gl.static_range(BN // CH):
        x = src.slice(c * CH, CH).load(layout)
        first = n + c * CH  # key of the piece's row 0: row r is visible iff lo <= first + r < hi
        vis = gl.expand_dims((r >= lo - first) & (r < hi - first), 1)
        dst_buf.slice(c * CH, CH).store(gl.where(vis, x, gl.zeros_like(x)))
    # The MMA reads the copy through the async proxy, after every thread of the warpgroup has written its part.
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _confine_values(v_smem, v_ready, j, stage, phase, start0, n0, start1, lo0, hi0, lo1, hi1, OWN: gl.constexpr,
                    BN: gl.constexpr, D: gl.constexpr):
    """The ``v_smem`` slot ``O += P V`` of tile ``j`` (in ring slot ``stage``) reads: the ring's, or for a tile
    whose scores the warpgroup masks, ``OWN`` after copying the tile there with the keys it does not see zeroed
    (``_visible_values``). Called when no MMA of the warpgroup reads ``OWN``."""
    n, lo, hi = _tile_keys(j, start0, n0, start1, lo0, hi0, lo1, hi1, BN)
    masked = (n < lo) | (n + BN > hi)
    if masked:
        mbarrier.wait(v_ready.index(stage), phase)
        _visible_values(v_smem, stage, OWN, n, lo, hi, BN, D)
    return gl.where(masked, OWN, stage)


@gluon.jit
def _finite_values(v_smem, v_ready, j, stage, phase, start0, n0, start1, lo0, hi0, lo1, hi1, row0, first_bad,
                   OWN: gl.constexpr, BN: gl.constexpr, D: gl.constexpr):
    """Causal: the ``v_smem`` slot ``O += P V`` of tile ``j`` (in ring slot ``stage``) reads, and ``first_bad``
    lowered to the tile's first key with a non-finite V element. A tile with keys right of the consumer's first
    row (a diagonal tile) is multiplied with rows that do not see all of its keys (their P is 0 there, and 0
    times a NaN / Inf is NaN inside the MMA), so it is copied into ``OWN`` with its non-finite elements set to 0.
    The rows at or after such a key see it: ``_attend`` sets their o to NaN from ``first_bad``. Tiles every row
    sees whole read the ring: a non-finite value there reaches every row through the product itself. Called
    when no MMA of the warpgroup reads ``OWN``."""
    n, lo, hi = _tile_keys(j, start0, n0, start1, lo0, hi0, lo1, hi1, BN)
    diagonal = n + BN - 1 > row0
    if diagonal:
        mbarrier.wait(v_ready.index(stage), phase)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
        CH: gl.constexpr = 32  # keys at a time, as _visible_values
        src = v_smem.index(stage).reshape([BN, D])
        dst = v_smem.index(OWN).reshape([BN, D])
        r = gl.arange(0, CH, gl.SliceLayout(1, layout))
        for c in gl.static_range(BN // CH):
            x = src.slice(c * CH, CH).load(layout)
            fine = (x == x) & (gl.abs(x) < float("inf"))  # NaN compares False
            dst.slice(c * CH, CH).store(gl.where(fine, x, gl.zeros_like(x)))
            bad_key = gl.min(fine.to(gl.int32), axis=1) == 0  # [CH]: the key's row holds a non-finite element
            first = gl.min(gl.where(bad_key, r, CH), axis=0)
            first_bad = gl.where(first < CH, gl.minimum(first_bad, n + c * CH + first), first_bad)
        # The MMA reads the copy through the async proxy, after every thread of the warpgroup has written its part.
        fence_async_shared()
        gl.thread_barrier()
    return gl.where(diagonal, OWN, stage), first_bad


@gluon.jit
def _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, n_tiles, start0, n0, start1,
            lo0, hi0, lo1, hi1, row0, rows, qk_scale, WG: gl.constexpr, BN: gl.constexpr,
            NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
            CONFINE_V: gl.constexpr):
    """One consumer warpgroup's key loop over the ``n_tiles`` tiles of the ring (``_tile_keys`` maps them to
    keys): the unnormalised accumulator o [ROWS, D] fp32, the base-2 row max and the row sums. ``q`` is the
    warpgroup's [ROWS, D] shared buffer; ``WG`` (0 or 1) its place in the ping-pong.

    ``CONFINE_V`` (not causal: every row of the warpgroup sees the same keys): ``v_smem`` holds two more slots
    after the ring's ``NUM_STAGES``, slot ``NUM_STAGES + WG`` the warpgroup's own. On a tile whose scores are
    masked, ``O += P V`` reads a copy of the V tile in that slot with the keys it does not see zeroed
    (``_visible_values``), so that their ``P = 0`` never meets a non-finite value; tiles seen whole read the
    ring. The copy is made in the step that issues that ``P V``, before the warpgroup waits for its turn (so
    outside the ping-pong turn), when the previous ``P V``, the slot's last reader, has completed (each step
    waits for its ``P V``). ``CONFINE_V = False`` compiles the loop as without it.

    ``CAUSAL``: the same two slots hold the consumer's finite copies of its diagonal tiles' V (``_finite_values``:
    a non-finite element of a key right of a row's diagonal would reach that row through ``0 * NaN``), and the
    rows that see a key with a non-finite V element there get o NaN."""
    ROWS: gl.constexpr = q.shape[0]
    D: gl.constexpr = q.shape[1]
    dtype: gl.constexpr = q.dtype
    gl.static_assert(not (CONFINE_V and CAUSAL), "CONFINE_V: visibility per key, not per row")
    OWN: gl.constexpr = NUM_STAGES + WG  # CONFINE_V, CAUSAL: the warpgroup's V slot
    first_bad = row0 + ROWS  # CAUSAL: the first key with a non-finite V element on a diagonal tile (none yet)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    o = gl.zeros([ROWS, D], gl.float32, o_layout)

    # Consumer 0 holds the first turn: a fresh mbarrier counts as having completed the phase before phase 0,
    # so waiting for parity 1 passes at once; consumer 1 waits for consumer 0's first hand-over (parity 0).
    # Both consumers run the same n_tiles, so the hand-overs pair up (none at all when it is 0).
    my_turn = turn.index(WG)
    next_turn = turn.index(1 - WG)
    turn_phase = 1 - WG
    if n_tiles > 0:
        # Tile 0: scores and softmax only; its P V is issued with the next tile's scores.
        mbarrier.wait(my_turn, turn_phase)
        s = _issue_scores(q, k_smem, k_ready, 0, 0, ROWS, D, BN, s_layout)
        mbarrier.arrive(next_turn)
        turn_phase ^= 1
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(0))
        n, lo, hi = _tile_keys(0, start0, n0, start1, lo0, hi0, lo1, hi1, BN)
        s = _masked_scores(s, n, lo, hi, row0, rows, BN, CAUSAL, s_layout)
        m_i, p, alpha, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_tiles):
            stage = j % NUM_STAGES
            phase = (j // NUM_STAGES) & 1
            prev = (j - 1) % NUM_STAGES
            prev_phase = ((j - 1) // NUM_STAGES) & 1
            if CONFINE_V:
                v_slot = _confine_values(v_smem, v_ready, j - 1, prev, prev_phase, start0, n0, start1, lo0, hi0,
                                         lo1, hi1, OWN, BN, D)
            if CAUSAL:
                v_slot, first_bad = _finite_values(v_smem, v_ready, j - 1, prev, prev_phase, start0, n0, start1,
                                                   lo0, hi0, lo1, hi1, row0, first_bad, OWN, BN, D)
            mbarrier.wait(my_turn, turn_phase)
            s = _issue_scores(q, k_smem, k_ready, stage, phase, ROWS, D, BN, s_layout)
            mbarrier.wait(v_ready.index(prev), prev_phase)
            if CONFINE_V or CAUSAL:
                o = warpgroup_mma(p, v_smem.index(v_slot).reshape([BN, D]), o, is_async=True)
            else:
                o = warpgroup_mma(p, v_smem.index(prev).reshape([BN, D]), o, is_async=True)
            mbarrier.arrive(next_turn)
            turn_phase ^= 1
            # The two MMAs complete in order: one outstanding means the scores are done.
            s = warpgroup_mma_wait(1, deps=(s, ))
            mbarrier.arrive(k_empty.index(stage))
            n, lo, hi = _tile_keys(j, start0, n0, start1, lo0, hi0, lo1, hi1, BN)
            s = _masked_scores(s, n, lo, hi, row0, rows, BN, CAUSAL, s_layout)
            m_i, p_new, alpha, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            # P of the previous tile stays alive (registers the MMA reads) until its MMA completes.
            o, p = warpgroup_mma_wait(0, deps=(o, p))
            mbarrier.arrive(v_empty.index(prev))
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p = gl.convert_layout(p_new.to(dtype), p_layout)

        last = (n_tiles - 1) % NUM_STAGES
        last_phase = ((n_tiles - 1) // NUM_STAGES) & 1
        if CONFINE_V:
            v_slot = _confine_values(v_smem, v_ready, n_tiles - 1, last, last_phase, start0, n0, start1, lo0, hi0,
                                     lo1, hi1, OWN, BN, D)
        if CAUSAL:
            v_slot, first_bad = _finite_values(v_smem, v_ready, n_tiles - 1, last, last_phase, start0, n0, start1,
                                               lo0, hi0, lo1, hi1, row0, first_bad, OWN, BN, D)
        mbarrier.wait(my_turn, turn_phase)
        mbarrier.wait(v_ready.index(last), last_phase)
        if CONFINE_V or CAUSAL:
            o = warpgroup_mma(p, v_smem.index(v_slot).reshape([BN, D]), o, is_async=True)
        else:
            o = warpgroup_mma(p, v_smem.index(last).reshape([BN, D]), o, is_async=True)
        mbarrier.arrive(next_turn)
        o, p = warpgroup_mma_wait(0, deps=(o, p))
        mbarrier.arrive(v_empty.index(last))
    if CAUSAL:
        rows_o = row0 + gl.arange(0, ROWS, row_o)
        o = gl.where(gl.expand_dims(rows_o >= first_bad, 1), float("nan"), o)
    return o, m_i, l_i


@gluon.jit
def _finish_rows(o, m_i, l_i, o_layout: gl.constexpr):
    """The normalised output rows (fp32) and their natural-log lse; a row that saw no key (``l_i = 0``) gets
    o 0 and lse -inf."""
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    o = o / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    return o, lse


@gluon.jit
def _consumer(q_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
              turn, b, h, m0, Lq, Lk, H, n_tiles, qk_scale,
              WG: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One consumer warpgroup: rows ``m0 + WG * 64 + [0, 64)`` of head ``h``, every key tile of the program."""
    D: gl.constexpr = q_desc.block_type.shape[2]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = score_layout(BN)
    o_layout: gl.constexpr = score_layout(D)

    row0 = m0 + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    q_buf = q_smem.index(WG)
    q = q_buf.reshape([ROWS, D])
    mbarrier.wait(q_ready.index(WG), 0)
    # One walk over keys [0, Lk): segment slot 0 is [0, Lk), slot 1 unused.
    o, m_i, l_i = _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, n_tiles, 0, n_tiles, 0,
                          0, Lk, 0, 0, row0, rows, qk_scale, WG, BN, NUM_STAGES, CAUSAL, s_layout, o_layout,
                          False)
    o, lse = _finish_rows(o, m_i, l_i, o_layout)
    lse_row = (b * H + h).to(gl.int64) * Lq + rows
    gl.store(lse_ptr + lse_row, lse, mask=rows < Lq)
    # Q's buffer holds o for the TMA store: every MMA that read Q has completed (waits in _attend).
    q.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, row0, h * D], q_buf)
    tma.store_wait(0)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, start0, n0,
             start1, BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The producer's K / V loop: tile by tile (``_tile_keys``'s walk) into the stage ring. A box reaching
    past the keys' end reads zeros."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        n = gl.where(j < n0, start0 + j * BN, start1 + (j - n0) * BN)
        # The first pass over the ring waits for parity 1, which a fresh mbarrier has completed.
        empty_phase = ((j // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), empty_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, n, hk * D], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), empty_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, n, hk * D], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
              b, h, hk, m0, n_tiles, BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads: the two Q halves, then K and V tile by tile into the stage ring."""
    D: gl.constexpr = q_desc.block_type.shape[2]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    for i in gl.static_range(2):
        mbarrier.expect(q_ready.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, m0 + i * ROWS, h * D], q_ready.index(i), q_smem.index(i))
    _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, 0, n_tiles, 0,
             BN, NUM_STAGES)


@gluon.jit
def _init_ring(NUM_STAGES: gl.constexpr):
    """The K / V stage ring's mbarriers (ready: one TMA arrival with its byte count; empty: one arrival per
    consumer warpgroup) and the two ping-pong turn barriers."""
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    return k_ready, k_empty, v_ready, v_empty, turn


@gluon.jit
def _attention_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, B, Lq, Lk, H, GROUP, qk_scale,
                             BN: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """One program: 128 query rows of one (batch, head). Grid: ``cdiv(Lq, 128) * B * H`` programs, flat,
    (batch, head) fastest and, causal, the heaviest row tiles (the last ones) first."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    D: gl.constexpr = q_desc.block_type.shape[2]
    gl.static_assert(ROWS == 64, "a consumer warpgroup owns 64 rows")
    gl.static_assert((D == 64) or (D == 128), "head dim 64 or 128")
    gl.static_assert(k_desc.block_type.shape[1] == BN, "K boxes are BN keys")

    pid = gl.program_id(0)
    n_m = gl.cdiv(Lq, 2 * ROWS)
    pid_bh = pid % (B * H)
    m_tile = pid // (B * H)
    if CAUSAL:
        m_tile = n_m - 1 - m_tile
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = m_tile * 2 * ROWS
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(Lk, m0 + 2 * ROWS), BN)
    else:
        n_tiles = gl.cdiv(Lk, BN)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    # Causal: the ring's stages, then one slot per consumer for its diagonal tiles' finite copies (_attend).
    V_SLOTS: gl.constexpr = NUM_STAGES + 2 if CAUSAL else NUM_STAGES
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_SLOTS] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    k_ready, k_empty, v_ready, v_empty, turn = _init_ring(NUM_STAGES)
    # The barriers are completed by TMA (the async proxy): make their initialisation visible to it.
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (q_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                     turn, b, h, m0, Lq, Lk, H, n_tiles, qk_scale, 0, BN, NUM_STAGES, CAUSAL)),
        (_consumer, (q_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                     turn, b, h, m0, Lq, Lk, H, n_tiles, qk_scale, 1, BN, NUM_STAGES, CAUSAL)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                     b, h, hk, m0, n_tiles, BN, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def tile_config(D: int) -> dict:
    """Key tile and pipeline depth per head dim. BN = 128 keys at both: at D = 128 two stages of K and V
    (128 KiB) and the two Q / o buffers (32 KiB) take 160 KiB of sm_90's 227 KiB per block (224 KiB with the
    causal kernel's and the DFlash kernel's two extra V slots); at D = 64 the stages are half as large and a
    third one fits."""
    return {"BN": 128, "NUM_STAGES": 2 if D == 128 else 3}


def smem_layout(block_shape, torch_dtype):
    """The NVMMA shared layout (128-byte swizzle for 64 or 128 16-bit elements per row) of a TMA box: what the
    kernel's TMA copies and warpgroup MMAs read; made once per box and dtype (runtime/tma.py)."""
    # Imported here, not at the top: a line added above the kernels would move them, and Triton's hash of a
    # kernel (the shipped tuning's key) includes the line numbers of the functions it calls.
    from dflash_kernels.runtime import tma

    return tma.smem_layout(block_shape, torch_dtype)


def descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-3 TMA descriptor over the contiguous ``[B, L, heads, D]`` tensor ``x`` viewed as
    ``[B, L, heads * D]``, with ``[1, rows, D]`` boxes (one head's ``rows`` positions)."""
    B, L, NH, D = x.shape
    view = x.view(B, L, NH * D)
    block = [1, rows, D]
    return TensorDescriptor(view, list(view.shape), list(view.stride()), block, smem_layout(block, x.dtype))


def attention_fwd_gluon_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                             sm_scale: float) -> tuple:
    """Dense attention forward on an sm_90 GPU: ``(o [B, Lq, H, D] like q, lse [B, H, Lq] fp32)``.

    q ``[B, Lq, H, D]``, k and v ``[B, Lk, Hkv, D]``, all contiguous, the same dtype (bf16 or fp16), on one
    CUDA device of compute capability 9.x, with D in (64, 128), ``H`` a multiple of ``Hkv`` and 16-byte
    aligned base pointers (TMA; every other stride is then a multiple of 16 bytes). ``causal``: key ``j``
    visible to query ``i`` iff ``j <= i``. With ``Lk = 0`` every row sees nothing: o 0, lse -inf.
    """
    assert q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9, "needs an sm_90 GPU"
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
    assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape
    B, Lq, H, D = q.shape
    Bk, Lk, Hkv, Dk = k.shape
    assert Bk == B and Dk == D and D in (64, 128) and H % Hkv == 0
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.is_contiguous(), f"{name} must be contiguous"
        assert x.data_ptr() % 16 == 0, f"{name}: TMA needs a 16-byte aligned base address"
    o = alloc.empty_like(q)
    lse = alloc.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    if Lq == 0 or B * H == 0:
        return o, lse
    if Lk == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    cfg = tile_config(D)
    attention_fwd_gluon_kernel(
        (cdiv(Lq, BM) * B * H, ), descriptor(q, BMW), descriptor(k, cfg["BN"]), descriptor(v, cfg["BN"]),
        descriptor(o, BMW), lse, B, Lq, Lk, H, H // Hkv, sm_scale * LOG2E, bucket=(bucket(Lq), bucket(Lk)),
        BN=cfg["BN"], NUM_STAGES=cfg["NUM_STAGES"], CAUSAL=bool(causal), CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS)
    return o, lse


# One launch configuration: the kernel's tiles are fixed per head dim (tile_config) and its register split is
# part of its design (setmaxnreg), so there is nothing to tune. The Gluon kernels' int arguments are left to
# Triton's specialization (== 1, % 16), a few compiled variants per kernel: unspecialized, the dense causal forward
# ran slower through the kernel cache than launched directly (benchmarks/results/README.md, the Gluon forwards'
# entries). Launched through the runtime's kernel cache: compiled once per key and device, thread-safe,
# precompiled, recorded and shipped like the Triton kernels.
GLUON_CONFIGS = [Config(num_warps=4, num_stages=1, maxnreg=MAXNREG)]
attention_fwd_gluon_kernel = TritonKernel(_attention_fwd_ws_kernel, name="block_sparse_attn_fwd_gluon_sm90",
                                          configs=GLUON_CONFIGS)
