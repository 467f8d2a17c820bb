"""Argument checks of block-sparse attention and of its mask builders."""

import math

import torch

# mask.py imports this module for its builders' checks: each module imports the other whole and
# reads its names at call time, so either may be imported first.
from dflash_kernels.ops.attention import mask as _mask
from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["HEAD_DIMS", "check_attention_inputs", "check_kernel_grid", "check_causal_block_mask_args", "check_dflash_block_mask_args",
           "check_flex_block_mask"]

HEAD_DIMS = (64, 128, 256)

# The kernels index positions, key tiles and element offsets inside one batch element in int32
# (batch offsets are int64): lengths and per-batch-element sizes must stay below these bounds.
INT32_MAX = 2**31 - 1
MAX_TILE = 128  # the widest key tile (BN) a kernel steps by: its last tile may reach past the keys
MAX_GRID_X = 2**31 - 1  # programs on a CUDA grid's first axis (the kernels' grids are flat)


def check_kv_len(name, kv_len, kv_tile):
    """Keys ``[0, kv_len)`` plus one key tile past the end must be int32 positions."""
    if kv_len + max(kv_tile, MAX_TILE) > INT32_MAX:
        raise ValueError(f"{name}: {kv_len} keys exceed the int32 positions the attention kernels use "
                         f"(at most {INT32_MAX - max(kv_tile, MAX_TILE)} with kv_tile={kv_tile})")


def check_q_len(name, q_len, q_block):
    """Query positions plus a segment's ``shift`` (up to ``NO_DIAGONAL`` = 2**30) and a few row tiles
    past the end must be int32 values."""
    limit = (1 << 30) - 4 * q_block
    if q_len > limit:
        raise ValueError(f"{name}: {q_len} query positions exceed the int32 arithmetic of the attention "
                         f"kernels (at most {limit} with q_block={q_block})")


def check_attention_inputs(q, k, v, mask, scale):
    """Raise TypeError/ValueError naming the argument (see ``block_sparse_attention``)."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
    check_same_device(q=q, k=k, v=v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: dtypes must equal q's {q.dtype}, got k {k.dtype} and v {v.dtype}")
    B, Tq, Hq, D = q.shape
    if tuple(v.shape) != tuple(k.shape) or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k, v: expected shape [B={B}, Tk, Hkv, D={D}] each, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim D must be one of {HEAD_DIMS}, got {D}")
    Hkv = k.shape[2]
    if Hq == 0:
        raise ValueError(f"q: the head count Hq must be at least 1, got shape {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k: Hq={Hq} must be a multiple of Hkv={Hkv} (Hkv >= 1)")
    Tk = k.shape[1]
    for name, T, H in (("q", Tq, Hq), ("k, v", Tk, Hkv)):
        if T * H * D > INT32_MAX:
            raise ValueError(f"{name}: T * H * D = {T} * {H} * {D} elements per batch element exceed the int32 "
                             f"offsets of the attention kernels (at most {INT32_MAX}); split the batch element")
    if not isinstance(mask, _mask.BlockSparseMask):
        raise TypeError(f"mask: expected a BlockSparseMask (dflash_block_mask, causal_block_mask, "
                        f"from_flex_block_mask), got {type(mask).__name__}")
    if mask.q_len != Tq or mask.kv_len != k.shape[1]:
        raise ValueError(f"mask: built for Tq={mask.q_len}, Tk={mask.kv_len} but q has Tq={Tq} and k "
                         f"has Tk={k.shape[1]}")
    if mask.batch_size not in (1, B):
        raise ValueError(f"mask: batch size {mask.batch_size} must be 1 or B={B}")
    if mask.device != q.device:
        raise ValueError(f"mask: is on {mask.device} but q is on {q.device}; use mask.to(q.device)")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale: must be finite, got {scale}")


def check_kernel_grid(B, Hq, n_row_tiles, n_key_tiles):
    """The kernels run on flat grids, one program per (row or key tile, batch element x head): the
    count must fit a CUDA grid's first axis (dk/dv may split each key tile in two)."""
    n = B * Hq * max(n_row_tiles, 2 * n_key_tiles)
    if n > MAX_GRID_X:
        raise ValueError(f"q: B * Hq * max(row tiles, 2 * key tiles) = {B} * {Hq} * "
                         f"{max(n_row_tiles, 2 * n_key_tiles)} exceeds {MAX_GRID_X}, the programs a CUDA grid "
                         f"holds; split the batch")


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")


