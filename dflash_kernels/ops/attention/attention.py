"""Block-sparse attention: launchers, the custom_op pair with its autograd, and the public functional."""

import math

import torch
import triton

from dflash_kernels.ops.attention import kernels
from dflash_kernels.ops.attention.mask import BlockSparseMask, dflash_block_mask
from dflash_kernels.runtime import Config, TritonKernel, alloc, register_op, register_precompile, resolve
from dflash_kernels.runtime.autograd import differentiable_op
from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["block_sparse_attention", "attention_fwd", "attention_bwd"]

HEAD_DIMS = (64, 128, 256)
LOG2E = math.log2(math.e)  # the kernels take the softmax scale premultiplied by it (they use exp2)

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
attn_fwd_kernel = TritonKernel(kernels._attn_fwd_kernel, name="block_sparse_attn_fwd", configs=_row_configs,
                               interpret_config=Config(BN=16, GPB=2))
# The same candidates for dq, with the one the H200's tuner chose at the DFlash shapes first: the first
# candidate is what an untuned run (DFLASH_KERNELS_TUNE=0) launches (the next that fits, if it does not).
attn_bwd_dq_kernel = TritonKernel(kernels._attn_bwd_dq_kernel, name="block_sparse_attn_bwd_dq",
                                  configs=[_row_configs[4]] + _row_configs[:4] + _row_configs[5:],
                                  interpret_config=Config(BN=16, GPB=2))
# The dk/dv kernel's key tile is the mask's kv_tile (the reverse index is built for it) or, with
# SPLIT=2, half of it; tuned: that split, how many row tiles (EPI) one step stacks, launch options.
# The SPLIT=2 candidates are the ones that do not spill registers at D=128 (kernels.py); a split
# that leaves fewer than 16 keys does not compile and is no candidate.
attn_bwd_dkdv_kernel = TritonKernel(
    kernels._attn_bwd_dkdv_kernel, name="block_sparse_attn_bwd_dkdv",
    configs=[Config(EPI=1, SPLIT=1, num_warps=4, num_stages=2), Config(EPI=1, SPLIT=1, num_warps=4, num_stages=3),
             Config(EPI=2, SPLIT=1, num_warps=4, num_stages=2), Config(EPI=2, SPLIT=1, num_warps=8, num_stages=2),
             Config(EPI=2, SPLIT=1, num_warps=8, num_stages=3), Config(EPI=1, SPLIT=2, num_warps=8, num_stages=2),
             Config(EPI=2, SPLIT=2, num_warps=8, num_stages=2), Config(EPI=1, SPLIT=2, num_warps=4, num_stages=2)],
    interpret_config=Config(EPI=2, SPLIT=1))  # the stacked path, odd entry counts included
attn_bwd_preprocess_kernel = TritonKernel(kernels._attn_bwd_preprocess_kernel, name="block_sparse_attn_bwd_pre",
                                          configs=[Config(BT=64, num_warps=4)], interpret_config=Config(BT=16))


def _row_tiling(q_block: int, G: int, D: int):
    """Heads per tile (GH, a divisor of G) and tile rows (BM): as many heads as fit in a tile.

    At most 128 rows (64 for D=256) keeps the fp32 [BM, D] accumulator in registers and the
    backward's q / do tiles in shared memory.
    """
    max_rows = 128 if D <= 128 else 64
    GH = 1
    for d in range(1, G + 1):
        if G % d == 0 and q_block * d <= max_rows:
            GH = d
    BM = max(16, triton.next_power_of_2(q_block * GH))
    return GH, BM


