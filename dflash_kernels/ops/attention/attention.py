"""Block-sparse attention: launchers, the custom_op pair with its autograd, and the public function."""

import math

import torch

from dflash_kernels.ops.attention.checks import check_attention_inputs, check_kernel_grid
from dflash_kernels.ops.attention.kernels import (attention_bwd_dkdv_kernel, attention_bwd_dq_kernel,
                                                  attention_bwd_preprocess_kernel, attention_fwd_kernel)
from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90
from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import dflash_fwd, gluon_dflash_rows
from dflash_kernels.ops.attention.kernels_gluon_sm90_causal_bwd import attention_bwd_gluon_sm90_causal
from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import attention_bwd_gluon_sm90_dflash
from dflash_kernels.ops.attention.mask import BlockSparseMask, dflash_block_mask
from dflash_kernels.runtime import Op, alloc, bucket, cdiv, next_pow2, register_precompile, settings
from dflash_kernels.runtime.autograd import differentiable_op, eager_call
from dflash_kernels.runtime.errors import BackendUnavailable

__all__ = ["block_sparse_attention", "attention_fwd", "attention_bwd", "forward_path", "choose_forward"]

LOG2E = math.log2(math.e)  # the kernels take the softmax scale premultiplied by it (they use exp2)

# Backend "portable": the portable Triton kernels only, also on GPUs where backend "triton" (the default) runs a
# hardware-specific forward; for comparing the two and for working around one.
_attention = Op("attention", extra={"portable": lambda: not settings.interpreting() and torch.cuda.is_available()})

PORTABLE, GLUON_DFLASH, GLUON_CAUSAL = "portable", "gluon_sm90_dflash", "gluon_sm90_causal"
_major = {}  # CUDA device index -> compute capability major


def _capability_major(device) -> int:
    major = _major.get(device.index)
    if major is None:
        major = _major[device.index] = torch.cuda.get_device_capability(device)[0]
    return major


