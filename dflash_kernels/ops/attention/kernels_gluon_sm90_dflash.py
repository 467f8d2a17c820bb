"""Warp-specialized Hopper (sm_90) forward in Gluon for the DFlash training mask: the dense prototype's
structure (kernels_gluon_sm90.py: one TMA producer warp, two ping-pong wgmma consumer warpgroups, a K / V
stage ring) over a block-sparse mask's key ranges.

Masks it takes: every segment without an element-mask tile and with the ``NO_DIAGONAL`` shift, at most two
segments per group, ``q_block <= 64`` (mask.py): ``dflash_block_mask`` with or without ``window`` and
``valid``, and flex masks of that form. Every row of a group then sees the same keys, the union of at most
two key ranges ``[lo, hi)``. Other masks stay on the portable forward (kernels.py).

Rows. A consumer warpgroup owns one query group: its ``q_block`` positions times ``GH`` query heads of one
kv head (GQA packing as in the portable kernel: row ``r`` is position ``q0 + r // GH``, head
``h0 + r % GH``; ``GH`` the largest divisor of ``Hq / Hkv`` with ``q_block * GH <= 64``). A warpgroup MMA
is 64 rows tall: at DFlash's 16 positions and 4 heads per kv head all 64 rows are live; with fewer the rest
are dead (zeros in, never stored), which costs MMA time (GQA 1 uses a quarter of it) but no other path.

Program (CTA) = two consumers on two adjacent query groups ``2i, 2i + 1`` of one (batch, kv head, head
chunk), plus the producer. With anchors sorted along the sequence (as a trainer samples them and as the
benchmark builds them) adjacent groups' context ranges nearly coincide and their own blocks are adjacent,
so the producer loads the union once for both: per segment slot ``s`` (0 = context, 1 = own block) the keys
from the lower ``lo`` to the higher ``hi`` of the two groups' slot-``s`` segments, in ``BN``-key TMA boxes
starting at that ``lo`` (boxes need not be aligned; a box past the keys' end reads zeros). The two own
blocks (2 x 16 keys) take one box. Each consumer masks the scores of keys outside its own segment of the
slot the tile belongs to; only tiles not wholly inside that segment evaluate the mask (the ragged end of
each range, and the keys between the two groups' anchors). Unsorted anchors stay correct, the union only
grows. One group per consumer with a ring each would load the shared context twice.

Q: the consumers load their rows with plain masked loads into their [64, D] NVMMA-swizzled shared buffer,
not with TMA. The 64 rows are ``q_block`` positions x ``GH`` heads, a box of a rank-4 view
``[B, Tq, Hq, D]`` would fit them only when ``q_block * GH == 64`` (and would still need the dead rows
zeroed otherwise); Q is read once per program, so the plain loads cost little. o goes back the same way:
written into the Q buffer (no longer read), read in a coalesced register layout, stored with a row mask.

Non-finite keys and values stay with the rows that see them (compare ``_poison_seen`` in kernels.py and
tests/ops/test_nonfinite.py). A non-finite K element makes only the scores of its key non-finite, and a
consumer replaces the scores of keys it does not see by -inf. V needs more: the tiles a consumer multiplies
hold keys it does not see (the ragged end of a segment's last box, up to ``BN - 1`` keys past it, which for
the context are later context keys and for the own block the next blocks' keys; and the other group's keys
of the union), and inside the warpgroup MMA their ``P = 0`` times a non-finite value would be NaN. The ring's
V tiles are read by both consumers, so neither may rewrite them; instead each consumer has one V slot of its
own in shared memory (``v_smem``'s slots ``NUM_STAGES`` and ``NUM_STAGES + 1``), and on the tiles where it
masks scores it copies the V tile there through registers with the rows of the keys it does not see set to 0
(a select), and ``O += P V`` reads the copy (``_attend``'s ``CONFINE_V``, ``_visible_values``). Every row of a
consumer sees the same keys, so zeroing whole key rows is exact. Tiles it sees whole read the ring as before.
So the rows that do not see a non-finite key or value get exactly what they get without it. The rows that
see it compute with it (the portable forward sets NaN there explicitly, ``_poison_seen``): a NaN in K or V or
an infinite V element makes them non-finite; an infinite K element whose score comes out -inf acts as a
masked key. The copies cost shared memory, two [BN, D] slots: 64 KiB at D = 128 (229,720 bytes in all, of
sm_90's 232,448 per block) and 32 KiB at D = 64; and time only on masked tiles (the ragged ends and the keys
between the two groups' ranges), 32 keys at a time, outside the consumer's ping-pong turn.

The op's dispatch (attention.py) runs this forward for ``dflash_block_mask`` masks on sm_90 GPUs (bf16 / fp16,
D 64 / 128), and after it the backward's Gluon sibling (kernels_gluon_sm90_dflash_bwd.py).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from dflash_kernels.ops.attention import checks
from dflash_kernels.ops.attention.kernels_gluon_sm90 import (BMW, CONSUMER_REGS, GLUON_CONFIGS, LOG2E,
                                                             PRODUCER_REGS, _attend, _finish_rows, _init_ring,
                                                             _load_kv, descriptor, score_layout, tile_config)
from dflash_kernels.ops.attention.mask import NO_DIAGONAL
from dflash_kernels.runtime import TritonKernel, alloc, bucket, cdiv

__all__ = ["attention_fwd_gluon_sm90_dflash", "attention_fwd_gluon_dflash_kernel", "gluon_dflash_rows"]

GROUPS_PER_PROGRAM = 2  # one query group per consumer warpgroup
_FAR: gl.constexpr = gl.constexpr(NO_DIAGONAL)  # past every key: the start of an empty range


@gluon.jit
def _group_segments(segments, seg_count, bm, g, NG, MS):
    """Key ranges ``[lo, hi)`` of segment slots 0 and 1 of group ``g`` of the mask's batch row ``bm``; a slot
    the group does not have, or an empty one, as ``(0, 0)``; a group past ``NG`` has none."""
    grp = bm.to(gl.int64) * NG + gl.minimum(g, NG - 1)
    n_seg = gl.load(seg_count + grp, mask=g < NG, other=0)
    seg = segments + grp * MS * 4
    lo0 = gl.load(seg, mask=n_seg > 0, other=0)
    hi0 = gl.load(seg + 1, mask=n_seg > 0, other=0)
    lo1 = gl.load(seg + 4, mask=n_seg > 1, other=0)
    hi1 = gl.load(seg + 5, mask=n_seg > 1, other=0)
    ok0 = hi0 > lo0
    ok1 = hi1 > lo1
    return gl.where(ok0, lo0, 0), gl.where(ok0, hi0, 0), gl.where(ok1, lo1, 0), gl.where(ok1, hi1, 0)


@gluon.jit
def _union(lo_a, hi_a, lo_b, hi_b, BN: gl.constexpr):
    """First key and tile count of the walk over ``[min lo, max hi)`` of two ranges, empty ones left out."""
    a = hi_a > lo_a
    b = hi_b > lo_b
    start = gl.minimum(gl.where(a, lo_a, _FAR), gl.where(b, lo_b, _FAR))
    stop = gl.maximum(gl.where(a, hi_a, 0), gl.where(b, hi_b, 0))
    n = gl.where(stop > start, (stop - start + BN - 1) // BN, 0)
    return gl.where(n > 0, start, 0), n


@gluon.jit
def _pair_program(segments, seg_count, NG, MS, MB, Hkv, k_desc, G: gl.constexpr, GH: gl.constexpr,
                  BQ: gl.constexpr, BN: gl.constexpr):
    """This program's place in the two-group grid (``_attn_fwd_dflash_ws_kernel``'s docstring; the backward's dq
    kernel runs the same grid): batch ``b``, kv head ``hk``, first query head ``h0``, first group ``g0``; the
    key walk over the union of the two groups' segments (``n_tiles`` BN-key tiles: ``n0`` from ``start0``, then
    from ``start1``) and each group's two segments ``[lo, hi)``. Checks the build's shapes (``k_desc``'s
    ``[1, BN, D]`` boxes, 64-row consumers of ``BQ`` positions x ``GH`` heads)."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    gl.static_assert((D == 64) or (D == 128), "head dim 64 or 128")
    gl.static_assert(k_desc.block_type.shape[1] == BN, "K boxes are BN keys")
    gl.static_assert(BQ * GH <= 64, "a consumer warpgroup's rows are one query group x GH heads")
    gl.static_assert(G % GH == 0, "GH divides the GQA group")
    pid = gl.program_id(0)
    n_pairs = (NG + 1) // 2
    pair = n_pairs - 1 - pid % n_pairs
    pid_bh = pid // n_pairs
    NC: gl.constexpr = G // GH
    b = pid_bh // (Hkv * NC)
    hk = (pid_bh // NC) % Hkv
    h0 = hk * G + (pid_bh % NC) * GH
    g0 = 2 * pair
    bm = b % MB
    lo00, hi00, lo01, hi01 = _group_segments(segments, seg_count, bm, g0, NG, MS)
    lo10, hi10, lo11, hi11 = _group_segments(segments, seg_count, bm, g0 + 1, NG, MS)
    start0, n0 = _union(lo00, hi00, lo10, hi10, BN)
    start1, n1 = _union(lo01, hi01, lo11, hi11, BN)
    return b, hk, h0, g0, n0 + n1, start0, n0, start1, lo00, hi00, lo01, hi01, lo10, hi10, lo11, hi11


@gluon.jit
def _dflash_consumer(q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn,
                     b, g, h0, Tq, NG, Hq, n_tiles, start0, n0, start1, lo0, hi0, lo1, hi1, qk_scale,
                     WG: gl.constexpr, BQ: gl.constexpr, GH: gl.constexpr, BN: gl.constexpr,
                     NUM_STAGES: gl.constexpr):
    """One consumer warpgroup: query group ``g`` (``BQ`` positions) x heads ``h0 + [0, GH)``, keys of its
    segments ``[lo0, hi0)`` and ``[lo1, hi1)`` among the program's walk."""
    ROWS: gl.constexpr = q_smem.shape[2]
    D: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = score_layout(BN)
    o_layout: gl.constexpr = score_layout(D)
    # Rows x D in 16-byte pieces, a row's D elements over consecutive lanes: coalesced global accesses.
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])

    r = gl.arange(0, ROWS, gl.SliceLayout(1, io_layout))
    t = g * BQ + r // GH
    live = (r < BQ * GH) & (g < NG) & (t < Tq)
    row_off = ((b.to(gl.int64) * Tq + t) * Hq + h0 + r % GH) * D
    offs = gl.expand_dims(row_off, 1) + gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, io_layout)), 0)
    q = q_smem.index(WG).reshape([ROWS, D])
    q.store(gl.load(q_ptr + offs, mask=gl.expand_dims(live, 1), other=0.0))
    fence_async_shared()  # the warpgroup MMA reads q through the async proxy

    rows = gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    o, m_i, l_i = _attend(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, n_tiles, start0, n0, start1,
                          lo0, hi0, lo1, hi1, 0, rows, qk_scale, WG, BN, NUM_STAGES, False, s_layout, o_layout,
                          True)
    o, lse = _finish_rows(o, m_i, l_i, o_layout)

    t_s = g * BQ + rows // GH
    live_s = (rows < BQ * GH) & (g < NG) & (t_s < Tq)
    gl.store(lse_ptr + (b.to(gl.int64) * Hq + h0 + rows % GH) * Tq + t_s, lse, mask=live_s)
    # Every MMA that read q has completed (_attend waits for all): its buffer carries o to the store layout.
    q.store(o.to(dtype))
    gl.store(o_ptr + offs, q.load(io_layout), mask=gl.expand_dims(live, 1))


