"""Warp-specialized Hopper (sm_90) backward in Gluon for DFlash-form masks: the sibling of the forward in
kernels_gluon_sm90_dflash.py (read its docstring: the masks it takes, the GQA row packing, the two-group
programs, the non-finite containment). Two kernels, deterministic (fixed summation orders, no atomics), after
the portable preprocess (``delta = rowsum(o * do)``, kernels.py):

dk / dv (``_attn_bwd_dkdv_ws_kernel``), most of the backward's time. One program per (batch, kv head, key tile of
``BN = 128`` keys); consumer warpgroup ``w`` (two of them) owns keys ``n0 + 64 w + [0, 64)`` and holds their
dk, dv ``[64, D]`` fp32 in registers (keys on the warpgroup MMA's M side). The program walks the reverse
index of the mask built for 128-key tiles (mask.py's ``rev_offsets`` / ``rev_full`` / ``rev_entries``; the
launcher rebuilds it when the mask's ``kv_tile`` is another width): each entry is a (query group, segment)
pair that reaches the tile, whole-tile entries first, each in group order (so the sums run in a fixed order).
An entry times the ``NC = G / GH`` head chunks of the kv head is an *item*: ``ROWS = q_block * GH`` query rows
(the forward's packing: row ``r`` is position ``q0 + r // GH``, head ``h0 + r % GH``), which is exactly a TMA
box ``[1, q_block, GH, D]`` of q and of do viewed as ``[B, Tq, Hq, D]`` (rows past ``Tq`` read zeros). So the
rows sit on the MMAs' N side with no dead rows, and ``ROWS`` must be 16, 32 or 64 (a power of two, at least
one MMA K step; the launcher sends other masks to the portable backward). Per item and consumer::

    S^T = K Q^T, P^T = exp2(S^T * scale * log2 e - lse2), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
    dV += P^T dO, dK += dS^T Q

(lse2 the base-2 lse, +inf for rows past Tq: P = 0 there), and ``dK *= scale`` at the end. Per item the two
score-side MMAs are issued together (P^T computed while dP^T runs), then dV's and dK's together. Items whose
entry sees the consumer's 64 keys whole run without any mask; items that see part of them select P^T and dS^T
on the keys (below); items that see none of them (a group's 16 own keys lie in one half of a tile) only take
part in the barrier protocol. The two consumers need no ping-pong turns: each has its own keys, and while one
computes its exponentials the other's MMAs run.

Partitions (``gl.warp_specialize``): the two consumer warpgroups (setmaxnreg ``CONSUMER_REGS``) and one
producer warp (``PRODUCER_REGS``) that TMA-loads K and V once (four 64-key boxes) and then every item's Q and
dO into a ring of ``NUM_STAGES`` stages, with each item's ``ROWS`` lse2 and delta values (plain loads,
stored into a per-stage shared buffer before the stage is announced) and its non-finite flag (below).

Barrier protocol of the dk / dv kernel (every wait has exactly the arrivals it counts; a mistake hangs):

- ``kv_bar`` (count 1, one phase): the producer's ``expect`` of the four K / V boxes' bytes, completed by the
  TMAs; both consumers wait for parity 0 once, before any item (also when the tile has no items, so that no
  TMA is in flight when the program ends).
- ``ready[s]`` (count 1): item ``i`` uses stage ``s = i % NUM_STAGES``, pass ``p = i // NUM_STAGES``. The
  producer stores the item's lse2 / delta into the stage's row buffer and its flag (0) into the stage's flag
  word (all lanes), ``thread_barrier``, then ``expect`` (its one arrival, a release that orders those stores
  before it) with the Q and dO boxes' bytes, then the two TMAs: the phase completes when both have landed.
  A *suspect* item (below) instead: row stores, ``expect`` on ``landed`` and the two TMAs onto it, wait for
  ``landed``, zero the boxes' non-finite elements in place, store the flag, ``fence_async_shared`` (the
  generic-proxy stores before the consumers' MMAs read the boxes through the async proxy),
  ``thread_barrier``, then a plain ``arrive`` on ``ready[s]`` (its one arrival, the release). Each consumer
  waits for parity ``p & 1`` before reading the stage (acquire: the row buffer, the flag and the boxes).
- ``landed`` (count 1, producer only): one phase per suspect item, waited for with parity ``n & 1`` (``n``
  the suspect items before it); the producer waits before it announces the stage, so no TMA is in flight
  when the program ends.
- ``empty[s]`` (count 2): each consumer arrives once per item, after every MMA of it that read the stage has
  completed (``warpgroup_mma_wait(0)``) and after reading the row buffer and the flag. The producer waits for
  parity ``(p & 1) ^ 1`` before refilling the stage (boxes, row buffer, flag) for item ``i`` (a fresh barrier
  has completed the phase before phase 0, so the first pass runs through). A consumer waits for ``ready`` even
  for an item it skips: its arrival for item ``i + NUM_STAGES`` then cannot come before the stage was
  refilled, which needs both arrivals of item ``i``, so arrivals never fall into the wrong phase.

Non-finite values stay with the rows and keys that meet them (the portable kernels' contract: kernels.py,
tests/ops/test_nonfinite.py, tests/ops/test_attention_gluon_sm90_bwd.py). Within an item every row sees the
same keys (the entry's segment cut to the tile), so masking is by whole key rows of S^T, P^T, dS^T: on items
that see part of the consumer's keys, P^T and dS^T are *selected* to 0 on the others, so a non-finite K or V
of an unseen key (a NaN / Inf row of S^T or dP^T) adds exactly 0 to dK / dV, and the rows that see a
non-finite key (their o, lse, delta non-finite) still add exactly 0 to the keys they do not see, as long as
their q and do are finite. A non-finite element *in q or do itself* (an upstream NaN) would meet the
``P^T = 0`` of the unseen keys inside the MMA (``0 * NaN``) and reach their dK / dV. Such a row always has a
non-finite lse or delta: ``delta = rowsum(o * do)`` is NaN or +-inf as soon as one do element is (a product
with a non-finite factor is never finite, nor is a sum with a non-finite term), and the forward gives a row
with a non-finite q element lse -inf or NaN (its scores are NaN or +-inf: a NaN row sum fails the forward's
``l > 0`` and gives -inf; all scores -inf give ``l = 0``, -inf too). The producer holds both row terms: an
item of a masked entry (index ``>= n_full``) with a live row whose lse or delta is not finite (-inf
included: every row of an item sees a key) is *suspect*; the producer loads it through ``landed``, sets
every non-finite element of its Q and dO boxes to 0 in place (``_zero_nonfinite``: one warp, a flat view of
the boxes' bytes, before either consumer reads the stage; both read the same zeroed boxes) and flags the
item if it zeroed any. A consumer that sees some of its keys in a flagged item sets dK and dV of those keys
to NaN before the item's products (NaN absorbs what they add: the portable kernel's explicit poisoning of
the seen keys, ``_poison_seen``, here of every column, as a non-finite q makes P^T NaN on them anyway); the
keys it does not see get exactly 0 from the zeroed rows. Whole-tile entries need nothing: every key of the
tile is seen by every row, and the NaN reaches the keys through the MMAs as in the portable kernel's
unmasked path. The common case pays one shared load and branch per masked item in the consumers (the item
paths' instructions and registers are as before) and a warp reduction per item in the producer. A suspect
item whose Q and dO are finite (its lse or delta non-finite through a non-finite key or value) is zeroed for
nothing and not flagged. This relies on lse and delta being the forward's and ``rowsum(o * do)``: a caller's
``delta`` that is finite for a non-finite do is not caught.

Registers: a consumer holds dK, dV (64 + 64 per thread at D = 128), S^T and dP^T (32 + 32 at 64 rows) and
the bf16 operands of P^T and dS^T; the row terms cost none beyond the accumulators, as the score MMAs start
from them (``-lse / scale`` and ``-delta`` broadcast over the keys: ``exp2((S^T - lse / scale) * scale *
log2 e)`` and ``dP^T - delta`` come out of the MMAs). Holding them as separate vectors (16 registers each)
spilled at D = 128.

dq (``_attn_bwd_dq_ws_kernel``): the forward's programs (two adjacent query groups sharing the union of their key
ranges, one per consumer warpgroup, 64 GQA-packed rows with dead rows as zeros) and its producer and K / V ring
(``_load_kv``, ``_init_ring`` of kernels_gluon_sm90.py; the ping-pong turns are not used). Q, dO, lse, delta are
loaded once per program with plain loads. Per key tile::

    S = Q K^T, dP = dO V^T (both issued, S waited first), P = exp2(S * scale * log2 e - lse2),
    dS = P (dP - delta), dQ += dS K

and ``dQ *= scale`` at the end. V's stage is released as soon as dP has completed, K's after dQ's MMA.
Containment is the forward's for V, applied to K: on tiles a consumer masks, P and dS are selected to 0 on the
keys it does not see and ``dQ += dS K`` reads a copy of the K tile in the consumer's own shared slot with
those keys' rows zeroed (``_visible_values``; ``k_smem`` slots ``NUM_STAGES + WG``). Fully seen tiles read the
ring. Key tiles: ``dq_config`` (64 keys at D = 128, for the two extra K slots to fit shared memory). A
non-finite q or do element needs nothing here: Q and dO are the A operands of ``S = Q K^T`` and ``dP = dO
V^T`` (rows on the M side), so it reaches only its own row of S, dP, dS and so of dQ, the row's own output.

The op's dispatch (attention.py) runs this backward after the Gluon DFlash forward (``forward_path``
"gluon_sm90_dflash"); other masks, dtypes, head dims and GPUs take the portable backward.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dflash_kernels.ops.attention import checks
from dflash_kernels.ops.attention.kernels_gluon_sm90 import (CONSUMER_REGS, GLUON_CONFIGS, LOG2E, PRODUCER_REGS,
                                                             _init_ring, _load_kv, _tile_keys, _visible_values,
                                                             descriptor, score_layout, smem_layout)
from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import (_pair_program, check_gluon_dflash_mask,
                                                                    gluon_dflash_rows)
from dflash_kernels.runtime import TritonKernel, alloc, bucket, cdiv

__all__ = ["attention_bwd_gluon_sm90_dflash", "dkdv_config", "dq_config"]

_LOG2E: gl.constexpr = gl.constexpr(LOG2E)
KH = 64  # keys per consumer warpgroup in the dk / dv kernel (the warpgroup MMA's M)
DKDV_BN = 2 * KH  # keys per dk / dv program: the reverse index's tile width


def dkdv_config(D: int) -> dict:
    """The dk / dv kernel's ring depth: K and V of the 128-key tile take 64 KiB at D = 128, a stage (Q and dO
    boxes of 64 rows) 32 KiB; three stages make 160 KiB. At D = 64 everything halves and four stages fit."""
    return {"BN": DKDV_BN, "NUM_STAGES": 3 if D == 128 else 4}


def dq_config(D: int) -> dict:
    """The dq kernel's key tile and ring depth. D = 128: 64-key tiles, three stages of K and V (96 KiB), two
    own K slots (32 KiB) and the two consumers' Q and dO (64 KiB): 192 KiB. D = 64: 128-key tiles (the K / V
    slots are as large as at D = 128, Q and dO half): 160 KiB."""
    return {"BN": 64 if D == 128 else 128, "NUM_STAGES": 3}


def row_descriptor(x: torch.Tensor, q_block: int, GH: int) -> TensorDescriptor:
    """A rank-4 TMA descriptor over the contiguous ``[B, T, H, D]`` tensor ``x`` with ``[1, q_block, GH, D]``
    boxes: one query group's positions times ``GH`` heads, in the GQA row order (position-major)."""
    block = [1, q_block, GH, x.shape[3]]
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, smem_layout(block, x.dtype))


