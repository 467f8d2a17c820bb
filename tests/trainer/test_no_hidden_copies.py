"""No copy, cast or strided fp32 elementwise op in the trainer's step that nobody chose.

One training step (target features -> drafter -> fused LM-head loss -> backward -> clip -> fused AdamW) of a
shrunken ``real`` preset (:func:`tools.audits.copy_audit.shrunken_real_setup`: a Qwen3.5 hybrid target, 3 GDN : 1
attention, bf16 weights, the drafter in fp32 master weights under bf16 autocast, as on a GPU) runs under
:class:`tools.audits.copy_audit.CopyLogger`. Every copy or cast, and every pointwise op whose operands a GPU
could not vectorize over (a broadcast or non-contiguous fp32 operand; a bf16 one too), issued from
``trainer/`` and moving more than ``MIN_REAL_BYTES`` per step at the real preset's sizes, must match an
entry of ``ALLOWED``, each with the reason it stays; every entry must still be seen (a removed op takes its
entry along). What the target's transformers code and the library's own ops do is theirs: listed, not judged.

Without ``trainer.model._InvRms`` and the fp32 RoPE tables the step fails here: the eager RMSNorm's
``MeanBackward1`` divides an expanded (stride-0) fp32 tensor as large as the activations (then copies,
scales and multiplies it), and the eager RoPE multiplies fp32 activations by bf16 cos / sin tables
(mixed-dtype kernels); both move gigabytes per real step. The tests below check that the replacements give
the same bits (on the device the suite runs on).
"""

import pytest
import torch

import trainer.model as model_mod
from tests.helpers import device, slow_param
from tools.audits import copy_audit as ca

# A source this small at the real preset (bytes read + written per step) is below notice: ~12 us at 4 TB/s.
MIN_REAL_BYTES = 50e6

_EAGER = ("the plain torch chain (trainer.model.FUSED_OPS off: the default on a CPU, DFLASH_DRAFTER_FUSED=0 on a GPU; "
          "benchmarks/tok_s.py --groups a,e is the comparison): fp32 math on bf16 activations")
_BCAST = "; a per-row scale / per-feature weight / per-position cos-sin broadcast, which CUDA cannot vectorize"