@gluon.jit
def _dflash_producer(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, start0,
                     n0, start1, BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of the program's key walk (both groups' union), K and V tile by tile into the ring."""
    _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, start0, n0,
             start1, BN, NUM_STAGES)


@gluon.jit
def _attn_fwd_dflash_ws_kernel(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, segments, seg_count, Tq, NG, MS, MB, Hq,
                               Hkv, NBH, qk_scale, G: gl.constexpr, BQ: gl.constexpr, GH: gl.constexpr,
                               BN: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr):
    """One program: query groups ``2i, 2i + 1`` x ``GH`` heads of one kv head. Grid: ``cdiv(NG, 2) * NBH``
    programs (``NBH = B * Hkv * G / GH``), flat, group pairs fastest and in reverse: with sorted anchors the
    last groups see the longest contexts, and starting them first keeps the last wave short (as the portable
    forward)."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    ROWS: gl.constexpr = 64
    b, hk, h0, g0, n_tiles, start0, n0, start1, lo00, hi00, lo01, hi01, lo10, hi10, lo11, hi11 = _pair_program(
        segments, seg_count, NG, MS, MB, Hkv, k_desc, G, GH, BQ, BN)

    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, 1, ROWS, D], k_desc.layout)  # K's swizzle: same D
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    # V: the ring's stages, then one slot per consumer for its masked tiles' copies (_attend's CONFINE_V).
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES + 2] + v_desc.block_type.shape, v_desc.layout)
    k_ready, k_empty, v_ready, v_empty, turn = _init_ring(NUM_STAGES)
    # The barriers are completed by TMA (the async proxy): make their initialisation visible to it.
    fence_async_shared()

    gl.warp_specialize([
        (_dflash_consumer, (q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                            turn, b, g0, h0, Tq, NG, Hq, n_tiles, start0, n0, start1, lo00, hi00, lo01, hi01,
                            qk_scale, 0, BQ, GH, BN, NUM_STAGES)),
        (_dflash_consumer, (q_ptr, o_ptr, lse_ptr, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                            turn, b, g0 + 1, h0, Tq, NG, Hq, n_tiles, start0, n0, start1, lo10, hi10, lo11, hi11,
                            qk_scale, 1, BQ, GH, BN, NUM_STAGES)),
        (_dflash_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles,
                            start0, n0, start1, BN, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_dflash_rows(q_block: int, G: int) -> int:
    """GH: query heads per consumer warpgroup, the largest divisor of the GQA group ``G`` with
    ``q_block * GH <= 64`` rows."""
    return max(d for d in range(1, G + 1) if G % d == 0 and q_block * d <= BMW)


def check_gluon_dflash_mask(mask) -> None:
    """ValueError naming ``mask`` unless this kernel takes it (module docstring): no element-mask tiles, at
    most two segments per group, every live segment without a diagonal, ``q_block <= 64``. Reads the
    segments back from the device (one synchronisation)."""
    if mask.tiles.shape[0] != 0:
        raise ValueError(f"mask: the Gluon DFlash forward takes masks without element-mask tiles, this one has "
                         f"{mask.tiles.shape[0]} (a flex mask with partial blocks: use block_sparse_attention)")
    MS = mask.segments.shape[2]
    if MS > 2:
        raise ValueError(f"mask: the Gluon DFlash forward takes at most 2 segments per group, this one has "
                         f"{MS} slots (use block_sparse_attention)")
    if mask.q_block > BMW:
        raise ValueError(f"mask: the Gluon DFlash forward takes q_block <= {BMW} (one warpgroup's rows), got "
                         f"{mask.q_block}")
    live = torch.arange(MS, device=mask.device) < mask.seg_count.long()[..., None]
    shift = mask.segments[..., 2]
    if bool((live & (shift != NO_DIAGONAL)).any()):
        raise ValueError("mask: the Gluon DFlash forward takes segments without a diagonal (shift NO_DIAGONAL, "
                         "as dflash_block_mask builds them); this one has a causal diagonal (use "
                         "block_sparse_attention)")


def attention_fwd_gluon_sm90_dflash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
                                    check_mask: bool = True) -> tuple:
    """The forward of ``block_sparse_attention(q, k, v, mask, scale)`` on an sm_90 GPU for a DFlash-form
    mask (``check_gluon_dflash_mask``): ``(o [B, Tq, Hq, D] like q, lse [B, Hq, Tq] fp32)``, as the portable
    launcher ``attention_fwd`` returns them (natural-log lse, -inf and o 0 for rows that see no key).

    q ``[B, Tq, Hq, D]``, k and v ``[B, Tk, Hkv, D]``, contiguous, bf16 or fp16, D in (64, 128), 16-byte
    aligned base pointers (TMA); the mask on q's device with batch size 1 or B. Raises the op's
    TypeError / ValueError for bad arguments, ValueError naming ``mask`` for a mask of another form.
    ``check_mask=False`` skips the mask's form check (it reads the segments back: a device synchronisation)
    for a mask already checked, as a timing loop needs.
    """
    checks.check_attention_inputs(q, k, v, mask, scale)
    if check_mask:
        check_gluon_dflash_mask(mask)
    assert q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9, "needs an sm_90 GPU"
    assert q.dtype in (torch.bfloat16, torch.float16), "bf16 or fp16"
    D = q.shape[3]
    assert D in (64, 128), "head dim 64 or 128"
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.is_contiguous(), f"{name} must be contiguous"
        assert x.data_ptr() % 16 == 0, f"{name}: TMA needs a 16-byte aligned base address"
    return dflash_fwd(q, k, v, mask.segments.contiguous(), mask.seg_count.contiguous(), mask.q_block, scale)


def dflash_fwd(q, k, v, segments, seg_count, q_block, scale):
    """The launcher: ``attention_fwd_gluon_sm90_dflash`` without its checks, on the mask's dense segment tensors
    (what the op's custom op holds). The caller guarantees the mask's form and the inputs' layout."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    o = alloc.empty_like(q)
    lse = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    if Tq == 0 or B == 0:
        return o, lse
    G = Hq // Hkv
    GH = gluon_dflash_rows(q_block, G)
    MB, NG, MS, _ = segments.shape
    NBH = B * Hkv * (G // GH)
    cfg = tile_config(D)
    attention_fwd_gluon_dflash_kernel(
        (cdiv(NG, GROUPS_PER_PROGRAM) * NBH, ), q, descriptor(k, cfg["BN"]), descriptor(v, cfg["BN"]), o, lse,
        segments, seg_count, Tq, NG, MS, MB, Hq, Hkv, NBH, scale * LOG2E, bucket=(bucket(Tq), bucket(Tk)),
        G=G, BQ=q_block, GH=GH, BN=cfg["BN"], NUM_STAGES=cfg["NUM_STAGES"], CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS)
    return o, lse


attention_fwd_gluon_dflash_kernel = TritonKernel(_attn_fwd_dflash_ws_kernel,
                                                 name="block_sparse_attn_fwd_gluon_sm90_dflash",
                                                 configs=GLUON_CONFIGS)  # the dense kernel's one launch config