# ------------------------------------------------------------------------------------------------ dk / dv


@gluon.jit
def _zero_nonfinite(tile):
    """Set every non-finite element of the 16-bit float shared tile ``tile`` (a Q or dO box of the ring) to 0,
    in place, by one warp; 1 if it held one, else 0. Element by element, so the tile is read through a flat
    view of its bytes (its swizzle does not matter): 16 bytes a lane, a runtime loop, few registers."""
    if tile.dtype == gl.bfloat16:
        EXP: gl.constexpr = 0x7F80  # exponent bits: all set for NaN and +-inf
    else:
        EXP: gl.constexpr = 0x7C00
    N: gl.constexpr = tile.numel // (32 * 8)
    flat = tile._reinterpret(gl.int16, [N, 32, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0])
    hit = gl.zeros([32], gl.int32, gl.SliceLayout(1, layout))  # one register a lane
    for c in range(N):
        piece = flat.index(c)
        x = piece.load(layout)
        bad = (x & EXP) == EXP
        piece.store(gl.where(bad, gl.zeros_like(x), x))
        hit = gl.maximum(hit, gl.max(bad.to(gl.int32), axis=1))  # within the lane
    return gl.max(hit, axis=0)


@gluon.jit
def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, rev_entries, q_smem, do_smem, k_smem,
                   v_smem, row_smem, flag_smem, kv_bar, landed, ready, empty, b, hk, n0, e_start, n_items, n_full,
                   Tq, Hq, sm_scale, G: gl.constexpr, NUM_STAGES: gl.constexpr):
    """K and V of the program's key tile, then Q, dO, the row terms and the flag of every item into the ring;
    the Q and dO of a masked item whose rows' lse or delta is not finite with their non-finite elements
    zeroed (module docstring)."""
    BQ: gl.constexpr = q_desc.block_type.shape[1]
    GH: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    ROWS: gl.constexpr = BQ * GH
    NC: gl.constexpr = G // GH
    KH_: gl.constexpr = k_desc.block_type.shape[1]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, n0 + w * KH_, hk * D], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, n0 + w * KH_, hk * D], kv_bar, v_smem.index(w))

    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    flag_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    r = gl.arange(0, ROWS, row_layout)
    n_landed = 0  # items loaded through `landed` so far: its phase
    for i in range(n_items):
        stage = i % NUM_STAGES
        e = e_start + i // NC
        h0 = hk * G + (i % NC) * GH
        g = gl.load(rev_entries + 2 * e)
        t = g * BQ + r // GH
        ok = t < Tq
        row = (b.to(gl.int64) * Hq + h0 + r % GH) * Tq + t
        # Row terms before the stage wait (their latency overlaps it), stored as the score MMAs' initial
        # accumulators: -lse / scale (S^T - lse / scale, times scale * log2 e, is the base-2 exponent) and
        # -delta. lse = -inf (a row that sees nothing) and rows past Tq give -inf: P = 0 exactly there.
        lse = gl.load(lse_ptr + row, mask=ok, other=float("-inf"))
        nlse = gl.where(lse == float("-inf"), float("-inf"), -lse / sm_scale)
        dlt = gl.load(delta_ptr + row, mask=ok, other=0.0)
        # A non-finite q or do element makes its row's lse (forward) or delta not finite; lse -inf counts too
        # (every row of an item sees a key). Only masked entries' items need their Q and dO looked at.
        fine = (gl.abs(lse) < float("inf")) & (gl.abs(dlt) < float("inf"))  # NaN compares False
        suspect = (i >= n_full) & (gl.max(gl.where(ok, 1 - fine.to(gl.int32), 0), axis=0) != 0)
        mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
        row_smem.index(2 * stage).store(nlse)
        row_smem.index(2 * stage + 1).store(-dlt)
        q_stage = q_smem.index(stage)
        do_stage = do_smem.index(stage)
        nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        if suspect:
            # Rare: load, zero the non-finite elements in place (before either consumer reads the stage), flag
            # the item if there were any, then announce the stage with a plain arrival.
            mbarrier.expect(landed, nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, g * BQ, h0, 0], landed, q_stage)
            tma.async_copy_global_to_shared(do_desc, [b, g * BQ, h0, 0], landed, do_stage)
            mbarrier.wait(landed, n_landed & 1)
            n_landed += 1
            hit = gl.maximum(_zero_nonfinite(q_stage), _zero_nonfinite(do_stage))
            flag_smem.index(stage).store(gl.full([1], hit, gl.int32, flag_layout))
            fence_async_shared()  # the zeroing stores before the consumers' MMAs (async proxy) read the stage
            gl.thread_barrier()  # every lane's stores before the (one-lane) arrival below
            mbarrier.arrive(ready.index(stage))
        else:
            flag_smem.index(stage).store(gl.full([1], 0, gl.int32, flag_layout))
            gl.thread_barrier()  # every lane's row stores before the (one-lane) arrival below
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, g * BQ, h0, 0], bar, q_stage)
            tma.async_copy_global_to_shared(do_desc, [b, g * BQ, h0, 0], bar, do_stage)


