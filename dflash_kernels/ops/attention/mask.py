"""Block-level attention masks: a few key ranges per query group, never a dense ``[Tq, Tk]`` tensor.

Queries are cut into groups of ``q_block`` consecutive positions (group ``g`` holds queries
``[g * q_block, (g + 1) * q_block)``). Each group lists up to ``MS`` *segments*; a segment is four
int32 ``(lo, hi, shift, tile)`` and query ``t`` of the group sees key ``kv`` through it iff

    lo <= kv < hi  and  kv <= t + shift  and  (tile < 0 or tiles[tile, t - g * q_block, kv - lo])

A query sees the union of its group's segments; segments of one group never overlap. With that:

- DFlash: group = one draft block; segment 0 is the context ``[lo, anchor)``, segment 1 the block's
  own keys; ``shift`` is huge (no diagonal), so every row of a group sees the same keys and the
  kernels mask only the ragged last tile of each segment.
- causal: one segment ``[0, q0 + q_block)`` with ``shift = 0``: only tiles crossing the diagonal
  are masked element-wise.
- arbitrary masks (from flex's ``BlockMask``): one segment per kv block; a partially visible block
  carries a ``[q_block, tile_width]`` boolean tile evaluated once from the ``mask_mod``.

All rows of a group see the same segments, so a kernel tile of ``q_block`` positions times the query
heads of one GQA group runs one key loop. The backward's dk/dv kernel needs the transpose: for each
``kv_tile``-wide key tile, the ``(group, segment)`` pairs that reach it (``rev_offsets`` /
``rev_entries``, a CSR index sorted by group so the dk/dv sums are deterministic). Everything is
built on the masks' device in time proportional to the number of segments plus visited tiles,
without host synchronisation (the DFlash builder's anchor range check is the one): segments with
tensor ops, the reverse index with two Triton kernels (``kernels_mask.py``) where the attention
backend is Triton or the interpreter, else with tensor ops and a sort (``_reverse_index``, also the
reference the kernels are tested against). Argument checks: ``checks.py``.
"""

from dataclasses import dataclass

import torch

from dflash_kernels.ops.attention import checks  # whole module: checks.py imports this one (see there)
from dflash_kernels.ops.attention.kernels_mask import attention_mask_rev_count_kernel, attention_mask_rev_fill_kernel
from dflash_kernels.runtime import alloc, backends

__all__ = ["BlockSparseMask", "dflash_block_mask", "causal_block_mask", "from_flex_block_mask", "NO_DIAGONAL"]

# `shift` for segments without a diagonal: larger than any position, small enough that
# `q0 + q_block + shift` cannot overflow int32 in the kernels.
NO_DIAGONAL = 1 << 30


