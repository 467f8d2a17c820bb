"""use_dflash_kernels: a Qwen3.5 hybrid gives the same logits, gradients and cached generation
through dflash_kernels as through transformers' own torch path."""

import inspect

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.integrations.transformers import ADAPTERS, use_dflash_kernels
from tests.helpers import device, rel_err

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402


@pytest.fixture()
def model(monkeypatch):
    # transformers calls fla / causal-conv1d instead of its own torch code when they import (the GPU
    # machine has them as peers, and fla's backward refuses on Hopper with triton < 3.7.1): the
    # reference here is transformers' torch path, the function each hub wrapper wraps.
    for name in ADAPTERS:
        if hasattr(modeling_qwen3_5, name):
            monkeypatch.setattr(modeling_qwen3_5, name, inspect.unwrap(getattr(modeling_qwen3_5, name)))
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, max_position_embeddings=256)
    return Qwen3_5ForCausalLM(cfg).to(device()).float().eval()


def _require_kernels():
    for op in ("conv1d", "gdn"):
        backend = dk.runtime.resolve(op, device())
        if backend not in ("interpret", "triton"):
            pytest.fail(f"needs the Triton kernels for {op} (TRITON_INTERPRET=1 on the CPU), got {backend!r}")


def test_logits_and_gradients_match_transformers(model):
    _require_kernels()
    ids = torch.randint(0, 97, (2, 70), device=device())
    ref = model(ids).logits
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    routing = use_dflash_kernels(model)
    try:
        for name, adapter in ADAPTERS.items():
            assert getattr(modeling_qwen3_5, name) is adapter, name
        out = model(ids).logits
        out.square().mean().backward()
    finally:
        routing.undo()
    # fp32 on a GPU: the kernels' fp32 products run on tensor cores in tf32 (10-bit mantissa), the
    # reference's torch matmuls in full fp32 (the worst gradient is dt_bias of layer 0); the
    # interpreter is exact fp32.
    tol_out, tol_grad = (1e-3, 5e-3) if out.is_cuda else (1e-4, 1e-3)
    assert rel_err(out, ref) < tol_out
    for name, g in ref_grads.items():
        got = dict(model.named_parameters())[name].grad
        assert rel_err(got, g) < tol_grad, name
    assert modeling_qwen3_5.causal_conv1d_fn is not ADAPTERS["causal_conv1d_fn"], "undo restores"


def test_cached_generation_matches(model):
    _require_kernels()
    ids = torch.randint(0, 97, (1, 20), device=device())
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    routing = use_dflash_kernels(model)
    try:
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    finally:
        routing.undo()
    assert torch.equal(out, ref)


def test_undo_reverts_only_its_own_routing(model):
    # A helper that routes for a while (trainer.build_default on a GPU) must not unroute its caller.
    outer = use_dflash_kernels(model)
    try:
        inner = use_dflash_kernels(model)
        inner.undo()
        for name, adapter in ADAPTERS.items():
            assert getattr(modeling_qwen3_5, name) is adapter, name
    finally:
        outer.undo()
    for name, adapter in ADAPTERS.items():
        assert getattr(modeling_qwen3_5, name) is not adapter, name


def test_model_without_linear_attention_is_refused():
    with pytest.raises(ValueError, match="model: Linear has no layer"):
        use_dflash_kernels(torch.nn.Linear(2, 2))
