"""Triton kernels that build a mask's reverse index (mask.py) in two launches instead of a sort.

One program per (batch element, key tile) scans the mask's ``(group, segment)`` pairs, flattened in
(group, segment) order, ``BP`` at a time, and decides for each, exactly as ``mask._reverse_index``
(the plain-torch reference) does, whether it reaches the key tile (``listed``) and whether the tile
then needs no element mask (``full``). The count kernel stores both counts; after a prefix sum the
fill kernel writes the pairs, full ones first, then masked ones, each in (group, segment) order:
the order of the reference's stable sort, so the dk/dv sums stay deterministic and identical.
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel


@triton.jit
def _pair_flags(segments, seg_count, b, p, NG, MS, n0, q_len, q_block, kv_tile):
    """(group, listed, full) of the flattened pairs ``p`` [BP] of batch element b for the key tile at n0."""
    g = p // MS
    s = p - g * MS
    ok = g < NG
    cell = (b * NG + g) * MS + s
    lo = tl.load(segments + cell * 4, mask=ok, other=0).to(tl.int64)
    hi = tl.load(segments + cell * 4 + 1, mask=ok, other=0).to(tl.int64)
    shift = tl.load(segments + cell * 4 + 2, mask=ok, other=0).to(tl.int64)
    tile_id = tl.load(segments + cell * 4 + 3, mask=ok, other=-1)
    count = tl.load(seg_count + b * NG + g, mask=ok, other=0)
    q0 = g.to(tl.int64) * q_block
    q_last = tl.minimum(q0 + q_block, q_len) - 1
    hi_eff = tl.minimum(hi, q_last + shift + 1)  # keys right of the group's last diagonal: never seen
    live = ok & (s < count) & (hi_eff > lo)
    tile = n0 // kv_tile
    listed = live & (tile >= lo // kv_tile) & (tile <= (hi_eff - 1) // kv_tile)
    full = listed & (tile_id < 0) & (n0 >= lo) & (n0 + kv_tile <= hi) & (n0 + kv_tile - 1 <= q0 + shift)
    return g, s, listed, full


@triton.jit(do_not_specialize=["NG", "MS", "NKV", "q_len", "q_block", "kv_tile"])
def _attention_mask_rev_count_kernel(segments, seg_count, counts, NG, MS, NKV, q_len, q_block, kv_tile,
                                     BP: tl.constexpr):
    """counts ``[2, MB * NKV]``: the pairs reaching key tile n of batch element b (row 0) and how many
    of them see the whole tile (row 1)."""
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n0 = n.to(tl.int64) * kv_tile
    n_all = 0
    n_full = 0
    for p0 in range(0, NG * MS, BP):
        p = p0 + tl.arange(0, BP)
        g, s, listed, full = _pair_flags(segments, seg_count, b, p, NG, MS, n0, q_len, q_block, kv_tile)
        n_all += tl.sum(listed.to(tl.int32), 0)
        n_full += tl.sum(full.to(tl.int32), 0)
    tl.store(counts + b * NKV + n, n_all)
    tl.store(counts + tl.num_programs(1) * NKV + b * NKV + n, n_full)


@triton.jit(do_not_specialize=["NG", "MS", "NKV", "q_len", "q_block", "kv_tile"])
def _attention_mask_rev_fill_kernel(segments, seg_count, offsets, counts, entries, NG, MS, NKV, q_len, q_block,
                                    kv_tile, BP: tl.constexpr):
    """Write the pairs of key tile n at ``entries[offsets[b * NKV + n]:]``: full ones, then masked."""
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n0 = n.to(tl.int64) * kv_tile
    idx = b * NKV + n
    next_full = tl.load(offsets + idx).to(tl.int64)
    next_masked = next_full + tl.load(counts + tl.num_programs(1) * NKV + idx).to(tl.int64)
    for p0 in range(0, NG * MS, BP):
        p = p0 + tl.arange(0, BP)
        g, s, listed, full = _pair_flags(segments, seg_count, b, p, NG, MS, n0, q_len, q_block, kv_tile)
        masked = listed & ~full
        f = full.to(tl.int32)
        m = masked.to(tl.int32)
        pos = tl.where(full, next_full + tl.cumsum(f, 0) - f, next_masked + tl.cumsum(m, 0) - m)
        tl.store(entries + pos * 2, g.to(tl.int32), mask=listed)
        tl.store(entries + pos * 2 + 1, s.to(tl.int32), mask=listed)
        next_full += tl.sum(f, 0)
        next_masked += tl.sum(m, 0)


attention_mask_rev_count_kernel = TritonKernel(_attention_mask_rev_count_kernel, name="mask_rev_count",
                                               configs=[Config(BP=256, num_warps=4)], interpret_config=Config(BP=64))
attention_mask_rev_fill_kernel = TritonKernel(_attention_mask_rev_fill_kernel, name="mask_rev_fill",
                                              configs=[Config(BP=256, num_warps=4)], interpret_config=Config(BP=64))
