"""Argument checks of ``rms_norm``: errors name the argument and the value seen."""

import math
import numbers

from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["check_rms_norm", "check_gate", "check_residual", "MAX_D"]

MAX_D = 16384  # one row is one block of the kernels


def _real(name, v, positive=False):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise TypeError(f"{name}: expected a finite number, got {v!r}")
    if positive and float(v) < 0:
        raise ValueError(f"{name}: expected a number >= 0, got {v!r}")
    return float(v)


def check_rms_norm(x, weight, eps, offset):
    """Returns ``(eps, offset)`` as floats."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., D] with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    if D > MAX_D:
        raise ValueError(f"x: the last dim D={D} is above the supported {MAX_D}")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    if weight.shape[0] != D:
        raise ValueError(f"weight: expected shape [D={D}], got {tuple(weight.shape)}")
    check_same_device(x=x, weight=weight)
    return _real("eps", eps, positive=True), _real("offset", offset)


def check_gate(x, gate):
    """The gate of ``rms_norm_gated``: a float tensor of ``x``'s shape on its device."""
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    check_same_device(x=x, gate=gate)


def check_residual(x, residual):
    """The residual of ``fused_add_rms_norm``: a tensor of ``x``'s shape and dtype on its device."""
    check_tensor("residual", residual, dtypes=FLOAT_DTYPES)
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual: expected x's dtype {x.dtype}, got {residual.dtype}")
    check_same_device(x=x, residual=residual)
