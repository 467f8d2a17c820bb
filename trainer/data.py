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

Packing (``load_jsonl(..., pack=True)``, the trainer's ``--pack``): sequences are concatenated in
file order into rows of at most ``max_len`` tokens (next fit), each token carrying its document id.
Anchors are drawn only where the whole block, ``anchor .. anchor + block_size - 1``, lies in one
document, so no label crosses a boundary. Two helpers keep the model side per document:
:func:`packed_target_features` runs the target on every document as its own sequence (position ids
restarting per document, document-causal attention, ``cu_seqlens`` for Gated DeltaNet and
``seq_idx`` for the conv), and :func:`packed_drafter_masks` limits each block's context to its own
document. Limits are in those functions' docstrings.
"""

import json
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = ["DataStats", "Dataset", "BadRecord", "load_jsonl", "render_chat", "record_messages", "sample_anchors",
           "batch_at", "steps_per_epoch", "seeded_generator", "pack_sequences", "packed_target_features",
           "packed_drafter_masks"]

_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system",
          "tool": "tool"}


@dataclass
class DataStats:
    records: int = 0  # lines seen (blank lines excluded)
    kept: int = 0  # records turned into sequences
    truncated: int = 0  # kept records cut to max_len
    bad: Counter = field(default_factory=Counter)  # reason -> count
    packed_rows: int = 0  # rows the kept sequences were packed into (0: not packed)

    def report(self, path: str) -> str:
        bad = ", ".join(f"{k}={v}" for k, v in sorted(self.bad.items())) or "none"
        packed = f"; packed into {self.packed_rows} rows" if self.packed_rows else ""
        return (f"data: {path}: kept {self.kept} of {self.records} records; skipped: {bad}; "
                f"truncated to max_len: {self.truncated}{packed}")


class BadRecord(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def record_messages(rec, require_assistant: bool = True) -> list[dict]:
    """A chat record's turns as ``[{"role", "content"}]`` (``messages`` or ShareGPT ``conversations``);
    :class:`BadRecord` if malformed."""
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
    if require_assistant and not any(m["role"] == "assistant" for m in msgs):
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
        ids, lm = render_chat(record_messages(rec), tokenizer)
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
    """Sequences as ``(ids int64 [L], loss_mask bool [L])`` pairs with L <= max_len.

    ``doc_ids``: for a packed dataset, one int64 ``[L]`` per row (documents 0, 1, ... in order);
    None otherwise.
    """

    def __init__(self, seqs, stats: DataStats, doc_ids=None):
        self.seqs = seqs
        self.stats = stats
        self.doc_ids = doc_ids

    def __len__(self):
        return len(self.seqs)


def load_jsonl(path: str, tokenizer, max_len: int, block_size: int, vocab_size=None, log=print,
               pack: bool = False) -> Dataset:
    """Read a JSONL file; bad records are counted per reason, reported through ``log``, and skipped.

    With ``pack`` the sequences are packed into rows of at most ``max_len`` tokens (:func:`pack_sequences`).
    """
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
    doc_ids = None
    if pack and seqs:
        rows = pack_sequences(seqs, max_len)
        seqs, doc_ids = [(ids, lm) for ids, lm, _ in rows], [doc for _, _, doc in rows]
        stats.packed_rows = len(rows)
    if log is not None:
        log(stats.report(path))
    if not seqs:
        raise ValueError(f"data: no usable record in {path} ({stats.report(path)})")
    return Dataset(seqs, stats, doc_ids)


def pack_sequences(seqs, max_len: int) -> list:
    """Concatenate ``(ids, loss_mask)`` sequences in order into rows of at most ``max_len`` tokens.

    Next fit: a sequence that does not fit in the current row starts a new one (O(n), keeps the
    file order, so a row's documents are neighbours in the data). Returns ``(ids, loss_mask,
    doc_ids)`` per row, ``doc_ids`` int64 numbering the row's documents 0, 1, ...
    """
    rows, cur = [], []

    def close():
        if cur:
            doc = torch.cat([torch.full((ids.numel(),), d, dtype=torch.long) for d, (ids, _) in enumerate(cur)])
            rows.append((torch.cat([i for i, _ in cur]), torch.cat([m for _, m in cur]), doc))

    used = 0
    for ids, lm in seqs:
        n = ids.numel()
        if n > max_len:
            raise ValueError(f"seqs: a sequence of {n} tokens exceeds max_len={max_len}")
        if used + n > max_len:
            close()
            cur, used = [], 0
        cur.append((ids, lm))
        used += n
    close()
    return rows


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of ints (seed, epoch, row, ...): the same key, the same draws."""
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k)) % (2 ** 63 - 1)
    return torch.Generator().manual_seed(seed)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, gen: torch.Generator,
                   doc_ids: torch.Tensor | None = None):
    """Up to ``num_anchors`` distinct sorted anchors among loss-mask positions ``p <= L - block_size``.

    ``L = len(loss_mask)``: every label ``p + j`` (j < block_size) of an anchor's block lies inside
    the sequence. With ``doc_ids`` (a packed row) also ``doc_ids[p] == doc_ids[p + block_size - 1]``:
    the whole block lies in one document (documents are contiguous).
    """
    L = loss_mask.shape[0]
    ok = loss_mask[: max(L - block_size + 1, 0)]
    if doc_ids is not None and ok.numel():
        ok = ok & (doc_ids[: ok.numel()] == doc_ids[block_size - 1: block_size - 1 + ok.numel()])
    cand = torch.nonzero(ok).flatten()
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
    bool ``[B, N]`` and ``epoch``; for a packed dataset also ``doc_ids`` int64 ``[B, S]`` (-1 on
    padding) and ``position_ids`` ``[B, S]`` (restarting at 0 in every document, 0 on padding).
    """
    spe = steps_per_epoch(len(ds), batch_size)
    epoch, i = divmod(step, spe)
    order = torch.randperm(len(ds), generator=seeded_generator(seed, epoch))
    idx = order[i * batch_size:(i + 1) * batch_size].tolist()
    if len(idx) < batch_size:  # fewer sequences than one batch: repeat them
        idx = (idx * batch_size)[:batch_size] if idx else [0] * batch_size
    B, S, N = batch_size, max_len, num_anchors
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    anchors = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    packed = getattr(ds, "doc_ids", None) is not None
    doc_ids = torch.full((B, S), -1, dtype=torch.long) if packed else None
    for b, r in enumerate(idx):
        ids, lm = ds.seqs[r]
        L = ids.shape[0]
        input_ids[b, :L], loss_mask[b, :L], lengths[b] = ids, lm, L
        doc = ds.doc_ids[r] if packed else None
        if packed:
            doc_ids[b, :L] = doc
        a = sample_anchors(lm, N, block_size, seeded_generator(seed, epoch, r, 1), doc)
        anchors[b, :a.numel()], valid[b, :a.numel()] = a, True
    out = {"input_ids": input_ids, "loss_mask": loss_mask, "lengths": lengths, "anchors": anchors,
           "valid": valid, "epoch": epoch}
    if packed:
        out["doc_ids"] = doc_ids
        out["position_ids"] = _positions_in_documents(doc_ids)
    return out


def _segments(doc_ids: torch.Tensor):
    """Flattened ``[B * S]`` view of the rows' documents (each row's padding a segment of its own):
    the segment index of every position and the start offset of every segment."""
    B, S = doc_ids.shape
    change = torch.ones(B, S, dtype=torch.bool, device=doc_ids.device)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    change = change.reshape(-1)
    seg = change.long().cumsum(0) - 1
    starts = torch.nonzero(change).flatten()
    return seg, starts


def _positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    seg, starts = _segments(doc_ids)
    pos = torch.arange(seg.numel(), device=doc_ids.device) - starts[seg]
    return pos.view_as(doc_ids).masked_fill(doc_ids < 0, 0)


@torch.no_grad()
def packed_target_features(target, input_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Target features ``[B, S, k * H]`` of packed rows, every document computed as if alone.

    The ``B`` rows are flattened into one sequence of ``B * S`` tokens in which each document (and
    each row's padding) is a segment; the target runs once on it with
    - ``position_ids`` restarting at 0 in each segment: transformers then builds a
      document-causal attention mask (its packed-sequence detection needs no attention mask and
      no cache, which is how this call runs);
    - ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``: the segment
      boundaries, which Qwen3.5 / Qwen3-Next pass to the Gated DeltaNet as ``cu_seqlens``
      (flash-attention backends use them too);
    - ``seq_idx``: the segment of every position, which the short conv takes.
    Limits: the GDN and conv honour the boundaries only when they run on dflash_kernels
    (``load_target`` routes them, ``use_dflash_kernels``) or on fla / causal-conv1d; transformers'
    torch fallbacks ignore ``cu_seqlens`` / ``seq_idx`` and would mix documents. Other
    architectures must honour packed ``position_ids`` the same way (tested: Qwen3, Qwen3.5).
    """
    B, S = input_ids.shape
    seg, starts = _segments(doc_ids)
    pos = torch.arange(B * S, device=input_ids.device) - starts[seg]
    cu = torch.cat([starts, starts.new_tensor([B * S])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    out = target.model.base_model(input_ids=input_ids.reshape(1, B * S), position_ids=pos[None],
                                  seq_idx=seg[None].to(torch.int32), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=max_len, max_length_k=max_len, output_hidden_states=True,
                                  use_cache=False)
    return target._select(out.hidden_states).view(B, S, -1)


def packed_drafter_masks(drafter, anchors: torch.Tensor, doc_ids: torch.Tensor, valid: torch.Tensor | None = None):
    """The drafter's masks for packed rows: as ``drafter.masks`` (context ``kv < anchor``, within the
    window on sliding layers, plus the block itself) and, in addition, context keys only from the
    anchor's own document. Pass them as ``drafter(..., masks=...)``.

    ``dflash_block_mask`` has no per-block lower bound, so this goes through flex's
    ``create_block_mask`` and :func:`dflash_kernels.from_flex_block_mask` (public API; query groups
    of one draft block, key blocks of 64). Correct, but the flex mask build costs host time per step
    (about a second per mask at 3072 x 512 anchors).
    """
    import dflash_kernels as dk
    from torch.nn.attention.flex_attention import create_block_mask

    cfg = drafter.config
    bs = cfg.block_size
    B, N = anchors.shape
    S = doc_ids.shape[1]
    if valid is None:
        valid = torch.ones(B, N, dtype=torch.bool, device=anchors.device)
    anchors = anchors.long()
    anchor_doc = torch.gather(doc_ids, 1, anchors.clamp(max=S - 1))
    out = {}
    for t in set(cfg.layer_types):
        window = cfg.sliding_window if t == "sliding_attention" else None

        def mask_mod(b, h, q_idx, kv_idx, window=window):
            blk = q_idx // bs
            a = anchors[b, blk]
            ctx = (kv_idx < a) & (doc_ids[b, kv_idx.clamp(max=S - 1)] == anchor_doc[b, blk])
            if window is not None:
                ctx = ctx & (kv_idx >= a - window)
            own = (kv_idx >= S) & ((kv_idx - S) // bs == blk)
            return (ctx | own) & valid[b, blk]

        bm = create_block_mask(mask_mod, B, None, N * bs, S + N * bs, device=anchors.device, BLOCK_SIZE=(bs, 64))
        out[t] = dk.from_flex_block_mask(bm)
    return out
