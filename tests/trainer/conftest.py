"""Tiny targets, tokenizer and data for the trainer tests (random weights, built once per session).

The drafter's attention runs on the ``reference`` backend here whatever the environment says: the
trainer tests check the trainer's wiring (masks, positions, labels), the op tests check the kernels.
Set ``DFLASH_TRAINER_TEST_BACKEND=interpret`` to run them through the Triton interpreter instead (slow).
"""

import json
import os

import pytest
import torch

import dflash_kernels as dk

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
]


@pytest.fixture(autouse=True, scope="session")
def _attention_backend():
    dk.set_backend("attention", os.environ.get("DFLASH_TRAINER_TEST_BACKEND", "reference"))
    yield
    dk.set_backend("attention", "auto")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from trainer.build_default import train_tokenizer
    return train_tokenizer(TEXT * 4, vocab_size=320)


def _save(model, tok, path):
    # Unit-scale embeddings (the LM head is tied): with the default 0.02 init every logit is near 0
    # and no drafter could express a confident prediction through this head.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer):
    """A random dense Qwen3: 6 layers, hidden 64."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=tiny_tokenizer.pad_token_id)
    return _save(Qwen3ForCausalLM(cfg).eval(), tiny_tokenizer, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen35_dir(tmp_path_factory, tiny_tokenizer):
    """A random Qwen3.5 hybrid (Gated DeltaNet and full attention), 4 layers, hidden 64."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                            max_position_embeddings=512, tie_word_embeddings=True,
                            pad_token_id=tiny_tokenizer.pad_token_id)
    return _save(Qwen3_5ForCausalLM(cfg).eval(), tiny_tokenizer, tmp_path_factory.mktemp("qwen35"))


def counting_records(vocab: int, n: int, length: int, seed: int = 0):
    """Pre-tokenized records whose tokens count up by one (mod a range): learnable from the anchor alone."""
    g = torch.Generator().manual_seed(seed)
    recs = []
    for _ in range(n):
        start = int(torch.randint(10, vocab - 10, (1,), generator=g))
        ids = [10 + (start + t - 10) % (vocab - 20) for t in range(length)]
        recs.append({"input_ids": ids, "loss_mask": [0] * 4 + [1] * (length - 4)})
    return recs


@pytest.fixture(scope="session")
def counting_data(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for r in counting_records(len(tiny_tokenizer), 16, 60):
            f.write(json.dumps(r) + "\n")
    return str(path)
