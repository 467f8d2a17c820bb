"""Hopper (sm_90) forward of block-sparse attention: keys and values through TMA tensor descriptors.

Same semantics, grid, program rows and outputs (o and lse) as ``_attention_fwd_kernel`` in kernels.py,
whose mask helpers it calls (the segment plan, the element mask, the non-finite poisoning), so the two
cannot drift apart on what a row sees. What differs is how the key loop reads K and V:

- K and V tiles come through tensor descriptors made in the kernel (``tl.make_tensor_descriptor``): one
  ``[Tk, D]`` view per (batch, kv head) program, read ``[BN, D]`` boxes at a time. On Hopper these are
  TMA copies into shared memory, with no address arithmetic in registers; keys at or past ``Tk`` read as
  zeros (the portable kernel masks its loads at the segment's end instead).
- The keys that every row of the program sees entirely (the body of each segment, mask.py's plan) run in
  a software-pipelined ``tl.range(..., num_stages=STAGES)`` loop with no element mask, no bounds and no
  non-finite handling: there a non-finite key or value reaches every row of the program, which is what the
  product gives, so the loop is TMA loads and two warpgroup MMAs per tile, which the pipeliner overlaps.
- The partially visible tiles (a segment's ragged start where the program's groups start at different keys,
  its last tile: the DFlash context's window edge and anchor, a block's own 16 keys, a causal diagonal, the
  end of the keys) run in a separate unpipelined loop with the element mask. A tile there reads keys past the
  segment's end (another segment's keys, possibly not finite; the portable kernel reads zeros): they are
  outside every row's mask, so the scores take -inf there and the values enter the product as zeros
  (non-finite ones are replaced first), and only the rows that see a non-finite value are set to NaN.

Q is gathered once per program and o stored with plain pointers, as in the portable kernel: a program's rows
are ``BQ`` positions times ``GH`` heads, a box only when both are powers of two, and read or written once.

Global-memory scratch: a descriptor made in a kernel is written to a scratch buffer (128 bytes per
descriptor per program) that Triton's launcher allocates on every launch through the allocator installed
with ``triton.set_allocator``. Triton keeps that allocator in a ``ContextVar``: it is per thread (a new
thread starts with none: autograd's backward threads, the runtime's tuning, a data loader) and per
``contextvars.Context``. So the op sets it where it launches, in ``attention_fwd_sm90`` right before the
launch (``_ensure_scratch_allocator``), never once at import. The interpreter needs none.

Descriptor constraints (TMA): K and V's base addresses and their token strides must be multiples of 16
bytes and the head dim contiguous; the launcher asserts it (the op passes contiguous inputs, whose
strides are multiples of D >= 64 elements).
"""

import torch
import triton
import triton.language as tl

from dflash_kernels.ops.attention.kernels import (LN2, _poison_seen, _program_rows, _row_program, _segment_plan,
                                                  _visible)
from dflash_kernels.runtime import Config, TritonKernel

__all__ = ["attention_fwd_sm90", "block_sparse_attn_fwd_sm90"]