@gluon.jit
def _dkdv_scores(kt, vt, q, do, rows_buf, stage, qk_scale, first, lo, hi, MASKED: gl.constexpr,
                 s_layout: gl.constexpr):
    """P^T and dS^T [64 keys, ROWS] fp32 of one item: both score-side MMAs issued together, P^T computed
    while dP^T runs. The MMAs start from the row terms of the stage's row buffer broadcast over the keys
    (``-lse / scale``, ``-delta``: no registers held for them beside the accumulators). ``MASKED``: selected
    to 0 on the keys outside ``[lo, hi)``."""
    KROWS: gl.constexpr = kt.shape[0]
    ROWS: gl.constexpr = q.shape[0]
    row_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    nlse = gl.zeros([KROWS, ROWS], gl.float32, s_layout) + \
        gl.expand_dims(rows_buf.index(2 * stage).load(row_vec), 0)
    st = warpgroup_mma(kt, q.permute((1, 0)), nlse, is_async=True)
    ndlt = gl.zeros([KROWS, ROWS], gl.float32, s_layout) + \
        gl.expand_dims(rows_buf.index(2 * stage + 1).load(row_vec), 0)
    dpt = warpgroup_mma(vt, do.permute((1, 0)), ndlt, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st, ))  # in order: one outstanding means S^T is done
    pt = gl.exp2(st * qk_scale)
    if MASKED:
        keys = first + gl.arange(0, KROWS, gl.SliceLayout(1, s_layout))
        seen = gl.expand_dims((keys >= lo) & (keys < hi), 1)
        pt = gl.where(seen, pt, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt, ))
    dst = pt * dpt
    if MASKED:
        # A select, not a product: 0 also where the key's K or V is not finite.
        dst = gl.where(seen, dst, 0.0)
    return pt, dst


