"""Argument checks of ``linear_cross_entropy``: errors name the argument and the value seen."""

import math
import numbers

import torch

from dflash_kernels.runtime.autograd import traced
from dflash_kernels.runtime.checks import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["check_arguments", "check_label_range", "REDUCTIONS", "LABEL_DTYPES"]

REDUCTIONS = ("mean", "sum", "none")
LABEL_DTYPES = (torch.int64, torch.int32)


def check_arguments(hidden, weight, labels, bias, weights, ignore_index, reduction, softcap):
    """Shapes, dtypes, devices and the scalar options. Returns ``(N, H, V, softcap as float or None)``."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden: expected shape [..., H] with H >= 1, got {tuple(hidden.shape)}")
    H = hidden.shape[-1]
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    V = weight.shape[0]
    if weight.shape[1] != H or V == 0:
        raise ValueError(f"weight: expected shape [V, H={H}] with V >= 1, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}; "
                        f"cast one of them (the GEMMs run in one input dtype)")
    check_tensor("labels", labels, dtypes=LABEL_DTYPES)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(hidden.shape[:-1])} (hidden's without H), "
                         f"got {tuple(labels.shape)}")
    check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, optional=True)
    if bias is not None:
        if bias.shape[0] != V:
            raise ValueError(f"bias: expected shape [V={V}], got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from weight's {weight.dtype}")
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES + (torch.float64,), optional=True)
    if weights is not None and tuple(weights.shape) != tuple(labels.shape):
        raise ValueError(f"weights: expected one weight per row, shape {tuple(labels.shape)}, "
                         f"got {tuple(weights.shape)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {list(REDUCTIONS)}, got {reduction!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap: expected None or a positive finite number, got {softcap!r}")
        softcap = float(softcap)
        if not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap: expected None or a positive finite number, got {softcap!r}")
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias, weights=weights)
    return labels.numel(), H, V, softcap


def check_label_range(labels, V, ignore_index):
    """Labels in ``[0, V)`` or equal to ``ignore_index``. Checked on the CPU only: on a GPU it would
    cost a host sync per call (there a bad label makes its row's loss NaN instead)."""
    if labels.device.type != "cpu" or labels.numel() == 0 or traced((labels,)):
        return
    bad = ((labels < 0) | (labels >= V)) & (labels != ignore_index)
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise ValueError(f"labels: values must lie in [0, V={V}) or equal ignore_index={ignore_index}; "
                         f"got {int(labels.reshape(-1)[i])} at flat index {i}")
