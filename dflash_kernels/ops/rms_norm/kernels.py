"""Triton kernels of the fused RMSNorm: ``y = x * rstd * (offset + w)``, ``rstd = 1 / sqrt(mean(x^2) + eps)``.

Rows of ``D`` elements (``D`` constexpr, the whole row in one block of ``BD = next_pow2(D)`` columns),
``BM`` rows per program, fp32 math whatever the input dtype.

- forward: one read of ``x``, one write of ``y`` (``x``'s dtype) and of the per-row ``rstd`` (fp32, for
  the backward);
- backward: one read of ``dy``, ``x``, ``rstd``; ``dx = rstd * (w' dy - xhat * mean(xhat * w' dy))``
  with ``xhat = x * rstd``, ``w' = offset + w``. The weight gradient ``sum_rows(dy * xhat)`` is
  accumulated per program over a contiguous range of rows and stored as one fp32 partial row per
  program; the host sums the partials (a fixed-order torch reduction): deterministic, no atomics.

The residual form (``HAS_RES``, pre-norm decoder layers: ``h = x + residual; y = rms_norm(h)``) adds the
residual first, rounds the sum ``h`` to x's dtype (what a plain ``x + residual`` gives), stores it and normalizes
it; its backward (``HAS_DRES``) adds the gradient that reaches ``h`` from its other reader (the residual
stream) to the norm's; that sum is the gradient of both ``x`` and ``residual``, stored once per input that
needs it (``HAS_DX2``: a second buffer, so the two gradients never share storage).

The gated form (``HAS_GATE``, the output norm of Gated DeltaNet layers) multiplies ``y`` by
``silu(gate)``: ``y = n * silu(g)``, ``n = xhat * w'``; backward ``dg = dy * n * silu'(g)`` and the norm's
backward with ``dy * silu(g)``. ``ROUND`` reproduces transformers' ``RMSNormGated`` roundings in the
forward: 1 rounds ``xhat`` to x's dtype before the weight, 2 also rounds the product ``n`` (a weight in x's
dtype); the backward treats the roundings as identities, as autograd does for the casts.

Two tunings per kernel: narrow rows (``D <= 512``: the q/k head norms, many rows per program) and wide
rows (the hidden-size norms, one to four rows per program).
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel

__all__ = ["rms_norm_fwd_narrow", "rms_norm_fwd_wide", "rms_norm_bwd_narrow", "rms_norm_bwd_wide", "NARROW_D",
           "FWD_NARROW_CONFIGS", "FWD_WIDE_CONFIGS", "BWD_NARROW_CONFIGS", "BWD_WIDE_CONFIGS"]

NARROW_D = 512  # rows up to this width take the narrow tuning


@triton.jit
def _silu(g):
    """SiLU in fp32 as torch computes it: ``g / (1 + exp(-g))``."""
    return g / (1.0 + tl.exp(-g))


@triton.jit(do_not_specialize=["N"])
def _rms_norm_fwd_kernel(x_ptr, w_ptr, g_ptr, y_ptr, rstd_ptr, N, stride_x, stride_g, stride_y, eps, offset,
                         r_ptr, h_ptr, stride_r, stride_h,
                         D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, HAS_GATE: tl.constexpr,
                         ROUND: tl.constexpr, HAS_RES: tl.constexpr = False):
    """x ``[N, D]`` (row stride ``stride_x``), w ``[D]``, y ``[N, D]`` (row stride ``stride_y``), rstd ``[N]``
    fp32; with ``HAS_GATE`` the gate ``[N, D]`` (row stride ``stride_g``); with ``HAS_RES`` the residual
    ``[N, D]`` (``stride_r``) and the sum ``h`` ``[N, D]`` written (``stride_h``, x's dtype)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    cols = tl.arange(0, BD)
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # h = x + residual, rounded once to x's dtype (a plain add's result), then normalized
        r = tl.load(r_ptr + r64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + r64[:, None] * stride_h + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    xhat = x * rstd[:, None]
    if ROUND >= 1:
        xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = xhat * w[None, :]
    if ROUND >= 2:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_GATE:
        g = tl.load(g_ptr + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * _silu(g)
    tl.store(y_ptr + r64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["N", "rows_per_program"])
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dg_ptr, dw_ptr, N, rows_per_program,
                         stride_dy, stride_x, stride_g, stride_dx, stride_dg, offset, dr_ptr, stride_dr,
                         dx2_ptr, stride_dx2,
                         D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, HAS_DW: tl.constexpr,
                         HAS_GATE: tl.constexpr, HAS_DRES: tl.constexpr = False, HAS_DX2: tl.constexpr = False):
    """dy, x, dx ``[N, D]`` (row strides), rstd ``[N]`` fp32; dw ``[programs, D]`` fp32 partial sums
    (``HAS_DW``); with ``HAS_GATE`` the gate and its gradient ``[N, D]``; with ``HAS_DRES`` the gradient
    ``[N, D]`` (``stride_dr``) added to dx; with ``HAS_DX2`` dx is also stored to ``dx2`` ``[N, D]``
    (``stride_dx2``): the residual form's two inputs get gradients of their own, never one shared
    buffer. Program ``p`` handles rows ``[p * rows_per_program, (p + 1) * rows_per_program)``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        rmask = rows < end
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)
        dy = tl.load(dy_ptr + r64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        if HAS_GATE:  # y = n * silu(g): dg = dy * n * silu'(g), and the norm sees dy * silu(g)
            g = tl.load(g_ptr + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sg = 1.0 / (1.0 + tl.exp(-g))
            dg = dy * (xhat * w[None, :]) * (sg * (1.0 + g * (1.0 - sg)))
            tl.store(dg_ptr + r64[:, None] * stride_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
            dy = dy * (g * sg)
        wdy = dy * w[None, :]
        c = tl.sum(xhat * wdy, axis=1) / D
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(dr_ptr + r64[:, None] * stride_dr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + r64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DX2:
            tl.store(dx2_ptr + r64[:, None] * stride_dx2 + cols[None, :], dx.to(dx2_ptr.dtype.element_ty), mask=mask)
        if HAS_DW:
            acc += dy * xhat
    if HAS_DW:
        tl.store(dw_ptr + pid.to(tl.int64) * D + cols, tl.sum(acc, axis=0), mask=cmask)


# Candidates. Narrow rows (q/k norms, D = 64..256, 10^5 rows and more): tiles of 1K to 8K elements, so
# that a program moves 2 to 16 KiB. Wide rows (D = 1K..8K): one to four rows, 4 to 16 warps (16 to 32
# fp32 elements of a tile per thread at D = 2560). The first of each list is the untuned default. On
# sm_90 the narrow backward spills from 32 rows per 4 warps on (compiled without a GPU by
# tests/ops/test_rms_norm.py through tools/studies/sm90_resources.compile_resources).
FWD_NARROW_CONFIGS = [Config(BM=bm, num_warps=nw, num_stages=1) for bm, nw in
                      [(16, 4), (32, 4), (8, 4), (64, 8), (32, 8), (8, 2), (128, 8)]]
FWD_WIDE_CONFIGS = [Config(BM=bm, num_warps=nw, num_stages=1) for bm, nw in
                    [(1, 8), (1, 4), (2, 8), (4, 8), (1, 16), (2, 16), (4, 16)]]
BWD_NARROW_CONFIGS = [Config(BM=bm, num_warps=nw, num_stages=ns) for bm, nw, ns in
                      [(8, 4, 2), (16, 8, 2), (16, 4, 2), (32, 8, 2), (64, 16, 1), (8, 2, 2)]]
BWD_WIDE_CONFIGS = [Config(BM=bm, num_warps=nw, num_stages=ns) for bm, nw, ns in
                    [(1, 8, 2), (1, 4, 2), (2, 8, 2), (1, 16, 2), (2, 16, 1), (4, 16, 1)]]

rms_norm_fwd_narrow = TritonKernel(_rms_norm_fwd_kernel, name="rms_norm_fwd_narrow", configs=FWD_NARROW_CONFIGS,
                                   interpret_config=Config(BM=16))
rms_norm_fwd_wide = TritonKernel(_rms_norm_fwd_kernel, name="rms_norm_fwd_wide", configs=FWD_WIDE_CONFIGS,
                                 interpret_config=Config(BM=4))
rms_norm_bwd_narrow = TritonKernel(_rms_norm_bwd_kernel, name="rms_norm_bwd_narrow", configs=BWD_NARROW_CONFIGS,
                                   interpret_config=Config(BM=16))
rms_norm_bwd_wide = TritonKernel(_rms_norm_bwd_kernel, name="rms_norm_bwd_wide", configs=BWD_WIDE_CONFIGS,
                                 interpret_config=Config(BM=4))