@gluon.jit
def _dkdv_item(dk, dv, kt, vt, q, do, rows_buf, stage, qk_scale, first, lo, hi, MASKED: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One item: dV += P^T dO and dK += dS^T Q in place, P^T and dS^T from registers (``MASKED``: selected to
    0 on the consumer's keys outside ``[lo, hi)``)."""
    dtype: gl.constexpr = q.dtype
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pt, dst = _dkdv_scores(kt, vt, q, do, rows_buf, stage, qk_scale, first, lo, hi, MASKED, s_layout)
    p_op = gl.convert_layout(pt.to(dtype), op_layout)
    ds_op = gl.convert_layout(dst.to(dtype), op_layout)
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=(dk, dv, p_op, ds_op))
    return dk, dv


@gluon.jit
def _dkdv_store(acc, buf, ptr, b, hk, first, Tk, Hkv, D: gl.constexpr):
    """Keys ``first + [0, 64)`` of ``acc`` (fp32, the accumulator layout) to ``ptr`` (``[B, Tk, Hkv, D]``)
    through the shared buffer ``buf`` (a K / V box no MMA reads any more), rows past ``Tk`` left out."""
    KROWS: gl.constexpr = acc.shape[0]
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    tile = buf.reshape([KROWS, D])
    tile.store(acc.to(ptr.dtype.element_ty))
    keys = first + gl.arange(0, KROWS, gl.SliceLayout(1, io_layout))
    offs = gl.expand_dims(((b.to(gl.int64) * Tk + keys) * Hkv + hk) * D, 1) + \
        gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, io_layout)), 0)
    gl.store(ptr + offs, tile.load(io_layout), mask=gl.expand_dims(keys < Tk, 1))


