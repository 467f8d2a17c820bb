"""Random-weight Qwen3.5 hybrids, built in seconds: the benchmarks' targets and the ``tiny`` preset's.

Speed does not depend on the weights, so ``benchmarks/tok_s.py`` (and ``roles.py``, ``make_target.py``)
build the :data:`TEXT_CONFIGS` shapes in memory (:func:`random_qwen35_target`, :func:`synthetic_dataset`).

The trainer's ``tiny`` preset (``builtin_target="tiny"``) trains against the ``tiny`` shape written as a
target folder (:func:`ensure_tiny`, into ``<cache_dir>/tiny/``), so that a first run on a CPU starts
training in seconds instead of after the embedded default's minutes-long build (``trainer.build_default``):

- a small byte-level tokenizer trained on a few Python standard-library files;
- the random model, its embeddings drawn with std hidden^-1/2 (a logit of a unit-RMS hidden state has unit
  variance): the drafter predicts through the target's frozen LM head, and with the usual 0.02 init
  every logit is near zero, too flat for any drafter to predict a token confidently;
- training records that are windows of those files' text (the loss on all but the first tokens), and
  held-out prompts. Not the target's own continuations, as the embedded default's data is: a random
  target's greedy continuation repeats its last input token, which teaches a drafter nothing.
"""

import json
import os
import shutil
import time

import torch

from trainer.config import DEFAULT_CACHE

__all__ = ["TEXT_CONFIGS", "random_qwen35", "random_qwen35_target", "synthetic_dataset", "build_tiny", "ensure_tiny",
           "tiny_paths"]

# Qwen3_5TextConfig keywords of the random targets.
TEXT_CONFIGS = {
    # 4 layers (3 Gated DeltaNet, 1 full attention), hidden 64: seconds per step on a CPU
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
                 tie_word_embeddings=True, pad_token_id=0),
    # Qwen3.5-4B's published text config
    "real": dict(vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=True, pad_token_id=0),
}


def random_qwen35(text_cfg, seed: int = 0, device="cpu", dtype=torch.float32):
    """A ``Qwen3_5ForCausalLM`` with random weights from ``seed``, built directly on ``device`` in ``dtype``
    (no copy through the CPU); ``text_cfg`` is a ``Qwen3_5TextConfig`` or a :data:`TEXT_CONFIGS` name."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if isinstance(text_cfg, str):
        if text_cfg not in TEXT_CONFIGS:
            raise ValueError(f"text_cfg: unknown {text_cfg!r}; known: {sorted(TEXT_CONFIGS)}")
        text_cfg = Qwen3_5TextConfig(**TEXT_CONFIGS[text_cfg])
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3_5ForCausalLM(text_cfg)
    finally:
        torch.set_default_dtype(prev)


def random_qwen35_target(text_cfg, cfg, dev, dtype, elementwise: bool = False):
    """A random-weight Qwen3.5 hybrid as a :class:`trainer.target.Target` (no tokenizer), seeded by ``cfg.seed``
    and routed through dflash_kernels (its norms / MLPs / RoPE too with ``elementwise``)."""
    from dflash_kernels.integrations.transformers import use_dflash_kernels
    from trainer.config import default_target_layer_ids
    from trainer.target import Target

    model = random_qwen35(text_cfg, cfg.seed, dev, dtype)
    use_dflash_kernels(model, elementwise=elementwise)
    layers = model.config.num_hidden_layers
    ids = cfg.target_layer_ids or default_target_layer_ids(layers, cfg.num_target_layers)
    return Target(model, None, ids)


def synthetic_dataset(vocab: int, n: int, length: int, seed: int = 0):
    """Full-length random sequences (loss on all but the first 8 tokens): every step has ``length`` tokens."""
    from trainer.data import Dataset, DataStats

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        ids = torch.randint(8, vocab, (length,), generator=g)
        lm = torch.ones(length, dtype=torch.bool)
        lm[:8] = False
        seqs.append((ids, lm))
    return Dataset(seqs, DataStats(records=n, kept=n))


def tiny_paths(cache_dir: str = DEFAULT_CACHE) -> dict:
    """Where :func:`build_tiny` puts the tiny target: the same layout as the embedded default's."""
    from trainer.build_default import default_paths

    return default_paths(cache_dir, "tiny")


