"""Rewrite the responses of a JSONL dataset with the target itself (DFlash trains on the target's own text).

    python -m trainer.regenerate --target DIR --data in.jsonl --out out.jsonl
        [--batch-size 16] [--max-new-tokens 512] [--temperature 0] [--top-p 1.0] [--seed 0]

Records (one JSON object per line, the formats ``trainer.data`` reads):
- chat, ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}``: every assistant turn is
  replaced, in order, by the target's response to the conversation before it (earlier turns already
  regenerated), rendered with the tokenizer's chat template and a generation prompt; a conversation
  that ends without an assistant turn (a prompt-only record) gets one. Written as ``{"messages":
  [...]}`` with the record's other fields kept.
- pre-tokenized, ``{"input_ids": [...], "loss_mask": [...]}``: the prompt is the tokens before the
  first loss-mask token; written as the prompt plus the generated tokens, loss mask on the latter.

Generation is batched: prompts of ``--batch-size`` records are left-padded and decoded together with
``generate`` (greedy with ``--temperature 0``, else sampling with ``--temperature`` and ``--top-p``),
stopping at the tokenizer's end-of-sequence / end-of-turn tokens or ``--max-new-tokens``. Greedy
output does not depend on the batch size (tested).

Every written line carries ``source_index``, the input record it came from (blank lines not
counted). A bad record is counted under a reason and skipped, never fatal. An existing ``--out`` is
continued: records up to the last ``source_index`` written are skipped (a torn last line from a
crash is cut off first), so an interrupted run resumes where it stopped. Sampling is seeded per
batch by ``(seed, first record index)``, so a resumed sampled run draws what the whole run would.
"""

import argparse
import json
import os
import time
from collections import Counter

import torch

from trainer.data import BadRecord, record_messages

