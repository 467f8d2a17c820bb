"""causal_conv1d / causal_conv1d_update against the plain fp32 reference: outputs and every gradient.

On the CPU the kernels run through the Triton interpreter (TRITON_INTERPRET=1, as .ci/run sets it);
without it the reference backend would run and these tests would compare it with itself, so they
refuse to run (see ``_require_kernels``). Tests marked ``gpu`` repeat them at real sizes on CUDA.
"""

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.ops.conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update
from tests.helpers import device, rel_err

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _require_kernels():
    backend = dk.runtime.resolve("conv1d", device())
    if backend not in ("interpret", "triton"):
        pytest.fail(f"conv1d tests need the Triton kernels (interpreter on the CPU), got backend {backend!r}; "
                    f"run with TRITON_INTERPRET=1")


def _tol(dtype):
    # Bound on ||kernel - ref|| / ||ref||: twice the rounding of the output dtype, plus a floor.
    return {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -8, torch.float16: 2 * 2 ** -11}[dtype]


def _check(name, got, ref, dtype):
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= _tol(dtype), f"{name}: relative error {err:.3g} > {_tol(dtype):.3g}"


def _inputs(B, D, T, W, dtype, bias=True, channel_last=False, init=False, seq=False):
    dev = device()
    if channel_last:
        x = torch.randn(B, T, D, device=dev, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(B, D, T, device=dev, dtype=dtype)
    weight = torch.randn(D, W, device=dev, dtype=dtype) / W
    b = torch.randn(D, device=dev, dtype=dtype) if bias else None
    initial_states = torch.randn(B, D, W - 1, device=dev, dtype=dtype) if init else None
    seq_idx = None
    if seq:
        # Uneven packed sequences: boundaries at random places, ids increasing.
        cuts = torch.rand(B, T, device=dev) < 0.15
        cuts[:, 0] = False
        seq_idx = cuts.cumsum(1).to(torch.int32)
    return x, weight, b, seq_idx, initial_states


def _run_both(x, weight, bias, seq_idx, init, activation, final):
    """Kernel and reference on leaf copies; returns outputs and gradients of both."""
    dtype = x.dtype
    leaves = [t for t in (x, weight, bias, init) if t is not None]
    kern = [t.detach().clone().requires_grad_() for t in leaves]
    ref = [t.detach().clone().float().requires_grad_() for t in leaves]

    def unpack(ts):
        it = iter(ts)
        xx = next(it)
        ww = next(it)
        bb = next(it) if bias is not None else None
        ii = next(it) if init is not None else None
        return xx, ww, bb, ii

    kx, kw, kb, ki = unpack(kern)
    rx, rw, rb, ri = unpack(ref)
    out_k = dk.causal_conv1d(kx, kw, kb, activation, seq_idx, ki, return_final_states=final)
    out_r = naive_causal_conv1d(rx, rw, rb, activation, seq_idx, ri, return_final_states=final)
    outs_k = out_k if final else (out_k,)
    outs_r = out_r if final else (out_r,)
    grads_out = [torch.randn_like(o, dtype=torch.float32) for o in outs_r]
    torch.autograd.backward([o.float() for o in outs_k], grads_out)
    torch.autograd.backward(list(outs_r), grads_out)
    return outs_k, [o.to(dtype) for o in outs_r], kern, ref


CASES = [
    # (B, D, T, W, activation, bias)
    (1, 8, 1, 4, "silu", True),
    (2, 24, 37, 4, "silu", True),
    (2, 19, 63, 3, None, False),
    (1, 16, 130, 2, "swish", True),
    (3, 5, 2, 4, None, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,D,T,W,activation,bias", CASES, ids=lambda c: str(c))
def test_forward_backward(B, D, T, W, activation, bias, dtype):
    x, weight, b, _, _ = _inputs(B, D, T, W, dtype, bias=bias)
    outs_k, outs_r, kern, ref = _run_both(x, weight, b, None, None, activation, final=False)
    _check("y", outs_k[0], outs_r[0], dtype)
    for name, k, r in zip(["dx", "dweight", "dbias"], kern, ref):
        _check(name, k.grad, r.grad.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [2, 45], ids=lambda t: f"T{t}")
def test_initial_and_final_states(T, dtype):
    x, weight, b, _, init = _inputs(2, 12, T, 4, dtype, init=True)
    outs_k, outs_r, kern, ref = _run_both(x, weight, b, None, init, "silu", final=True)
    _check("y", outs_k[0], outs_r[0], dtype)
    _check("final_states", outs_k[1], outs_r[1], dtype)
    for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref):
        _check(name, k.grad, r.grad.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seq_idx(dtype):
    x, weight, b, seq, init = _inputs(2, 10, 70, 4, dtype, seq=True, init=True)
    outs_k, outs_r, kern, ref = _run_both(x, weight, b, seq, init, "silu", final=False)
    _check("y", outs_k[0], outs_r[0], dtype)
    for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref):
        _check(name, k.grad, r.grad.to(dtype), dtype)


@pytest.mark.parametrize("W,channel_last,T", [(2, False, 53), (3, True, 53), (4, True, 70), (3, False, 1100)],
                         ids=lambda v: str(v))
def test_seq_idx_widths_and_layouts(W, channel_last, T):
    # seq_idx with initial and final states at every width and in both layouts; T = 1100 spans two
    # backward chunks (two partial dweight rows).
    x, weight, b, seq, init = _inputs(1, 21, T, W, torch.float32, channel_last=channel_last, init=True, seq=True)
    outs_k, outs_r, kern, ref = _run_both(x, weight, b, seq, init, "silu", final=True)
    _check("y", outs_k[0], outs_r[0], torch.float32)
    _check("final_states", outs_k[1], outs_r[1], torch.float32)
    for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref):
        _check(name, k.grad, r.grad, torch.float32)


def test_seq_idx_isolates_sequences():
    # Changing one packed sequence's inputs must leave every other sequence's outputs unchanged.
    x, weight, b, _, _ = _inputs(1, 6, 40, 4, torch.float32)
    seq = torch.zeros(1, 40, dtype=torch.int32, device=x.device)
    seq[:, 20:] = 1
    y1 = dk.causal_conv1d(x, weight, b, "silu", seq_idx=seq)
    x2 = x.clone()
    x2[:, :, :20] += 5.0
    y2 = dk.causal_conv1d(x2, weight, b, "silu", seq_idx=seq)
    assert torch.equal(y1[:, :, 20:], y2[:, :, 20:])
    assert not torch.allclose(y1[:, :, :20], y2[:, :, :20])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channel_last(dtype):
    x, weight, b, _, init = _inputs(2, 24, 33, 4, dtype, channel_last=True, init=True)
    assert x.stride(1) == 1
    outs_k, outs_r, kern, ref = _run_both(x, weight, b, None, init, "silu", final=True)
    assert outs_k[0].stride(1) == 1, "output keeps the channel-last layout"
    _check("y", outs_k[0], outs_r[0], dtype)
    _check("final_states", outs_k[1], outs_r[1], dtype)
    for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref):
        _check(name, k.grad, r.grad.to(dtype), dtype)


