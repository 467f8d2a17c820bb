"""The drafter's attention wiring against a dense re-computation: which keys each block sees, RoPE
positions (context 0..S-1, draft j of block i at anchor_i + j), and no leakage across blocks."""

import math

import pytest
import torch

from tests.helpers import rel_err
from trainer.loss import block_inputs, block_labels
from trainer.model import DFlashDrafter, DrafterConfig

BS = 8


def make_drafter(layer_types, window=10):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, vocab_size=100, num_layers=len(layer_types), num_heads=2,
                        num_kv_heads=1, head_dim=64, rope_theta=10000.0, block_size=BS, mask_token_id=3,
                        target_layer_ids=[1, 2], layer_types=layer_types, sliding_window=window)
    return DFlashDrafter(cfg)


def rope(x, pos, theta):
    """Rotate-half RoPE written as a complex rotation of (x1 + i x2): an independent formulation."""
    D = x.shape[-1]
    f = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    z = torch.complex(*(t.double() for t in x.chunk(2, -1))) * torch.polar(torch.ones((), dtype=torch.float64), pos.double()[:, None, None] * f)
    return torch.cat([z.real, z.imag], -1).float()


def dense_forward(drafter, emb, feats, anchors):
    """Block by block: block i attends to ctx[lo:anchor] (lo = anchor - window on sliding layers) and itself."""
    cfg = drafter.config
    B, N = anchors.shape
    ctx = drafter.hidden_norm(drafter.fc(feats))
    x = emb
    for layer in drafter.layers:
        at = layer.self_attn
        h = layer.input_layernorm(x)
        out = torch.zeros(B, N * BS, at.Hq * at.D)
        for b in range(B):
            for i in range(N):
                a = int(anchors[b, i])
                lo = max(a - cfg.sliding_window, 0) if layer.layer_type == "sliding_attention" else 0
                blk, crow = h[b, i * BS:(i + 1) * BS], ctx[b, lo:a]
                pb, pc = a + torch.arange(BS), torch.arange(lo, a)
                q = rope(at.q_norm(at.q_proj(blk).view(BS, at.Hq, at.D)), pb, cfg.rope_theta)
                k = torch.cat([rope(at.k_norm(at.k_proj(crow).view(-1, at.Hkv, at.D)), pc, cfg.rope_theta),
                               rope(at.k_norm(at.k_proj(blk).view(BS, at.Hkv, at.D)), pb, cfg.rope_theta)])
                v = torch.cat([at.v_proj(crow), at.v_proj(blk)]).view(-1, at.Hkv, at.D)
                k, v = (t.repeat_interleave(at.Hq // at.Hkv, 1) for t in (k, v))
                p = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(at.D), -1)
                out[b, i * BS:(i + 1) * BS] = torch.einsum("hqk,khd->qhd", p, v).reshape(BS, -1)
        x = x + at.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"], ["full_attention"]],
                         ids=["sliding+full", "full"])
def test_drafter_matches_dense_recomputation(layer_types):
    d = make_drafter(layer_types)
    B, S, N = 2, 37, 3
    anchors = torch.tensor([[0, 13, 29], [5, 6, 36]])
    emb, feats = torch.randn(B, N * BS, 64), torch.randn(B, S, 128)
    out = d(emb, feats, anchors)
    ref = dense_forward(d, emb, feats, anchors)
    assert rel_err(out, ref) < 1e-5


def test_block_sees_only_its_context_and_itself():
    """Gradients of one block's output: nonzero exactly on the context rows it may see and its own rows."""
    W = 10
    d = make_drafter(["sliding_attention"], window=W)
    B, S, N = 1, 40, 3
    anchors = torch.tensor([[4, 20, 33]])
    emb = torch.randn(B, N * BS, 64, requires_grad=True)
    feats = torch.randn(B, S, 128, requires_grad=True)
    for i in range(N):
        out = d(emb, feats, anchors)
        g_emb, g_ctx = torch.autograd.grad(out[:, i * BS:(i + 1) * BS].sum(), [emb, feats])
        a = int(anchors[0, i])
        ctx_seen = g_ctx[0].abs().sum(-1) > 0
        expect = torch.zeros(S, dtype=torch.bool)
        expect[max(a - W, 0):a] = True
        assert torch.equal(ctx_seen, expect), (i, ctx_seen.nonzero().flatten().tolist())
        blk_seen = g_emb[0].abs().sum(-1).view(N, BS) > 0
        assert blk_seen[i].all() and not blk_seen[torch.arange(N) != i].any()


def test_labels_are_tokens_at_anchor_plus_j():
    torch.manual_seed(1)
    B, S, N = 2, 30, 3
    ids = torch.randint(5, 100, (B, S))
    lm = torch.rand(B, S) > 0.3
    lengths = torch.tensor([30, 21])
    anchors = torch.tensor([[0, 10, 22], [3, 14, 17]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    labels, counted = block_labels(ids, lm, lengths, anchors, valid, BS)
    inputs = block_inputs(ids, anchors, 3, BS).view(B, N, BS)
    for b in range(B):
        for i in range(N):
            a = int(anchors[b, i])
            assert inputs[b, i, 0] == ids[b, a] and (inputs[b, i, 1:] == 3).all()
            for j in range(BS):
                inside = a + j < lengths[b]
                if inside:
                    assert labels[b, i, j] == ids[b, a + j]
                want = j > 0 and bool(valid[b, i]) and bool(inside) and bool(lm[b, a + j])
                assert bool(counted[b, i, j]) == want, (b, i, j)
