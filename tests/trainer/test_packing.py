"""Sequence packing: rows, document ids, anchors and labels inside one document, target features and drafter
loss per document equal to the padded (one document per row) computation."""

import json

import pytest
import torch

from tests.helpers import slow_param
from trainer.data import (batch_at, load_jsonl, pack_sequences, packed_drafter_masks, packed_target_features,
                          sample_anchors, seeded_generator)
from trainer.loss import block_inputs, block_labels, dflash_loss
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.target import load_target

BS = 4


def _seqs(lengths, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        lm = torch.ones(n, dtype=torch.bool)
        lm[:3] = False
        out.append((torch.randint(10, vocab, (n,), generator=g), lm))
    return out


def test_pack_sequences_next_fit():
    seqs = _seqs([10, 20, 30, 7, 25, 40, 3])
    rows = pack_sequences(seqs, max_len=40)
    assert [r[0].numel() for r in rows] == [30, 37, 25, 40, 3]
    assert torch.equal(torch.cat([r[0] for r in rows]), torch.cat([s[0] for s in seqs]))
    assert torch.equal(torch.cat([r[1] for r in rows]), torch.cat([s[1] for s in seqs]))
    assert rows[1][2].tolist() == [0] * 30 + [1] * 7
    with pytest.raises(ValueError, match="max_len"):
        pack_sequences(_seqs([41]), 40)


def test_no_anchor_or_label_crosses_a_document(tmp_path):
    lengths = [9, 17, 6, 30, 12, 5, 21, 8, 14, 11, 26, 7]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s.tolist(), "loss_mask": m.int().tolist()}) + "\n"
                            for s, m in _seqs(lengths)))
    logged = []
    ds = load_jsonl(str(path), None, max_len=48, block_size=BS, log=logged.append, pack=True)
    assert len(ds) < len(lengths) and ds.doc_ids is not None and "packed into" in logged[0]
    seen_boundary_candidates = 0
    for step in range(8):
        b = batch_at(ds, step, batch_size=2, max_len=48, num_anchors=20, block_size=BS, seed=3)
        doc, pos = b["doc_ids"], b["position_ids"]
        for r in range(2):
            L = int(b["lengths"][r])
            assert (doc[r, L:] == -1).all() and (pos[r, L:] == 0).all()
            starts = torch.nonzero(torch.diff(doc[r, :L], prepend=doc[r, :1] - 1)).flatten()
            for s in starts.tolist():
                assert pos[r, s] == 0
            a = b["anchors"][r][b["valid"][r]]
            assert (doc[r, a] == doc[r, a + BS - 1]).all() and b["loss_mask"][r, a].all()
            # every position of every block, labels included, lies in the anchor's document
            blk = a[:, None] + torch.arange(BS)
            assert (doc[r][blk] == doc[r, a][:, None]).all()
            seen_boundary_candidates += int(((doc[r, :L - BS + 1] != doc[r, BS - 1:L]) &
                                             b["loss_mask"][r, :L - BS + 1]).sum())
        labels, counted = block_labels(b["input_ids"], b["loss_mask"], b["lengths"], b["anchors"], b["valid"], BS)
        assert counted.any()
    assert seen_boundary_candidates > 0  # there were loss positions whose block would have crossed


def test_sample_anchors_respects_documents():
    lm = torch.ones(20, dtype=torch.bool)
    doc = torch.tensor([0] * 7 + [1] * 13)
    a = sample_anchors(lm, 100, BS, seeded_generator(0), doc)
    assert a.tolist() == [0, 1, 2, 3] + list(range(7, 17))


def _packed_case(vocab):
    """Three documents packed into two rows of 40 (the second row padded)."""
    docs = _seqs([15, 22, 31], vocab=vocab, seed=1)
    rows = pack_sequences(docs, 40)
    assert [r[2].max().item() for r in rows] == [1, 0]
    S = 40
    ids = torch.zeros(2, S, dtype=torch.long)
    doc_ids = torch.full((2, S), -1, dtype=torch.long)
    for r, (i, _, d) in enumerate(rows):
        ids[r, :i.numel()], doc_ids[r, :i.numel()] = i, d
    where = [(0, 0), (0, 15), (1, 0)]  # (row, start) of each document
    return docs, ids, doc_ids, where


