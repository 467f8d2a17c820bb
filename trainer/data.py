"""Training data: JSONL records -> token ids and loss masks -> padded batches with sampled anchors.

Two record formats, one JSON object per line:
- chat: ``{"messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}`` (or
  ShareGPT's ``{"conversations": [{"from": "human" | "gpt" | "system", "value": str}, ...]}``),
  rendered with the target tokenizer's chat template; the loss mask covers each assistant turn
  as the template renders it (content and end-of-turn tokens).
- pre-tokenized: ``{"input_ids": [int, ...], "loss_mask": [0/1, ...]}`` of equal length.

A record that cannot be used is counted under a reason and skipped, never fatal; the counts are
reported once. Anchors are drawn per sequence and per epoch from a generator seeded by (seed,
epoch, record index), so a resumed run sees exactly the batches of an uninterrupted one.
"""

import json
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = ["DataStats", "Dataset", "load_jsonl", "render_chat", "sample_anchors", "batch_at", "steps_per_epoch"]

_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
          "tool": "tool"}


@dataclass
class DataStats:
    records: int = 0  # lines seen (blank lines excluded)
    kept: int = 0  # records turned into sequences
    truncated: int = 0  # kept records cut to max_len
    bad: Counter = field(default_factory=Counter)  # reason -> count

    def report(self, path: str) -> str:
        bad = ", ".join(f"{k}={v}" for k, v in sorted(self.bad.items())) or "none"
        return (f"data: {path}: kept {self.kept} of {self.records} records; skipped: {bad}; "
                f"truncated to max_len: {self.truncated}")


