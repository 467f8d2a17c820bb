"""Fixes for Triton's CPU interpreter (the ``interpret`` backend), applied when it is active.

Both are bugs of Triton 3.4-3.6's interpreter, not of the kernels; without them the interpret
backend fails or computes garbage, so they are applied at import whenever ``TRITON_INTERPRET=1``.
They touch only the interpreter's Python code; compiled GPU launches are unaffected.
"""

import numpy as np

__all__ = ["apply"]


def apply():
    """Work around two interpreter bugs (idempotent).

    1. Scalars are 1-element numpy arrays and ``tensor.__index__`` calls ``int()`` on them, which
       numpy deprecates (1.25) and numpy 2.4 refuses, so ``range(runtime_value)`` loops fail.
       Fix: ``int(data.item())``.
    2. ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns. Fix: widen bf16 to fp32 first
       (products of bf16 values are exact in fp32: the result equals a bf16 dot with fp32 accumulation).
    """
    import triton.runtime.interpreter as interp

    if getattr(interp, "_dflash_compat", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def _patched(tensor, *scope):  # triton 3.6 passes a patch scope; 3.4 patches attributes directly
        patch_tensor(tensor, *scope)
        index = lambda self: int(self.handle.data.item())  # noqa: E731
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index
    interp._patch_lang_tensor = _patched
    create_dot = interp.InterpreterBuilder.create_dot

    def _widen(x):
        if x.dtype == interp.tl.bfloat16:
            return interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), interp.tl.float32)
        return x

    def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)
    interp.InterpreterBuilder.create_dot = _dot
    interp._dflash_compat = True
