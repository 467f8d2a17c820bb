"""Fused AdamW step over a list of fp32 parameters: gradients in any float dtype, an optional device-side
gradient scale (the clip), optional compute-dtype copies written in the same pass (``kernels.py``)."""

import math

import torch

from dflash_kernels.ops.adamw.kernels import adamw_kernel
from dflash_kernels.runtime import Op, bucket, cdiv, register_precompile

__all__ = ["fused_adamw_", "device_hparams"]

_op = Op("adamw")


def _check(params, grads, exp_avgs, exp_avg_sqs, compute_copies, grad_scale, lr, beta1, beta2, eps, weight_decay,
           step):
    n = len(params)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)) + (
            (("compute_copies", compute_copies),) if compute_copies is not None else ()):
        if len(seq) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per parameter), got {len(seq)}")
    for i, p in enumerate(params):
        for name, t, fp32 in (("params", p, True), ("grads", grads[i], False), ("exp_avgs", exp_avgs[i], True),
                              ("exp_avg_sqs", exp_avg_sqs[i], True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}]: expected a tensor, got {type(t).__name__}")
            if fp32 and t.dtype != torch.float32:
                raise TypeError(f"{name}[{i}]: dtype {t.dtype}, expected torch.float32")
            if not t.is_floating_point():
                raise TypeError(f"{name}[{i}]: dtype {t.dtype}, expected a float dtype")
            if t.shape != p.shape:
                raise ValueError(f"{name}[{i}]: shape {tuple(t.shape)} != the parameter's {tuple(p.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}]: must be contiguous")
            if t.device != p.device:
                raise ValueError(f"{name}[{i}]: on {t.device}, the parameter on {p.device}")
        if compute_copies is not None and compute_copies[i] is not None:
            c = compute_copies[i]
            if c.shape != p.shape or not c.is_contiguous() or c.device != p.device or not c.is_floating_point():
                raise ValueError(f"compute_copies[{i}]: expected a contiguous float tensor of shape "
                                 f"{tuple(p.shape)} on {p.device}, got {c.dtype} {tuple(c.shape)} on {c.device}")
    if grad_scale is not None and (grad_scale.numel() != 1 or not grad_scale.is_floating_point()):
        raise ValueError(f"grad_scale: expected a one-element float tensor, got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)}")
    dev = params[0].device if params else None
    if isinstance(lr, torch.Tensor):  # its value is on the device: not read back (no synchronization)
        _check_device_scalar("lr", lr, dev)
        hosted = ()
    else:
        hosted = (("lr", lr, 0, math.inf),)
    # below 1, as torch's AdamW: beta1 = 1 divides by a zero bias correction, beta2 = 1 makes every parameter
    # NaN (0 / 0 in the second moment's correction)
    for name, x in (("beta1", beta1), ("beta2", beta2)):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x < 1:
            raise ValueError(f"{name}: expected a finite number in [0, 1), got {x!r}")
    for name, x, lo, hi in hosted + (("eps", eps, 0, math.inf), ("weight_decay", weight_decay, 0, math.inf)):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not (lo <= x <= hi) or not math.isfinite(x):
            raise ValueError(f"{name}: expected a finite number in [{lo}, {hi}], got {x!r}")
    if isinstance(step, (list, tuple)):
        if len(step) != n:
            raise ValueError(f"step: expected {n} tensors (one per parameter), got {len(step)}")
        for i, t in enumerate(step):
            _check_device_scalar(f"step[{i}]", t, dev)
    elif isinstance(step, torch.Tensor):
        _check_device_scalar("step", step, dev)
    elif not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step: expected an int >= 1 (the step being taken), got {step!r}")


def _check_device_scalar(name, t, dev):
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a number or a one-element float tensor, got {got}")
    if dev is not None and t.device != dev:
        raise ValueError(f"{name}: on {t.device}, the parameters on {dev}")


def device_hparams(n, lr, step, beta1, beta2, weight_decay, device):
    """``[n, 4]`` fp32 rows ``(1 - lr * wd, lr / bc1, sqrt(bc2), 0)`` computed on ``device`` from a device-tensor
    ``lr`` and/or ``step`` (one tensor, or one per parameter): a few small kernels, no read-back. The bias
    corrections ``1 - beta ** step`` in fp64, as torch's capturable fused AdamW computes them. Four columns,
    not three: every row starts 16-byte aligned, so the kernel's key (which holds its pointers' alignment)
    is the same for every parameter, whatever its index in the list (as a precompile's scratch list has it)."""
    f64 = dict(dtype=torch.float64, device=device)
    if isinstance(step, (list, tuple)):
        s = torch.stack([t.reshape(()) for t in step]).to(**f64)
    elif isinstance(step, torch.Tensor):
        s = step.reshape(1).to(**f64).expand(n)
    else:
        s = torch.full((n,), float(step), **f64)
    lr = lr.reshape(()).to(**f64) if isinstance(lr, torch.Tensor) else torch.tensor(float(lr), **f64)
    bc1 = 1 - torch.pow(beta1, s)
    bc2 = 1 - torch.pow(beta2, s)
    return torch.stack([(1 - lr * weight_decay).expand(n), lr / bc1, bc2.sqrt(), torch.zeros_like(bc1)],
                       1).to(torch.float32)


