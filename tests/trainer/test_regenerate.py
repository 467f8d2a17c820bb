"""trainer.regenerate on a tiny random Qwen3: greedy batched output equals per-record generate, does not
depend on the batch size, bad records are counted, and an interrupted run resumes where it stopped."""

import json

import pytest
import torch

from trainer.regenerate import main, regenerate, resume_point, stop_token_ids
from trainer.target import load_target

NEW = 10


@pytest.fixture(scope="module")
def target(tiny_qwen3_dir):
    return load_target(tiny_qwen3_dir, k=1)


def _records(tok):
    V = len(tok)
    return [
        {"messages": [{"role": "user", "content": "def add(a, b):"}], "id": "a"},
        {"input_ids": [5 + (7 * i) % (V - 10) for i in range(9)] + [11, 12, 13], "loss_mask": [0] * 9 + [1] * 3},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print a square"},
                      {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "and a cube"},
                      {"role": "assistant", "content": "old again"}]},
        {"conversations": [{"from": "human", "value": "class Point"}, {"from": "gpt", "value": "stale"}]},
        {"input_ids": [20, 21, 22, 23, 24, 25, 26]},
    ]


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _greedy_one(model, prompt, stop):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, eos_token_id=stop, pad_token_id=0)[0, len(prompt):]
    out = out.tolist()
    cut = next((j + 1 for j, t in enumerate(out) if t in stop), len(out))
    return out[:cut]


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_greedy_equals_per_record_generate_for_any_batch_size(tmp_path, target):
    model, tok = target.model, target.tokenizer
    src = _write(tmp_path / "in.jsonl", _records(tok))
    outs = {}
    for bs in (1, 2, 5):
        out = str(tmp_path / f"out{bs}.jsonl")
        rep = regenerate(model, tok, src, out, batch_size=bs, max_new_tokens=NEW, log=lambda s: None)
        assert rep["written"] == 5 and not rep["bad"]
        outs[bs] = _read(out)
    assert outs[1] == outs[2] == outs[5]
    recs, stop = outs[2], stop_token_ids(tok, model)
    # pre-tokenized: the prompt (tokens before the loss mask) plus the target's greedy continuation
    assert recs[1]["input_ids"] == recs[1]["input_ids"][:9] + _greedy_one(model, recs[1]["input_ids"][:9], stop)
    assert recs[1]["loss_mask"] == [0] * 9 + [1] * (len(recs[1]["input_ids"]) - 9)
    assert recs[4]["input_ids"][:7] == list(range(20, 27)) and len(recs[4]["input_ids"]) > 7
    # chat: each assistant turn is the greedy response to the conversation before it (regenerated turns included)
    first = recs[0]["messages"]
    assert recs[0]["id"] == "a" and [m["role"] for m in first] == ["user", "assistant"]
    ids = tok(tok.apply_chat_template(first[:1], tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    assert first[1]["content"] == tok.decode(_greedy_one(model, ids, stop), skip_special_tokens=True)
    multi = recs[2]["messages"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    ids = tok(tok.apply_chat_template(multi[:4], tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    assert multi[4]["content"] == tok.decode(_greedy_one(model, ids, stop), skip_special_tokens=True)
    assert multi[2]["content"] != "old answer" and multi[1]["content"] == "print a square"
    assert [r["source_index"] for r in recs] == [0, 1, 2, 3, 4]


def test_bad_records_counted_and_resume(tmp_path, target, capsys):
    model, tok = target.model, target.tokenizer
    good = _records(tok)
    lines = [good[0], "{not json", [1, 2], {"text": "?"}, {"messages": [{"role": "wizard", "content": "x"}]},
             {"input_ids": "abc"}, {"input_ids": [1, 2], "loss_mask": [1, 1]}, {"input_ids": [1, 10 ** 6, 2]},
             good[1], {"messages": [{"role": "user", "content": "word " * 400}]}, good[2]]
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    rep = regenerate(model, tok, src, str(out), batch_size=3, max_new_tokens=4, max_prompt_len=200,
                     log=lambda s: None)
    assert rep["records"] == 11 and rep["written"] == 3
    assert rep["bad"] == {"invalid_json": 1, "not_an_object": 1, "unknown_format": 1, "bad_messages": 1,
                          "bad_input_ids": 1, "empty_prompt": 1, "token_out_of_range": 1, "prompt_too_long": 1}
    full = _read(out)
    assert [r["source_index"] for r in full] == [0, 8, 10]
    # Interrupted after the second record, with a torn line: the rerun appends exactly the rest.
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:2]) + text[2][:15])
    assert resume_point(str(out)) == 9 and out.read_text() == "".join(text[:2])
    main(["--target", target.model.name_or_path, "--data", src, "--out", str(out), "--batch-size", "3",
          "--max-new-tokens", "4", "--max-prompt-len", "200"])
    assert _read(out) == full
    assert "continuing from 9" in capsys.readouterr().out
