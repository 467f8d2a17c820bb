"""Where a training step waits for the device: host synchronizations inside the step.

A ``.item()``, ``bool(t)``, ``int(t)`` or ``float(t)`` of a device tensor, and every op whose output
size depends on the data (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without an
output size), blocks the host until the GPU has caught up: the queue drains and the kernels after it
start only as fast as the host can launch them. :class:`SyncLogger` is a ``TorchDispatchMode`` that
records those aten ops with the repository frames that issued them; :func:`sync_points` runs one step
of the trainer's path (``forward_loss`` -> backward -> clip -> fused AdamW, as ``benchmarks/tok_s.py``)
under it on the CPU (the batch is made before, as the data loader does). On the CPU a ``.cpu()`` or
``.tolist()`` of a tensor is free and does not dispatch, so those are not seen here.
``tests/trainer/test_no_host_sync.py`` keeps the step free of them outside a short allow-list.
"""

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools.audits.copy_audit import _frames_from_stack, trainer_step

__all__ = ["SYNC_OPS", "SyncPoint", "SyncLogger", "sync_points"]

# aten overload packets that read device data back to the host
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "unique", "_unique",
            "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "bincount", "histc"}


@dataclasses.dataclass(frozen=True)
class SyncPoint:
    op: str
    frames: tuple  # tools.audits.copy_audit.Frame, outermost first

    def where(self) -> str:
        return " < ".join(str(f) for f in reversed(self.frames)) or "?"


class SyncLogger(TorchDispatchMode):
    """Records every aten op of :data:`SYNC_OPS` (``repeat_interleave`` only without ``output_size``)."""

    def __init__(self, frames: int = 6):
        super().__init__()
        self.frames = frames
        self.points = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
            self.points.append(SyncPoint(str(func), _frames_from_stack(self.frames)))
        return func(*args, **kwargs)


def sync_points(setup, dtype=torch.bfloat16, backend="reference", warmup: int = 1):
    """The :class:`SyncPoint` list of one training step after ``warmup`` unlogged ones (``setup`` as
    ``tools.audits.copy_audit.audit_step``'s: ``(cfg, target, dataset)``); the batch is made outside the
    logger, as the data loader does."""
    with trainer_step(setup, dtype, backend) as (step, batch):
        for i in range(warmup):
            step(batch(i))
        b = batch(warmup)
        logger = SyncLogger()
        with logger:
            step(b)
        return logger.points
