"""Position weights and the weighted, masked cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from trainer.loss import (dflash_fused_head_loss, dflash_head_loss, dflash_loss, position_weights,
                          predicted_positions)


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


@pytest.mark.parametrize("chunk_rows", [1, 5, 4096])
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_loss_matches_lm_head_then_loss(chunk_rows, with_bias):
    """The chunked head + loss equals F.linear + dflash_loss: loss, accuracy stats and the hidden gradient."""
    torch.manual_seed(1)
    B, N, bs, H, V, gamma = 2, 3, 7, 24, 53, 3.0
    hidden = torch.randn(B, N * bs, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64) / H ** 0.5
    bias = torch.randn(V, dtype=torch.float64) if with_bias else None
    labels = torch.randint(0, V, (B, N, bs))
    counted = torch.rand(B, N, bs) > 0.3
    counted[..., 0] = False
    counted[1, 2] = False  # a padding block
    # make some predictions right so the accuracy is not trivially 0
    labels[0, 0, 1:] = F.linear(hidden[0, 1:bs], weight, bias).argmax(-1)

    h_ref = hidden.clone().requires_grad_()
    ref, st_ref = dflash_loss(F.linear(h_ref, weight, bias), labels, counted, gamma)
    ref.backward()
    h = hidden.clone().requires_grad_()
    got, st = dflash_head_loss(h, weight, labels, counted, gamma, bias=bias, chunk_rows=chunk_rows)
    got.backward()
    assert rel_err(got, ref) < 1e-6
    assert st["acc"] == st_ref["acc"] > 0 and st["tokens"] == st_ref["tokens"]
    assert torch.equal(st["acc_by_pos"], st_ref["acc_by_pos"])
    assert rel_err(h.grad, h_ref.grad) < 1e-6  # both take the CE in fp32
    assert torch.equal(h.grad.abs().sum(-1).view(B, N, bs) > 0, counted), "uncounted rows get no gradient"


def test_head_loss_low_precision_head_and_no_counted_rows():
    torch.manual_seed(2)
    B, N, bs, H, V = 1, 4, 5, 16, 40
    hidden = torch.randn(B, N * bs, H)
    weight = (torch.randn(V, H) / 4).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, N, bs))
    counted = torch.ones(B, N, bs, dtype=torch.bool)
    counted[..., 0] = False
    h_ref = hidden.clone().requires_grad_()
    ref, _ = dflash_loss(F.linear(h_ref.to(weight.dtype), weight), labels, counted, 7.0)
    ref.backward()
    h = hidden.clone().requires_grad_()
    got, _ = dflash_head_loss(h, weight, labels, counted, 7.0, chunk_rows=3)
    got.backward()
    assert rel_err(got, ref) < 1e-5 and rel_err(h.grad, h_ref.grad) < 1e-2
    none = torch.zeros_like(counted)
    h0 = hidden.clone().requires_grad_()
    loss, st = dflash_head_loss(h0, weight, labels, none, 7.0)
    loss.backward()
    assert loss.item() == 0 and st["tokens"] == 0 and not h0.grad.any()


def test_head_loss_bad_arguments():
    hidden = torch.randn(1, 8, 4)
    labels = torch.zeros(1, 2, 4, dtype=torch.long)
    counted = torch.ones(1, 2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="chunk_rows"):
        dflash_head_loss(hidden, torch.randn(5, 4), labels, counted, 7.0, chunk_rows=0)
    with pytest.raises(ValueError, match="hidden"):
        dflash_head_loss(torch.randn(1, 7, 4), torch.randn(5, 4), labels, counted, 7.0)


# ------------------------------------------------------------------- fused LM head + CE (dflash_kernels)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_head_loss_matches_lm_head_then_loss(with_bias):
    """fused=True (dflash_kernels' linear_cross_entropy) equals F.linear + dflash_loss in fp32: loss,
    accuracy stats, hidden gradient; uncounted rows get no gradient."""
    torch.manual_seed(1)
    B, N, bs, H, V, gamma = 2, 3, 7, 24, 53, 3.0
    hidden = torch.randn(B, N * bs, H)
    weight = torch.randn(V, H) / H ** 0.5
    bias = torch.randn(V) if with_bias else None
    labels = torch.randint(0, V, (B, N, bs))
    counted = torch.rand(B, N, bs) > 0.3
    counted[..., 0] = False
    counted[1, 2] = False  # a padding block
    labels[0, 0, 1:] = F.linear(hidden[0, 1:bs], weight, bias).argmax(-1)  # some hits

    h_ref = hidden.clone().requires_grad_()
    ref, st_ref = dflash_loss(F.linear(h_ref, weight, bias), labels, counted, gamma)
    ref.backward()
    h = hidden.clone().requires_grad_()
    got, st = dflash_head_loss(h, weight, labels, counted, gamma, bias=bias, fused=True)
    got.backward()
    assert got.dtype == torch.float32 and rel_err(got, ref) < 1e-5
    assert st["acc"] == st_ref["acc"] > 0 and st["tokens"] == st_ref["tokens"]
    assert torch.equal(st["acc_by_pos"], st_ref["acc_by_pos"])
    assert rel_err(h.grad, h_ref.grad) < 1e-5
    assert torch.equal(h.grad.abs().sum(-1).view(B, N, bs) > 0, counted), "uncounted rows get no gradient"


def test_fused_head_loss_bf16_head_and_no_counted_rows():
    torch.manual_seed(2)
    B, N, bs, H, V = 1, 4, 5, 16, 40
    hidden = torch.randn(B, N * bs, H)
    weight = (torch.randn(V, H) / 4).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, N, bs))
    counted = torch.ones(B, N, bs, dtype=torch.bool)
    counted[..., 0] = False
    h_ref = hidden.clone().requires_grad_()
    ref, _ = dflash_loss(F.linear(h_ref.to(weight.dtype), weight), labels, counted, 7.0)
    ref.backward()
    h = hidden.clone().requires_grad_()
    got, _ = dflash_fused_head_loss(h, weight, labels, counted, 7.0)
    got.backward()
    assert h.grad.dtype == torch.float32
    assert rel_err(got, ref) < 1e-3 and rel_err(h.grad, h_ref.grad) < 2e-2
    none = torch.zeros_like(counted)
    h0 = hidden.clone().requires_grad_()
    loss, st = dflash_fused_head_loss(h0, weight, labels, none, 7.0)
    loss.backward()
    assert loss.item() == 0 and st["tokens"] == 0 and not h0.grad.any()


@pytest.mark.parametrize("path", ["logits", "chunked", "fused"])
def test_predicted_positions_give_the_whole_blocks_loss_and_stats(path):
    """The LM head on block positions 1..bs-1 only (``predicted_positions``, ``first=1``) gives the loss,
    hidden gradient (0 on the left-out position 0) and stats of the whole blocks, on every loss path."""
    torch.manual_seed(4)
    B, N, bs, H, V = 2, 3, 5, 16, 40
    hidden = torch.randn(B, N * bs, H)
    weight = torch.randn(V, H) / 4
    labels = torch.randint(0, V, (B, N, bs))
    counted = torch.rand(B, N, bs) > 0.3
    counted[..., 0] = False
    labels[0, 0, 1:] = F.linear(hidden[0, 1:bs], weight).argmax(-1)  # some hits

    def run(h, lab, cnt, first):
        if path == "logits":
            return dflash_loss(F.linear(h, weight), lab, cnt, 7.0, first=first)
        return dflash_head_loss(h, weight, lab, cnt, 7.0, chunk_rows=4, fused=path == "fused", first=first)

    h_ref = hidden.clone().requires_grad_()
    ref, st_ref = run(h_ref, labels, counted, 0)
    ref.backward()
    h = hidden.clone().requires_grad_()
    got, st = run(*predicted_positions(h, labels, counted), 1)
    got.backward()
    assert rel_err(got, ref) < 1e-5 and rel_err(h.grad, h_ref.grad) < 1e-5
    assert not h.grad.view(B, N, bs, H)[:, :, 0].any()
    assert st["acc"] == st_ref["acc"] > 0 and st["tokens"] == st_ref["tokens"]
    assert torch.equal(st["acc_by_pos"], st_ref["acc_by_pos"]) and st["acc_by_pos"].shape == (bs,)


def test_predicted_positions_checks_the_hidden_shape():
    labels = torch.zeros(1, 2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden"):
        predicted_positions(torch.randn(1, 7, 8), labels, labels.bool())
