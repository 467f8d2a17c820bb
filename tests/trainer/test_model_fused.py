"""The drafter with the fused RMSNorm / RoPE / SwiGLU ops against its plain torch chains
(``trainer.model.FUSED_OPS`` off): same output and parameter gradients on a tiny config in fp32, and
under bf16 autocast (the fused ops round once where torch rounds after each op)."""

import torch

import trainer.model as model_mod
from dflash_kernels.runtime import resolve
from tests.helpers import device, rel_err
from trainer.model import DFlashDrafter, DrafterConfig

BS = 4


def _drafter_and_inputs(dev):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=48, intermediate_size=80, vocab_size=50, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=64, rope_theta=10000.0, block_size=BS, target_layer_ids=[0, 1],
                        layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    drafter = DFlashDrafter(cfg).to(dev)
    with torch.no_grad():  # non-trivial norm weights, so that their gradients and scaling are exercised
        for n, p in drafter.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    B, S, N = 2, 13, 3
    emb = torch.randn(B, N * BS, cfg.hidden_size, device=dev)
    feats = torch.randn(B, S, 2 * cfg.hidden_size, device=dev)
    anchors = torch.tensor([[2, 6, 11], [1, 5, 9]], device=dev)
    return drafter, emb, feats, anchors


def _run(drafter, emb, feats, anchors, fused, monkeypatch, autocast=False):
    monkeypatch.setattr(model_mod, "FUSED_OPS", fused)
    drafter.zero_grad(set_to_none=True)
    e = emb.clone().requires_grad_()
    with torch.autocast(emb.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = drafter(e, feats, anchors)
    # a fixed random projection of the output: well conditioned. ``out.square().mean()`` after the final
    # RMSNorm is nearly constant in the states before it, and its gradients were mostly cancellation (a
    # 0.4% perturbation of one layer's queries moved them by ~50%).
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out.float() * proj).sum().backward()
    return out.detach().float(), e.grad.clone(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_fused_ops_match_plain_torch_fp32(monkeypatch):
    for op in ("rms_norm", "rope", "swiglu"):
        assert resolve(op, device()) in ("interpret", "triton"), f"{op}: the kernels must run (TRITON_INTERPRET=1)"
    drafter, emb, feats, anchors = _drafter_and_inputs(device())
    ref, ref_de, ref_g = _run(drafter, emb, feats, anchors, False, monkeypatch)
    calls = {"rms_norm": 0, "add": 0}
    real, real_add = model_mod.fused_rms_norm, model_mod.dk.fused_add_rms_norm

    def counting(*a, **k):
        calls["rms_norm"] += 1
        return real(*a, **k)

    def counting_add(*a, **k):
        calls["add"] += 1
        return real_add(*a, **k)
    monkeypatch.setattr(model_mod, "fused_rms_norm", counting)
    monkeypatch.setattr(model_mod.dk, "fused_add_rms_norm", counting_add)
    out, de, grads = _run(drafter, emb, feats, anchors, True, monkeypatch)
    assert calls["rms_norm"], "the fused path ran no fused RMSNorm"
    # every residual add but the first layer's input folded into the norm after it: 2 per layer, less the
    # first layer's input norm, plus the final norm
    assert calls["add"] == 2 * drafter.config.num_layers, calls
    tol = 2e-3 if device().type == "cuda" else 1e-5  # tf32 GEMMs on a GPU make the two runs differ
    assert rel_err(out, ref) < tol
    assert rel_err(de, ref_de) < tol
    assert ref_g.keys() == grads.keys()
    for n, g in ref_g.items():
        assert rel_err(grads[n], g) < 10 * tol, n


def test_fused_ops_match_plain_torch_bf16_autocast(monkeypatch):
    """Under bf16 autocast (CUDA's, or the CPU's with the kernels in the interpreter): the two paths round
    to bf16 in different places, so they agree to bf16 rounding accumulated over the layers, no closer."""
    drafter, emb, feats, anchors = _drafter_and_inputs(device())
    ref, ref_de, ref_g = _run(drafter, emb, feats, anchors, False, monkeypatch, autocast=True)
    out, de, grads = _run(drafter, emb, feats, anchors, True, monkeypatch, autocast=True)
    assert rel_err(out, ref) < 2e-2 and rel_err(de, ref_de) < 2e-2
    for n, g in ref_g.items():
        assert grads[n].dtype == torch.float32
        assert rel_err(grads[n], g) < 5e-2, n