class BadRecord(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _messages(rec) -> list[dict]:
    if "messages" in rec:
        raw, rk, ck = rec["messages"], "role", "content"
    elif "conversations" in rec:
        raw = rec["conversations"]
        rk, ck = ("from", "value") if raw and isinstance(raw[0], dict) and "from" in raw[0] else ("role", "content")
    else:
        raise BadRecord("unknown_format")
    if not isinstance(raw, list) or not raw:
        raise BadRecord("bad_messages")
    msgs = []
    for m in raw:
        if not isinstance(m, dict) or m.get(rk) not in _ROLES or not isinstance(m.get(ck), str):
            raise BadRecord("bad_messages")
        msgs.append({"role": _ROLES[m[rk]], "content": m[ck]})
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRecord("no_assistant_turn")
    return msgs


def render_chat(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation; the mask is 1 on the assistant turns' tokens.

    Each assistant turn i spans the characters from the end of ``template(messages[:i],
    add_generation_prompt=True)`` to the end of ``template(messages[:i + 1])`` in the full
    rendering; tokens whose characters fall in a span are loss tokens. Templates whose partial
    renderings are not prefixes of the full one (some drop earlier turns' reasoning) fall back to
    the turn's content found in the text.
    """
    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    try:
        text = render(messages)
    except Exception as e:  # a template may reject a role order; that is the record's fault
        raise BadRecord("template_error") from e
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, full = render(messages[:i], gen=True), render(messages[:i + 1])
        if text.startswith(full) and full.startswith(head) and len(head) >= cursor:
            spans.append((len(head), len(full)))
            cursor = len(full)
        else:
            start = text.find(m["content"], cursor)
            if start < 0:
                raise BadRecord("template_error")
            spans.append((start, start + len(m["content"])))
            cursor = start + len(m["content"])
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [int(any(a < hi and b > lo for lo, hi in spans)) for a, b in enc["offset_mapping"]]
    return ids, mask


def _pretokenized(rec, vocab_size):
    ids, lm = rec.get("input_ids"), rec.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRecord("bad_input_ids")
    if lm is None:
        lm = [1] * len(ids)
    if not isinstance(lm, list) or not all(x in (0, 1, True, False) for x in lm):
        raise BadRecord("bad_loss_mask")
    if len(lm) != len(ids):
        raise BadRecord("length_mismatch")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise BadRecord("token_out_of_range")
    return ids, [int(x) for x in lm]


def record_to_sequence(rec, tokenizer, vocab_size, max_len, block_size):
    """One parsed JSON value -> (ids, loss_mask) lists, truncated to max_len; raises BadRecord."""
    if not isinstance(rec, dict):
        raise BadRecord("not_an_object")
    if "input_ids" in rec:
        ids, lm = _pretokenized(rec, vocab_size)
    else:
        if tokenizer is None:
            raise BadRecord("chat_without_tokenizer")
        ids, lm = render_chat(_messages(rec), tokenizer)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise BadRecord("token_out_of_range")
    truncated = len(ids) > max_len
    ids, lm = ids[:max_len], lm[:max_len]
    if not any(lm):
        raise BadRecord("no_loss_tokens")
    if not any(lm[: max(len(ids) - block_size + 1, 0)]):
        raise BadRecord("too_short_for_a_block")
    return ids, lm, truncated


class Dataset:
    """Sequences as ``(ids int64 [L], loss_mask bool [L])`` pairs with L <= max_len."""

    def __init__(self, seqs, stats: DataStats):
        self.seqs = seqs
        self.stats = stats

    def __len__(self):
        return len(self.seqs)


def load_jsonl(path: str, tokenizer, max_len: int, block_size: int, vocab_size=None, log=print) -> Dataset:
    """Read a JSONL file; bad records are counted per reason, reported through ``log``, and skipped."""
    stats, seqs = DataStats(), []
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            stats.records += 1
            try:
                try:
                    rec = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    raise BadRecord("invalid_json")
                ids, lm, truncated = record_to_sequence(rec, tokenizer, vocab_size, max_len, block_size)
            except BadRecord as e:
                stats.bad[e.reason] += 1
                continue
            except Exception:  # a tokenizer failing on odd text must not end the run either
                stats.bad["unexpected_error"] += 1
                continue
            stats.kept += 1
            stats.truncated += truncated
            seqs.append((torch.tensor(ids, dtype=torch.long), torch.tensor(lm, dtype=torch.bool)))
    if log is not None:
        log(stats.report(path))
    if not seqs:
        raise ValueError(f"data: no usable record in {path} ({stats.report(path)})")
    return Dataset(seqs, stats)


def _generator(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k)) % (2 ** 63 - 1)
    return torch.Generator().manual_seed(seed)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, gen: torch.Generator):
    """Up to ``num_anchors`` distinct sorted anchors among loss-mask positions ``p <= L - block_size``.

    ``L = len(loss_mask)``: every label ``p + j`` (j < block_size) of an anchor's block lies inside
    the sequence.
    """
    L = loss_mask.shape[0]
    cand = torch.nonzero(loss_mask[: max(L - block_size + 1, 0)]).flatten()
    n = min(num_anchors, cand.numel())
    pick = cand[torch.randperm(cand.numel(), generator=gen)[:n]]
    return torch.sort(pick).values


def steps_per_epoch(n_seqs: int, batch_size: int) -> int:
    return max(n_seqs // batch_size, 1)


def batch_at(ds: Dataset, step: int, batch_size: int, max_len: int, num_anchors: int, block_size: int,
             seed: int, pad_id: int = 0) -> dict:
    """The batch of global step ``step``: a pure function of (data, step, seed), so resume is exact.

    Returns ``input_ids`` int64 ``[B, S]`` (S = max_len, right-padded with ``pad_id``), ``loss_mask``
    bool ``[B, S]``, ``lengths`` ``[B]``, ``anchors`` int64 ``[B, N]`` (0 where unused), ``valid``
    bool ``[B, N]`` and ``epoch``.
    """
    spe = steps_per_epoch(len(ds), batch_size)
    epoch, i = divmod(step, spe)
    order = torch.randperm(len(ds), generator=_generator(seed, epoch))
    idx = order[i * batch_size:(i + 1) * batch_size].tolist()
    if len(idx) < batch_size:  # fewer sequences than one batch: repeat them
        idx = (idx * batch_size)[:batch_size] if idx else [0] * batch_size
    B, S, N = batch_size, max_len, num_anchors
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    anchors = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    for b, r in enumerate(idx):
        ids, lm = ds.seqs[r]
        L = ids.shape[0]
        input_ids[b, :L], loss_mask[b, :L], lengths[b] = ids, lm, L
        a = sample_anchors(lm, N, block_size, _generator(seed, epoch, r, 1))
        anchors[b, :a.numel()], valid[b, :a.numel()] = a, True
    return {"input_ids": input_ids, "loss_mask": loss_mask, "lengths": lengths, "anchors": anchors,
            "valid": valid, "epoch": epoch}