def forward_path(q, k, v, mask, backend: str = "triton") -> str:
    """Which forward kernel ``block_sparse_attention`` runs for these inputs (contiguous, as the op passes them)
    under ``backend``: ``"portable"`` (kernels.py), ``"gluon_sm90_dflash"`` or ``"gluon_sm90_causal"`` (the
    warp-specialized Hopper forwards, kernels_gluon_sm90*.py): :func:`choose_forward`'s kernel where the inputs'
    base addresses suit it (:func:`_aligned_for`), else the portable one. Reads no device memory."""
    major = _capability_major(q.device) if backend == "triton" and q.is_cuda else None
    path = choose_forward(major, q.dtype, q.shape[-1], q.shape[2] // k.shape[2], mask)
    return path if _aligned_for(path, q, k, v) else PORTABLE


def _aligned_for(path: str, q, k, v) -> bool:
    """Whether the base addresses suit the kernel of ``path``: TMA boxes of k and v (and of q for the dense
    forward) need 16-byte aligned bases. Called where the tensors are real (the custom op's body: under
    torch.compile the wrapper sees fake tensors, which have no address)."""
    if path == PORTABLE:
        return True
    ok = k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
    return ok and (path != GLUON_CAUSAL or q.data_ptr() % 16 == 0)


def choose_forward(major, dtype, D: int, G: int, mask) -> str:
    """The forward kernel for inputs on a CUDA device of compute capability ``major`` (None: not a CUDA input
    under backend ``triton``), of ``dtype`` and head dim ``D``, GQA ratio ``G``, under ``mask``, before the
    base-address check of :func:`forward_path` (a misaligned k or v runs the portable forward).

    The Hopper forwards need capability 9.x. The DFlash one takes ``dflash_block_mask`` masks whose query groups
    fill a 64-row warpgroup (``q_block`` x the query heads packed per kv head = 64: 16-token blocks at GQA 4 or
    8; with fewer rows the warpgroup MMA runs partly empty, untimed against the portable forward), bf16 / fp16,
    D 64 or 128; the dense one ``causal_block_mask`` masks, bf16 / fp16, D 64 or 128. Everything else runs the
    portable forward, which takes every mask, dtype and head dim. The backward after each Gluon forward is its
    Gluon sibling (kernels_gluon_sm90_dflash_bwd.py, kernels_gluon_sm90_causal_bwd.py; :func:`_gluon_backward`);
    the portable backward, which reads any forward's o and lse, follows the portable forward."""
    if major != 9 or dtype not in (torch.bfloat16, torch.float16) or D not in (64, 128):
        return PORTABLE
    if mask.form == "dflash" and mask.tiles.shape[0] == 0 and mask.segments.shape[2] <= 2 and mask.q_block <= 64:
        if mask.q_block * gluon_dflash_rows(mask.q_block, G) == 64:
            return GLUON_DFLASH
    if mask.form == "causal":
        return GLUON_CAUSAL
    return PORTABLE


def _gluon_backward(q, k, v, o, do) -> bool:
    """Whether the backward after a Gluon forward is its Gluon sibling: every dtype, head dim and mask
    that forward takes (:func:`choose_forward`), with every tensor at a 16-byte aligned base address
    (TMA); an unaligned upstream gradient takes the portable backward."""
    return all(x.data_ptr() % 16 == 0 for x in (q, k, v, o, do))


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
    BM = max(16, next_pow2(q_block * GH))
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


def attention_fwd(q, k, v, segments, seg_count, tiles, q_block, tile_width, scale, kernel=None):
    """Launch the forward. Inputs contiguous ``[B, T, H, D]``; returns ``o`` like q and lse fp32 ``[B, Hq, Tq]``.
    ``kernel``: a forward kernel of the portable one's arguments (default: the portable one; the Hopper
    forward in kernels_sm90.py launches through here)."""
    B, Tq, Tk, Hq, Hkv, G, MB, NG, MS, meta = _common(q, k, segments, q_block, tile_width, tiles)
    o = alloc.empty_like(q)
    lse = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    NC = G // meta["GH"]
    (attention_fwd_kernel if kernel is None else kernel)(
        lambda m: (cdiv(NG, m["GPB"]) * B * Hkv * NC,), q, k, v, o, lse, segments, seg_count, tiles,
        Tq, Tk, NG, MS, MB, Hq, Hkv, B * Hkv * NC,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        scale * LOG2E, bucket=(bucket(Tq), bucket(Tk)), **meta)
    return o, lse


def attention_bwd(do, q, k, v, o, lse, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries,
                  q_block, kv_tile, tile_width, scale):
    """Launch the backward: delta = rowsum(o * do), then dq (per row tile) and dk, dv (per key tile)."""
    B, Tq, Tk, Hq, Hkv, G, MB, NG, MS, meta = _common(q, k, segments, q_block, tile_width, tiles)
    D = meta["D"]
    delta = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    attention_bwd_preprocess_kernel(
        lambda m: (cdiv(Tq, m["BT"]), B * Hq), o, do, delta, Tq, Hq,
        o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        bucket=(bucket(Tq), 1), D=D)
    dq = alloc.empty_like(q)
    dk = alloc.empty_like(k)
    dv = alloc.empty_like(v)
    NC = G // meta["GH"]
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    attention_bwd_dq_kernel(
        lambda m: (cdiv(NG, m["GPB"]) * B * Hkv * NC,), q, k, v, do, lse, delta, dq, segments, seg_count, tiles,
        Tq, Tk, NG, MS, MB, Hq, Hkv, B * Hkv * NC, *strides, scale * LOG2E, scale,
        bucket=(bucket(Tq), bucket(Tk)), **meta)
    NKV = cdiv(Tk, kv_tile)
    attention_bwd_dkdv_kernel(
        lambda m: (NKV * m["SPLIT"] * B * Hkv,), q, k, v, do, lse, delta, dk, dv, segments, rev_offsets, rev_full,
        rev_entries, tiles, Tq, Tk, NG, MS, MB, NKV, Hq, Hkv, B * Hkv, *strides, scale * LOG2E, scale,
        bucket=(bucket(Tq), bucket(Tk)), KVT=kv_tile, **meta)
    return dq, dk, dv


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
              seg_count: torch.Tensor, tiles: torch.Tensor, rev_offsets: torch.Tensor, rev_full: torch.Tensor,
              rev_entries: torch.Tensor, q_block: int, kv_tile: int, tile_width: int, scale: float,
              path: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not _aligned_for(path, q, k, v):
        path = PORTABLE
    if path == GLUON_DFLASH:
        return dflash_fwd(q, k, v, segments, seg_count, q_block, scale)
    if path == GLUON_CAUSAL:
        return attention_fwd_gluon_sm90(q, k, v, True, scale)
    return attention_fwd(q, k, v, segments, seg_count, tiles, q_block, tile_width, scale)


_fwd_op = torch.library.custom_op("dflash_kernels::block_sparse_attn_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(q, k, v, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries, q_block, kv_tile, tile_width, scale,
      path):
    B, Tq, Hq, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, Hq, Tq, dtype=torch.float32)