@gluon.jit
def _dkdv_consumer(dk_ptr, dv_ptr, segments, rev_entries, q_smem, do_smem, k_smem, v_smem, row_smem, flag_smem,
                   kv_bar, ready, empty, b, bm, hk, n0, e_start, n_items, n_full, Tk, NG, MS, Hkv, qk_scale,
                   sm_scale, WG: gl.constexpr, G: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer warpgroup ``WG``: dK, dV of keys ``n0 + 64 WG + [0, 64)`` over every item of the program."""
    BQ: gl.constexpr = q_smem.shape[2]
    GH: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    ROWS: gl.constexpr = BQ * GH
    NC: gl.constexpr = G // GH
    KROWS: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = score_layout(ROWS)
    o_layout: gl.constexpr = score_layout(D)
    first = n0 + WG * KROWS
    dk = gl.zeros([KROWS, D], gl.float32, o_layout)
    dv = gl.zeros([KROWS, D], gl.float32, o_layout)
    kt = k_smem.index(WG).reshape([KROWS, D])
    vt = v_smem.index(WG).reshape([KROWS, D])
    flag_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(kv_bar, 0)
    for i in range(n_items):
        stage = i % NUM_STAGES
        # A whole-tile entry sees every key of the tile; a masked one its segment [lo, hi) of it.
        # (Loads predicated off for whole-tile entries: no latency on the common path.)
        masked = i >= n_full
        entry = rev_entries + 2 * (e_start + i // NC)
        g = gl.load(entry, mask=masked, other=0)
        seg = segments + ((bm.to(gl.int64) * NG + g) * MS + gl.load(entry + 1, mask=masked, other=0)) * 4
        lo = gl.load(seg, mask=masked, other=0)
        hi = gl.load(seg + 1, mask=masked, other=2147483647)
        whole = (first >= lo) & (first + KROWS <= hi)
        some = (first < hi) & (first + KROWS > lo)
        mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
        q = q_smem.index(stage).reshape([ROWS, D])
        do = do_smem.index(stage).reshape([ROWS, D])
        if masked & some:
            if gl.max(flag_smem.index(stage).load(flag_layout), axis=0) != 0:
                # The producer zeroed non-finite q / do elements of the item: NaN on the keys it sees, set
                # before the item's products (NaN absorbs what they add), where nothing else is live.
                keys = first + gl.arange(0, KROWS, gl.SliceLayout(1, o_layout))
                seen = gl.expand_dims((keys >= lo) & (keys < hi), 1)
                dk = gl.where(seen, float("nan"), dk)
                dv = gl.where(seen, float("nan"), dv)
        if whole:
            dk, dv = _dkdv_item(dk, dv, kt, vt, q, do, row_smem, stage, qk_scale, first, lo, hi, False, s_layout,
                                o_layout)
        elif some:
            dk, dv = _dkdv_item(dk, dv, kt, vt, q, do, row_smem, stage, qk_scale, first, lo, hi, True, s_layout,
                                o_layout)
        mbarrier.arrive(empty.index(stage))
    # Every MMA that read this consumer's K / V boxes has completed: they stage the stores.
    _dkdv_store(dk * sm_scale, k_smem.index(WG), dk_ptr, b, hk, first, Tk, Hkv, D)
    _dkdv_store(dv, v_smem.index(WG), dv_ptr, b, hk, first, Tk, Hkv, D)


@gluon.jit
def _attn_bwd_dkdv_ws_kernel(q_desc, do_desc, k_desc, v_desc, dk_ptr, dv_ptr, lse_ptr, delta_ptr, segments,
                             rev_offsets, rev_full, rev_entries, Tq, Tk, NG, MS, MB, NKV, Hq, Hkv, NBH, qk_scale,
                             sm_scale, G: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr):
    """One program: the 128-key tile ``pid // NBH`` of (batch, kv head) ``pid % NBH`` (``NBH = B * Hkv``):
    key tiles in ascending order with the heads fastest, as the portable dk / dv kernel (kernels.py: the first
    keys are seen by the most groups; every head's heavy tiles start first)."""
    BQ: gl.constexpr = q_desc.block_type.shape[1]
    GH: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    ROWS: gl.constexpr = BQ * GH
    KROWS: gl.constexpr = k_desc.block_type.shape[1]
    NC: gl.constexpr = G // GH
    gl.static_assert((D == 64) or (D == 128), "head dim 64 or 128")
    gl.static_assert(KROWS == 64, "a consumer warpgroup owns 64 keys")
    gl.static_assert((ROWS == 16) or (ROWS == 32) or (ROWS == 64), "q_block * GH rows: 16, 32 or 64")
    gl.static_assert(G % GH == 0, "GH divides the GQA group")

    pid = gl.program_id(0)
    pid_n = pid // NBH
    pid_bh = pid % NBH
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    bm = b % MB
    n0 = pid_n * (2 * KROWS)
    key_tile = bm.to(gl.int64) * NKV + pid_n
    e_start = gl.load(rev_offsets + key_tile)
    n_full = gl.load(rev_full + key_tile) * NC
    n_items = (gl.load(rev_offsets + key_tile + 1) - e_start) * NC

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    row_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, ROWS],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # per-row-vector layout
    flag_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(landed, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    # The barriers are completed by TMA (the async proxy): make their initialisation visible to it.
    fence_async_shared()

    gl.warp_specialize([
        (_dkdv_consumer, (dk_ptr, dv_ptr, segments, rev_entries, q_smem, do_smem, k_smem, v_smem, row_smem,
                          flag_smem, kv_bar, ready, empty, b, bm, hk, n0, e_start, n_items, n_full, Tk, NG, MS, Hkv,
                          qk_scale, sm_scale, 0, G, NUM_STAGES)),
        (_dkdv_consumer, (dk_ptr, dv_ptr, segments, rev_entries, q_smem, do_smem, k_smem, v_smem, row_smem,
                          flag_smem, kv_bar, ready, empty, b, bm, hk, n0, e_start, n_items, n_full, Tk, NG, MS, Hkv,
                          qk_scale, sm_scale, 1, G, NUM_STAGES)),
        (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, rev_entries, q_smem, do_smem,
                          k_smem, v_smem, row_smem, flag_smem, kv_bar, landed, ready, empty, b, hk, n0, e_start,
                          n_items, n_full, Tq, Hq, sm_scale, G, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------------ dq


@gluon.jit
def _dq_consumer(q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_smem, do_smem, k_smem, v_smem, k_ready, k_empty,
                 v_ready, v_empty, b, g, h0, Tq, NG, Hq, n_tiles, start0, n0, start1, lo0, hi0, lo1, hi1,
                 qk_scale, sm_scale, WG: gl.constexpr, BQ: gl.constexpr, GH: gl.constexpr, BN: gl.constexpr,
                 NUM_STAGES: gl.constexpr):
    """Consumer warpgroup ``WG``: dQ of query group ``g`` x heads ``h0 + [0, GH)`` over the program's key walk,
    masked to its segments ``[lo0, hi0)`` and ``[lo1, hi1)``."""
    ROWS: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    OWN: gl.constexpr = NUM_STAGES + WG
    s_layout: gl.constexpr = score_layout(BN)
    o_layout: gl.constexpr = score_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])

    r = gl.arange(0, ROWS, gl.SliceLayout(1, io_layout))
    t = g * BQ + r // GH
    live = (r < BQ * GH) & (g < NG) & (t < Tq)
    row_off = ((b.to(gl.int64) * Tq + t) * Hq + h0 + r % GH) * D
    offs = gl.expand_dims(row_off, 1) + gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, io_layout)), 0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    q.store(gl.load(q_ptr + offs, mask=gl.expand_dims(live, 1), other=0.0))
    do.store(gl.load(do_ptr + offs, mask=gl.expand_dims(live, 1), other=0.0))
    rows = gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    t_s = g * BQ + rows // GH
    live_s = (rows < BQ * GH) & (g < NG) & (t_s < Tq)
    row = (b.to(gl.int64) * Hq + h0 + rows % GH) * Tq + t_s
    lse2 = gl.load(lse_ptr + row, mask=live_s, other=float("-inf")) * _LOG2E
    lse2 = gl.expand_dims(gl.where(lse2 == float("-inf"), float("inf"), lse2), 1)  # P = 0: dead, unseeing rows
    dlt = gl.expand_dims(gl.load(delta_ptr + row, mask=live_s, other=0.0), 1)
    fence_async_shared()  # the warpgroup MMAs read q and do through the async proxy

    dq = gl.zeros([ROWS, D], gl.float32, o_layout)
    zero = gl.zeros([ROWS, BN], gl.float32, s_layout)
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        n, lo, hi = _tile_keys(j, start0, n0, start1, lo0, hi0, lo1, hi1, BN)
        masked = (n < lo) | (n + BN > hi)
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q, k_smem.index(stage).reshape([BN, D]).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp = warpgroup_mma(do, v_smem.index(stage).reshape([BN, D]).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        p = gl.exp2(s * qk_scale - lse2)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        mbarrier.arrive(v_empty.index(stage))
        ds = p * (dp - dlt)
        if masked:
            cols = n + gl.arange(0, BN, gl.SliceLayout(0, s_layout))
            # A select, not a product: dS of unseen keys is exactly 0 also where their K or V is not finite.
            ds = gl.where(gl.expand_dims((cols >= lo) & (cols < hi), 0), ds, 0.0)
            _visible_values(k_smem, stage, OWN, n, lo, hi, BN, D)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        slot = gl.where(masked, OWN, stage)
        dq = warpgroup_mma(ds_op, k_smem.index(slot).reshape([BN, D]), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        mbarrier.arrive(k_empty.index(stage))

    # Every MMA that read q has completed: its buffer carries dq to the store layout.
    q.store((dq * sm_scale).to(dtype))
    gl.store(dq_ptr + offs, q.load(io_layout), mask=gl.expand_dims(live, 1))


@gluon.jit
def _attn_bwd_dq_ws_kernel(q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, k_desc, v_desc, segments, seg_count, Tq, NG,
                           MS, MB, Hq, Hkv, NBH, qk_scale, sm_scale, G: gl.constexpr, BQ: gl.constexpr,
                           GH: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr):
    """One program: query groups ``2i, 2i + 1`` x ``GH`` heads of one kv head, the forward's grid and order
    (kernels_gluon_sm90_dflash.py's ``_attn_fwd_dflash_ws_kernel``)."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    ROWS: gl.constexpr = 64
    b, hk, h0, g0, n_tiles, start0, n0, start1, lo00, hi00, lo01, hi01, lo10, hi10, lo11, hi11 = _pair_program(
        segments, seg_count, NG, MS, MB, Hkv, k_desc, G, GH, BQ, BN)

    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], k_desc.dtype)
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, ROWS, D], row_layout)
    do_smem = gl.allocate_shared_memory(k_desc.dtype, [2, ROWS, D], row_layout)
    # K: the ring's stages, then one slot per consumer for its masked tiles' copies.
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES + 2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    k_ready, k_empty, v_ready, v_empty, turn = _init_ring(NUM_STAGES)
    fence_async_shared()

    gl.warp_specialize([
        (_dq_consumer, (q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_smem, do_smem, k_smem, v_smem, k_ready,
                        k_empty, v_ready, v_empty, b, g0, h0, Tq, NG, Hq, n_tiles, start0, n0, start1, lo00, hi00,
                        lo01, hi01, qk_scale, sm_scale, 0, BQ, GH, BN, NUM_STAGES)),
        (_dq_consumer, (q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_smem, do_smem, k_smem, v_smem, k_ready,
                        k_empty, v_ready, v_empty, b, g0 + 1, h0, Tq, NG, Hq, n_tiles, start0, n0, start1, lo10,
                        hi10, lo11, hi11, qk_scale, sm_scale, 1, BQ, GH, BN, NUM_STAGES)),
        (_dq_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles,
                        start0, n0, start1, BN, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _dq_producer(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, start0,
                 n0, start1, BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of the program's key walk (both groups' union), K and V tile by tile into the ring."""
    _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, start0, n0,
             start1, BN, NUM_STAGES)


# ------------------------------------------------------------------------------------------------ launcher


def _reverse_index_128(mask):
    """The mask's reverse index for 128-key tiles (the dk / dv programs' width): its own when built for 128,
    else rebuilt on the device with the mask's builder (mask.py; no host synchronisation, the segments'
    length bounded by the key count)."""
    from dflash_kernels.ops.attention import mask as mask_mod

    if mask.kv_tile == DKDV_BN:
        return mask.rev_offsets, mask.rev_full, mask.rev_entries
    build = mask_mod._reverse_index_triton if mask_mod._use_triton_builder(mask.device) else mask_mod._reverse_index
    return build(mask.segments.contiguous(), mask.seg_count.contiguous(), mask.q_block, mask.q_len, mask.kv_len,
                 DKDV_BN, mask.kv_len)


def gluon_dflash_bwd_supported(mask, G: int) -> bool:
    """Whether the dk / dv kernel takes the mask's row packing: ``q_block * GH`` rows of 16, 32 or 64."""
    return mask.q_block * gluon_dflash_rows(mask.q_block, G) in (16, 32, 64)


def attention_bwd_gluon_sm90_dflash(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    o: torch.Tensor, lse: torch.Tensor, mask, scale: float, delta=None,
                                    check_mask: bool = True) -> tuple:
    """The backward of ``block_sparse_attention(q, k, v, mask, scale)`` on an sm_90 GPU for a DFlash-form mask
    (``check_gluon_dflash_mask``): ``(dq, dk, dv)`` like q, k, v, the contract of the portable launcher
    ``attention_bwd`` (rows that see nothing get dq 0 and add nothing; keys nobody sees get dk, dv 0).

    ``o``, ``lse`` the forward's outputs (natural-log lse fp32 ``[B, Hq, Tq]``), ``do`` the gradient of o;
    ``delta`` (fp32 ``[B, Hq, Tq]``, ``rowsum(o * do)``) when already computed, else the portable preprocess
    kernel computes it. q, k, v contiguous bf16 / fp16 with D in (64, 128), TMA-aligned as the forward needs.
    A mask whose rows per query group (``q_block * GH``, module docstring) are not 16, 32 or 64 runs the
    portable backward instead. ``check_mask=False`` skips the mask's form check (a device synchronisation).
    """
    from dflash_kernels.ops.attention.attention import attention_bwd
    from dflash_kernels.ops.attention.kernels import attention_bwd_preprocess_kernel

    checks.check_attention_inputs(q, k, v, mask, scale)
    if check_mask:
        check_gluon_dflash_mask(mask)
    assert q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9, "needs an sm_90 GPU"
    assert q.dtype in (torch.bfloat16, torch.float16), "bf16 or fp16"
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    assert D in (64, 128), "head dim 64 or 128"
    do = do.contiguous()
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        assert x.is_contiguous(), f"{name} must be contiguous"
        assert x.data_ptr() % 16 == 0, f"{name}: TMA needs a 16-byte aligned base address"
    if not gluon_dflash_bwd_supported(mask, G):
        fields = (mask.segments, mask.seg_count, mask.tiles, mask.rev_offsets, mask.rev_full, mask.rev_entries)
        return attention_bwd(do, q, k, v, o, lse, *(t.contiguous() for t in fields), mask.q_block, mask.kv_tile,
                             mask.tile_width, scale)
    dq = alloc.empty_like(q)
    dk = alloc.empty_like(k)
    dv = alloc.empty_like(v)
    if B == 0 or Tq == 0 or Tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    if delta is None:
        delta = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
        attention_bwd_preprocess_kernel(
            lambda m: (cdiv(Tq, m["BT"]), B * Hq), o, do, delta, Tq, Hq,
            o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
            bucket=(bucket(Tq), 1), D=D)
    delta = delta.contiguous()
    GH = gluon_dflash_rows(mask.q_block, G)
    MB, NG, MS, _ = mask.segments.shape
    segments, seg_count = mask.segments.contiguous(), mask.seg_count.contiguous()

    cfg = dq_config(D)
    NBH = B * Hkv * (G // GH)
    buckets = (bucket(Tq), bucket(Tk))
    attention_bwd_gluon_dq_kernel(
        (cdiv(NG, 2) * NBH, ), q, do, lse, delta, dq, descriptor(k, cfg["BN"]), descriptor(v, cfg["BN"]), segments,
        seg_count, Tq, NG, MS, MB, Hq, Hkv, NBH, scale * LOG2E, scale, bucket=buckets,
        G=G, BQ=mask.q_block, GH=GH, BN=cfg["BN"], NUM_STAGES=cfg["NUM_STAGES"], CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS)

    cfg = dkdv_config(D)
    rev_offsets, rev_full, rev_entries = _reverse_index_128(mask)
    NKV = cdiv(Tk, DKDV_BN)
    attention_bwd_gluon_dkdv_kernel(
        (NKV * B * Hkv, ), row_descriptor(q, mask.q_block, GH), row_descriptor(do, mask.q_block, GH),
        descriptor(k, KH), descriptor(v, KH), dk, dv, lse, delta, segments, rev_offsets, rev_full, rev_entries,
        Tq, Tk, NG, MS, MB, NKV, Hq, Hkv, B * Hkv, scale * LOG2E, scale, bucket=buckets,
        G=G, NUM_STAGES=cfg["NUM_STAGES"], CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    return dq, dk, dv


# Launched through the runtime's kernel cache with the forwards' one launch config (kernels_gluon_sm90.py).
attention_bwd_gluon_dq_kernel = TritonKernel(_attn_bwd_dq_ws_kernel, name="block_sparse_attn_bwd_gluon_sm90_dq",
                                             configs=GLUON_CONFIGS)
attention_bwd_gluon_dkdv_kernel = TritonKernel(_attn_bwd_dkdv_ws_kernel, name="block_sparse_attn_bwd_gluon_sm90_dkdv",
                                               configs=GLUON_CONFIGS)