# (file, function, aten op, kind, autograd node ("" = forward), parameter cast, eager path only, reason)
ALLOWED = [
    ("trainer/model.py", "RMSNorm.forward", "aten._to_copy.default", "cast", "", False, True,
     _EAGER + ": x.float() in, .to(x.dtype) out"),
    ("trainer/model.py", "RMSNorm.forward", "aten._to_copy.default", "cast", "ToCopyBackward0", False, True,
     _EAGER + ": the gradients of those two casts"),
    ("trainer/model.py", "RMSNorm.forward", "aten.mul.Tensor", "strided-fp32", "", False, True,
     _EAGER + ": x * rsqrt(mean(x^2) + eps), weight * x" + _BCAST),
    ("trainer/model.py", "RMSNorm.forward", "aten.mul.Tensor", "strided-fp32", "MulBackward0", False, True,
     _EAGER + ": autograd's gradients of those two products" + _BCAST),
    ("trainer/model.py", "RMSNorm.forward", "aten.mul.Tensor", "strided-fp32", "_InvRmsBackward", False, True,
     _EAGER + ": the one full-size product left of the mean-of-squares gradient (trainer.model._InvRms)"),
    ("trainer/model.py", "apply_rope", "aten._to_copy.default", "cast", "", False, True,
     _EAGER + ": x.float() and rotate_half(x).float()"),
    ("trainer/model.py", "apply_rope", "aten._to_copy.default", "cast", "ToCopyBackward0", False, True,
     _EAGER + ": the gradients of those casts"),
    ("trainer/model.py", "apply_rope", "aten.mul.Tensor", "strided-fp32", "", False, True,
     _EAGER + ": x * cos, rotate_half(x) * sin (cos / sin fp32: no mixed-dtype kernel)" + _BCAST),
    ("trainer/model.py", "apply_rope", "aten.mul.Tensor", "strided-fp32", "MulBackward0", False, True,
     _EAGER + ": the gradients of those products" + _BCAST),
    ("trainer/model.py", "apply_rope", "aten.cat.default", "copy", "", False, True,
     _EAGER + ": rotate_half's cat([-x2, x1]) reads the half x1 in place (a strided source)"),
    ("trainer/model.py", "apply_rope", "aten.cat.default", "copy", "SplitBackward0", False, True,
     _EAGER + ": chunk's gradient, the halves' gradients put back together"),
    ("trainer/model.py", "apply_rope", "aten.neg.default", "strided-bfloat16", "", False, True,
     _EAGER + ": -x2 of the half x2 read in place"),
    ("trainer/model.py", "apply_rope", "aten.neg.default", "strided-bfloat16", "NegBackward0", False, True,
     _EAGER + ": its gradient, of the half of the cat's gradient"),
    ("trainer/model.py", "Attention.forward", "aten.cat.default", "copy", "", False, False,
     "keys and values [context | draft blocks]: the attention kernel takes one [B, S + N * bs, Hkv, D] tensor "
     "(bf16, contiguous sources; 2 x 23 MB per layer at the real preset)"),
    ("trainer/model.py", "*", "aten._to_copy.default", "cast", "", True, False,
     "autocast's bf16 copy of each fp32 master weight, once per weight and step (autocast's cache): the "
     "drafter trains in fp32 weights and bf16 GEMMs"),
    ("trainer/model.py", "*", "aten._to_copy.default", "cast", "ToCopyBackward0", True, False,
     "each weight's bf16 gradient cast to the fp32 master weight's dtype, once per step (AdamW updates fp32)"),
    ("trainer/target.py", "Target._features", "aten.cat.default", "copy", "", False, False,
     "the k chosen layers' outputs side by side, the drafter's fc input [B, S, k * H] (one GEMM operand); "
     "copying each layer's output into a preallocated buffer from its tap would move the same bytes "
     "(126 MB per real step)"),
    ("trainer/loss.py", "predicted_positions", "aten.clone.default", "copy", "", False, False,
     "the LM head's rows: block positions 1..bs-1 gathered (position 0 is never predicted), so the head's two "
     "GEMMs run on (bs - 1) / bs of the rows (79 MB per real step against ~1.3 TFLOP of head GEMMs saved)"),
]

# Sources outside trainer/ (by the innermost frame that issued them): reported by `python -m
# tools.audits.copy_audit`, not judged here.
FOREIGN = {
    "transformers": "the target's modeling code (its RMSNorm / RoPE in fp32, head-major clones); "
                    "dflash_kernels.integrations.transformers.use_dflash_kernels(elementwise=True) routes the "
                    "norms and RoPE to the fused ops",
    "torch": "torch.optim / clip_grad_norm_ internals (per-parameter norms stacked: kilobytes)",
    "dflash_kernels": "the library's ops (here their plain-torch reference backends; the GPU kernels' "
                      "wrappers are covered by the op tests)",
}


def _match(e: ca.Event, fused: bool):
    fr = e.frames[-1] if e.frames else None
    for entry in ALLOWED:
        file, func, op, kind, node, param, eager_only, _ = entry
        if eager_only and fused:
            continue
        if (fr is not None and fr.file == file and func in ("*", fr.func) and e.op == op and e.kind == kind
                and e.node == node and e.param == param):
            return entry
    return None


def _describe(e: ca.Event) -> str:
    shapes = ", ".join(f"{list(s)} {dt}" for s, _, dt in e.inputs)
    where = " < ".join(str(f) for f in reversed(e.frames)) or "?"
    return (f"{e.kind} {e.op}{' [backward ' + e.node + ']' if e.node else ''}: {shapes}; {e.reason}; "
            f"{ca.real_bytes(e) / 1e6:.0f} MB per real step; at {where}")


@pytest.fixture(scope="module")
def audit_setup():
    setup = ca.shrunken_real_setup()
    yield setup
    setup[1].routing.undo()  # transformers' own functions back for the tests that follow in this process