@_op.impl("reference")
def _reference(*args, **kwargs):
    from dflash_kernels.ops.adamw.naive import naive_adamw_
    return naive_adamw_(*args, **kwargs)


@_op.impl("triton", "interpret")
def _kernels(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step, grad_scale=None,
             compute_copies=None):
    on_device = isinstance(lr, torch.Tensor) or not isinstance(step, int)
    if on_device:
        hp = device_hparams(len(params), lr, step, beta1, beta2, weight_decay, params[0].device)
        decay = step_size = bc2_sqrt = 1.0  # unused: the kernel reads its row of hp
    else:
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
        decay, step_size, bc2_sqrt = 1 - lr * weight_decay, lr / bc1, math.sqrt(bc2)
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        out = compute_copies[i] if compute_copies is not None else None
        adamw_kernel(lambda m, n=n: (cdiv(n, m["BLOCK"]),), p, grads[i], exp_avgs[i], exp_avg_sqs[i],
                     p if out is None else out, p if grad_scale is None else grad_scale, hp[i] if on_device else p,
                     n, beta1, beta2, eps, decay, step_size, bc2_sqrt, bucket=(bucket(n, cap=1 << 26),),
                     HAS_OUT=out is not None, HAS_SCALE=grad_scale is not None, HP_ON_DEVICE=on_device)


def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 step, grad_scale=None, compute_copies=None):
    """One AdamW step (torch's math, decoupled weight decay), in place.

    Args:
        params, exp_avgs, exp_avg_sqs: lists of contiguous fp32 tensors, one shape per parameter.
        grads: the gradients, contiguous, any float dtype (bf16 gradients of bf16 compute copies are
            read as they are).
        lr: a host number, or a one-element float tensor on the parameters' device (its value is read on the
            device only: the step can be recorded into a CUDA graph and replayed as the value changes).
        beta1, beta2: host numbers in [0, 1) (as torch's AdamW).
        eps, weight_decay: host numbers >= 0.
        step: the step being taken (1 first), for the bias corrections: an int, or (device-side, as ``lr``) a
            one-element float tensor or a list of them, one per parameter (torch's capturable ``state["step"]``).
        grad_scale: optional one-element device tensor; each gradient is divided by it first (the
            gradient clip's ``1 / coef``: no host synchronization).
        compute_copies: optional list (entries may be None) of tensors that receive the updated parameter
            rounded to their dtype in the same pass (the bf16 weights the next forward uses).

    Returns:
        None: ``params``, ``exp_avgs``, ``exp_avg_sqs`` and ``compute_copies`` are updated in place. Bad
        arguments raise ValueError / TypeError naming the list and index.
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, compute_copies, grad_scale, lr, beta1, beta2, eps,
           weight_decay, step)
    if not params:
        return
    _op(params[0].device, params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, grad_scale=grad_scale, compute_copies=compute_copies)


def _dtype(name, x):
    if x is None or isinstance(x, torch.dtype):
        return x
    if isinstance(x, str) and isinstance(getattr(torch, x.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, x.removeprefix("torch."))
    raise ValueError(f"{name}: expected a torch dtype or its name, got {x!r}")


@register_precompile("adamw")
def _precompile_adamw(shape: dict, dtype, device, backward: bool):
    """Run one step on scratch tensors (never on live parameters: the step is in place). ``shape``:
    ``tensors``, a list of ``{"numel", "grad_dtype" (default ``dtype``), "copy_dtype" (default None: no
    compute copy)}``, one per parameter as the real step passes them; ``grad_scale`` (bool, default False)
    and ``device_hparams`` (bool, default False: lr and step as host numbers; True: device tensors, the
    capturable step). ``dtype`` is the parameters' (fp32). Kernels are cached per size bucket, so
    ``tensors`` needs one entry per distinct (size bucket, grad dtype, copy dtype), not per parameter."""
    tensors = shape.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"shape['tensors']: expected a non-empty list of {{'numel': ...}}, got {tensors!r}")
    ps, gs, cs = [], [], []
    for i, t in enumerate(tensors):
        n = t.get("numel") if isinstance(t, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"shape['tensors'][{i}]['numel']: expected an int >= 1, got {n!r}")
        gd = _dtype(f"shape['tensors'][{i}]['grad_dtype']", t.get("grad_dtype", dtype))
        cd = _dtype(f"shape['tensors'][{i}]['copy_dtype']", t.get("copy_dtype"))
        ps.append(torch.zeros(n, dtype=dtype, device=device))
        gs.append(torch.zeros(n, dtype=gd, device=device))
        cs.append(None if cd is None else torch.empty(n, dtype=cd, device=device))
    scale = torch.ones(1, dtype=torch.float32, device=device) if shape.get("grad_scale") else None
    if shape.get("device_hparams"):
        lr = torch.full((1,), 1e-3, dtype=torch.float32, device=device)
        step = [torch.ones((), dtype=torch.float32, device=device) for _ in ps]
    else:
        lr, step = 1e-3, 1
    fused_adamw_(ps, gs, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], lr=lr, step=step,
                 grad_scale=scale, compute_copies=cs if any(c is not None for c in cs) else None)
