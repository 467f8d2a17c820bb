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


@pytest.fixture(autouse=True, scope="module")
def _routing_of_other_tests_undone():
    """``trainer.target.load_target`` routes process-wide and for good (trainer tests leave it on), while
    these tests compare a routed model with transformers' own functions and check what ``undo`` restores:
    the module runs with every routing undone, and puts the routings back after."""
    import sys

    from dflash_kernels.integrations import transformers as integ
    with integ._lock:
        originals, owners = dict(integ._originals), dict(integ._owners)
    places = {key: owners.get(key, (sys.modules[key[0]], key[1])) for key in originals}
    routed = {key: getattr(owner, attr) for key, (owner, attr) in places.items()}
    integ.KernelRouting([], list(originals)).undo()
    yield
    with integ._lock:
        for key, (owner, attr) in places.items():
            setattr(owner, attr, routed[key])
        integ._originals.update(originals)
        integ._owners.update(owners)


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


def _elementwise_state():
    """The objects the elementwise routes replace: the norm and MLP forwards, apply_rotary_pos_emb, the
    GDN layers' gated norm."""
    return (modeling_qwen3_5.Qwen3_5RMSNorm.forward, modeling_qwen3_5.Qwen3_5MLP.forward,
            modeling_qwen3_5.apply_rotary_pos_emb, modeling_qwen3_5.Qwen3_5RMSNormGated.forward)


def _require_kernels():
    for op in ("conv1d", "gdn", "rms_norm", "rope", "swiglu"):
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
    before = _elementwise_state()
    routing = use_dflash_kernels(model, elementwise=True)
    try:
        for name, adapter in ADAPTERS.items():
            assert getattr(modeling_qwen3_5, name) is adapter, name
        after = _elementwise_state()
        assert all(a is not b for a, b in zip(after, before)), "norm, MLP, RoPE and gated norm are routed"
        out = model(ids).logits
        out.square().mean().backward()
    finally:
        routing.undo()
    assert _elementwise_state() == before, "undo restores the norm, MLP and RoPE"
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
    routing = use_dflash_kernels(model, elementwise=True)
    try:
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    finally:
        routing.undo()
    assert torch.equal(out, ref)


def test_undo_reverts_only_its_own_routing(model):
    # A helper that routes for a while (trainer.build_default on a GPU) must not unroute its caller.
    before = _elementwise_state()
    outer = use_dflash_kernels(model, elementwise=True)
    try:
        inner = use_dflash_kernels(model, elementwise=True)
        inner.undo()
        for name, adapter in ADAPTERS.items():
            assert getattr(modeling_qwen3_5, name) is adapter, name
        assert _elementwise_state() != before
    finally:
        outer.undo()
    for name, adapter in ADAPTERS.items():
        assert getattr(modeling_qwen3_5, name) is not adapter, name
    assert _elementwise_state() == before


