"""A random-weight target folder and data for ``trainer.train`` at the benchmarks' shapes.

    python benchmarks/make_target.py --preset real --out /tmp/real [--sequences 64] [--device auto]
    python -m trainer.train --target /tmp/real/target --data /tmp/real/train.jsonl \\
        --target-gpus 0 --drafter-gpus 1 --steps 30 --out-dir runs/real-2gpu

``tok_s`` and ``roles`` build their random targets in memory; the trainer's pipeline loads its target
from a folder, once per target GPU. This writes what it loads:

- ``OUT/target``: the preset's Qwen3.5 hybrid (``tok_s.TEXT_CONFIGS`` for ``tiny`` and ``real``,
  ``roles.TEXT_27B`` for ``27b``) with random weights from ``--seed``, saved in bf16 (54 GB for ``27b``),
  and a small byte-level tokenizer (``trainer.build_default.train_tokenizer``): the data is pre-tokenized,
  so the tokenizer only gives the pad and mask ids;
- ``OUT/train.jsonl``: ``--sequences`` pre-tokenized records of the trainer preset's ``max_len`` tokens
  (``default``: 3072 for ``real`` and ``27b``; ``tiny``: 64), random ids, the loss on all but the first
  8 (``tok_s``'s synthetic data), so every step has the same shape.

The model is built on ``--device`` (default: the GPU when there is one; a 4B target takes minutes on a
CPU) and only its weights are saved: speed does not depend on them.
"""

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

PRESETS = ("tiny", "real", "27b")


def text_config(name: str) -> dict:
    if name == "27b":
        from roles import TEXT_27B
        return dict(TEXT_27B)
    from tok_s import TEXT_CONFIGS
    return dict(TEXT_CONFIGS[name])


def train_preset(name: str) -> str:
    """The trainer preset whose run shape the benchmarks use with this target."""
    return "tiny" if name == "tiny" else "default"


def write_data(path: str, vocab: int, n: int, length: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(8, vocab, (length,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * (length - 8)}) + "\n")


def make(name: str, out: str, sequences: int = 64, device: str = "auto", seed: int = 0, log=print) -> dict:
    """Write ``out/target`` and ``out/train.jsonl``; returns their paths."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from trainer.build_default import train_tokenizer
    from trainer.config import preset

    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; choose one of {list(PRESETS)}")
    if sequences < 1:
        raise ValueError(f"sequences: expected at least 1, got {sequences}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    paths = {"target": os.path.join(out, "target"), "data": os.path.join(out, "train.jsonl")}
    os.makedirs(paths["target"], exist_ok=True)
    t0 = time.perf_counter()
    tok = train_tokenizer(["a random-weight benchmark target: the data is pre-tokenized"] * 8, vocab_size=300)
    text = Qwen3_5TextConfig(**{**text_config(name), "pad_token_id": tok.pad_token_id})
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = Qwen3_5ForCausalLM(text)
    finally:
        torch.set_default_dtype(prev)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(paths["target"])
    tok.save_pretrained(paths["target"])
    del model
    length = preset(train_preset(name)).max_len
    write_data(paths["data"], text.vocab_size, sequences, length, seed)
    log(f"make_target: {name}: {n_params / 1e9:.2f}B parameters (bf16) -> {paths['target']}; {sequences} "
        f"sequences of {length} tokens -> {paths['data']} ({time.perf_counter() - t0:.1f}s on {dev})")
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=PRESETS, default="real")
    p.add_argument("--out", required=True, help="folder for target/ and train.jsonl")
    p.add_argument("--sequences", type=int, default=64, help="records in train.jsonl")
    p.add_argument("--device", default="auto", help="where the model is built: auto, cuda or cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return make(args.preset, args.out, args.sequences, args.device, args.seed)


if __name__ == "__main__":
    main()
