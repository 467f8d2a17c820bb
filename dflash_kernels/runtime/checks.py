"""Argument checks for the public functionals: errors name the argument and the value seen."""

import torch

__all__ = ["check_tensor", "check_same_device", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name, t, ndim=None, dtypes=None, optional=False):
    """Raise TypeError/ValueError unless ``t`` is a tensor of rank ``ndim`` and one of ``dtypes``."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name}: expected a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected one of {list(dtypes)}")


def check_same_device(**tensors):
    """Raise ValueError when the given (non-None) tensors are not all on one device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: is on {t.device} but {first_name} is on {first.device}; "
                             f"all inputs must be on one device")
