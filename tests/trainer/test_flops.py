"""The analytic FLOP count of a training step (trainer/flops.py) against independent counts."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import dflash_kernels as dk
from dflash_kernels.reference import dense_mask
from trainer.flops import _visible_pairs, mfu, step_flops, target_flops
from trainer.model import DFlashDrafter, DrafterConfig


def _drafter(window=24):
    cfg = DrafterConfig(hidden_size=48, intermediate_size=80, vocab_size=97, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=64, block_size=4, target_layer_ids=[0, 1],
                        layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=window)
    return DFlashDrafter(cfg)


@pytest.mark.parametrize("window", [None, 5])
def test_visible_pairs_match_the_dense_mask(window):
    B, S, N, bs = 2, 40, 6, 4
    anchors = torch.sort(torch.randint(0, S + 1, (B, N)), dim=1).values
    valid = torch.rand(B, N) > 0.3
    mask = dk.dflash_block_mask(anchors, S, bs, window=window, valid=valid)
    dense = dense_mask(mask)  # [B or 1, Tq, Tk] booleans, built by the reference
    assert _visible_pairs(anchors, valid, bs, window) == float(dense.expand(B, -1, -1).sum())


def test_drafter_linear_flops_match_torch_flop_counter():
    """The drafter's projections, MLP and fc, counted by torch's FlopCounterMode on a real forward
    (attention replaced by a stub that does no arithmetic, so only the linear layers count)."""
    drafter = _drafter()
    B, S, N, bs = 2, 32, 3, drafter.config.block_size
    H = drafter.config.hidden_size
    anchors = torch.sort(torch.randint(1, S - bs, (B, N)), dim=1).values
    valid = torch.ones(B, N, dtype=torch.bool)
    batch = {"input_ids": torch.zeros(B, S, dtype=torch.long), "anchors": anchors, "valid": valid}
    for layer in drafter.layers:
        layer.self_attn.attend = lambda q, k, v, mask: q
    feats = torch.randn(B, S, 2 * H)
    emb = torch.randn(B, N * bs, H)
    with FlopCounterMode(display=False) as counter:
        drafter(emb, feats, anchors, valid)
    counted = counter.get_total_flops()

    class _Target(torch.nn.Module):  # step_flops reads the target's config and decoder stack only
        def __init__(self):
            super().__init__()
            self.base_model = torch.nn.Linear(1, 1)
            self.config = type("C", (), {"num_hidden_layers": 0, "layer_types": [], "hidden_size": 8,
                                         "num_attention_heads": 1})()

    parts = step_flops(_Target(), drafter, batch)
    attn = sum(4.0 * drafter.config.num_heads * drafter.config.head_dim *
               _visible_pairs(anchors, valid, bs, drafter.config.sliding_window if t == "sliding_attention" else None)
               for t in drafter.config.layer_types)
    assert parts["drafter_fwd"] - attn == pytest.approx(counted, rel=1e-9)
    fc = 2.0 * B * S * drafter.fc.weight.numel()
    assert parts["drafter_bwd"] == pytest.approx(2 * (parts["drafter_fwd"] - fc) + fc)
    assert parts["lm_head_fwd"] == parts["lm_head_bwd"] == 2.0 * B * N * (bs - 1) * H * drafter.config.vocab_size
    batch["valid"] = valid.clone()
    batch["valid"][0, 1] = False  # an invalid block predicts nothing
    less = step_flops(_Target(), drafter, batch)["lm_head_fwd"]
    assert less == 2.0 * (B * N - 1) * (bs - 1) * H * drafter.config.vocab_size
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


def test_target_flops_by_hand():
    cfg = type("C", (), dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             hidden_size=32, num_attention_heads=2, head_dim=8, linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4))()
    T, B, P = 10, 3, 1000
    expect = (2 * B * T * P + 6 * B * T * 4 * 16 * 8 + 2 * B * T * 4 * (2 * 2 * 16 + 4 * 8)
              + 4 * 2 * 8 * B * T * (T + 1) / 2)
    assert target_flops(cfg, T, B, P) == pytest.approx(expect)


def test_mfu():
    assert mfu(989e12, 1.0) == pytest.approx(1.0)
    assert mfu(70e12, 0.226) == pytest.approx(70e12 / 0.226 / 989e12)
