"""fused_add_rms_norm (residual add + RMSNorm in one pass) against the plain fp32 reference.

``h = x + residual`` and ``y = rms_norm(h)``: both outputs, and the gradients of x, residual and weight with
both outputs read (the pre-norm decoder layer: h goes on down the residual stream), with only one of them
read, at odd sizes, narrow and wide rows, strided inputs, fp32 weights under bf16 activations; torch.compile;
argument errors naming the argument; real sizes on a GPU. Kernel outputs are poisoned before the kernels
run (the suite's conftest), so a value the kernels fail to write shows up as NaN.
"""

import pytest
import torch

from dflash_kernels.ops.rms_norm import fused_add_rms_norm, naive_fused_add_rms_norm, naive_rms_norm, rms_norm
from tests.helpers import check_close, check_compiled_matches_eager, device, rel_err, require_triton_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 1.6e-2), torch.float16: (1e-3, 2e-3)}


@pytest.fixture(autouse=True)
def _require_kernels():
    require_triton_kernels("rms_norm_add")


def _compare(x, r, w, eps, offset, read=("y", "h")):
    """Ours on (x, r, w) against the reference on fp32 copies: y, h and the gradients of the three inputs,
    with the outputs named in ``read`` given a gradient."""
    dtype = x.dtype
    xo, ro, wo = (t.detach().clone().requires_grad_() for t in (x, r, w))
    xr, rr, wr = (t.detach().float().requires_grad_() for t in (x, r, w))
    y, h = fused_add_rms_norm(xo, ro, wo, eps, offset)
    yr, hr = naive_fused_add_rms_norm(xr, rr, wr, eps, offset)
    assert y.shape == h.shape == x.shape and y.dtype == h.dtype == dtype
    check_close("y", y, yr.to(dtype), *TOL[dtype])
    # h is x + r rounded once to x's dtype: what torch's own add gives (exactly, on a GPU; the interpreter's
    # casts truncate instead of rounding, one unit in the last place at most)
    h_torch = x + r
    if h.is_cuda:
        assert torch.equal(h, h_torch), "h: not the rounded sum x + residual"
    else:
        check_close("h", h, h_torch, *TOL[dtype])
    gy, gh = (torch.randn(x.shape, device=x.device).to(dtype) for _ in range(2))
    outs, grads = zip(*[(o, g) for name, o, g in (("y", y, gy), ("h", h, gh)) if name in read])
    outs_r = [o for name, o in (("y", yr), ("h", hr)) if name in read]
    need_w = "y" in read
    dx, dr, *dw = torch.autograd.grad(outs, (xo, ro, wo) if need_w else (xo, ro), grads)
    dxr, drr, *dwr = torch.autograd.grad(outs_r, (xr, rr, wr) if need_w else (xr, rr), [g.float() for g in grads])
    check_close("dx", dx, dxr, *TOL[dtype])
    check_close("dresidual", dr, drr, *TOL[dtype])
    assert torch.equal(dx, dr), "x and residual get the same gradient"
    assert dx.untyped_storage().data_ptr() != dr.untyped_storage().data_ptr(), "dx and dresidual share storage"
    assert dx.dtype == dr.dtype == dtype
    if need_w:
        assert dw[0].dtype == w.dtype
        err = rel_err(dw[0], dwr[0])
        assert err <= TOL[dtype][0] * (1 if w.dtype == torch.float32 else 2), f"dweight: relative error {err:.3g}"


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
@pytest.mark.parametrize("D", [67, 600], ids=["narrow67", "wide600"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, D, offset):
    x = (torch.randn(3, 13, D, device=device()) * 3).to(dtype)
    r = (torch.randn(3, 13, D, device=device()) * 2 + 0.5).to(dtype)
    w = (torch.randn(D, device=device()) * 0.3 + (0.0 if offset else 1.0)).to(dtype)
    _compare(x, r, w, 1e-6, offset)


@pytest.mark.parametrize("read", [("y",), ("h",)], ids=["y_only", "h_only"])
def test_one_output_read(read):
    """Only the norm read (the last layer's residual stream ends there), or only the sum."""
    x = torch.randn(37, 96, device=device()).to(torch.bfloat16)
    r = torch.randn(37, 96, device=device()).to(torch.bfloat16)
    w = torch.rand(96, device=device()) + 0.5
    _compare(x, r, w, 1e-5, 0.0, read=read)


def test_fp32_weight_with_bf16_activations_strided():
    """The drafter's case: bf16 activations, fp32 weight; x a chunk of a wider tensor (row stride 2D)."""
    base = torch.randn(2, 21, 2 * 160, device=device()).to(torch.bfloat16)
    x = base[..., :160]
    r = torch.randn(2, 21, 160, device=device()).to(torch.bfloat16)
    w = torch.rand(160, device=device()) + 0.5
    _compare(x, r, w, 1e-6, 0.0)


@pytest.mark.parametrize("read", [("y", "h"), ("h",)], ids=["both", "h_only"])
def test_leaf_gradients_have_storage_of_their_own(read):
    """x and residual as leaves: .grad of each is its own tensor, so a second backward accumulates each
    once, zeroing one leaves the other, and an in-place clip over both scales each once."""
    x = torch.randn(9, 40, device=device(), requires_grad=True)
    r = torch.randn(9, 40, device=device(), requires_grad=True)
    w = torch.randn(40, device=device())

    def loss():
        y, h = fused_add_rms_norm(x, r, w)
        return sum((o * (i + 1.5)).sum() for i, (name, o) in enumerate((("y", y), ("h", h))) if name in read)
    loss().backward()
    assert x.grad.untyped_storage().data_ptr() != r.grad.untyped_storage().data_ptr()
    g1 = x.grad.clone()
    check_close("residual.grad", r.grad, g1, 0, 0)
    loss().backward()  # accumulates: each .grad is now twice the first, not g1 + 2 * g1 on one of them
    check_close("x.grad", x.grad, 2 * g1, 1e-6, 1e-6)
    check_close("residual.grad", r.grad, 2 * g1, 1e-6, 1e-6)
    x.grad.zero_()
    assert r.grad.abs().max() > 0, "zeroing x.grad zeroed residual.grad"
    torch.nn.utils.clip_grad_norm_([x, r], max_norm=1e-3)
    assert not x.grad.any() and abs(r.grad.norm().item() - 1e-3) < 1e-6, "the clip scaled one buffer twice"


@pytest.mark.parametrize("wview", ["step2", "expanded", "offset"])
def test_weight_views(wview):
    """A weight that is a strided, expanded (stride 0) or offset view is read by its strides."""
    D = 48
    base = torch.randn(3 * D, device=device())
    w = {"step2": base[::2][:D], "expanded": base[:1].expand(D), "offset": base[D + 5:2 * D + 5]}[wview]
    x = torch.randn(2, 7, D, device=device())
    r = torch.randn(2, 7, D, device=device())
    _compare(x, r, w, 1e-6, 0.0)


def test_same_as_add_then_rms_norm():
    """The composition it replaces: y is the library's own rms_norm of the h it returns, bit for bit, and h
    torch's x + r (bit for bit on a GPU; the interpreter's casts truncate)."""
    x = torch.randn(29, 200, device=device()).to(torch.bfloat16)
    r = torch.randn(29, 200, device=device()).to(torch.bfloat16)
    w = torch.randn(200, device=device())
    y, h = fused_add_rms_norm(x, r, w, 1e-6, 1.0)
    if x.is_cuda:
        assert torch.equal(h, x + r)
    else:
        check_close("h", h, x + r, *TOL[torch.bfloat16])
    assert torch.equal(y, rms_norm(h, w, 1e-6, 1.0))
    assert rel_err(y, naive_rms_norm(h.float(), w, 1e-6, 1.0)) < 1e-2


def test_torch_compile_no_graph_break():
    x = torch.randn(2, 7, 48, device=device())
    r = torch.randn(2, 7, 48, device=device())
    w = torch.randn(48, device=device())

    def f(x, r, w):
        y, h = fused_add_rms_norm(x * 2, r, w, 1e-6, 1.0)
        return y.square().sum() + (h * 0.5).sum()

    check_compiled_matches_eager(f, (x, r, w))


def _args():
    return dict(x=torch.randn(4, 16, device=device()), residual=torch.randn(4, 16, device=device()),
                weight=torch.randn(16, device=device()))


BAD = [
    (lambda a: a.update(residual=torch.randn(4, 8, device=device())), ValueError, r"residual: expected x's shape"),
    (lambda a: a.update(residual=a["residual"].double()), (TypeError, ValueError), r"residual"),
    (lambda a: a.update(residual=a["residual"].half()), ValueError, r"residual: expected x's dtype"),
    (lambda a: a.update(residual=[1.0]), TypeError, r"residual"),
    (lambda a: a.update(weight=torch.randn(15, device=device())), ValueError, r"weight: expected shape"),
]


@pytest.mark.parametrize("change,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(change, exc, match):
    a = _args()
    change(a)
    with pytest.raises(exc, match=match):
        fused_add_rms_norm(a["x"], a["residual"], a["weight"])


# ------------------------------------------------------------------------------------ GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("shape,wdtype", [((8192, 2560), torch.float32), ((3 * 4099, 2560), torch.bfloat16)],
                         ids=["drafter8192-w32", "odd-rows"])
def test_gpu_real_sizes(shape, wdtype):
    x = (torch.randn(shape, device="cuda") * 2).to(torch.bfloat16)
    r = (torch.randn(shape, device="cuda") * 4).to(torch.bfloat16)
    w = (torch.randn(shape[-1], device="cuda") * 0.2 + 1.0).to(wdtype)
    _compare(x, r, w, 1e-6, 0.0)
