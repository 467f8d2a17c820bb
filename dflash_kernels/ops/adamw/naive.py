"""The plain fp32 PyTorch reference of the fused AdamW step (the ``reference`` backend)."""

import math


__all__ = ["naive_adamw_"]


def naive_adamw_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                 grad_scale=None, compute_copies=None):
    """In place, tensor by tensor, in fp32: the math of ``kernels.py`` (torch's AdamW). ``lr`` and ``step`` may
    be device tensors (``step`` one per parameter): read back here."""
    lr = float(lr)
    steps = [int(float(t)) for t in step] if isinstance(step, (list, tuple)) else [int(float(step))] * len(params)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        bc1, bc2 = 1 - beta1 ** steps[i], 1 - beta2 ** steps[i]
        g = g.float()
        if grad_scale is not None:
            g = g / grad_scale.float()
        p.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_((1 - beta1) * g)
        v.mul_(beta2).add_((1 - beta2) * g * g)
        p.sub_((lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps))
        if compute_copies is not None and compute_copies[i] is not None:
            compute_copies[i].copy_(p)
