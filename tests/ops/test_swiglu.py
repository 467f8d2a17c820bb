"""swiglu / swiglu_packed against the plain fp32 reference: outputs and the gradients of every input
(whole tensor and worst row), odd sizes, strided inputs (the halves of one projection), all dtypes,
torch.compile, checkpoint, threads, argument errors, sm_90 compile of the candidates, GPU sizes."""

import threading

import pytest
import torch

from dflash_kernels.ops.swiglu import naive_swiglu, naive_swiglu_packed, swiglu, swiglu_packed
from tests.helpers import check_close, device, rel_err, require_triton_kernels

OP = "swiglu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (6e-3, 1.2e-2), torch.float16: (8e-4, 1.5e-3)}


@pytest.fixture(autouse=True)
def _require_kernels():
    require_triton_kernels(OP)


def _check(name, got, ref, dtype):
    check_close(name, got, ref, *TOL[dtype])


def _compare(gate, up, dtype):
    go_, uo = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    gr, ur = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    y = swiglu(go_, uo)
    yr = naive_swiglu(gr, ur)
    assert y.dtype == gate.dtype and y.shape == gate.shape
    dy = torch.randn(y.shape, device=y.device).to(dtype)
    dg, du = torch.autograd.grad(y, (go_, uo), dy)
    dgr, dur = torch.autograd.grad(yr, (gr, ur), dy.float())
    _check("y", y, yr.to(dtype), dtype)
    _check("dgate", dg, dgr, dtype)
    _check("dup", du, dur, dtype)
    assert dg.dtype == du.dtype == gate.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype):
    g = (torch.randn(3, 11, 133, device=device()) * 4).to(dtype)  # saturating sigmoids both ways
    u = torch.randn(3, 11, 133, device=device()).to(dtype)
    _compare(g, u, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_matches_reference(dtype):
    x = (torch.randn(2, 9, 2 * 70, device=device()) * 3).to(dtype)
    xo, xr = x.clone().requires_grad_(), x.float().requires_grad_()
    y, yr = swiglu_packed(xo), naive_swiglu_packed(xr)
    assert y.shape == (2, 9, 70) and y.dtype == dtype
    dy = torch.randn(y.shape, device=device()).to(dtype)
    (dx,) = torch.autograd.grad(y, (xo,), dy)
    (dxr,) = torch.autograd.grad(yr, (xr,), dy.float())
    _check("y", y, yr.to(dtype), dtype)
    _check("dx", dx, dxr, dtype)


def test_strided_inputs():
    """The two halves of one [N, 2C] projection as views; a transposed (column-major) pair."""
    base = torch.randn(37, 2 * 90, device=device())
    _compare(base[:, :90], base[:, 90:], torch.float32)
    _compare(torch.randn(50, 21, device=device()).t(), torch.randn(21, 50, device=device()), torch.float32)


def test_one_input_requires_grad_and_empty_input():
    g = torch.randn(6, 10, device=device(), requires_grad=True)
    u = torch.randn(6, 10, device=device())
    (dg,) = torch.autograd.grad(swiglu(g, u).sum(), (g,))
    (dgr,) = torch.autograd.grad(naive_swiglu(g, u).sum(), (g,))
    assert rel_err(dg, dgr) < 1e-6
    e = torch.randn(0, 10, device=device(), requires_grad=True)
    assert swiglu(e, e).shape == (0, 10)


def test_torch_compile_no_graph_break():
    g, u = torch.randn(2, 7, 40, device=device()), torch.randn(2, 7, 40, device=device())
    x = torch.randn(2, 7, 80, device=device())

    def f(g, u, x):
        return swiglu(g * 2, u).square().sum() + swiglu_packed(x).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = [t.clone().requires_grad_() for t in (g, u, x)]
    exp = [t.clone().requires_grad_() for t in (g, u, x)]
    out = compiled(*got)
    out.backward()
    ref = f(*exp)
    ref.backward()
    assert rel_err(out, ref) < 1e-6
    for a, b in zip(got, exp):
        assert rel_err(a.grad, b.grad) < 1e-6


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint(reentrant):
    g = torch.randn(9, 30, device=device(), requires_grad=True)
    u = torch.randn(9, 30, device=device(), requires_grad=True)

    def f(g, u):
        return swiglu(torch.tanh(g), u).square().sum()
    torch.utils.checkpoint.checkpoint(f, g, u, use_reentrant=reentrant).backward()
    a, b = g.grad.clone(), u.grad.clone()
    g.grad = u.grad = None
    f(g, u).backward()
    assert rel_err(a, g.grad) < 1e-6 and rel_err(b, u.grad) < 1e-6


def test_threads_on_fresh_shapes():
    errors = []
    cases = [(torch.randn(3 + i, 20 + 13 * i, device=device()), torch.randn(3 + i, 20 + 13 * i, device=device()))
             for i in range(6)]

    def work(i):
        try:
            _compare(*cases[i], torch.float32)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append((i, repr(e)))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_precompile_then_strict():
    from dflash_kernels.runtime import precompile, strict
    precompile([(OP, dict(N=12, C=40), torch.float32)], devices=[device()], verbose=False)
    g = torch.randn(12, 40, device=device(), requires_grad=True)
    with strict():
        swiglu(g, g * 2).sum().backward()


def test_precompile_packed_then_strict():
    """``packed=True`` compiles the packed function's kernels (``--preset ops`` ships them for first calls)."""
    from dflash_kernels.runtime import precompile, strict
    precompile([(OP, dict(N=12, C=40, packed=True), torch.float32)], devices=[device()], verbose=False)
    x = torch.randn(12, 80, device=device(), requires_grad=True)
    with strict():
        y = swiglu_packed(x)
        torch.autograd.grad(y, x, torch.randn_like(y))


BAD = [
    (lambda a: dict(a, gate=a["gate"].long()), TypeError, "gate: dtype torch.int64"),
    (lambda a: dict(a, up=a["up"][:, :5]), ValueError, "up: shape .* differs from gate's"),
    (lambda a: dict(a, up=a["up"].half()), TypeError, "up: dtype torch.float16 differs"),
    (lambda a: dict(a, up=a["up"].to("meta")), ValueError, "up: is on meta"),
]


@pytest.mark.parametrize("change,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(change, exc, match):
    a = change(dict(gate=torch.randn(4, 8), up=torch.randn(4, 8)))
    with pytest.raises(exc, match=match):
        swiglu(a["gate"], a["up"])


def test_bad_packed_input():
    with pytest.raises(ValueError, match=r"x: expected shape \[..., 2C\]"):
        swiglu_packed(torch.randn(4, 7))


def test_kernel_configs_compile_for_hopper():
    from dflash_kernels.ops.swiglu.kernels import SWIGLU_CONFIGS
    from tests.helpers import H200_SHARED_MEMORY, hopper_shared_memory
    mod = "dflash_kernels.ops.swiglu.kernels"
    cfgs = [(c.num_warps, c.num_stages, c.meta) for c in SWIGLU_CONFIGS]
    shared = hopper_shared_memory(mod, "_swiglu_fwd_kernel", {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16"},
                                  {}, cfgs)
    shared += hopper_shared_memory(mod, "_swiglu_bwd_kernel", {n: "*bf16" for n in
                                                               ("dy_ptr", "g_ptr", "u_ptr", "dg_ptr", "du_ptr")},
                                   {}, cfgs)
    assert all(s <= H200_SHARED_MEMORY for s in shared), shared


# ------------------------------------------------------------------------------------ GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 9216), (3001, 9217)], ids=["real", "odd"])
def test_gpu_real_sizes_bf16(shape):
    g = (torch.randn(shape, device="cuda") * 3).to(torch.bfloat16)
    u = torch.randn(shape, device="cuda").to(torch.bfloat16)
    _compare(g, u, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_packed_bf16():
    x = (torch.randn(4096, 2 * 9216, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    y = swiglu_packed(x)
    yr = naive_swiglu_packed(x.detach().float().requires_grad_())
    _check("y", y, yr.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_other_dtypes(dtype):
    _compare(torch.randn(2048, 9216, device="cuda").to(dtype), torch.randn(2048, 9216, device="cuda").to(dtype),
             dtype)
