"""rms_norm (fused RMSNorm, plain and ``(1 + w)`` forms) against the plain fp32 reference.

Outputs and the gradients of x and weight by whole-tensor and worst-row relative error, at odd sizes
(D not a power of two, row counts not a multiple of any block), narrow (head norm) and wide rows,
non-contiguous inputs, fp32 weights under low-precision activations; deterministic weight gradient;
torch.compile, checkpoint, threads, precompile + strict, argument errors; every tuning candidate
compiled for sm_90; real sizes on a GPU.
"""

import threading

import pytest
import torch

from dflash_kernels.ops.rms_norm import fused_add_rms_norm, naive_rms_norm, naive_rms_norm_gated, rms_norm, rms_norm_gated
from tests.helpers import check_close, check_compiled_matches_eager, device, rel_err, require_triton_kernels

OP = "rms_norm"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _require_kernels():
    require_triton_kernels(OP)


TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 1.6e-2), torch.float16: (1e-3, 2e-3)}


def _check(name, got, ref, dtype):
    check_close(name, got, ref, *TOL[dtype])


def _compare(x, w, eps, offset, dtype):
    """Ours on (x, w) against the reference on their fp32 copies; gradients of both inputs."""
    xo, wo = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y = rms_norm(xo, wo, eps, offset)
    yr = naive_rms_norm(xr, wr, eps, offset)
    assert y.dtype == x.dtype and y.shape == x.shape
    go = torch.randn(y.shape, device=y.device).to(dtype)
    dx, dw = torch.autograd.grad(y, (xo, wo), go)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), go.float())
    _check("y", y, yr.to(dtype), dtype)
    _check("dx", dx, dxr, dtype)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    err = rel_err(dw, dwr)
    assert err <= TOL[dtype][0] * (1 if w.dtype == torch.float32 else 2), f"dweight: relative error {err:.3g}"


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
@pytest.mark.parametrize("D", [67, 600], ids=["narrow67", "wide600"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, D, offset):
    x = (torch.randn(3, 13, D, device=device()) * 3 + 0.5).to(dtype)
    w = (torch.randn(D, device=device()) * 0.3 + (0.0 if offset else 1.0)).to(dtype)
    _compare(x, w, 1e-6, offset, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_weight_with_low_precision_x(dtype):
    """The drafter's case under autocast: fp32 weights, bf16 activations; dweight stays fp32."""
    x = torch.randn(41, 96, device=device()).to(dtype)
    w = torch.rand(96, device=device()) + 0.5
    _compare(x, w, 1e-5, 0.0, dtype)


def _compare_gated(x, g, w, eps, offset, dtype, round_normed):
    """rms_norm_gated on (x, gate, w) against the fp32 reference on fp32 copies: y and the three
    gradients. With ``round_normed`` y is also held to the reference run on the inputs as they are
    (transformers' roundings, done by torch) at the dtype's tolerance."""
    xo, go_, wo = (t.detach().clone().requires_grad_() for t in (x, g, w))
    xr, gr, wr = (t.detach().float().requires_grad_() for t in (x, g, w))
    y = rms_norm_gated(xo, go_, wo, eps, offset, round_normed=round_normed)
    yr = naive_rms_norm_gated(xr, gr, wr, eps, offset)
    assert y.dtype == x.dtype and y.shape == x.shape
    up = torch.randn(y.shape, device=y.device).to(dtype)
    dx, dg, dw = torch.autograd.grad(y, (xo, go_, wo), up)
    dxr, dgr, dwr = torch.autograd.grad(yr, (xr, gr, wr), up.float())
    # the roundings of round_normed are 2 more of the dtype's: twice the tolerance against fp32
    k = 2 if round_normed and dtype != torch.float32 else 1
    check_close("y", y, yr.to(dtype), TOL[dtype][0] * k, TOL[dtype][1] * k)
    if round_normed and dtype != torch.float32:
        # The same roundings as torch: on a GPU only rare 1-ulp flips (rstd's last bits) remain; the Triton
        # interpreter's fp32 -> bf16 / fp16 casts truncate instead of rounding, three times here.
        tol = 2e-3 if y.is_cuda else 2 * TOL[dtype][0]
        check_close("y (transformers' roundings)", y, naive_rms_norm_gated(x, g, w, eps, offset, round_normed=True),
                    tol, 2 * tol)
    _check("dx", dx, dxr, dtype)
    _check("dgate", dg, dgr, dtype)
    assert dx.dtype == x.dtype and dg.dtype == g.dtype and dw.dtype == w.dtype
    err = rel_err(dw, dwr)
    assert err <= TOL[dtype][0] * (1 if w.dtype == torch.float32 else 2), f"dweight: relative error {err:.3g}"


@pytest.mark.parametrize("round_normed", [False, True], ids=["fp32", "hf_rounding"])
@pytest.mark.parametrize("wdtype", ["x", torch.float32], ids=["w_like_x", "w32"])
@pytest.mark.parametrize("D", [67, 600], ids=["narrow67", "wide600"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_matches_reference(dtype, D, wdtype, round_normed):
    """The Gated DeltaNet output norm, ``rms_norm(x) * silu(gate)``, fp32 math or transformers' roundings."""
    x = (torch.randn(3, 13, D, device=device()) * 3 + 0.5).to(dtype)
    g = (torch.randn(3, 13, D, device=device()) * 2).to(dtype)
    w = (torch.randn(D, device=device()) * 0.3 + 1.0).to(dtype if wdtype == "x" else wdtype)
    _compare_gated(x, g, w, 1e-6, 0.0, dtype, round_normed)


def test_gated_strided_inputs_and_one_gradient():
    """A gate and x read as views (row stride 2D), and only the gate needing a gradient."""
    base = torch.randn(40, 2 * 96, device=device())
    x, g = base[:, :96], base[:, 96:]
    w = torch.rand(96, device=device()) + 0.5
    _compare_gated(x, g, w, 1e-5, 1.0, torch.float32, False)
    gl = g.clone().requires_grad_()
    y = rms_norm_gated(x, gl, w)
    (dg,) = torch.autograd.grad(y, (gl,), torch.ones_like(y))
    gr = g.clone().requires_grad_()
    (dgr,) = torch.autograd.grad(naive_rms_norm_gated(x, gr, w), (gr,), torch.ones_like(y))
    _check("dgate alone", dg, dgr, torch.float32)


def test_gated_bad_gate():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"gate: expected x's shape \(4, 8\), got \(4, 7\)"):
        rms_norm_gated(x, torch.randn(4, 7), torch.randn(8))
    with pytest.raises(TypeError, match="gate: dtype torch.int64"):
        rms_norm_gated(x, torch.ones(4, 8, dtype=torch.long), torch.randn(8))


def test_non_contiguous_inputs():
    """A chunk of a wider projection (the Qwen3.5 q_norm input: row stride 2D) and a transposed view."""
    base = torch.randn(2, 9, 3, 2 * 40, device=device())
    x = base[..., :40]  # [B, T, H, D] with row stride 80
    w = torch.randn(40, device=device())
    _compare(x, w, 1e-6, 1.0, torch.float32)
    xt = torch.randn(40, 33, device=device()).t()  # unit stride on the wrong dim: copied once
    _compare(xt, w, 1e-6, 0.0, torch.float32)


@pytest.mark.parametrize("wview", ["step2", "expanded", "offset"])
def test_weight_views(wview):
    """A weight that is a strided, expanded (stride 0) or offset view is read by its strides, and its gradient
    reaches the base tensor: plain and gated forms."""
    D = 40
    base = torch.randn(3 * D, device=device(), requires_grad=True)
    views = {"step2": lambda b: b[::2][:D], "expanded": lambda b: b[:1].expand(D), "offset": lambda b: b[D + 3:2 * D + 3]}
    x = torch.randn(3, 11, D, device=device(), requires_grad=True)
    gate = torch.randn(3, 11, D, device=device(), requires_grad=True)
    go = torch.randn(3, 11, D, device=device())
    bref = base.detach().clone().requires_grad_()
    for ours, ref in ((lambda w: rms_norm(x, w, 1e-6, 1.0), lambda w: naive_rms_norm(x, w, 1e-6, 1.0)),
                      (lambda w: rms_norm_gated(x, gate, w, 1e-6, 0.0),
                       lambda w: naive_rms_norm_gated(x, gate, w, 1e-6, 0.0))):
        y = ours(views[wview](base))
        yr = ref(views[wview](bref))
        check_close("y", y, yr, 1e-5, 1e-5)
        dx, db = torch.autograd.grad(y, (x, base), go)
        dxr, dbr = torch.autograd.grad(yr, (x, bref), go)
        check_close("dx", dx, dxr, 1e-5, 1e-5)
        check_close("dweight (base)", db, dbr, 1e-5, 1e-5)


def test_only_one_input_requires_grad_and_empty_input():
    x = torch.randn(10, 24, device=device())
    w = torch.randn(24, device=device(), requires_grad=True)
    (dw,) = torch.autograd.grad(rms_norm(x, w).sum(), (w,))
    (dwr,) = torch.autograd.grad(naive_rms_norm(x, w).sum(), (w,))
    assert rel_err(dw, dwr) < 1e-5
    xg = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(xg, w.detach()).sum(), (xg,))
    assert rel_err(dx, torch.autograd.grad(naive_rms_norm(xg, w.detach()).sum(), (xg,))[0]) < 1e-5
    e = torch.randn(0, 24, device=device(), requires_grad=True)
    y = rms_norm(e, w)
    assert y.shape == (0, 24)
    de, dw0 = torch.autograd.grad(y.sum(), (e, w))
    assert de.shape == (0, 24) and not dw0.any()


def test_weight_gradient_is_deterministic():
    x = torch.randn(203, 72, device=device(), requires_grad=True)
    w = torch.randn(72, device=device(), requires_grad=True)
    go = torch.randn(203, 72, device=device())
    first = torch.autograd.grad(rms_norm(x, w, 1e-6, 1.0), (x, w), go)
    for _ in range(2):
        again = torch.autograd.grad(rms_norm(x, w, 1e-6, 1.0), (x, w), go)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_torch_compile_no_graph_break():
    x = torch.randn(2, 7, 48, device=device())
    w = torch.randn(48, device=device())

    def f(x, w):
        return rms_norm(x * 2, w, 1e-6, 1.0).square().sum()

    check_compiled_matches_eager(f, (x, w))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint(reentrant):
    x = torch.randn(11, 40, device=device(), requires_grad=True)
    w = torch.randn(40, device=device(), requires_grad=True)

    def f(x, w):
        return rms_norm(torch.tanh(x), w).square().sum()
    loss = torch.utils.checkpoint.checkpoint(f, x, w, use_reentrant=reentrant)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).backward()
    assert rel_err(gx, x.grad) < 1e-6 and rel_err(gw, w.grad) < 1e-6


def test_threads_on_fresh_shapes():
    errors = []
    gen = torch.Generator().manual_seed(1)
    cases = [(torch.randn(5 + 3 * i, 16 + 9 * i, generator=gen).to(device()),
              torch.randn(16 + 9 * i, generator=gen).to(device())) for i in range(6)]

    def work(i):
        try:
            x, w = cases[i]
            _compare(x, w, 1e-6, float(i % 2), torch.float32)
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
    precompile([(OP, dict(N=20, D=40, offset=1.0), torch.float32)], devices=[device()], verbose=False)
    x = torch.randn(20, 40, device=device(), requires_grad=True)
    w = torch.randn(40, device=device(), requires_grad=True)
    with strict():
        rms_norm(x, w, 1e-6, 1.0).sum().backward()


@pytest.mark.parametrize("form", ["gated", "add"])
def test_precompile_then_strict_other_forms(form):
    """The gated and fused-add norms run other kernels than the plain one: each has a precompile entry of
    its own, and after it strict() finds every kernel (forward and backward)."""
    from dflash_kernels.runtime import precompile, strict
    name = {"gated": "rms_norm_gated", "add": "fused_add_rms_norm"}[form]
    precompile([(name, dict(N=20, D=40, offset=1.0), torch.float32)], devices=[device()], verbose=False)
    x, other = (torch.randn(20, 40, device=device(), requires_grad=True) for _ in range(2))
    w = torch.randn(40, device=device(), requires_grad=True)
    with strict():
        if form == "gated":
            rms_norm_gated(x, other, w, 1e-6, 1.0).sum().backward()
        else:
            y, h = fused_add_rms_norm(x, other, w, 1e-6, 1.0)
            (y.sum() + h.square().sum()).backward()


BAD = [
    (lambda a: dict(a, x=a["x"].long()), TypeError, "x: dtype torch.int64"),
    (lambda a: dict(a, x="x"), TypeError, "x: expected a tensor"),
    (lambda a: dict(a, weight=a["weight"][:5]), ValueError, r"weight: expected shape \[D=8\]"),
    (lambda a: dict(a, weight=a["weight"].double()), TypeError, "weight: dtype torch.float64"),
    (lambda a: dict(a, weight=a["weight"].to("meta")), ValueError, "weight: is on meta"),
    (lambda a: dict(a, eps=-1.0), ValueError, "eps: expected a number >= 0, got -1.0"),
    (lambda a: dict(a, eps="1e-6"), TypeError, "eps: expected a finite number"),
    (lambda a: dict(a, offset=float("nan")), TypeError, "offset: expected a finite number"),
    (lambda a: dict(a, x=torch.randn(2, 0)), ValueError, "x: expected shape"),
]


@pytest.mark.parametrize("change,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(change, exc, match):
    a = change(dict(x=torch.randn(6, 8), weight=torch.randn(8), eps=1e-6, offset=0.0))
    with pytest.raises(exc, match=match):
        rms_norm(a["x"], a["weight"], a["eps"], a["offset"])


def test_kernel_configs_compile_for_hopper():
    """Every tuning candidate compiles for sm_90 (no GPU needed) and fits Hopper's shared memory."""
    from dflash_kernels.ops.rms_norm import kernels as k
    from tests.helpers import H200_SHARED_MEMORY, hopper_shared_memory
    mod = "dflash_kernels.ops.rms_norm.kernels"
    fwd_types = {"x_ptr": "*bf16", "w_ptr": "*fp32", "g_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32",
                 "eps": "fp32", "offset": "fp32", "r_ptr": "*bf16", "h_ptr": "*bf16"}
    bwd_types = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*fp32", "g_ptr": "*bf16", "rstd_ptr": "*fp32",
                 "dx_ptr": "*bf16", "dg_ptr": "*bf16", "dw_ptr": "*fp32", "offset": "fp32", "dr_ptr": "*bf16",
                 "dx2_ptr": "*bf16"}
    plain, gated = dict(HAS_GATE=False, ROUND=0, HAS_RES=False), dict(HAS_GATE=True, ROUND=2, HAS_RES=False)
    res = dict(HAS_GATE=False, ROUND=0, HAS_RES=True)
    bplain, bres = dict(HAS_GATE=False, HAS_DRES=False), dict(HAS_GATE=False, HAS_DRES=True, HAS_DX2=True)
    shared = []
    for fn, types, consts, configs in [
            ("_rms_norm_fwd_kernel", fwd_types, dict(D=128, BD=128, **plain), k.FWD_NARROW_CONFIGS),
            ("_rms_norm_fwd_kernel", fwd_types, dict(D=128, BD=128, **gated), k.FWD_NARROW_CONFIGS),
            ("_rms_norm_fwd_kernel", fwd_types, dict(D=2560, BD=4096, **plain), k.FWD_WIDE_CONFIGS),
            ("_rms_norm_fwd_kernel", fwd_types, dict(D=2560, BD=4096, **res), k.FWD_WIDE_CONFIGS),
            ("_rms_norm_bwd_kernel", bwd_types, dict(D=256, BD=256, HAS_DW=True, **bplain), k.BWD_NARROW_CONFIGS),
            ("_rms_norm_bwd_kernel", bwd_types, dict(D=128, BD=128, HAS_DW=True, HAS_GATE=True, HAS_DRES=False),
             k.BWD_NARROW_CONFIGS),
            ("_rms_norm_bwd_kernel", bwd_types, dict(D=2560, BD=4096, HAS_DW=True, **bplain), k.BWD_WIDE_CONFIGS),
            ("_rms_norm_bwd_kernel", bwd_types, dict(D=2560, BD=4096, HAS_DW=True, **bres), k.BWD_WIDE_CONFIGS)]:
        shared += hopper_shared_memory(mod, fn, types, consts, [(c.num_warps, c.num_stages, c.meta) for c in configs])
    assert all(s <= H200_SHARED_MEMORY for s in shared), shared


# ------------------------------------------------------------------------------------ GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "1+w"])
@pytest.mark.parametrize("shape,wdtype", [((8192, 2560), torch.float32), ((3072, 2560), torch.bfloat16),
                                          ((8192 * 32, 128), torch.float32), ((3 * 4099, 8, 256), torch.bfloat16)],
                         ids=["hidden8192-w32", "hidden3072", "qnorm-w32", "odd-rows-256"])
def test_gpu_real_sizes_bf16(shape, wdtype, offset):
    x = (torch.randn(shape, device="cuda") * 2).to(torch.bfloat16)
    w = (torch.randn(shape[-1], device="cuda") * 0.2 + (0.0 if offset else 1.0)).to(wdtype)
    _compare(x, w, 1e-6, offset, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_other_dtypes(dtype):
    x = torch.randn(4097, 2560, device="cuda").to(dtype)
    w = torch.randn(2560, device="cuda").to(dtype)
    _compare(x, w, 1e-6, 1.0, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("round_normed", [False, True], ids=["fp32", "hf_rounding"])
def test_gpu_gated_real_size(round_normed):
    """The target's GDN output norm at the `real` preset: 3072 tokens x 32 value heads, D = 128, bf16."""
    x = (torch.randn(3072 * 32, 128, device="cuda") * 2).to(torch.bfloat16)
    g = (torch.randn(3072 * 32, 128, device="cuda") * 2).to(torch.bfloat16)
    w = (torch.randn(128, device="cuda") * 0.2 + 1.0).to(torch.bfloat16)
    _compare_gated(x, g, w, 1e-6, 0.0, torch.bfloat16, round_normed)


@pytest.mark.gpu
def test_gpu_deterministic_weight_gradient():
    x = torch.randn(8192, 2560, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2560, device="cuda", requires_grad=True)
    go = torch.randn_like(x)
    a = torch.autograd.grad(rms_norm(x, w), (x, w), go)
    b = torch.autograd.grad(rms_norm(x, w), (x, w), go)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
