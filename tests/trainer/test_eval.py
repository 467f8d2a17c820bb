"""Block speculative decoding: output equals the target's greedy decoding, acceptance lengths in
range; the hybrid target loads and gives the chosen layers' states."""

import pytest
import torch

from trainer.config import default_target_layer_ids
from trainer.eval import acceptance_length, draft_block, greedy_generate, speculative_generate
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.target import load_target


def tiny_drafter(target, block_size=8):
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=target.hidden_size, intermediate_size=96, vocab_size=target.vocab_size,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, block_size=block_size,
                        mask_token_id=3, target_layer_ids=target.layer_ids,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    return DFlashDrafter(cfg).eval()


def test_speculative_output_equals_greedy(tiny_qwen3_dir):
    target = load_target(tiny_qwen3_dir, k=2)
    d = tiny_drafter(target)
    prompt = torch.tensor([5, 17, 40, 41, 42, 9, 11])
    new, acc = speculative_generate(d, target, prompt, max_new_tokens=20)
    assert torch.equal(new, greedy_generate(target, prompt, 20))
    assert all(1 <= a <= d.config.block_size for a in acc)
    assert sum(acc) + 1 >= 20  # the first token comes from the prefill, every round adds its acceptance length


def test_oracle_drafts_are_fully_accepted(tiny_qwen3_dir, monkeypatch):
    """A drafter that proposes the target's own greedy continuation gets block_size per round: the
    verification indexing (matched prefix + 1) is checked, not only that the output is right."""
    import trainer.eval as ev

    target = load_target(tiny_qwen3_dir, k=2)
    d = tiny_drafter(target)
    bs = d.config.block_size

    def oracle(drafter, target_, seq, feats):
        return greedy_generate(target_, seq[0].cpu(), bs - 1).to(seq.device)
    monkeypatch.setattr(ev, "draft_block", oracle)
    prompt = torch.tensor([7, 8, 9])
    new, acc = ev.speculative_generate(d, target, prompt, max_new_tokens=1 + 2 * bs)
    assert acc == [bs, bs] and torch.equal(new, greedy_generate(target, prompt, 1 + 2 * bs))


def test_draft_ignores_context_at_and_after_anchor(tiny_qwen3_dir):
    target = load_target(tiny_qwen3_dir, k=2)
    d = tiny_drafter(target)
    seq = torch.tensor([[5, 6, 7, 8, 9, 10]])
    feats = torch.randn(1, 5, 2 * target.hidden_size)
    a = draft_block(d, target, seq, feats)
    feats2 = torch.cat([feats, torch.randn(1, 3, feats.shape[-1])], 1)  # rows at/after the anchor: unused
    assert torch.equal(a, draft_block(d, target, seq, feats2))
    res = acceptance_length(d, target, [seq[0]], max_new_tokens=10)
    assert res["rounds"] >= 1 and 1 <= res["tau"] <= d.config.block_size


@pytest.mark.slow
def test_hybrid_target_features(tiny_qwen35_dir):
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's DFlash layers
    assert default_target_layer_ids(4, 2) == [1, 1]
    target = load_target(tiny_qwen35_dir, layer_ids=[0, 2])
    assert target.num_layers == 4
    types = target.model.config.layer_types
    assert "linear_attention" in types and "full_attention" in types
    ids = torch.randint(5, 100, (2, 19))
    logits, feats = target.logits_and_features(ids)
    hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(feats, torch.cat([hs[1], hs[3]], -1))
    assert torch.allclose(target.features(ids), feats, atol=1e-5)
    # right padding does not change the valid positions' features
    padded = torch.cat([ids, torch.full((2, 5), 4)], 1)
    assert torch.allclose(target.features(padded)[:, :19], feats, atol=1e-5)