def _common(q, k, segments, q_block, tile_width, tiles):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    GH, BM = _row_tiling(q_block, G, D)
    MB, NG, MS, _ = segments.shape
    meta = dict(D=D, G=G, GH=GH, BQ=q_block, BM=BM, TW=tile_width, HAS_TILES=tiles.shape[0] > 0,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")
    return B, Tq, Tk, Hq, Hkv, G, MB, NG, MS, meta


def _bucket(Tq, Tk):
    return (triton.next_power_of_2(Tq), triton.next_power_of_2(Tk))


def attention_fwd(q, k, v, segments, seg_count, tiles, q_block, tile_width, scale):
    """Launch the forward. Inputs contiguous ``[B, T, H, D]``; returns ``o`` like q and lse fp32 ``[B, Hq, Tq]``."""
    B, Tq, Tk, Hq, Hkv, G, MB, NG, MS, meta = _common(q, k, segments, q_block, tile_width, tiles)
    o = alloc.empty_like(q)
    lse = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    NC = G // meta["GH"]
    attn_fwd_kernel(
        lambda m: (triton.cdiv(NG, m["GPB"]), B * Hkv * NC), q, k, v, o, lse, segments, seg_count, tiles,
        Tq, Tk, NG, MS, MB, Hq, Hkv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        scale * LOG2E, bucket=_bucket(Tq, Tk), **meta)
    return o, lse


def attention_bwd(do, q, k, v, o, lse, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries,
                  q_block, kv_tile, tile_width, scale):
    """Launch the backward: delta = rowsum(o * do), then dq (per row tile) and dk, dv (per key tile)."""
    B, Tq, Tk, Hq, Hkv, G, MB, NG, MS, meta = _common(q, k, segments, q_block, tile_width, tiles)
    D = meta["D"]
    delta = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    attn_bwd_preprocess_kernel(
        lambda m: (triton.cdiv(Tq, m["BT"]), B * Hq), o, do, delta, Tq, Hq,
        o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        bucket=_bucket(Tq, 1), D=D)
    dq = alloc.empty_like(q)
    dk = alloc.empty_like(k)
    dv = alloc.empty_like(v)
    NC = G // meta["GH"]
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    attn_bwd_dq_kernel(
        lambda m: (triton.cdiv(NG, m["GPB"]), B * Hkv * NC), q, k, v, do, lse, delta, dq, segments, seg_count, tiles,
        Tq, Tk, NG, MS, MB, Hq, Hkv, *strides, scale * LOG2E, scale,
        bucket=_bucket(Tq, Tk), **meta)
    NKV = triton.cdiv(Tk, kv_tile)
    attn_bwd_dkdv_kernel(
        lambda m: (NKV * m["SPLIT"], B * Hkv), q, k, v, do, lse, delta, dk, dv, segments, rev_offsets, rev_full,
        rev_entries, tiles, Tq, Tk, NG, MS, MB, NKV, Hq, Hkv, *strides, scale * LOG2E, scale,
        bucket=_bucket(Tq, Tk), KVT=kv_tile, **meta)
    return dq, dk, dv


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
              seg_count: torch.Tensor, tiles: torch.Tensor, rev_offsets: torch.Tensor, rev_full: torch.Tensor,
              rev_entries: torch.Tensor,
              q_block: int, kv_tile: int, tile_width: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_fwd(q, k, v, segments, seg_count, tiles, q_block, tile_width, scale)


_fwd_op = torch.library.custom_op("dflash_kernels::block_sparse_attn_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(q, k, v, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries, q_block, kv_tile, tile_width, scale):
    B, Tq, Hq, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, Hq, Tq, dtype=torch.float32)


@torch.library.custom_op("dflash_kernels::block_sparse_attn_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, segments: torch.Tensor, seg_count: torch.Tensor, tiles: torch.Tensor,
            rev_offsets: torch.Tensor, rev_full: torch.Tensor,
            rev_entries: torch.Tensor, q_block: int, kv_tile: int,
            tile_width: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_bwd(do.contiguous(), q, k, v, o, lse, segments, seg_count, tiles, rev_offsets,
                         rev_full, rev_entries, q_block, kv_tile, tile_width, scale)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries, q_block, kv_tile,
      tile_width, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries, q_block, kv_tile, tile_width, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries)
    ctx.meta = (q_block, kv_tile, tile_width, scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    dq, dk, dv = _bwd_op(do, *ctx.saved_tensors, *ctx.meta)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_fwd_differentiable = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


def _check(q, k, v, mask, scale):
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
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k: Hq={Hq} must be a multiple of Hkv={Hkv}")
    if not isinstance(mask, BlockSparseMask):
        raise TypeError(f"mask: expected a BlockSparseMask (dflash_block_mask, causal_block_mask, "
                        f"from_flex_block_mask), got {type(mask).__name__}")
    if mask.q_len != Tq or mask.kv_len != k.shape[1]:
        raise ValueError(f"mask: built for Tq={mask.q_len}, Tk={mask.kv_len} but q has Tq={Tq} and k "
                         f"has Tk={k.shape[1]}")
    if mask.batch_size not in (1, B):
        raise ValueError(f"mask: batch size {mask.batch_size} must be 1 or B={B}")
    if mask.device != q.device:
        raise ValueError(f"mask: is on {mask.device} but q is on {q.device}; use mask.to(q.device)")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")


register_op("attention")


def block_sparse_attention(q, k, v, mask, scale=None, return_lse=False):
    """Attention restricted to a block-sparse mask, with GQA.

    Args:
        q: ``[B, Tq, Hq, D]``, bf16 / fp16 / fp32, D in {64, 128, 256}.
        k, v: ``[B, Tk, Hkv, D]``, same dtype; Hq a multiple of Hkv (query head h uses kv head
            ``h // (Hq // Hkv)``).
        mask: a :class:`BlockSparseMask` for (Tq, Tk) on q's device, batch size 1 or B
            (:func:`dflash_block_mask`, :func:`causal_block_mask`, :func:`from_flex_block_mask`).
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of the scaled scores, fp32 ``[B, Hq, Tq]``
            (natural log; not differentiable).

    Returns:
        o ``[B, Tq, Hq, D]`` in q's dtype, or ``(o, lse)``. Rows that see no key get o = 0,
        lse = -inf, and contribute zero gradient. The backward is deterministic (no atomics).
    """
    _check(q, k, v, mask, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    backend = resolve("attention", q.device)
    if backend == "reference":
        from dflash_kernels.ops.attention.reference import sdpa_dense
        out = sdpa_dense(q, k, v, mask, scale=scale, return_lse=True)
    else:
        out = _fwd_differentiable(q.contiguous(), k.contiguous(), v.contiguous(), mask.segments, mask.seg_count,
                      mask.tiles, mask.rev_offsets, mask.rev_full, mask.rev_entries, mask.q_block, mask.kv_tile,
                      mask.tile_width, scale)
    return out if return_lse else out[0]


@register_precompile("attention")
def _precompile_attention(shape: dict, dtype, device, backward: bool):
    """Run the DFlash-mask attention once: ``shape`` has B, S, N, Hq, Hkv, D and optionally
    ``block_size`` (16) and ``window``. Kernels are cached per power-of-two bucket of Tq and Tk."""
    B, S, N, Hq, Hkv, D = (shape[n] for n in ("B", "S", "N", "Hq", "Hkv", "D"))
    bs = shape.get("block_size", 16)
    anchors = torch.sort(torch.randint(0, S, (B, N), device=device), dim=1).values
    mask = dflash_block_mask(anchors, S, bs, window=shape.get("window"))
    q = torch.randn(B, N * bs, Hq, D, device=device, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(B, S + N * bs, Hkv, D, device=device, dtype=dtype, requires_grad=backward)
            for _ in range(2))
    o = block_sparse_attention(q, k, v, mask)
    if backward:
        o.backward(torch.randn_like(o))
