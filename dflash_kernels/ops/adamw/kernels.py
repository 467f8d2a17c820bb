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


@triton.jit(do_not_specialize=["n", "beta1", "beta2", "eps", "decay", "step_size", "bc2_sqrt"])
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, hp_ptr, n, beta1, beta2, eps, decay, step_size,
                  bc2_sqrt, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, HP_ON_DEVICE: tl.constexpr,
                  BLOCK: tl.constexpr):
    if HP_ON_DEVICE:  # (1 - lr * wd, lr / bc1, sqrt(bc2)) computed on the device
        decay = tl.load(hp_ptr)
        step_size = tl.load(hp_ptr + 1)
        bc2_sqrt = tl.load(hp_ptr + 2)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


# In place: the tuner's trials (each candidate launched dozens of times on the real tensors) would apply
# the step over and over, so the parameter, the moments and the compute copy are restored after them.
adamw_kernel = TritonKernel(
    _adamw_kernel, name="adamw",
    configs=[Config(BLOCK=b, num_warps=w) for b, w in ((4096, 8), (2048, 4), (8192, 8), (1024, 4))],
    interpret_config=Config(BLOCK=256), restore=("p_ptr", "m_ptr", "v_ptr", "out_ptr"))