@torch.library.custom_op("dflash_kernels::block_sparse_attn_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, segments: torch.Tensor, seg_count: torch.Tensor, tiles: torch.Tensor,
            rev_offsets: torch.Tensor, rev_full: torch.Tensor,
            rev_entries: torch.Tensor, q_block: int, kv_tile: int,
            tile_width: int, scale: float, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do = do.contiguous()
    if path == GLUON_DFLASH and _gluon_backward(q, k, v, o, do):  # after the Gluon DFlash forward: its sibling
        mask = BlockSparseMask(segments, seg_count, tiles, rev_offsets, rev_full, rev_entries, q_len=q.shape[1],
                               kv_len=k.shape[1], q_block=q_block, kv_tile=kv_tile, tile_width=tile_width,
                               form="dflash")
        return attention_bwd_gluon_sm90_dflash(do, q, k, v, o, lse, mask, scale, check_mask=False)
    if path == GLUON_CAUSAL and _gluon_backward(q, k, v, o, do):  # after the Gluon causal forward: its sibling
        return attention_bwd_gluon_sm90_causal(do, q, k, v, o, lse, scale)
    return attention_bwd(do, q, k, v, o, lse, segments, seg_count, tiles, rev_offsets,
                         rev_full, rev_entries, q_block, kv_tile, tile_width, scale)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries, q_block, kv_tile,
      tile_width, scale, path):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries = inputs[:9]
    q_block, kv_tile, tile_width, scale, path = inputs[9:]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, segments, seg_count, tiles, rev_offsets, rev_full, rev_entries)
    ctx.meta = (q_block, kv_tile, tile_width, scale, path)
    ctx.mark_non_differentiable(lse)


_bwd_op_eager = eager_call(_bwd_op)  # the plain function outside torch.compile


def _backward(ctx, do, dlse):
    dq, dk, dv = _bwd_op_eager(do, *ctx.saved_tensors, *ctx.meta)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


# Eager calls take a plain autograd.Function, torch.compile the custom op (runtime/autograd.py).
_fwd_differentiable = differentiable_op(_fwd_op, _fwd_impl, _setup_context, _backward)


def _run_kernels(q, k, v, mask, scale, backend):
    check_kernel_grid(q.shape[0], q.shape[2], cdiv(q.shape[1], mask.q_block), cdiv(k.shape[1], mask.kv_tile))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # The kernels index the mask's tensors densely; the builders make them so, a mask assembled from
    # views (strided, transposed, at an offset) is copied.
    fields = (mask.segments, mask.seg_count, mask.tiles, mask.rev_offsets, mask.rev_full, mask.rev_entries)
    major = _capability_major(q.device) if backend == "triton" and q.is_cuda else None
    path = choose_forward(major, q.dtype, q.shape[-1], q.shape[2] // k.shape[2], mask)  # the op checks addresses
    return _fwd_differentiable(q, k, v, *(t.contiguous() for t in fields), mask.q_block, mask.kv_tile,
                               mask.tile_width, scale, path)


@_attention.impl("triton")
def _attention_kernels(q, k, v, mask, scale):
    return _run_kernels(q, k, v, mask, scale, "triton")


@_attention.impl("interpret")
def _attention_interpreted(q, k, v, mask, scale):
    return _run_kernels(q, k, v, mask, scale, "interpret")


@_attention.impl("portable")
def _attention_portable(q, k, v, mask, scale):
    if not q.is_cuda:
        raise BackendUnavailable(f"attention: backend 'portable' needs CUDA tensors, got device {q.device}; use "
                                 f"'interpret' (with TRITON_INTERPRET=1) or 'reference' on the CPU")
    return _run_kernels(q, k, v, mask, scale, "portable")


@_attention.impl("reference")
def _attention_reference(q, k, v, mask, scale):
    from dflash_kernels.ops.attention.naive import masked_block_sparse_attention

    return masked_block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)


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
    check_attention_inputs(q, k, v, mask, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = _attention(q.device, q, k, v, mask, scale)
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
