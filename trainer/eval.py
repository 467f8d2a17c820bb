"""Acceptance length of a drafter by real block speculative decoding, next to an untrained drafter's.

    python -m trainer.eval                                   # the embedded default's run and prompts
    python -m trainer.eval --drafter runs/x/drafter --target DIR --prompts prompts.jsonl

One decoding round: the last token (the anchor, produced by the target) opens a block of
``block_size`` positions, the rest mask tokens; the drafter, conditioned on the target features of
every earlier position, proposes ``block_size - 1`` tokens at once; the target scores the sequence
with the proposals appended and keeps the longest prefix that equals its own greedy choice, plus its
own next token. The acceptance length of the round is that matched prefix + 1; the output is exactly
the target's greedy decoding (tested).

The target is re-run on the whole sequence each round (no KV cache): correct for every
architecture, hybrids included (a Gated DeltaNet state cannot be rolled back past rejected drafts
without extra bookkeeping); fine for evaluation, not a serving path.

Prompts JSONL: ``{"input_ids": [...]}``, ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered
with the chat template and a generation prompt).
"""

import argparse
import json
import os
import time

import torch

from trainer.model import DFlashDrafter
from trainer.target import Target, load_target

__all__ = ["speculative_generate", "greedy_generate", "acceptance_length", "load_prompts", "main"]


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, target: Target, seq: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Proposals ``[block_size - 1]`` for the positions after the last token of ``seq`` ``[1, L]``.

    ``feats`` ``[1, >= L - 1, k*H]``: target features of the positions before the anchor (L - 1).
    """
    cfg = drafter.config
    anchor = seq.shape[1] - 1
    # The block sees context keys kv < anchor: every position before the anchor (anchor == S).
    ctx = feats[:, :anchor]
    block = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=seq.dtype, device=seq.device)
    block[0, 0] = seq[0, anchor]
    anchors = torch.tensor([[anchor]], device=seq.device)
    hidden = drafter(target.embed(block).to(ctx.dtype), ctx, anchors)
    return target.lm_head(hidden)[0, 1:].argmax(-1)


@torch.no_grad()
def speculative_generate(drafter, target, prompt: torch.Tensor, max_new_tokens: int, eos_id=None):
    """Greedy decoding of ``prompt`` ``[L]`` with block drafts; returns (new tokens, acceptance lengths)."""
    seq = prompt[None].to(target.device)
    logits, feats = target.logits_and_features(seq)
    seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    accepts = []
    P = prompt.numel()
    while seq.shape[1] - P < max_new_tokens and not (eos_id is not None and bool((seq[0, P:] == eos_id).any())):
        anchor = seq.shape[1] - 1
        draft = draft_block(drafter, target, seq, feats)
        logits, feats_all = target.logits_and_features(torch.cat([seq, draft[None]], 1))
        verify = logits[0, anchor:].argmax(-1)  # verify[j]: the target's token for position anchor + 1 + j
        match = (draft == verify[:-1]).int()
        m = int(match.cumprod(0).sum())
        seq = torch.cat([seq, draft[None, :m], verify[None, m:m + 1]], 1)
        feats = feats_all[:, :anchor + m + 1]  # verified positions only: the rejected tail never leaks in
        accepts.append(m + 1)
    new = seq[0, prompt.numel():]
    new = new[:max_new_tokens]
    if eos_id is not None and (new == eos_id).any():
        new = new[: int((new == eos_id).nonzero()[0]) + 1]
    return new.cpu(), accepts


@torch.no_grad()
def greedy_generate(target: Target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding without a cache (the reference speculative decoding must match)."""
    seq = prompt[None].to(target.device)
    for _ in range(max_new_tokens):
        logits, _ = target.logits_and_features(seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, prompt.numel():].cpu()


def acceptance_length(drafter, target, prompts, max_new_tokens: int, eos_id=None) -> dict:
    """Mean acceptance length over all rounds of all prompts (and per-prompt means)."""
    drafter.eval()
    all_acc, per_prompt, t0 = [], [], time.perf_counter()
    for p in prompts:
        _, acc = speculative_generate(drafter, target, p, max_new_tokens, eos_id)
        all_acc += acc
        per_prompt.append(sum(acc) / max(len(acc), 1))
    return {"tau": sum(all_acc) / max(len(all_acc), 1), "rounds": len(all_acc), "prompts": len(prompts),
            "per_prompt": per_prompt, "seconds": time.perf_counter() - t0}


def load_prompts(path: str, tokenizer, limit: int | None = None) -> list[torch.Tensor]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "input_ids" in rec:
                ids = rec["input_ids"]
            elif "prompt" in rec:
                ids = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer.apply_chat_template(rec["messages"], tokenize=True, add_generation_prompt=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            out.append(torch.tensor(ids, dtype=torch.long))
            if limit and len(out) >= limit:
                break
    return out


def main(argv=None):
    from trainer.build_default import default_paths
    from trainer.config import BUILTIN_TARGETS, DEFAULT_CACHE

    p = argparse.ArgumentParser(description="Acceptance length of a DFlash drafter (block speculative decoding).")
    p.add_argument("--drafter", default="runs/dflash/drafter", help="HF-style drafter folder (trainer.train output)")
    p.add_argument("--target", default="", help="target folder (default: the built-in target --builtin-target names)")
    p.add_argument("--prompts", default="", help="held-out prompts JSONL (default: the built-in target's)")
    p.add_argument("--builtin-target", default="embedded", choices=BUILTIN_TARGETS,
                   help="the built-in target a drafter trained without --target was trained on: embedded (default) "
                   "or tiny (trainer.train --preset tiny)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--cache-dir", default=DEFAULT_CACHE)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="seed of the untrained drafter")
    a = p.parse_args(argv)
    paths = default_paths(a.cache_dir, a.builtin_target)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    trained = DFlashDrafter.from_pretrained(a.drafter, device=dev).to(dtype)
    target = load_target(a.target or paths["target"], trained.config.target_layer_ids, device=dev, dtype=dtype)
    prompts = load_prompts(a.prompts or paths["eval_prompts"], target.tokenizer, a.num_prompts)
    torch.manual_seed(a.seed)
    untrained = DFlashDrafter(trained.config).to(dev, dtype)
    eos = target.tokenizer.eos_token_id
    res = {}
    for name, d in (("trained", trained), ("untrained", untrained)):
        r = acceptance_length(d, target, prompts, a.max_new_tokens, eos)
        res[name] = r
        print(f"{name:>9}: acceptance length {r['tau']:.3f} over {r['rounds']} rounds, {r['prompts']} prompts "
              f"({r['seconds']:.1f}s)", flush=True)
    out = {"drafter": os.path.abspath(a.drafter), "target": a.target or paths["target"],
           "max_new_tokens": a.max_new_tokens, "block_size": trained.config.block_size,
           **{k: {kk: v for kk, v in r.items() if kk != "per_prompt"} for k, r in res.items()}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