def _check_kv_tile(kv_tile):
    _check_int("kv_tile", kv_tile, 16)
    if kv_tile & (kv_tile - 1):
        raise ValueError(f"kv_tile: must be a power of two, got {kv_tile}")


def check_dflash_block_mask_args(anchors, context_len, block_size, window, valid, kv_tile, check_range):
    """Raise TypeError/ValueError naming the argument (see ``dflash_block_mask``). With
    ``check_range``, valid anchors outside ``[0, context_len]`` raise too: one read back from the
    anchors' device."""
    if not isinstance(anchors, torch.Tensor):
        raise TypeError(f"anchors: expected a tensor, got {type(anchors).__name__}")
    if anchors.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"anchors: dtype {anchors.dtype} is not supported; expected torch.int32 or torch.int64")
    if anchors.dim() != 2 or anchors.shape[1] == 0 or anchors.shape[0] == 0:
        raise ValueError(f"anchors: expected shape [B, N] with B, N >= 1, got {tuple(anchors.shape)}")
    _check_int("context_len", context_len, 1)
    _check_int("block_size", block_size, 1)
    _check_kv_tile(kv_tile)
    if window is not None:
        _check_int("window", window, 1)
    B, N = anchors.shape
    Tk, limit = context_len + N * block_size, INT32_MAX - max(kv_tile, MAX_TILE)
    if Tk > limit:
        raise ValueError(f"context_len: {context_len} context keys plus N * block_size = {N} * {block_size} "
                         f"block keys exceed the int32 key positions of the attention kernels (Tk at most {limit})")
    check_q_len("anchors", N * block_size, block_size)  # Tq = N * block_size
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            raise TypeError(f"valid: expected a bool tensor, got "
                            f"{valid.dtype if isinstance(valid, torch.Tensor) else type(valid).__name__}")
        if tuple(valid.shape) != (B, N):
            raise ValueError(f"valid: expected shape {(B, N)} like anchors, got {tuple(valid.shape)}")
        if valid.device != anchors.device:
            raise ValueError(f"valid: is on {valid.device} but anchors is on {anchors.device}")
    if check_range:
        a = anchors.long()
        bad = (a < 0) | (a > context_len)
        if valid is not None:
            bad &= valid
        if bool(bad.any()):
            idx = torch.nonzero(bad)[0].tolist()
            raise ValueError(f"anchors: every valid anchor must be in [0, context_len] = [0, {context_len}]; "
                             f"got anchors[{idx[0]}, {idx[1]}] = {int(a[idx[0], idx[1]])}")


def check_causal_block_mask_args(q_len, kv_len, q_block, kv_tile):
    """Raise TypeError/ValueError naming the argument (see ``causal_block_mask``; kv_len given)."""
    _check_int("q_len", q_len, 1)
    _check_int("kv_len", kv_len, 1)
    _check_int("q_block", q_block, 1)
    if q_block > 128:
        raise ValueError(f"q_block: at most 128 (kernel tile rows), got {q_block}")
    _check_kv_tile(kv_tile)
    check_q_len("q_len", q_len, q_block)
    check_kv_len("kv_len", kv_len, kv_tile)


def check_flex_block_mask(block_mask):
    """Raise ValueError for a flex ``BlockMask`` that ``from_flex_block_mask`` cannot convert."""
    if block_mask.kv_num_blocks is None or block_mask.kv_indices is None:
        raise ValueError("block_mask: has no kv_num_blocks / kv_indices")
    if block_mask.kv_num_blocks.shape[1] != 1:
        raise ValueError(f"block_mask: head-dependent masks are not supported (head dimension "
                         f"{block_mask.kv_num_blocks.shape[1]}); build the BlockMask with H=None")
    q_len, kv_len = block_mask.seq_lengths
    check_q_len("block_mask", q_len, block_mask.BLOCK_SIZE[0])
    check_kv_len("block_mask", kv_len, block_mask.BLOCK_SIZE[1])