@dataclass(frozen=True, eq=False)
class BlockSparseMask:
    """A block-sparse mask for :func:`dflash_kernels.block_sparse_attention`.

    Build it with :func:`dflash_block_mask`, :func:`causal_block_mask` or :func:`from_flex_block_mask`.
    A mask with batch size 1 applies to every batch element.
    """

    segments: torch.Tensor  # int32 [MB, NG, MS, 4]: (lo, hi, shift, tile) per segment, see module doc
    seg_count: torch.Tensor  # int32 [MB, NG]: live segments of each group (the first seg_count)
    tiles: torch.Tensor  # uint8 [NT, q_block, tile_width]: element masks of partial blocks (NT may be 0)
    rev_offsets: torch.Tensor  # int32 [MB * NKV + 1]: CSR offsets of key tile (b, n) into rev_entries
    rev_full: torch.Tensor  # int32 [MB * NKV]: how many of a key tile's entries need no element mask
    rev_entries: torch.Tensor  # int32 [E, 2]: (group, segment) per key tile: unmasked first, by group;
    # E is an upper bound, rows past rev_offsets[-1] are unused
    q_len: int  # Tq: query positions covered
    kv_len: int  # Tk: key positions covered
    q_block: int  # positions per query group
    kv_tile: int  # key tile width of the reverse index (the dk/dv kernel's BN)
    tile_width: int  # width of `tiles` (the flex kv block size; 1 when there are none)
    # What the builder guarantees about the segments, for the dispatch (a kernel that takes only that form runs
    # without reading the segments back): "dflash" (dflash_block_mask: at most 2 segments per group, none with a
    # diagonal or a tile), "causal" (causal_block_mask: exactly top-left causal attention over (q_len, kv_len)),
    # "general" (anything else). A mask whose fields are replaced must say "general" unless it keeps the form.
    form: str = "general"

    @property
    def batch_size(self) -> int:
        return self.segments.shape[0]

    @property
    def num_groups(self) -> int:
        return self.segments.shape[1]

    @property
    def device(self) -> torch.device:
        return self.segments.device

    def to(self, device) -> "BlockSparseMask":
        move = {f: getattr(self, f).to(device) for f in
                ("segments", "seg_count", "tiles", "rev_offsets", "rev_full", "rev_entries")}
        return BlockSparseMask(**move, q_len=self.q_len, kv_len=self.kv_len, q_block=self.q_block,
                               kv_tile=self.kv_tile, tile_width=self.tile_width, form=self.form)

    def visible_pairs(self) -> torch.Tensor:
        """Number of visible (query, key) pairs per batch element of the mask, int64 ``[MB]``.

        Counts with the tiles and diagonals, without a dense mask; used for effective FLOPs.
        """
        seg = self.segments.long()
        lo, hi, shift, tile = seg.unbind(-1)
        MB, NG, MS = lo.shape
        live = torch.arange(MS, device=lo.device) < self.seg_count.long()[..., None]
        q0 = torch.arange(NG, device=lo.device)[None, :, None] * self.q_block
        total = torch.zeros(MB, dtype=torch.long, device=lo.device)
        for r in range(self.q_block):  # per row of a group: a loop of q_block, not of blocks
            t = q0 + r
            cnt = (torch.minimum(hi, t + shift + 1) - lo).clamp_min(0)
            ok = live & (t < self.q_len) & (tile < 0)
            total += torch.where(ok, cnt, 0).sum((1, 2))
        if self.tiles.shape[0]:
            per_tile = self.tiles.reshape(self.tiles.shape[0], -1).long().sum(1)
            with_tile = live & (tile >= 0)
            total += torch.where(with_tile, per_tile[tile.clamp_min(0)], 0).sum((1, 2))
        return total