def test_non_contiguous_input():
    # A strided slice along T is copied once; the result equals the contiguous call.
    base = torch.randn(2, 8, 80, device=device())
    x = base[:, :, ::2]
    weight = torch.randn(8, 4, device=device())
    torch.testing.assert_close(dk.causal_conv1d(x, weight), dk.causal_conv1d(x.contiguous(), weight))
    # A prefix along T keeps stride 1 there but is not dense: outputs must still land in place.
    x = base[:, :, :37].requires_grad_()
    y = dk.causal_conv1d(x, weight, activation="silu")
    ref = naive_causal_conv1d(x.detach(), weight, activation="silu")
    _check("y of a time slice", y, ref, torch.float32)
    y.sum().backward()
    assert not torch.isnan(x.grad).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", [(1, 3), (5, 3), (2, 6)], ids=lambda v: str(v))
def test_update(L, S, dtype):
    B, D, W = 2, 20, 4
    dev = device()
    x = torch.randn(B, D, L, device=dev, dtype=dtype)
    state = torch.randn(B, D, S, device=dev, dtype=dtype)
    weight = torch.randn(D, W, device=dev, dtype=dtype)
    bias = torch.randn(D, device=dev, dtype=dtype)
    state_ref = state.clone()
    y = dk.causal_conv1d_update(x, state, weight, bias, "silu")
    y_ref = naive_causal_conv1d_update(x, state_ref, weight, bias, "silu")
    _check("y", y, y_ref, dtype)
    assert torch.equal(state, state_ref), "conv_state after the update"


def test_update_matches_full_conv():
    # Decoding token by token from a zero state equals the causal conv over the whole sequence.
    B, D, T, W = 1, 6, 9, 4
    x = torch.randn(B, D, T, device=device())
    weight, bias = torch.randn(D, W, device=device()), torch.randn(D, device=device())
    state = torch.zeros(B, D, W - 1, device=device())
    steps = [dk.causal_conv1d_update(x[:, :, t], state, weight, bias, "silu") for t in range(T)]
    torch.testing.assert_close(torch.stack(steps, -1), dk.causal_conv1d(x, weight, bias, "silu"))