def build_tiny(out_root: str, n_train: int = 512, n_eval: int = 16, prompt_len: int = 16, length: int = 64,
               seed: int = 0, replace: bool = False, log=print) -> dict:
    """Write the tiny target folder, its training data and held-out prompts under ``out_root`` (see the module
    doc); returns the build's summary (also ``build.json``). Training records are ``length`` tokens (the
    ``tiny`` preset's ``max_len``), the loss on all but their first ``prompt_len``; the prompts are windows
    no training record holds. ``replace``: an earlier build in ``out_root`` is replaced (else kept, if one
    is published meanwhile)."""
    from transformers import Qwen3_5TextConfig

    from trainer.build_default import read, stdlib_files, train_tokenizer

    t0 = time.perf_counter()
    files = stdlib_files()
    # a few files spread over the sorted list: the tokenizer learns from half of them, the records come from all
    picked = files[:: max(len(files) // 24, 1)][:24]
    texts = [read(f) for f in picked]
    vocab = TEXT_CONFIGS["tiny"]["vocab_size"]
    tok = train_tokenizer(texts[::2], vocab)
    text_cfg = Qwen3_5TextConfig(**{**TEXT_CONFIGS["tiny"], "pad_token_id": tok.pad_token_id,
                                    "eos_token_id": tok.eos_token_id, "bos_token_id": None})
    model = random_qwen35(text_cfg, seed).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, text_cfg.hidden_size ** -0.5,
                                                    generator=torch.Generator().manual_seed(seed))
    ids = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor(ids, dtype=torch.long)
    n = n_train + n_eval
    stride = max((ids.numel() - length) // n, 1)
    windows = [ids[i * stride: i * stride + length].tolist() for i in range(n)]
    tmp = f"{out_root}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(os.path.join(tmp, "target"))
    tok.save_pretrained(os.path.join(tmp, "target"))
    with open(os.path.join(tmp, "train.jsonl"), "w") as f:
        for w in windows[:n_train]:
            f.write(json.dumps({"input_ids": w, "loss_mask": [0] * prompt_len + [1] * (len(w) - prompt_len)}) + "\n")
    with open(os.path.join(tmp, "eval_prompts.jsonl"), "w") as f:
        for w in windows[n_train:]:
            f.write(json.dumps({"input_ids": w[:prompt_len]}) + "\n")
    info = {"source": f"random tiny Qwen3.5 hybrid (trainer.random_target.TEXT_CONFIGS['tiny']); data: "
                      f"{length}-token windows of {len(picked)} Python standard-library files",
            "target": text_cfg.to_dict(), "vocab_size": len(tok), "train_records": n_train, "eval_prompts": n_eval,
            "seed": seed, "params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - t0}
    with open(os.path.join(tmp, "build.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    # Publish with one rename: an interrupted build never looks finished. Without ``replace`` a concurrent
    # build that published first wins (same seed: the same files).
    if replace and os.path.isdir(out_root):
        shutil.rmtree(out_root)
    try:
        os.rename(tmp, out_root)
    except OSError:
        if not os.path.exists(os.path.join(out_root, "build.json")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny target: a random {text_cfg.num_hidden_layers}-layer Qwen3.5 hybrid (hidden {text_cfg.hidden_size}), "
        f"a {len(tok)}-token tokenizer, {n_train} training records, built in {time.perf_counter() - t0:.1f}s")
    return info


def ensure_tiny(cache_dir: str = DEFAULT_CACHE, force: bool = False, log=print) -> dict:
    """The tiny target's paths (:func:`tiny_paths`), building it first when absent (or when ``force``)."""
    paths = tiny_paths(cache_dir)
    if force or not os.path.exists(paths["build"]):
        log(f"tiny target: building a random tiny target and its data into {paths['root']} (seconds, once)")
        os.makedirs(cache_dir, exist_ok=True)
        build_tiny(paths["root"], replace=force, log=log)
    else:
        log(f"tiny target: {paths['root']}")
    return paths
