"""``tools.audits.copy_audit``'s ``--ops`` path: every call of the named aten ops, whatever its kind, with its bytes and
issuing line (``CopyLogger(all_ops=True)`` + ``select_ops``)."""

import torch

from tools.audits import copy_audit as ca


def _step(a, b, w):
    h = a + b  # the line the add is charged to
    return (h * w).sum()


def test_select_ops_keeps_every_add_with_its_bytes_and_line():
    a, b = (torch.randn(6, 10, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(6, 10, dtype=torch.bfloat16)
    with ca.CopyLogger(all_ops=True) as logger:
        _step(a, b, w)
    adds = ca.select_ops(logger.events, ["add"])
    assert [e.op for e in adds] == ["aten.add.Tensor"]
    assert adds[0].kind == "op" and adds[0].nbytes == 3 * 6 * 10 * 2
    assert adds[0].frames and adds[0].frames[-1].line == _step.__code__.co_firstlineno + 1
    assert {e.op.split(".")[1] for e in ca.select_ops(logger.events, ["mul", " sum"])} == {"mul", "sum"}
    assert ca.select_ops(logger.events, ["add_"]) == []
    # without all_ops a contiguous same-shape add is no event at all
    with ca.CopyLogger() as plain:
        _step(a, b, w)
    assert ca.select_ops(plain.events, ["add"]) == []