@pytest.mark.parametrize("fused", [slow_param(False), True], ids=["eager", "fused"])
def test_no_unlisted_copies_casts_or_strided_fp32(audit_setup, fused, monkeypatch):
    monkeypatch.setattr(model_mod, "FUSED_OPS", fused)
    events = ca.audit_step(audit_setup, backend="reference", warmup=0)
    assert events, "the logger saw nothing: the step did not run under it"
    unlisted, seen = [], set()
    for e in events:
        if ca.real_bytes(e) < MIN_REAL_BYTES:
            continue
        if ca.owner(e) in FOREIGN:
            continue
        entry = _match(e, fused)
        if entry is None:
            unlisted.append(_describe(e))
        else:
            seen.add(entry)
    assert not unlisted, ("copies / casts / strided elementwise ops of the trainer outside ALLOWED (remove them, "
                          "or add an entry saying why they stay):\n  " + "\n  ".join(dict.fromkeys(unlisted)))
    stale = [e for e in ALLOWED if e not in seen and not (fused and e[6])]
    assert not stale, "ALLOWED entries no longer seen (remove them):\n  " + "\n  ".join(map(str, stale))


def _eager_rms_norm_autograd(x, weight, eps):
    """The plain RMSNorm as it was, differentiated by autograd (pow -> mean -> rsqrt)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_same_bits_as_autograd(dtype, monkeypatch):
    monkeypatch.setattr(model_mod, "FUSED_OPS", False)
    dev = device()
    torch.manual_seed(0)
    norm = model_mod.RMSNorm(96, 1e-6).to(dev)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    x0 = (torch.randn(3, 37, 96, device=dev) * torch.rand(3, 37, 1, device=dev) * 4).to(dtype)
    g = torch.randn(3, 37, 96, device=dev).to(dtype)
    results = []
    for fn in (norm, lambda x: _eager_rms_norm_autograd(x, norm.weight, norm.eps)):
        x = x0.clone().requires_grad_()
        norm.weight.grad = None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype != torch.float32):
            y = fn(x)
        y.backward(g)
        results.append((y.detach(), x.grad, norm.weight.grad.clone()))
    for name, a, b in zip(("output", "input gradient", "weight gradient"), *results):
        assert torch.equal(a, b), f"{name}: differs from autograd's plain chain (max {(a - b).abs().max()})"


def test_rope_tables_in_fp32_same_bits(monkeypatch):
    """cos / sin rounded to bf16 then held in fp32 give the eager RoPE's bf16-table results exactly."""
    monkeypatch.setattr(model_mod, "FUSED_OPS", False)
    torch.manual_seed(0)
    dev = device()
    pos = torch.randint(0, 5000, (2, 40), device=dev)
    cos, sin = model_mod.rope_cos_sin(pos, 64, 1e6)
    x0 = torch.randn(2, 40, 4, 64, device=dev).to(torch.bfloat16)
    g = torch.randn(2, 40, 4, 64, device=dev).to(torch.bfloat16)
    results = []
    for c, s in ((cos.to(torch.bfloat16), sin.to(torch.bfloat16)),
                 (model_mod._rounded(cos, torch.bfloat16), model_mod._rounded(sin, torch.bfloat16))):
        x = x0.clone().requires_grad_()
        y = model_mod.apply_rope(x, c, s)
        y.backward(g)
        results.append((y.detach(), x.grad))
    assert model_mod._rounded(cos, torch.bfloat16).dtype == torch.float32
    for name, a, b in zip(("output", "input gradient"), *results):
        assert torch.equal(a, b), f"{name}: fp32 tables differ from bf16 tables"


@pytest.mark.slow
def test_audit_report_ranks_sources(audit_setup):
    """``python -m tools.audits.copy_audit``'s report: sources ranked by bytes per real step, with their lines."""
    events = ca.audit_step(audit_setup, backend="reference", warmup=0)
    text = ca.report(events, top=200)
    assert "per real step" in text and "trainer/model.py" in text


def test_profile_sources_attributes_backward_ops_to_forward_lines(monkeypatch):
    """``python -m tools.audits.copy_audit --profile real`` (the GPU check): each op's time is charged to the function
    that issued it, a backward op's to the forward function of its node."""
    monkeypatch.setattr(model_mod, "FUSED_OPS", False)
    norm = model_mod.RMSNorm(64, 1e-6)
    x = torch.randn(8, 64, requires_grad=True)

    def step():
        norm(x).square().sum().backward()
    rows = ca.profile_sources(step)
    funcs = {(node, src[0].func) for (_, _, node, src) in rows if src}
    assert ("", "RMSNorm.forward") in funcs
    assert any(node and func == "RMSNorm.forward" for node, func in funcs), sorted(funcs)
