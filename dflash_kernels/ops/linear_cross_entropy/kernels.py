"""Triton kernel of the fused LM head + cross-entropy: the per-row pass over one chunk of logits.

The logits of a chunk of rows come from cuBLAS (``linear_cross_entropy.py``); this kernel reads them
once to get each row's log-sum-exp, its loss and its argmax, and, when a gradient is wanted, a second
time to overwrite them in place with the gradient of the row's cross-entropy with respect to the
logits, ``(softmax - onehot(label))`` times the softcap derivative. That gradient is left unscaled
(entries in [-1, 1]): the per-row loss weight and the reduction's scale are applied to the GEMM
results by the host code, so no small probability underflows in fp16 and the gradient keeps full
relative precision in any input dtype.

``BR`` rows per program (1 on the GPU, where a row is long; 16 in the interpreter, whose cost is per
operation), sweeping the vocabulary in blocks of ``BV``:
- first sweep (fp32): the running max is one value per row and block, the running sum of
  exponentials a per-lane vector rescaled by ``exp(m_old - m_new)``, so each element costs one
  exponential and each block one reduction; the argmax is a per-lane (value, first index) pair
  reduced once at the end, which keeps torch's first-occurrence rule;
- second sweep (``GRAD``): one exponential per element, stored in the logits' dtype. It runs over the
  row's blocks in reverse: the end of the row, which sweep 1 read last, is the part most likely still in
  L2 (sweep 1 loads ``evict_last``; sweep 2's loads and stores, never read again by this kernel,
  ``evict_first``). A ``real``-preset chunk is 1,024 rows of 485 KiB each against 50 MB of L2, so
  without it sweep 2 read almost every byte from HBM a second time.

``V`` and the row stride are specialized (not in ``do_not_specialize``): when they are multiples of 16
(every common vocabulary: 32768, 128256, 151936, 248320, ...) the compiler knows each row starts 16-byte
aligned and the column mask is constant over 16 columns, so loads and stores are 16-byte vectors; an
odd vocabulary compiles a variant with scalar accesses (correct, slower).

Rows whose label equals ``ignore_index`` get loss 0 and a zero gradient row. A label outside
``[0, V)`` that is not ``ignore_index`` cannot be reported without a host sync, so its row's loss
and gradient are NaN: the mean loss shows it.
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel

__all__ = ["linear_ce_rows", "ROWS_CONFIGS"]


@triton.jit
def _tanh(x):
    # tanh through one exponential: the same code compiled and interpreted; saturates to +-1 on overflow.
    return 1.0 - tl.fdiv(2.0, tl.exp(2.0 * x) + 1.0)


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _linear_ce_rows_kernel(logits_ptr, labels_ptr, weights_ptr, loss_ptr, lse_ptr, argmax_ptr,
                           n_rows, V, stride_row, ignore_index, softcap,
                           BR: tl.constexpr, BV: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SOFTCAP: tl.constexpr,
                           ARGMAX: tl.constexpr, GRAD: tl.constexpr):
    """logits ``[n_rows, V]`` (row stride ``stride_row``, unit column stride), read and, with ``GRAD``,
    overwritten by the unscaled logits gradient; labels ``[n_rows]`` (int32/int64); weights ``[n_rows]``
    fp32 (``HAS_WEIGHTS``); outputs loss ``[n_rows]`` fp32 (``w * ce``, 0 at ignored rows), lse
    ``[n_rows]`` fp32 and argmax ``[n_rows]`` int64 (``ARGMAX``). ``BR`` rows per program."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    # Rows past the end re-read the last row (loads need no row mask); only masked stores use rmask.
    rows = tl.minimum(rows, n_rows - 1)
    base = logits_ptr + rows.to(tl.int64)[:, None] * stride_row
    label = tl.load(labels_ptr + rows).to(tl.int64)
    ignored = label == ignore_index
    bad = (label < 0) | (label >= V)
    bad = bad & (ignored == 0)
    cols = tl.arange(0, BV)
    inv_cap = 1.0 / softcap

    # ---- sweep 1: max, sum of exponentials, argmax
    m = tl.full([BR], float("-inf"), tl.float32)
    s_vec = tl.zeros([BR, BV], dtype=tl.float32)
    best_vec = tl.full([BR, BV], float("-inf"), tl.float32)
    idx_vec = tl.zeros([BR, BV], dtype=tl.int32)
    for v0 in range(0, V, BV):
        offs = v0 + cols
        cmask = offs < V
        x = tl.load(base + offs[None, :], mask=cmask[None, :], other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32)
        if SOFTCAP:
            x = tl.where(cmask[None, :], softcap * _tanh(x * inv_cap), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s_vec = s_vec * tl.exp(m - m_new)[:, None] + tl.exp(x - m_new[:, None])
        m = m_new
        if ARGMAX:
            better = x > best_vec  # strict: a lane keeps its first index of a tie
            best_vec = tl.where(better, x, best_vec)
            idx_vec = tl.where(better, offs[None, :], idx_vec)
    lse = m + tl.log(tl.sum(s_vec, axis=1))

    safe_label = tl.where(ignored | bad, 0, label)
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_row
    x_label = tl.load(row_ptr + safe_label).to(tl.float32)
    if SOFTCAP:
        x_label = softcap * _tanh(x_label * inv_cap)
    ce = lse - x_label
    if HAS_WEIGHTS:
        ce = ce * tl.load(weights_ptr + rows)
    ce = tl.where(ignored, 0.0, ce)
    ce = tl.where(bad, float("nan"), ce)
    tl.store(loss_ptr + rows, ce, mask=rmask)
    tl.store(lse_ptr + rows, lse, mask=rmask)
    if ARGMAX:
        best = tl.max(best_vec, axis=1)
        first = tl.min(tl.where(best_vec == best[:, None], idx_vec, V), axis=1)
        tl.store(argmax_ptr + rows, first.to(tl.int64), mask=rmask)

    # ---- sweep 2: the unscaled gradient of each row's cross-entropy, in place
    if GRAD:
        keep = tl.where(ignored, 0.0, 1.0)
        keep = tl.where(bad, float("nan"), keep)
        target = tl.where(ignored | bad, -1, label).to(tl.int32)  # a 32-bit compare per element
        n_blocks = tl.cdiv(V, BV)
        for i in range(0, n_blocks):
            # last block first: the end of the row, read last by sweep 1, is the part most likely still in L2
            offs = (n_blocks - 1 - i) * BV + cols
            cmask = offs < V
            x = tl.load(base + offs[None, :], mask=cmask[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            if SOFTCAP:
                t = _tanh(x * inv_cap)
                x = softcap * t
            p = tl.exp(x - lse[:, None])
            p = tl.where(offs[None, :] == target[:, None], p - 1.0, p)
            if SOFTCAP:
                p = p * (1.0 - t * t)
            tl.store(base + offs[None, :], (p * keep[:, None]).to(logits_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :], eviction_policy="evict_first")


# Candidates: a row of the real vocabulary (248,320 columns) is 485 KiB of bf16, so every config
# streams; they differ in bytes in flight per program (BV / threads), in programs per SM (registers:
# sm_90 compiles with V % 16 == 0 give 48 to 97 per thread, no spills, 16-byte accesses; BV / threads
# = 32 needs over 200 or spills) and in loop pipelining.
ROWS_CONFIGS = [Config(BR=br, BV=bv, num_warps=nw, num_stages=ns) for br, bv, nw, ns in
                [(1, 2048, 8, 4), (1, 4096, 8, 2), (1, 2048, 4, 3), (1, 4096, 16, 3), (1, 8192, 16, 2),
                 (1, 1024, 4, 4), (1, 4096, 8, 4), (2, 2048, 8, 3), (1, 8192, 32, 2)]]

# In place on the logits when GRAD: tuning trials restore them after timing.
linear_ce_rows = TritonKernel(
    _linear_ce_rows_kernel, name="linear_ce_rows",
    configs=ROWS_CONFIGS,
    interpret_config=Config(BR=16, BV=256),  # few programs: the interpreter's cost is per op
    restore=("logits_ptr",),
)
