"""Position weights and the weighted, masked cross-entropy."""

import math

import torch
import torch.nn.functional as F

from trainer.loss import dflash_loss, position_weights


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w[0] == 0
    for j in range(1, 16):
        assert math.isclose(float(w[j]), math.exp(-(j - 1) / 7.0), rel_tol=1e-6)


def test_loss_is_weighted_mean_over_counted_positions():
    torch.manual_seed(0)
    B, N, bs, V, gamma = 2, 3, 5, 11, 2.0
    logits = torch.randn(B, N * bs, V, requires_grad=True)
    labels = torch.randint(0, V, (B, N, bs))
    counted = torch.rand(B, N, bs) > 0.4
    counted[..., 0] = False
    loss, st = dflash_loss(logits, labels, counted, gamma)
    num = den = 0.0
    for b in range(B):
        for i in range(N):
            for j in range(1, bs):
                if counted[b, i, j]:
                    w = math.exp(-(j - 1) / gamma)
                    num += w * F.cross_entropy(logits[b, i * bs + j][None], labels[b, i, j][None]).item()
                    den += w
    assert math.isclose(loss.item(), num / den, rel_tol=1e-5)
    hits = ((logits.argmax(-1).view(B, N, bs) == labels) & counted).sum().item()
    assert math.isclose(st["acc"], hits / counted.sum().item(), rel_tol=1e-6) and st["tokens"] == counted.sum().item()
    # Positions that are not counted get no gradient.
    loss.backward()
    g = logits.grad.view(B, N, bs, V).abs().sum(-1)
    assert torch.equal(g > 0, counted)


def test_loss_without_counted_positions_is_zero():
    logits = torch.randn(1, 4, 7)
    loss, st = dflash_loss(logits, torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 1, 4, dtype=torch.bool), 7.0)
    assert loss.item() == 0 and st["tokens"] == 0