@triton.jit
def _fwd_tiles_full(acc, l_i, m_i, q, k_desc, v_desc, start, stop, qk_scale,
                    BN: tl.constexpr, STAGES: tl.constexpr, DOT_PREC: tl.constexpr):
    """Keys ``[start, stop)`` (a multiple of BN) that every row sees: no mask, pipelined over STAGES tiles."""
    for n in tl.range(start, stop, BN, num_stages=STAGES):
        kt = k_desc.load([n, 0])  # [BN, D]
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = v_desc.load([n, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_tiles_masked(acc, l_i, m_i, q, k_desc, v_desc, start, stop, t, q0, lo, hi, shift, tile, tiles, qk_scale,
                      BQ: tl.constexpr, BN: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr,
                      DOT_PREC: tl.constexpr):
    """Keys ``[start, stop)`` under the element mask, one tile at a time: usually one or two tiles per
    segment, where a pipeline's prologue would cost more than it hides."""
    offs_n = tl.arange(0, BN)
    for n in tl.range(start, stop, BN, num_stages=1):
        kv = n + offs_n
        kt = k_desc.load([n, 0])
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
        vis = _visible(t, kv, q0, lo, hi, shift, tile, tiles, BQ, TW, HAS_TILES)
        s = tl.where(vis, s, float("-inf"))
        # m_i starts finite (-1e30), so a fully masked tile gives p = 0 and alpha = 1, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = v_desc.load([n, 0])
        # The portable kernel's containment: the dot takes the finite values only (p = 0 times a
        # non-finite value would be NaN), and the rows that see a non-finite value are set to NaN after it.
        v_ok = tl.abs(vt) < float("inf")
        vt = tl.where(v_ok, vt, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        acc = _poison_seen(acc, vis, v_ok)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Tq", "Tk", "NG", "MS", "MB", "NBH"])
def _attention_fwd_sm90_kernel(q, k, v, o, lse, segments, seg_count, tiles,
                               Tq, Tk, NG, MS, MB, Hq, Hkv, NBH,
                               stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                               stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                               qk_scale,
                               D: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, BQ: tl.constexpr,
                               BM: tl.constexpr, TW: tl.constexpr, HAS_TILES: tl.constexpr,
                               DOT_PREC: tl.constexpr, BN: tl.constexpr, GPB: tl.constexpr,
                               STAGES: tl.constexpr):
    tl.static_assert(BM >= BQ * GH)
    tl.static_assert(G % GH == 0)
    pid_g, pid_bh = _row_program(NBH)
    b, kvh, grp, q0, t, h, row_ok = _program_rows(pid_g, pid_bh, Tq, NG, MB, Hkv, G, GH, BQ, BM, GPB)
    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    q_ptrs = q + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    qt = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    # One [Tk, D] view of this (batch, kv head)'s keys and values: boxes past Tk read as zeros.
    k_desc = tl.make_tensor_descriptor(k + b64 * stride_kb + kvh * stride_kh, shape=[Tk, D], strides=[stride_kt, 1],
                                       block_shape=[BN, D])
    v_desc = tl.make_tensor_descriptor(v + b64 * stride_vb + kvh * stride_vh, shape=[Tk, D], strides=[stride_vt, 1],
                                       block_shape=[BN, D])

    m_i = tl.full([GPB * BM], -1.0e30, tl.float32)
    l_i = tl.zeros([GPB * BM], tl.float32)
    acc = tl.zeros([GPB * BM, D], tl.float32)
    n_seg = tl.load(seg_count + grp)
    for s_i in tl.range(tl.max(n_seg, 0), num_stages=1):  # the pipelined loop is the body inside
        lo, hi, shift, tile, start, mid0, mid1, stop = _segment_plan(segments, n_seg, grp, s_i, q0, MS, BQ, BN,
                                                                     HAS_TILES)
        acc, l_i, m_i = _fwd_tiles_masked(acc, l_i, m_i, qt, k_desc, v_desc, start, mid0, t, q0, lo, hi, shift,
                                          tile, tiles, qk_scale, BQ, BN, TW, HAS_TILES, DOT_PREC)
        acc, l_i, m_i = _fwd_tiles_full(acc, l_i, m_i, qt, k_desc, v_desc, mid0, mid1, qk_scale, BN, STAGES,
                                        DOT_PREC)
        acc, l_i, m_i = _fwd_tiles_masked(acc, l_i, m_i, qt, k_desc, v_desc, mid1, stop, t, q0, lo, hi, shift,
                                          tile, tiles, qk_scale, BQ, BN, TW, HAS_TILES, DOT_PREC)

    seen = l_i > 0.0  # rows that see no key: output 0, lse -inf
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = o + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=row_ok[:, None])
    lse_val = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(lse + (b64 * Hq + h) * Tq + t, lse_val, mask=row_ok)


def _scratch(size: int, alignment: int, stream):
    """Triton's global-scratch allocator: device memory for the kernel's tensor descriptors, from torch's
    caching allocator on the current device (the launch runs there) and its current stream."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator():
    """Install ``_scratch`` as Triton's allocator in this thread's context unless one is installed (the
    user's own allocator is kept). Triton has no public getter: its ``ContextVar`` is read directly."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _check_tma_operand(name, x):
    """TMA reads ``[Tk, D]`` boxes of one (batch, kv head): contiguous D, 16-byte aligned base and strides."""
    e = x.element_size()
    assert x.stride(3) == 1, f"{name}: the head dim must be contiguous for TMA"
    assert x.data_ptr() % 16 == 0 and all(x.stride(i) * e % 16 == 0 for i in range(3)), \
        f"{name}: TMA needs 16-byte aligned base and strides, got strides {x.stride()}"


def attention_fwd_sm90(q, k, v, segments, seg_count, tiles, q_block, tile_width, scale):
    """The Hopper forward; the arguments and returns of ``attention.attention_fwd``: inputs contiguous
    ``[B, T, H, D]``, returns ``o`` like q and lse fp32 ``[B, Hq, Tq]`` (natural log)."""
    # attention.py is imported here, not at the top: its dispatch is the one that will import this module.
    from dflash_kernels.ops.attention.attention import attention_fwd

    if q.is_cuda:
        _check_tma_operand("k", k)
        _check_tma_operand("v", v)
        _ensure_scratch_allocator()
    return attention_fwd(q, k, v, segments, seg_count, tiles, q_block, tile_width, scale,
                         kernel=block_sparse_attn_fwd_sm90)


# The portable forward's row tilings (GPB groups of BM rows; BM = 64 at the DFlash shape, 16 positions x 4
# heads), each with the pipeline depth of the unmasked loop (STAGES; num_stages, the launch option, is the
# same so that no other loop takes a different default). Warpgroup MMAs are 64 rows tall: 4 warps per 64
# rows, or 8 warps splitting the tile's columns, which halves each thread's share of the scores and of the
# accumulator: at BN = 128 that is what keeps the masked tiles from spilling heavily at D = 128
# (python -m tools.studies.sm90_resources attention_sm90). Deeper pipelines at BN = 64, where a stage (a K and
# a V box) is small; at BN = 128 and D = 128 two stages take 144 KiB of the 227 KiB of shared memory.
_configs = [Config(BN=bn, GPB=gpb, STAGES=st, num_warps=w, num_stages=st) for bn, gpb, st, w in (
    (64, 1, 3, 4), (64, 1, 4, 4), (64, 1, 3, 8), (128, 1, 2, 8), (64, 2, 3, 8), (64, 2, 4, 8), (128, 2, 2, 8))]
block_sparse_attn_fwd_sm90 = TritonKernel(_attention_fwd_sm90_kernel, name="block_sparse_attn_fwd_sm90",
                                          configs=_configs, interpret_config=Config(BN=16, GPB=2, STAGES=2))