@pytest.mark.parametrize("arch", ["qwen3", slow_param("qwen35")])
def test_packed_target_features_equal_each_document_alone(arch, tiny_qwen3_dir, tiny_qwen35_dir):
    target = load_target(tiny_qwen3_dir if arch == "qwen3" else tiny_qwen35_dir, [1, 2])
    docs, ids, doc_ids, where = _packed_case(target.vocab_size)
    feats = packed_target_features(target, ids, doc_ids)
    assert feats.shape == (2, 40, 2 * target.hidden_size)
    for (seq, _), (r, s) in zip(docs, where):
        alone = target.features(seq[None])[0]
        torch.testing.assert_close(feats[r, s:s + seq.numel()], alone, rtol=1e-4, atol=1e-4)
    # Without the per-document inputs the second document of row 0 sees the first: the check has teeth.
    plain = target.features(ids)
    assert not torch.allclose(plain[0, 15:37], target.features(docs[1][0][None])[0], atol=1e-3)


def test_padding_and_packing_give_the_same_per_document_loss(tiny_qwen35_dir):
    target = load_target(tiny_qwen35_dir, [1, 2])
    docs, ids, doc_ids, where = _packed_case(target.vocab_size)
    torch.manual_seed(0)
    H = target.hidden_size
    drafter = DFlashDrafter(DrafterConfig(hidden_size=H, intermediate_size=2 * H, vocab_size=target.vocab_size,
                                          num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, block_size=BS,
                                          mask_token_id=3, target_layer_ids=[1, 2],
                                          layer_types=["sliding_attention", "full_attention"], sliding_window=9))
    lm = torch.zeros(2, 40, dtype=torch.bool)
    for (seq, m), (r, s) in zip(docs, where):
        lm[r, s:s + seq.numel()] = m
    lengths = torch.tensor([37, 31])
    # anchors per row, some near the start of the second document (their context would cross)
    anchors = torch.tensor([[3, 10, 16, 18, 30], [4, 9, 14, 20, 26]])
    valid = torch.ones(2, 5, dtype=torch.bool)

    def loss_of(hidden, ids_, lm_, lengths_, anchors_, sel):
        labels, counted = block_labels(ids_, lm_, lengths_, anchors_, torch.ones_like(anchors_, dtype=torch.bool), BS)
        logits = target.lm_head(hidden).view(*anchors_.shape, BS, -1)
        return dflash_loss(logits[sel].reshape(1, -1, logits.shape[-1]), labels[sel][None], counted[sel][None], 7.0)[0]

    with torch.no_grad():
        feats = packed_target_features(target, ids, doc_ids)
        emb = target.embed(block_inputs(ids, anchors, 3, BS))
        hidden = drafter(emb, feats, anchors, valid, masks=packed_drafter_masks(drafter, anchors, doc_ids, valid))
        crossing = drafter(emb, feats, anchors, valid)  # the plain masks let row 0's second document see the first
        assert torch.allclose(hidden[0, :2 * BS], crossing[0, :2 * BS], atol=1e-5)
        assert not torch.allclose(hidden[0, 2 * BS:], crossing[0, 2 * BS:], atol=1e-3)
        a_doc = torch.gather(doc_ids, 1, anchors)
        for d, ((seq, m), (r, s)) in enumerate(zip(docs, where)):
            sel_row = torch.zeros(2, 5, dtype=torch.bool)
            sel_row[r] = a_doc[r] == (d if r == 0 else 0)
            n = int(sel_row.sum())
            # the same blocks, unpacked: the document alone in its own row (anchors shifted)
            a1 = anchors[r][sel_row[r]][None] - s
            f1 = target.features(seq[None])
            h1 = drafter(target.embed(block_inputs(seq[None], a1, 3, BS)), f1, a1)
            torch.testing.assert_close(hidden.view(2, 5, BS, -1)[sel_row], h1.view(n, BS, -1), rtol=1e-4, atol=1e-4)
            packed = loss_of(hidden, ids, lm, lengths, anchors, sel_row)
            alone = loss_of(h1, seq[None], m[None], torch.tensor([seq.numel()]), a1,
                            torch.ones(1, n, dtype=torch.bool))
            torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
