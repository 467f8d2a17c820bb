"""Data: chat rendering and loss masks, pre-tokenized records, bad records counted, anchor sampling."""

import json

import torch

from trainer.data import batch_at, load_jsonl, render_chat, sample_anchors, seeded_generator


def test_chat_loss_mask_covers_assistant_turns(tiny_tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two numbers"},
            {"role": "assistant", "content": "def add(a, b): return a + b"},
            {"role": "user", "content": "and print"}, {"role": "assistant", "content": "print(add(1, 2))"}]
    ids, mask = render_chat(msgs, tiny_tokenizer)
    assert len(ids) == len(mask)
    text = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert text == "def add(a, b): return a + b<|im_end|>\nprint(add(1, 2))<|im_end|>\n"
    assert tiny_tokenizer.decode(ids) == tiny_tokenizer.apply_chat_template(msgs, tokenize=False)


def test_bad_records_are_counted_not_fatal(tmp_path, tiny_tokenizer):
    V = len(tiny_tokenizer)
    good_chat = {"messages": [{"role": "user", "content": "hi there"},
                              {"role": "assistant", "content": "for i in range(10): print(i * i)"}]}
    share_gpt = {"conversations": [{"from": "human", "value": "hello"},
                                   {"from": "gpt", "value": "class Point: pass; import os; print(os)"}]}
    good_tok = {"input_ids": list(range(5, 85)), "loss_mask": [0] * 10 + [1] * 70}
    lines = [json.dumps(good_chat), json.dumps(share_gpt), json.dumps(good_tok), "{not json",
             json.dumps([1, 2]), json.dumps({"text": "no known fields"}),
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
             json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
             json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}),
             json.dumps({"input_ids": [1, V + 5] * 20}),
             json.dumps({"input_ids": list(range(5, 45)), "loss_mask": [0] * 40}),
             json.dumps({"input_ids": list(range(5, 11))}),
             json.dumps({"input_ids": "abc"}), "", b"\xff\xfe".decode("latin-1")]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    logged = []
    ds = load_jsonl(str(path), tiny_tokenizer, max_len=64, block_size=8, vocab_size=V, log=logged.append)
    st = ds.stats
    assert st.records == 14 and st.kept == 3 and len(ds) == 3
    assert dict(st.bad) == {"invalid_json": 2, "not_an_object": 1, "unknown_format": 1, "no_assistant_turn": 1,
                            "bad_messages": 1, "length_mismatch": 1, "token_out_of_range": 1, "no_loss_tokens": 1,
                            "too_short_for_a_block": 1, "bad_input_ids": 1}
    assert st.truncated >= 1 and all(s[0].numel() <= 64 for s in ds.seqs)  # good_tok has 80 tokens
    assert "kept 3 of 14" in logged[0] and "invalid_json=2" in logged[0]


def test_anchor_sampling():
    L, bs, N = 50, 8, 6
    lm = torch.zeros(L, dtype=torch.bool)
    lm[10:48] = True
    a = sample_anchors(lm, N, bs, seeded_generator(0, 0, 3))
    assert a.numel() == N and torch.equal(a, a.unique()) and lm[a].all() and (a <= L - bs).all()
    # capped by the candidates (positions 10..42): all of them, no repeats
    a = sample_anchors(lm, 100, bs, seeded_generator(0))
    assert torch.equal(a, torch.arange(10, L - bs + 1))


def test_batches_are_a_function_of_step(tmp_path, tiny_tokenizer):
    recs = [{"input_ids": list(range(5, 5 + n)), "loss_mask": [1] * n} for n in (30, 40, 50, 60)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ds = load_jsonl(str(path), None, max_len=64, block_size=8, log=None)
    kw = dict(batch_size=2, max_len=64, num_anchors=5, block_size=8, seed=1, pad_id=4)
    b0, b0_again, b2 = batch_at(ds, 0, **kw), batch_at(ds, 0, **kw), batch_at(ds, 2, **kw)  # 2 steps per epoch
    assert all(torch.equal(b0[k], b0_again[k]) for k in ("input_ids", "anchors", "valid"))
    assert b0["epoch"] == 0 and b2["epoch"] == 1 and not torch.equal(b0["anchors"], b2["anchors"])
    for b in (b0, b2):
        assert b["input_ids"].shape == (2, 64) and b["valid"].all()
        for r in range(2):
            L = int(b["lengths"][r])
            assert (b["input_ids"][r, L:] == 4).all() and (b["anchors"][r] <= L - 8).all()
