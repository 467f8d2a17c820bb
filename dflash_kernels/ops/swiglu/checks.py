"""Argument checks of ``swiglu`` / ``swiglu_packed``: errors name the argument and the value seen."""

from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["check_swiglu", "check_swiglu_packed"]


def check_swiglu(gate, up):
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, dtypes=FLOAT_DTYPES)
    if gate.dim() < 1:
        raise ValueError(f"gate: expected shape [..., C], got {tuple(gate.shape)}")
    if up.shape != gate.shape:
        raise ValueError(f"up: shape {tuple(up.shape)} differs from gate's {tuple(gate.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up: dtype {up.dtype} differs from gate's {gate.dtype}")
    check_same_device(gate=gate, up=up)


def check_swiglu_packed(x):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: expected shape [..., 2C] (gate then up on the last dim), got {tuple(x.shape)}")
