"""Triton kernel of rotate-half RoPE: ``y = x * cos + rotate_half(x) * sin`` on the first ``R`` of ``D``
features of each head, the other ``D - R`` passed through (partial rotary, as Qwen3.5 / Qwen3-Next).

With ``x1, x2`` the two halves of the rotated part and ``c1, c2, s1, s2`` those of cos and sin:
forward ``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2``; the backward is the transposed map (the rotation
by ``-sin``): ``dx1 = dy1 c1 + dy2 s2``, ``dx2 = dy2 c2 - dy1 s1`` (``BACKWARD``). fp32 math, one
rounding to the output dtype.

One program takes ``BT`` consecutive tokens of one sequence and, per token, every head at once (an
``[BH, R/2]`` tile per half): cos / sin are read once per token whatever the head count, the
broadcast over heads never materializes.
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel

__all__ = ["rope_kernel", "ROPE_CONFIGS"]


@triton.jit(do_not_specialize=["T"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, stride_xb, stride_xt, stride_xh, stride_cb, stride_ct,
                 stride_yb, stride_yt, stride_yh, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                 BH: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr,
                 BACKWARD: tl.constexpr):
    """x, y ``[B, T, H, D]`` (unit feature stride), cos / sin ``[B, T, R]`` (unit feature stride; a
    batch stride of 0 broadcasts). ``BR = next_pow2(R / 2)``, ``BP = next_pow2(D - R)`` (0: no pass-through)."""
    b = tl.program_id(1).to(tl.int64)
    t0 = tl.program_id(0) * BT
    HALF: tl.constexpr = R // 2
    heads = tl.arange(0, BH)
    j = tl.arange(0, BR)
    hmask = heads < H
    jmask = j < HALF
    mask = hmask[:, None] & jmask[None, :]
    xoff = heads.to(tl.int64)[:, None] * stride_xh + j[None, :]
    yoff = heads.to(tl.int64)[:, None] * stride_yh + j[None, :]
    for i in range(BT):
        t = t0 + i
        ok = t < T
        t = tl.minimum(t, T - 1).to(tl.int64)
        cbase = b * stride_cb + t * stride_ct
        c1 = tl.load(cos_ptr + cbase + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + cbase + HALF + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + cbase + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + cbase + HALF + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
        xb = x_ptr + b * stride_xb + t * stride_xt
        yb = y_ptr + b * stride_yb + t * stride_yt
        x1 = tl.load(xb + xoff, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xb + xoff + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(yb + yoff, y1.to(y_ptr.dtype.element_ty), mask=mask & ok)
        tl.store(yb + yoff + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask & ok)
        if BP > 0:
            p = tl.arange(0, BP)
            pmask = hmask[:, None] & (p < D - R)[None, :] & ok
            xp = tl.load(xb + heads.to(tl.int64)[:, None] * stride_xh + R + p[None, :], mask=pmask, other=0.0)
            tl.store(yb + heads.to(tl.int64)[:, None] * stride_yh + R + p[None, :], xp.to(y_ptr.dtype.element_ty),
                     mask=pmask)


# Candidates: a token of q is 32 heads x 128 features (8 KiB of bf16), of k 8 x 128 (2 KiB): 1 to 8
# tokens per program, 2 to 8 warps. The first is the untuned default.
ROPE_CONFIGS = [Config(BT=bt, num_warps=nw, num_stages=ns) for bt, nw, ns in
                [(2, 4, 2), (1, 4, 2), (4, 4, 2), (4, 8, 2), (8, 8, 2), (1, 2, 2), (2, 8, 3), (8, 4, 3)]]

rope_kernel = TritonKernel(_rope_kernel, name="rope", configs=ROPE_CONFIGS, interpret_config=Config(BT=4))