def _count_op_calls(monkeypatch):
    from dflash_kernels.integrations import transformers as integ
    calls = {"rms_norm": 0, "rope": 0, "swiglu": 0, "rms_norm_gated": 0}
    for name, attr in (("rms_norm", "_rms_norm"), ("rope", "_apply_rope"), ("swiglu", "_swiglu"),
                       ("rms_norm_gated", "_rms_norm_gated")):
        real = getattr(integ, attr)

        def counting(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(integ, attr, counting)
    return calls


def test_elementwise_routes_run_the_ops_and_can_be_left_out(model, monkeypatch):
    """Every (1 + w) RMSNorm (input, post-attention, q/k, final), SwiGLU MLP and RoPE call runs the
    fused ops (the config's partial rotary: cos is a quarter of head_dim); ``elementwise=False`` routes
    only the GDN and conv."""
    _require_kernels()
    calls = _count_op_calls(monkeypatch)
    cfg = model.config
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    ids = torch.randint(0, 97, (1, 12), device=device())
    with torch.no_grad():
        ref = model(ids).logits
    routing = use_dflash_kernels(model, elementwise=True)
    try:
        with torch.no_grad():
            out = model(ids).logits
    finally:
        routing.undo()
    assert calls == {"rms_norm": 2 * cfg.num_hidden_layers + 1 + 2 * n_attn, "rope": 2 * n_attn,
                     "swiglu": cfg.num_hidden_layers, "rms_norm_gated": cfg.num_hidden_layers - n_attn}, calls
    assert rel_err(out, ref) < (1e-3 if out.is_cuda else 1e-5)
    before = _elementwise_state()
    routing = use_dflash_kernels(model, elementwise=False)
    try:
        assert _elementwise_state() == before
        assert modeling_qwen3_5.causal_conv1d_fn is ADAPTERS["causal_conv1d_fn"]
    finally:
        routing.undo()


def test_gdn_layers_give_the_kernels_q_and_k_at_their_own_head_count(model, monkeypatch):
    """The routed GDN layer gives the delta rule q and k with the layer's key-head count (2 here, for 4
    value heads; transformers up to 5.2x copies them to the value heads with ``repeat_interleave``, which
    never runs here) and the raw gate and beta logits with A_log and dt_bias (the decay and sigmoid
    computed in the kernels: no softplus or sigmoid runs). ``undo`` restores transformers' forward.
    Outputs and the gradients of every parameter (A_log and dt_bias through the kernels) match
    transformers' torch path."""
    _require_kernels()
    layer_cls = modeling_qwen3_5.Qwen3_5GatedDeltaNet
    original = layer_cls.forward
    ids = torch.randint(0, 97, (2, 70), device=device())
    ref = model(ids, use_cache=False).logits  # as the trainer's target; with a cache, transformers' forward
    ref_grads = torch.autograd.grad(ref.square().mean(), list(model.parameters()))
    heads, gates, calls = [], [], {"repeat_interleave": 0, "softplus": 0, "sigmoid": 0}
    real_gdn = dk.chunk_gated_delta_rule
    real = {"repeat_interleave": torch.Tensor.repeat_interleave, "sigmoid": torch.Tensor.sigmoid,
            "softplus": torch.nn.functional.softplus}

    def gdn(q, k, v, g, beta, *args, **kwargs):
        heads.append((q.shape[2], k.shape[2], v.shape[2]))
        layer = next(m for m in model.modules() if isinstance(m, layer_cls) and m.A_log is kwargs.get("A_log"))
        gates.append((kwargs.get("use_gate_in_kernel"), kwargs.get("use_beta_sigmoid_in_kernel"),
                       kwargs.get("dt_bias") is layer.dt_bias, g.shape[-1], beta.shape[-1]))
        return real_gdn(q, k, v, g, beta, *args, **kwargs)

    def counting(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return fn
    monkeypatch.setattr(dk, "chunk_gated_delta_rule", gdn)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", counting("repeat_interleave"))
    monkeypatch.setattr(torch.Tensor, "sigmoid", counting("sigmoid"))
    monkeypatch.setattr(torch.nn.functional, "softplus", counting("softplus"))
    routing = use_dflash_kernels(model, gdn_layers=True)
    try:
        assert layer_cls.forward is not original
        out = model(ids, use_cache=False).logits
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    finally:
        routing.undo()
    assert layer_cls.forward is original
    n_gdn = sum(t == "linear_attention" for t in model.config.layer_types)
    assert heads == [(2, 2, 4)] * n_gdn, heads
    assert gates == [(True, True, True, 4, 4)] * n_gdn, gates
    assert calls == {"repeat_interleave": 0, "softplus": 0, "sigmoid": 0}, calls
    tol_out, tol_grad = (1e-3, 5e-3) if out.is_cuda else (1e-4, 1e-3)
    assert rel_err(out, ref) < tol_out
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        assert rel_err(g, r) < tol_grad, name


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32], ids=["w_bf16", "w_fp32"])
def test_gated_norm_route_matches_transformers_in_bf16(wdtype):
    """The GDN output norm routed: transformers' module in bf16 (its roundings: x_hat to bf16, the
    product with a bf16 weight rounded too) against the routed forward, and gradients of x, gate, weight."""
    if dk.runtime.resolve("rms_norm_gated", device()) not in ("interpret", "triton"):
        pytest.fail("needs the Triton kernels (TRITON_INTERPRET=1 on the CPU)")
    torch.manual_seed(1)
    norm = modeling_qwen3_5.Qwen3_5RMSNormGated(64, eps=1e-6).to(device())
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.3 + 1.0)
    norm = norm.to(wdtype)
    x = (torch.randn(150, 64, device=device()) * 2).to(torch.bfloat16).requires_grad_()
    g = (torch.randn(150, 64, device=device()) * 2).to(torch.bfloat16).requires_grad_()
    up = torch.randn(150, 64, device=device()).to(torch.bfloat16)
    ref = norm(x, g)
    ref_grads = torch.autograd.grad(ref, (x, g, norm.weight), up)
    original = modeling_qwen3_5.Qwen3_5RMSNormGated.forward
    routing = use_dflash_kernels(Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=8, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=1,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention"])), elementwise=True)
    try:
        assert modeling_qwen3_5.Qwen3_5RMSNormGated.forward is not original, "the gated norm is routed"
        out = norm(x, g)
        grads = torch.autograd.grad(out, (x, g, norm.weight), up)
    finally:
        routing.undo()
    assert modeling_qwen3_5.Qwen3_5RMSNormGated.forward is original
    assert out.dtype == ref.dtype == torch.bfloat16
    # same roundings: on a GPU a rare 1-ulp flip; the interpreter's casts truncate (three of them)
    assert rel_err(out, ref) < (2e-3 if out.is_cuda else 1.6e-2)
    for name, a, b in zip(("x", "gate", "weight"), grads, ref_grads):
        assert rel_err(a, b) < 1.6e-2, name


def test_rope_adapter_matches_transformers_in_both_layouts():
    from dflash_kernels.integrations.transformers import _make_rope
    original = inspect.unwrap(modeling_qwen3_5.apply_rotary_pos_emb)
    adapter = _make_rope(original)
    B, T, H, Hk, D, R = 2, 7, 4, 2, 32, 8
    inv = 10000.0 ** (-torch.arange(0, R, 2, device=device()).double() / R)
    ang = torch.arange(T, device=device()).double()[None, :, None] * inv
    ang = torch.cat([ang, ang], -1).expand(B, T, R)
    cos, sin = ang.cos().float(), ang.sin().float()
    for dim, shape_q, shape_k in ((1, (B, H, T, D), (B, Hk, T, D)), (2, (B, T, H, D), (B, T, Hk, D))):
        q, k = torch.randn(shape_q, device=device()), torch.randn(shape_k, device=device())
        got = adapter(q, k, cos, sin, unsqueeze_dim=dim)
        ref = original(q, k, cos, sin, unsqueeze_dim=dim)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and rel_err(g, r) < 1e-6


def test_model_without_linear_attention_is_refused():
    with pytest.raises(ValueError, match="model: Linear has no layer"):
        use_dflash_kernels(torch.nn.Linear(2, 2))
