"""Triton kernel of the fused AdamW step over one parameter tensor (flattened).

One read of the fp32 parameter, the gradient (any float dtype: bf16 gradients of bf16 compute copies
are read as they are, no fp32 copy first), the fp32 moments; one write of the parameter and the moments,
and optionally of the parameter rounded to a compute dtype (the bf16 copy the next forward uses, instead
of autocast casting the fp32 weight in every forward). The math is torch's fused AdamW (decoupled weight
decay) in fp32:

    p *= 1 - lr * wd;   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

with ``g`` divided by ``*scale`` first when a scale is given (the gradient clip's ``1 / coef``, a device
scalar: no host synchronization). ``1 - lr * wd``, ``lr / bc1`` and ``sqrt(bc2)`` come as host numbers or,
with ``HP_ON_DEVICE``, from a device row of three fp32 values (a learning rate and step count that live on
the device: the step can be recorded into a CUDA graph).
"""

import triton
import triton.language as tl

from dflash_kernels.runtime import Config, TritonKernel

__all__ = ["adamw_kernel"]


@triton.jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(ptr + offs)
    return x


@triton.jit
def _store(ptr, offs, x, n, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=offs < n)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, offs, n, beta1, beta2, eps, decay, step_size,
                 bc2_sqrt, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, MASKED: tl.constexpr):
    p = _load(p_ptr, offs, n, MASKED)
    g = _load(g_ptr, offs, n, MASKED).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    m = _load(m_ptr, offs, n, MASKED)
    v = _load(v_ptr, offs, n, MASKED)
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    _store(p_ptr, offs, p, n, MASKED)
    _store(m_ptr, offs, m, n, MASKED)
    _store(v_ptr, offs, v, n, MASKED)
    if HAS_OUT:
        _store(out_ptr, offs, p.to(out_ptr.dtype.element_ty), n, MASKED)


# ``n`` is not specialized (one compiled kernel for every size), so the compiler cannot prove a block's mask
# uniform over a vector and a masked access is a scalar one: every block but the last runs unmasked, with
# 16-byte accesses, which an elementwise kernel bound by memory bandwidth needs (benchmarks/results/README.md).
@triton.jit(do_not_specialize=["n", "beta1", "beta2", "eps", "decay", "step_size", "bc2_sqrt"])
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, hp_ptr, n, beta1, beta2, eps, decay, step_size,
                  bc2_sqrt, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, HP_ON_DEVICE: tl.constexpr,
                  BLOCK: tl.constexpr):
    if HP_ON_DEVICE:  # (1 - lr * wd, lr / bc1, sqrt(bc2)) computed on the device
        decay = tl.load(hp_ptr)
        step_size = tl.load(hp_ptr + 1)
        bc2_sqrt = tl.load(hp_ptr + 2)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, offs, n, beta1, beta2, eps, decay, step_size,
                     bc2_sqrt, HAS_OUT, HAS_SCALE, False)
    else:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, offs, n, beta1, beta2, eps, decay, step_size,
                     bc2_sqrt, HAS_OUT, HAS_SCALE, True)


# In place: the tuner's trials (each candidate launched dozens of times on the real tensors) would apply
# the step over and over, so the parameter, the moments and the compute copy are restored after them.
adamw_kernel = TritonKernel(
    _adamw_kernel, name="adamw",
    configs=[Config(BLOCK=b, num_warps=w) for b, w in ((1024, 4), (2048, 4), (4096, 8), (4096, 4))],
    interpret_config=Config(BLOCK=256), restore=("p_ptr", "m_ptr", "v_ptr", "out_ptr"))
