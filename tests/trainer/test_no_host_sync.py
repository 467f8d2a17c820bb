"""No host synchronization inside the trainer's step (target features -> drafter -> fused LM-head loss
-> backward -> clip -> fused AdamW) outside ``ALLOWED``: ``tools.audits.sync_audit`` logs every aten op that reads
device data back (``.item()``, ``bool(t)``, ``nonzero``, ...) during one step of a shrunken real preset on
the CPU, and each must match an entry with its reason. The step's statistics (accuracy, counted tokens)
stay on the device until the caller logs them (``trainer.loss.StepStats``)."""

import pytest
import torch

import trainer.model as model_mod
from tests.helpers import slow_param
from tools.audits import copy_audit as ca
from tools.audits import sync_audit as sa

# (function qualname in a frame, aten op prefix, reason): syncs that run on the CPU only
ALLOWED = [
    ("check_label_range", "aten.", "the fused loss's label check, CPU tensors only (on a GPU it returns at once)"),
    ("_check_anchors", "aten.", "the host batch's anchors, checked before they move to the device: CPU tensors "
                                "on a GPU run too"),
    ("check_dflash_block_mask_args", "aten.", "DFlashDrafter.masks checks the anchors' range only when they are "
                                              "CPU tensors (this audit); device anchors skip it "
                                              "(test_drafter_masks_check_the_range_on_the_host_only)"),
]


@pytest.fixture(scope="module")
def audit_setup():
    setup = ca.shrunken_real_setup()
    yield setup
    setup[1].routing.undo()


@pytest.mark.parametrize("fused", [False, slow_param(True)], ids=["eager", "fused"])
def test_the_step_does_not_wait_for_the_device(audit_setup, fused, monkeypatch):
    monkeypatch.setattr(model_mod, "FUSED_OPS", fused)
    points = sa.sync_points(audit_setup)
    unlisted = [f"{p.op} at {p.where()}" for p in points
                if not any(any(f.func.endswith(fn) for f in p.frames) and p.op.startswith(op) for fn, op, _ in ALLOWED)]
    assert not unlisted, "host synchronizations inside the step:\n  " + "\n  ".join(dict.fromkeys(unlisted))


def test_the_logger_sees_a_synchronization():
    """The audit can fail: an .item(), a bool() and a nonzero() inside it are each recorded."""
    logger = sa.SyncLogger()
    x = torch.arange(5.0)
    with logger:
        x.sum().item()
        bool((x > 2).any())
        torch.nonzero(x)
        torch.repeat_interleave(x, 2, output_size=10)  # a known output size does not wait
    ops = [p.op for p in logger.points]
    assert any("_local_scalar_dense" in o for o in ops) and any("nonzero" in o for o in ops)
    assert sum("_local_scalar_dense" in o or "is_nonzero" in o for o in ops) >= 2
    assert not any("repeat_interleave" in o for o in ops)


def test_drafter_masks_check_the_range_on_the_host_only(monkeypatch):
    from trainer.model import DFlashDrafter, DrafterConfig

    seen = []
    monkeypatch.setattr(model_mod.dk, "dflash_block_mask", lambda *a, **k: seen.append(k["check_range"]))
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, vocab_size=100, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=64, block_size=4, target_layer_ids=[0, 1],
                        layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    drafter = DFlashDrafter(cfg)
    drafter.masks(torch.zeros(1, 2, dtype=torch.long), 8)
    drafter.masks(torch.zeros(1, 2, dtype=torch.long, device="meta"), 8)  # a device tensor
    assert seen == [True, True, False, False]


def test_drafter_loss_refuses_an_anchor_outside_the_batch():
    from trainer.step import _check_anchors

    batch = {"input_ids": torch.zeros(1, 10, dtype=torch.long), "anchors": torch.tensor([[0, 11]]),
             "valid": torch.tensor([[True, True]])}
    with pytest.raises(ValueError, match=r"anchors: every valid anchor must be in \[0, 10\]; got anchors\[0, 1\] = 11"):
        _check_anchors(batch)
    batch["valid"] = torch.tensor([[True, False]])  # an invalid block's anchor is ignored
    _check_anchors(batch)