def _reverse_index(segments, seg_count, q_block, q_len, kv_len, kv_tile, max_len):
    """CSR of the (group, segment) pairs whose keys fall in each ``kv_tile``-wide key tile.

    ``max_len`` bounds every segment's length, so each segment spans at most ``T`` tiles and the
    index is built on a fixed ``[MB, NG, MS, T]`` grid: no host synchronisation.
    """
    dev = segments.device
    MB, NG, MS, _ = segments.shape
    NKV = -(-kv_len // kv_tile)
    T = -(-max_len // kv_tile) + 1
    lo, hi, shift, tile_id = (x[..., None] for x in segments.long().unbind(-1))  # [MB, NG, MS, 1]
    q0 = (torch.arange(NG, device=dev) * q_block)[None, :, None, None]
    q_last = torch.clamp(q0 + q_block, max=q_len) - 1
    hi_eff = torch.minimum(hi, q_last + shift + 1)  # the diagonal cuts keys no row of the group sees
    live = (torch.arange(MS, device=dev)[:, None] < seg_count.long()[..., None, None]) & (hi_eff > lo)
    first = lo // kv_tile
    j = torch.arange(T, device=dev)
    listed = live & (j < (hi_eff - 1) // kv_tile - first + 1)
    tile = first + j
    n0 = tile * kv_tile
    # A key tile needs no element mask for a segment that covers it and lies left of the diagonal of
    # the group's first row (the same test as the kernels').
    full = (tile_id < 0) & (n0 >= lo) & (n0 + kv_tile <= hi) & (n0 + kv_tile - 1 <= q0 + shift)
    b = torch.arange(MB, device=dev)[:, None, None, None]
    key = (b * NKV + tile) * 2 + (~full).long()
    key = torch.where(listed, key, 2 * MB * NKV)  # unlisted grid cells sort past the end
    # Per key tile: the full entries first, then the masked ones, so the dk/dv kernel runs two
    # branch-free loops. The grid is flattened in (b, group, segment) order and the sort is stable,
    # so the kernel sums groups in a fixed order: deterministic gradients without atomics.
    sort_key, order = torch.sort(key.flatten(), stable=True)
    gs = order // T
    entries = torch.stack([(gs // MS) % NG, gs % MS], 1).to(torch.int32).contiguous()
    bounds = torch.arange(MB * NKV + 1, device=dev) * 2
    offsets = torch.searchsorted(sort_key, bounds)
    n_full = torch.searchsorted(sort_key, bounds[:-1] + 1) - offsets[:-1]
    return offsets.to(torch.int32), n_full.to(torch.int32), entries


def _reverse_index_triton(segments, seg_count, q_block, q_len, kv_len, kv_tile, max_len):
    """``_reverse_index`` by the Triton kernels (kernels_mask.py: two launches and a prefix sum); the
    same result on the listed entries (rows past ``offsets[-1]`` are unused and left unwritten)."""
    dev = segments.device
    MB, NG, MS, _ = segments.shape
    NKV = -(-kv_len // kv_tile)
    T = -(-max_len // kv_tile) + 1
    counts = alloc.empty(2, MB * NKV, dtype=torch.int32, device=dev)
    args = (NG, MS, NKV, q_len, q_block, kv_tile)
    attention_mask_rev_count_kernel((NKV, MB), segments, seg_count, counts, *args)
    offsets = torch.zeros(MB * NKV + 1, dtype=torch.int32, device=dev)
    torch.cumsum(counts[0], 0, dtype=torch.int32, out=offsets[1:])
    entries = alloc.empty(MB * NG * MS * T, 2, dtype=torch.int32, device=dev)
    attention_mask_rev_fill_kernel((NKV, MB), segments, seg_count, offsets, counts, entries, *args)
    return offsets, counts[1].clone(), entries  # its own allocation: 16-byte aligned like the torch build's


def _use_triton_builder(device) -> bool:
    """The reverse index is built by the kernels where the attention runs on them, else by tensor ops."""
    return backends.resolve("attention", device) in ("triton", "portable", "interpret")


def _finish(segments, seg_count, tiles, q_len, kv_len, q_block, kv_tile, tile_width, max_len, form):
    segments = segments.to(torch.int32).contiguous()
    seg_count = seg_count.to(torch.int32).contiguous()
    build = _reverse_index_triton if _use_triton_builder(segments.device) else _reverse_index
    offsets, n_full, entries = build(segments, seg_count, q_block, q_len, kv_len, kv_tile, max_len)
    return BlockSparseMask(segments, seg_count, tiles.contiguous(), offsets, n_full, entries, q_len=q_len,
                           kv_len=kv_len, q_block=q_block, kv_tile=kv_tile, tile_width=tile_width, form=form)


def _no_tiles(q_block, device):
    return torch.zeros(0, q_block, 1, dtype=torch.uint8, device=device)


def dflash_block_mask(anchors, context_len, block_size=16, window=None, valid=None, kv_tile=64,
                      check_range=True):
    """The DFlash training mask: each draft block sees the context before its anchor and itself.

    Keys are laid out ``[context (S) | block_0 | ... | block_{N-1}]`` (``Tk = S + N * block_size``),
    queries ``[block_0 | ... | block_{N-1}]`` (``Tq = N * block_size``). Query block ``i`` sees
    context keys ``kv < anchors[b, i]`` (strict: the anchor's own state is not available at
    inference) and the ``block_size`` keys of its own block, bidirectionally; no other block.

    Args:
        anchors: int32/int64 ``[B, N]``, each in ``[0, S]`` where ``valid`` is True; an anchor of 0
            sees no context (only its own block), an anchor of S the whole context (decoding: the
            block follows the newest context token). Anchors of invalid blocks are ignored (any value).
        context_len: S, the number of context keys (>= 1).
        block_size: queries (and own keys) per draft block.
        window: if given, context is limited to ``anchor - window <= kv < anchor``.
        valid: optional bool ``[B, N]``; blocks with False (padding) see nothing: their output and
            gradients are 0 and their lse is -inf.
        kv_tile: key tile width of the backward's reverse index (the dk/dv kernel's BN).
        check_range: check that valid anchors lie in ``[0, S]``. The check reads one scalar back
            from the device (a synchronisation); without it the build never synchronises, and an
            out-of-range anchor is clamped into ``[0, S]``.

    Returns:
        A :class:`BlockSparseMask` of batch size B for ``(Tq, Tk) = (N * block_size, S + N * block_size)``
        on the anchors' device.

    Raises TypeError/ValueError naming the argument for bad dtypes, shapes or anchor values.
    """
    checks.check_dflash_block_mask_args(anchors, context_len, block_size, window, valid, kv_tile, check_range)
    B, N = anchors.shape
    dev = anchors.device
    a = anchors.long().clamp(0, context_len)  # anchors of invalid blocks are ignored
    lo = torch.zeros_like(a) if window is None else (a - window).clamp_min(0)
    own = (context_len + torch.arange(N, device=dev) * block_size).expand(B, N)
    no_diag, no_tile = torch.full_like(a, NO_DIAGONAL), torch.full_like(a, -1)
    segments = torch.stack([torch.stack([lo, a, no_diag, no_tile], -1),
                            torch.stack([own, own + block_size, no_diag, no_tile], -1)], 2)  # [B, N, 2, 4]
    seg_count = torch.full((B, N), 2, device=dev, dtype=torch.int32)
    if valid is not None:
        seg_count = torch.where(valid, seg_count, 0)
    max_len = max(block_size, context_len if window is None else min(window, context_len))
    return _finish(segments, seg_count, _no_tiles(block_size, dev), N * block_size,
                   context_len + N * block_size, block_size, kv_tile, 1, max_len, "dflash")


def causal_block_mask(q_len, kv_len=None, q_block=64, kv_tile=64, device=None):
    """Causal attention, top-left aligned like ``F.scaled_dot_product_attention(is_causal=True)``:
    query ``t`` sees keys ``kv <= t`` (and all keys when ``t >= kv_len``). Applies to every batch element.

    Args:
        q_len: Tq. kv_len: Tk (default Tq). q_block: positions per query group (kernel tile rows are
        ``q_block`` times the heads packed per tile), at most 128. kv_tile: the backward's key tile width
        (a power of two). device: where the structure lives (that of the attention inputs; default the CPU).

    Returns:
        A :class:`BlockSparseMask` of batch size 1 for ``(q_len, kv_len)``.
    """
    kv_len = q_len if kv_len is None else kv_len
    checks.check_causal_block_mask_args(q_len, kv_len, q_block, kv_tile)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    NG = -(-q_len // q_block)
    q0 = torch.arange(NG, device=dev) * q_block
    hi = torch.clamp(q0 + q_block, max=kv_len)
    segments = torch.stack([torch.zeros_like(q0), hi, torch.zeros_like(q0), torch.full_like(q0, -1)], -1)
    segments = segments[None, :, None, :]
    seg_count = torch.ones(1, NG, device=dev, dtype=torch.int32)
    return _finish(segments, seg_count, _no_tiles(q_block, dev), q_len, kv_len, q_block, kv_tile, 1, kv_len, "causal")


def from_flex_block_mask(block_mask, kv_tile=64):
    """Convert a ``torch.nn.attention.flex_attention.BlockMask`` into a :class:`BlockSparseMask`.

    Full kv blocks (``full_kv_num_blocks`` / ``full_kv_indices``) become plain segments; each partial
    block (``kv_num_blocks`` / ``kv_indices``) is evaluated once with the mask's ``mask_mod`` on its
    ``Q_BLOCK x KV_BLOCK`` elements (a boolean tile kept beside the segments), so any ``mask_mod``
    works, at a memory cost of one byte per element of the partial blocks only.

    Limits:
        - the mask must not depend on the head: the BlockMask's head dimension must be 1 (build it
          with ``H=None``); per-head masks raise ValueError.
        - ``mask_mod`` is called once, on broadcastable index tensors ``b [P,1,1]``, ``h [P,1,1]``,
          ``q_idx [P,Q_BLOCK,1]``, ``kv_idx [P,1,KV_BLOCK]`` (not under vmap): it must be written
          with element-wise tensor ops and tensor indexing, as flex's own examples are.
        - a mask's batch size of 1 applies to every batch element; otherwise it must equal B.
        - positions beyond the BlockMask's ``seq_lengths`` are never visible.
        - speed: each kv block is one segment, so a mask with long runs of full blocks loops over
          them one block at a time (still no element masking on full blocks).

    Args:
        block_mask: a ``BlockMask`` from ``torch.nn.attention.flex_attention.create_block_mask`` built
            with ``H=None``.
        kv_tile: key tile width of the backward's reverse index (a power of two).

    Returns:
        A :class:`BlockSparseMask` for ``block_mask.seq_lengths`` on the BlockMask's device, with its batch
        size.
    """
    checks.check_flex_block_mask(block_mask)
    kv_num, kv_idx = block_mask.kv_num_blocks, block_mask.kv_indices
    QB, KB = block_mask.BLOCK_SIZE
    q_len, kv_len = block_mask.seq_lengths
    dev = kv_num.device
    MB, _, NQB = kv_num.shape
    full_num, full_idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    if full_num is None:
        full_num = torch.zeros_like(kv_num)
        full_idx = kv_idx[..., :0]
    kv_num, kv_idx = kv_num[:, 0].long(), kv_idx[:, 0].long()
    full_num, full_idx = full_num[:, 0].long(), full_idx[:, 0].long()
    NG = -(-q_len // QB)
    kv_num, kv_idx, full_num, full_idx = kv_num[:, :NG], kv_idx[:, :NG], full_num[:, :NG], full_idx[:, :NG]
    MS = max(1, int((kv_num + full_num).max()))

    # Evaluate mask_mod on every listed partial block, in one batched call.
    MP = kv_idx.shape[-1]
    is_part = torch.arange(MP, device=dev) < kv_num[..., None]  # [MB, NG, MP]
    pb, pg, pj = torch.nonzero(is_part, as_tuple=True)
    P = pb.numel()
    pk = kv_idx[pb, pg, pj]
    q_pos = (pg * QB)[:, None, None] + torch.arange(QB, device=dev)[None, :, None]
    kv_pos = (pk * KB)[:, None, None] + torch.arange(KB, device=dev)[None, None, :]
    if P:
        values = block_mask.mask_mod(pb[:, None, None], torch.zeros_like(pb)[:, None, None], q_pos, kv_pos)
        values = torch.as_tensor(values, device=dev).expand(P, QB, KB)
        values = values & (q_pos < q_len) & (kv_pos < kv_len)
    else:
        values = torch.zeros(0, QB, KB, dtype=torch.bool, device=dev)
    tiles = values.to(torch.uint8)

    # Segments: full blocks first, then partial blocks with their tile index.
    MF = full_idx.shape[-1]
    fcols = torch.arange(MF, device=dev)
    f_live = fcols < full_num[..., None]
    tile_id = torch.full(kv_idx.shape, -1, dtype=torch.long, device=dev)
    tile_id[pb, pg, pj] = torch.arange(P, device=dev)
    blocks = torch.cat([torch.where(f_live, full_idx, 0), kv_idx], -1)
    slot = torch.cat([torch.where(f_live, fcols, MS + MP), full_num[..., None] + torch.arange(MP, device=dev)], -1)
    slot = torch.where(torch.cat([f_live, is_part], -1), slot, MS + MP)  # dead entries to a trash slot
    tid = torch.cat([torch.full_like(full_idx, -1), tile_id], -1)
    lo = blocks * KB
    seg_all = torch.stack([lo, torch.clamp(lo + KB, max=kv_len), torch.full_like(lo, NO_DIAGONAL), tid], -1)
    segments = torch.zeros(MB, NG, MS + MP + 1, 4, dtype=torch.long, device=dev)
    segments.scatter_(2, slot[..., None].expand(-1, -1, -1, 4), seg_all)
    segments = segments[:, :, :MS]
    seg_count = full_num + kv_num
    return _finish(segments, seg_count, tiles, q_len, kv_len, QB, kv_tile, KB, KB, "general")
