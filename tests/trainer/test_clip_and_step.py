"""trainer.step.clip_and_step: clip_grad_norm_ + AdamW step, with the clip folded into torch's fused AdamW."""

import copy

import pytest
import torch

from trainer.step import clip_and_step


def _models():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    return copy.deepcopy(m), copy.deepcopy(m)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_same_steps_as_clip_grad_norm_then_step(fused):
    """Five steps, the first three clipped (norm ~15 against max 1), the last two not: the norms returned
    equal clip_grad_norm_'s, the parameters agree to fp32 rounding (the folded clip divides by 1 / coef)
    and exactly where nothing was clipped."""
    a, b = _models()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    for i in range(5):
        x = torch.randn(16, 32) * (10 if i < 3 else 0.01)
        a(x).square().mean().backward()
        na = torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        oa.step()
        oa.zero_grad()
        b(x).square().mean().backward()
        nb = clip_and_step(ob, b.parameters(), 1.0)
        ob.zero_grad()
        assert torch.allclose(na, nb, rtol=1e-6), (i, float(na), float(nb))
        assert not hasattr(ob, "grad_scale"), "the fused kernel's grad_scale hook is removed after the step"
    for p, q in zip(a.parameters(), b.parameters()):
        if fused:
            assert (p - q).abs().max() <= 1e-6 * p.abs().max(), (p - q).abs().max()
        else:
            assert torch.equal(p, q)


def test_unclipped_fused_step_is_exact():
    """No clipping (coef = 1): grad / 1 is the gradient itself, so the fused step is bit for bit torch's."""
    a, b = _models()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        x = torch.randn(16, 32) * 0.01
        a(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(a.parameters(), 100.0)
        oa.step()
        oa.zero_grad()
        b(x).square().mean().backward()
        clip_and_step(ob, b.parameters(), 100.0)
        ob.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_max_norm_zero_means_no_clipping():
    """grad_clip <= 0 turns clipping off (HF Trainer's max_grad_norm <= 0), where clip_grad_norm_(params, 0)
    would zero every gradient: the step is AdamW's on the raw gradients and the norm is still returned."""
    from trainer.compute_weights import ComputeWeights, MasterAdamW

    a, b = _models()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    x = torch.randn(16, 32) * 10  # a norm far above 1
    a(x).square().mean().backward()
    b(x).square().mean().backward()
    expect = torch.nn.utils.get_total_norm([p.grad for p in a.parameters()])
    oa.step()
    norm = clip_and_step(ob, b.parameters(), 0.0)
    assert float(expect) > 10 and torch.allclose(norm, expect)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    c, _ = _models()
    cw = ComputeWeights(c, torch.float32)  # fp32 leaves: MasterAdamW's path, compared with torch's AdamW
    oc = MasterAdamW(c.parameters(), cw, lr=1e-2, weight_decay=0.01)  # torch.optim.AdamW's default
    cw(c, x).square().mean().backward()
    norm = clip_and_step(oc, c.parameters(), 0.0)
    assert torch.allclose(norm, expect, rtol=1e-5)
    for p, q in zip(a.parameters(), c.parameters()):
        assert (p - q).abs().max() <= 1e-6 * p.abs().max()
