"""Every op under a tracer: ``make_fx`` with fake tensors (what AOT autograd does to a compiled backward,
and ``torch.export``) records the ops' custom ops, forward and backward, instead of running a kernel on
tensors without data; a graph traced on one set of inputs computes the eager result on another (the
ops are in the graph, not baked in as constants)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dflash_kernels as dk
from tests.helpers import device, rel_err


def _rope_inputs(g):
    T, R = 9, 8
    ang = torch.arange(T, device=device())[None, :, None].float() * torch.rand(1, 1, R // 2, generator=g,
                                                                               device=device())
    ang = torch.cat([ang, ang], -1).expand(2, T, R)
    return [torch.randn(2, T, 3, 16, generator=g, device=device()), ang.cos(), ang.sin()], [0]


def _gdn_inputs(g):
    B, T, Hk, Hv, K = 1, 70, 1, 2, 16
    r = lambda *s: torch.randn(*s, generator=g, device=device())  # noqa: E731
    return [r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, Hv, K), -torch.rand(B, T, Hv, generator=g, device=device()),
            torch.rand(B, T, Hv, generator=g, device=device())], [0, 1, 2, 3, 4]


_MASK = {}


def _attention_inputs(g):
    # the mask is built outside the trace (its construction is host-side work with kernels of its own)
    _MASK.setdefault(device(), dk.causal_block_mask(40, q_block=16, kv_tile=16, device=device()))
    r = lambda *s: torch.randn(*s, generator=g, device=device())  # noqa: E731
    return [r(1, 40, 2, 64), r(1, 40, 2, 64), r(1, 40, 2, 64)], [0, 1, 2]


def _attention(q, k, v):
    return dk.block_sparse_attention(q, k, v, _MASK[device()])


def _lce_inputs(g):
    r = lambda *s: torch.randn(*s, generator=g, device=device())  # noqa: E731
    labels = torch.randint(0, 37, (13,), generator=g, device=device())
    return [r(13, 16), r(37, 16), labels], [0, 1]


CASES = {
    "rms_norm": (lambda x, w: dk.rms_norm(x, w, 1e-6, 1.0),
                 lambda g: ([torch.randn(5, 48, generator=g, device=device()),
                             torch.randn(48, generator=g, device=device())], [0, 1])),
    "rms_norm_gated": (lambda x, z, w: dk.rms_norm_gated(x, z, w, 1e-6),
                       lambda g: ([torch.randn(5, 48, generator=g, device=device()),
                                   torch.randn(5, 48, generator=g, device=device()),
                                   torch.randn(48, generator=g, device=device())], [0, 1, 2])),
    # both outputs (the norm and the sum) carry gradients into the one backward op
    "fused_add_rms_norm": (lambda x, r, w: torch.stack(dk.fused_add_rms_norm(x, r, w, 1e-6)),
                           lambda g: ([torch.randn(5, 48, generator=g, device=device()),
                                       torch.randn(5, 48, generator=g, device=device()),
                                       torch.randn(48, generator=g, device=device())], [0, 1, 2])),
    "swiglu": (dk.swiglu, lambda g: ([torch.randn(5, 40, generator=g, device=device()),
                                      torch.randn(5, 40, generator=g, device=device())], [0, 1])),
    "swiglu_packed": (dk.swiglu_packed, lambda g: ([torch.randn(5, 80, generator=g, device=device())], [0])),
    "apply_rope": (dk.apply_rope, _rope_inputs),
    "causal_conv1d": (lambda x, w, b: dk.causal_conv1d(x, w, b, "silu"),
                      lambda g: ([torch.randn(2, 24, 30, generator=g, device=device()),
                                  torch.randn(24, 4, generator=g, device=device()),
                                  torch.randn(24, generator=g, device=device())], [0, 1, 2])),
    "chunk_gated_delta_rule": (lambda q, k, v, gg, b: dk.chunk_gated_delta_rule(
        q, k, v, gg, b, use_qk_l2norm_in_kernel=True)[0], _gdn_inputs),
    "block_sparse_attention": (_attention, _attention_inputs),
    "linear_cross_entropy": (lambda h, w, y: dk.linear_cross_entropy(h, w, y), _lce_inputs),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_forward_and_backward_record_the_ops(name):
    op, make = CASES[name]
    gen = torch.Generator(device=device()).manual_seed(0)
    inputs, diff = make(gen)

    def f(*args):
        leaves = [a.detach().requires_grad_() if i in diff else a for i, a in enumerate(args)]
        out = op(*leaves)
        up = torch.ones_like(out) if out.dim() == 0 else out.detach().sin()
        return (out, *torch.autograd.grad(out, [leaves[i] for i in diff], up))

    # the attention mask's tensors are constants of the graph (real tensors, as dynamo would lift them)
    fake = make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    recorded = {str(n.target) for n in fake.graph.nodes if n.op == "call_function"}
    ours = sorted(t for t in recorded if t.startswith("dflash_kernels."))
    # the fused loss computes its gradients in the forward op (its backward scales them in torch)
    assert len(ours) >= (1 if name == "linear_cross_entropy" else 2), f"{name}: custom ops in the graph: {ours}"
    traced = make_fx(f)(*inputs)
    other, _ = make(torch.Generator(device=device()).manual_seed(1))
    for got, ref in zip(traced(*other), f(*other)):
        assert rel_err(got, ref) < 1e-6, name