__all__ = ["regenerate", "stop_token_ids", "resume_point", "main"]


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """End-of-sequence and end-of-turn ids: the tokenizer's eos, ``<|im_end|>`` / ``<|eot_id|>`` when
    the vocabulary has them, and the model's generation config's eos ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for t in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        if t in vocab:
            ids.add(int(vocab[t]))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))
    return sorted(ids)


def resume_point(out_path: str) -> int:
    """The input index to start from: one past the last ``source_index`` in ``out_path`` (0 if none).

    A last line without its newline (a crash mid-write) is cut off the file first.
    """
    if not os.path.exists(out_path):
        return 0
    with open(out_path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)
            data = data[:cut]
    last = -1
    for line in data.splitlines():
        if line.strip():
            last = max(last, int(json.loads(line)["source_index"]))
    return last + 1


class _Job:
    """One record in flight: what to generate next and how to fold the answer back in."""

    def __init__(self, index: int, rec: dict, tokenizer, max_prompt_len: int):
        self.index, self.rec, self.tok, self.max_prompt_len = index, rec, tokenizer, max_prompt_len
        if not isinstance(rec, dict):
            raise BadRecord("not_an_object")
        if "input_ids" in rec:
            ids, lm = rec["input_ids"], rec.get("loss_mask")
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in ids):
                raise BadRecord("bad_input_ids")
            if lm is not None and (not isinstance(lm, list) or len(lm) != len(ids)):
                raise BadRecord("bad_loss_mask")
            first = next((i for i, m in enumerate(lm or []) if m), len(ids))
            if first == 0:
                raise BadRecord("empty_prompt")
            if any(not 0 <= t < len(tokenizer) for t in ids[:first]):
                raise BadRecord("token_out_of_range")
            self.kind, self.prompt_ids = "tokens", ids[:first]
            self.turns = [None]
        else:
            self.kind = "chat"
            self.messages = record_messages(rec, require_assistant=False)
            self.turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
            if self.messages[-1]["role"] != "assistant":
                self.turns.append(len(self.messages))
        self.turn = 0
        self.out = None

    @property
    def done(self) -> bool:
        return self.turn >= len(self.turns)

    def prompt(self) -> list[int]:
        if self.kind == "tokens":
            ids = self.prompt_ids
        else:
            head = self.messages[: self.turns[self.turn]]
            try:
                text = self.tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a template may reject a role order: the record's fault
                raise BadRecord("template_error") from e
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_prompt_len:
            raise BadRecord("prompt_too_long")
        return ids

    def answer(self, new_ids: list[int]) -> None:
        """Fold the generated tokens (stop token included when one was hit) into the record."""
        if self.kind == "tokens":
            self.out = {"input_ids": self.prompt_ids + new_ids,
                        "loss_mask": [0] * len(self.prompt_ids) + [1] * len(new_ids)}
        else:
            text = self.tok.decode(new_ids, skip_special_tokens=True)
            i = self.turns[self.turn]
            if i == len(self.messages):
                self.messages.append({"role": "assistant", "content": text})
            else:
                self.messages[i] = {"role": "assistant", "content": text}
        self.turn += 1

    def record(self) -> dict:
        extra = {k: v for k, v in self.rec.items() if k not in ("messages", "conversations", "input_ids",
                                                                 "loss_mask", "source_index")}
        body = self.out if self.kind == "tokens" else {"messages": self.messages}
        return {**extra, **body, "source_index": self.index}


def _generate(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], max_new_tokens: int,
              temperature: float, top_p: float) -> list[list[int]]:
    """Left-padded batched decoding; per prompt the new tokens up to and including the first stop token."""
    dev = next(model.parameters()).device
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    att = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        att[b, P - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, eos_token_id=stop_ids or None, **kw)
    res = []
    stop = set(stop_ids)
    for row in out[:, P:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
        res.append(row[:cut])
    return res


def _read(path: str, start: int, stats: Counter):
    """(index, parsed record or BadRecord) for every non-blank line at index >= start."""
    index = -1
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            index += 1
            if index < start:
                continue
            stats["records"] += 1
            try:
                yield index, json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                yield index, BadRecord("invalid_json")


def regenerate(model, tokenizer, data: str, out: str, batch_size: int = 16, max_new_tokens: int = 512,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, max_prompt_len: int = 2048,
               log=print) -> dict:
    """Regenerate ``data`` into ``out`` (appending after what is there); returns the counts."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature, top_p: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    start = resume_point(out)
    if start:
        log(f"regenerate: {out} already holds records up to input {start - 1}: continuing from {start}")
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        pad_id = 0
    stop_ids = stop_token_ids(tokenizer, model)
    counts, bad = Counter(), Counter()
    t0, new_tokens = time.perf_counter(), 0

    def fail(reason):
        bad[reason] += 1

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "a") as f:
        pending = []

        def flush_batch(jobs):
            nonlocal new_tokens
            torch.manual_seed(seed * 1_000_003 + jobs[0].index)
            live = list(jobs)
            while live:
                prompts, ready = [], []
                for j in live:
                    try:
                        prompts.append(j.prompt())
                        ready.append(j)
                    except BadRecord as e:
                        fail(e.reason)
                    except Exception:  # noqa: BLE001 - odd text must not end the run
                        fail("unexpected_error")
                if not ready:
                    break
                try:
                    answers = _generate(model, prompts, pad_id, stop_ids, max_new_tokens, temperature, top_p)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory on a long batch: count, go on
                    log(f"regenerate: generation failed for records {[j.index for j in ready]}: "
                        f"{type(e).__name__}: {str(e)[:200]}")
                    for _ in ready:
                        fail("generation_error")
                    break
                for j, a in zip(ready, answers):
                    j.answer(a)
                    new_tokens += len(a)
                live = [j for j in ready if not j.done]
            for j in jobs:
                if j.done:
                    f.write(json.dumps(j.record()) + "\n")
                    counts["written"] += 1
            f.flush()
            log(f"regenerate: {counts['written']} written, {sum(bad.values())} skipped "
                f"({new_tokens / (time.perf_counter() - t0):,.0f} new tokens/s)")

        for index, rec in _read(data, start, counts):
            if isinstance(rec, BadRecord):
                fail(rec.reason)
                continue
            try:
                pending.append(_Job(index, rec, tokenizer, max_prompt_len))
            except BadRecord as e:
                fail(e.reason)
                continue
            except Exception:  # noqa: BLE001
                fail("unexpected_error")
                continue
            if len(pending) == batch_size:
                flush_batch(pending)
                pending = []
        if pending:
            flush_batch(pending)
    report = {"records": counts["records"], "written": counts["written"], "resumed_from": start,
              "bad": dict(bad), "new_tokens": new_tokens, "seconds": time.perf_counter() - t0}
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "none"
    log(f"regenerate: {data} -> {out}: wrote {report['written']} of {report['records']} records read"
        f"{f' (from input {start})' if start else ''}; skipped: {skipped}; {new_tokens} new tokens in "
        f"{report['seconds']:.1f}s")
    return report


def main(argv=None):
    from trainer.target import load_target

    p = argparse.ArgumentParser(description="Rewrite a JSONL dataset's responses with the target (trainer/regenerate.py).")
    p.add_argument("--target", required=True, help="local HF causal-LM folder")
    p.add_argument("--data", required=True, help="input JSONL (chat or pre-tokenized records)")
    p.add_argument("--out", required=True, help="output JSONL; an existing file is continued")
    p.add_argument("--batch-size", type=int, default=16, help="records decoded together (left-padded)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=2048, help="longer prompts are skipped as bad records")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on a GPU, float32 on a CPU")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    dtype = (torch.bfloat16 if dev.type == "cuda" else torch.float32) if a.dtype == "auto" else getattr(torch, a.dtype)
    target = load_target(a.target, k=1, device=dev, dtype=dtype)
    return regenerate(target.model, target.tokenizer, a.data, a.out, a.batch_size, a.max_new_tokens, a.temperature,
                      a.top_p, a.seed, a.max_prompt_len, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