def test_torch_compile_no_graph_break():
    x = torch.randn(1, 8, 20, device=device(), requires_grad=True)
    weight = torch.randn(8, 4, device=device(), requires_grad=True)

    def f(x, w):
        return dk.causal_conv1d(x * 2, w, activation="silu").sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, weight)
    out.backward()
    ref = naive_causal_conv1d(x.detach() * 2, weight.detach(), activation="silu").sum()
    torch.testing.assert_close(out.detach(), ref)
    assert x.grad is not None and weight.grad is not None


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint(reentrant):
    x = torch.randn(2, 8, 20, device=device(), requires_grad=True)
    weight = torch.randn(8, 4, device=device(), requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(lambda a, w: dk.causal_conv1d(a, w, activation="silu"), x, weight,
                                          use_reentrant=reentrant)
    y.square().sum().backward()
    gx, gw = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    dk.causal_conv1d(x, weight, activation="silu").square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, weight.grad)


BAD = [
    (lambda x, w: dk.causal_conv1d(x[0], w), ValueError, "x: expected 3 dimensions"),
    (lambda x, w: dk.causal_conv1d(x.long(), w), TypeError, "x: dtype torch.int64"),
    (lambda x, w: dk.causal_conv1d(x, torch.randn(8, 5)), ValueError, "W=5"),
    (lambda x, w: dk.causal_conv1d(x, torch.randn(7, 4)), ValueError, "weight: expected shape \\[D=8"),
    (lambda x, w: dk.causal_conv1d(x, w, torch.randn(3)), ValueError, "bias: expected shape"),
    (lambda x, w: dk.causal_conv1d(x, w, activation="relu"), ValueError, "activation: .*'relu'"),
    (lambda x, w: dk.causal_conv1d(x, w, seq_idx=torch.zeros(2, 10)), TypeError, "seq_idx: dtype"),
    (lambda x, w: dk.causal_conv1d(x, w, seq_idx=torch.zeros(2, 9, dtype=torch.int32)), ValueError,
     "seq_idx: expected shape"),
    (lambda x, w: dk.causal_conv1d(x, w, initial_states=torch.zeros(2, 8, 2)), ValueError,
     "initial_states: expected shape"),
    (lambda x, w: dk.causal_conv1d(x, w.to("meta")), ValueError, "weight: is on meta"),
    (lambda x, w: dk.causal_conv1d_update(x, torch.zeros(2, 8, 2), w), ValueError, "conv_state: expected shape"),
    (lambda x, w: dk.causal_conv1d(x, "w"), TypeError, "weight: expected a tensor"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=[b[2] for b in BAD])
def test_bad_input(call, exc, match):
    x = torch.randn(2, 8, 10)
    w = torch.randn(8, 4)
    with pytest.raises(exc, match=match):
        call(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,D,T", [(1, 2560, 4096), (2, 1000, 3001)], ids=lambda v: str(v))
def test_gpu_real_sizes(B, D, T, dtype):
    for channel_last in (False, True):
        x, weight, b, seq, init = _inputs(B, D, T, 4, dtype, channel_last=channel_last, init=True, seq=True)
        outs_k, outs_r, kern, ref = _run_both(x, weight, b, seq, init, "silu", final=True)
        _check("y", outs_k[0], outs_r[0], dtype)
        _check("final_states", outs_k[1], outs_r[1], dtype)
        for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref):
            _check(name, k.grad, r.grad.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aligned_layouts_take_the_vectorized_variant(dtype):
    """Layouts whose rows start 16-byte aligned with lengths that are multiples of 16 run the ALIGNED
    kernels (vectorized accesses on the GPU) and match the reference; a view one element in is not
    aligned (the op copies it to a dense layout first)."""
    from dflash_kernels.ops.conv1d.conv1d import _aligned
    cases = []
    x, w, b, _, _ = _inputs(2, 24, 64, 4, dtype)  # channel-first, T a multiple of 16
    cases.append((x, w, b, False, True))
    x, w, b, _, _ = _inputs(2, 32, 40, 4, dtype, channel_last=True)  # channel-last, D a multiple of 16
    cases.append((x, w, b, True, True))
    full, w, b, _, _ = _inputs(2, 24, 65, 4, dtype)
    cases.append((full[..., 1:], w, b, False, False))  # T = 64 but the rows start 2 bytes in
    for x, w, b, channel_last, want in cases:
        assert _aligned(channel_last, x) is want, (tuple(x.shape), x.stride())
        outs_k, outs_r, kern, ref = _run_both(x, w, b, None, None, "silu", final=False)
        _check("y", outs_k[0], outs_r[0], dtype)
        for name, k, r in zip(["dx", "dweight", "dbias"], kern, ref):
            _check(name, k.grad, r.grad.to(dtype), dtype)
