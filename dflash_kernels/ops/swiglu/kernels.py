"""Triton kernels of SwiGLU, ``y = silu(gate) * up`` (``silu(g) = g * sigmoid(g)``), and its backward
``dgate = dy * up * s * (1 + g * (1 - s))``, ``dup = dy * silu(g)`` (``s = sigmoid(g)``, recomputed from
the saved ``gate``), fp32 math, one rounding to the output dtype.

Rows ``[N, C]`` with a row stride per tensor (unit column stride), so that the two halves of one
concatenated ``[N, 2C]`` projection are read and written in place. Tiles of ``BM`` rows by ``BC``
columns; rows on grid axis 0 (no 65,535 limit there).
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel

__all__ = ["swiglu_fwd_kernel", "swiglu_bwd_kernel", "SWIGLU_CONFIGS"]


@triton.jit(do_not_specialize=["N"])
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, N, C, stride_g, stride_u, stride_y, BM: tl.constexpr,
                       BC: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    y = g * s * u
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, C, stride_dy, stride_g, stride_u, stride_dg,
                       stride_du, BM: tl.constexpr, BC: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = g * s
    dg = dy * u * (s * (1.0 + g * (1.0 - s)))
    du = dy * silu
    tl.store(dg_ptr + rows[:, None] * stride_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + rows[:, None] * stride_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


# Candidates: streaming tiles of 1K to 8K elements (2 to 16 KiB of bf16 per tensor), 4 or 8 warps,
# 8 to 32 elements per thread (16-byte accesses when C and the row strides are multiples of 8).
SWIGLU_CONFIGS = [Config(BM=bm, BC=bc, num_warps=nw, num_stages=1) for bm, bc, nw in
                  [(4, 1024, 8), (1, 2048, 8), (2, 1024, 4), (8, 512, 8), (1, 1024, 4), (4, 2048, 8),
                   (8, 1024, 8), (2, 4096, 16)]]

swiglu_fwd_kernel = TritonKernel(_swiglu_fwd_kernel, name="swiglu_fwd", configs=SWIGLU_CONFIGS,
                                 interpret_config=Config(BM=8, BC=64))
swiglu_bwd_kernel = TritonKernel(_swiglu_bwd_kernel, name="swiglu_bwd", configs=SWIGLU_CONFIGS,
                                 interpret_config=Config(BM=8, BC=64))
