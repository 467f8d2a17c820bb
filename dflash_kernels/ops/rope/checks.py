"""Argument checks of ``apply_rope``: errors name the argument and the value seen."""

from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["check_rope"]


def check_rope(x, cos, sin):
    """Returns ``cos, sin`` as ``[B or 1, T, R]`` views."""
    check_tensor("x", x, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, H, D = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    if cos.shape != sin.shape:
        raise ValueError(f"sin: shape {tuple(sin.shape)} differs from cos's {tuple(cos.shape)}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"sin: dtype {sin.dtype} differs from cos's {cos.dtype}")
    if cos.dim() == 4:
        if cos.shape[2] != 1:
            raise ValueError(f"cos: expected shape [B, T, 1, R] (one value for every head), got {tuple(cos.shape)}")
        cos, sin = cos[:, :, 0], sin[:, :, 0]
    R = cos.shape[-1]
    if cos.shape[0] not in (1, B) or cos.shape[1] != T or R % 2 or R == 0 or R > D:
        raise ValueError(f"cos: expected shape [B={B} or 1, T={T}, R] with R even and 2 <= R <= D={D}, "
                         f"got {tuple(cos.shape)}")
    check_same_device(x=x, cos=cos, sin=sin)
    return cos, sin
