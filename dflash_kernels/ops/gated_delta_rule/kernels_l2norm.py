"""Triton kernels of the row-wise L2 normalization of q and k (``use_qk_l2norm_in_kernel``) and its backward.

y = x * rstd with rstd = 1 / sqrt(sum(x^2) + eps), eps = 1e-6 as in fla and HF transformers.
Backward: dx = rstd * (dy - y * sum(dy * y)). With G > 1 the incoming gradient is ``[R, G, D]``, one
row per value head of the query/key head's group (Hv = G * Hk), summed in a fixed order first.

x is read where it lies: row r = (token n, head h) of ``[N, H, D]`` at ``n * SX + h * D``, so q and k
can be views of a wider projection (the GDN layer's split of its conv output, SX = that width) without
a copy; y, rstd, dy and dx are contiguous.
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel


@triton.jit
def _x_rows(o_r, SX, H: tl.constexpr, D: tl.constexpr):
    """The offset of each row ``o_r`` (int64) of x: token ``o_r // H`` at row stride SX, head ``o_r % H``."""
    return (o_r // H) * SX + (o_r % H) * D


@triton.jit(do_not_specialize=["R"])
def _gdn_l2norm_fwd_kernel(x_ptr, y_ptr, rstd_ptr, R, SX, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           BR: tl.constexpr):
    i_r = tl.program_id(0)
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)
    o_d = tl.arange(0, BD)
    mask = (o_r < R)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x_ptr + (_x_rows(o_r, SX, H, D)[:, None] + o_d[None, :]), mask=mask, other=0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y_ptr + p, (b_x * b_rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + o_r, b_rstd, mask=o_r < R)


@triton.jit(do_not_specialize=["R"])
def _gdn_l2norm_bwd_kernel(x_ptr, rstd_ptr, dy_ptr, dx_ptr, R, SX, H: tl.constexpr, D: tl.constexpr,
                           BD: tl.constexpr, BR: tl.constexpr, G: tl.constexpr = 1):
    i_r = tl.program_id(0)
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)
    o_d = tl.arange(0, BD)
    mask = (o_r < R)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_rstd = tl.load(rstd_ptr + o_r, mask=o_r < R, other=0)
    b_y = tl.load(x_ptr + (_x_rows(o_r, SX, H, D)[:, None] + o_d[None, :]), mask=mask, other=0).to(tl.float32)
    b_y = b_y * b_rstd[:, None]
    p_dy = o_r[:, None] * (G * D) + o_d[None, :]
    b_dy = tl.load(dy_ptr + p_dy, mask=mask, other=0).to(tl.float32)
    for j in tl.static_range(1, G):
        b_dy += tl.load(dy_ptr + p_dy + j * D, mask=mask, other=0).to(tl.float32)
    b_dx = b_rstd[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None])
    tl.store(dx_ptr + p, b_dx.to(dx_ptr.dtype.element_ty), mask=mask)


gdn_l2norm_fwd_kernel = TritonKernel(_gdn_l2norm_fwd_kernel, name="gdn_l2norm_fwd",
                                     configs=[Config(BR=16, num_warps=4), Config(BR=32, num_warps=8)],
                                     interpret_config=Config(BR=16))
gdn_l2norm_bwd_kernel = TritonKernel(_gdn_l2norm_bwd_kernel, name="gdn_l2norm_bwd",
                                     configs=[Config(BR=16, num_warps=4), Config(BR=32, num_warps=8)],
                                     interpret_config=Config(BR=16))
