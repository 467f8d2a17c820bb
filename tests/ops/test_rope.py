"""apply_rope (rotate-half RoPE, full and partial rotary) against the plain fp32 reference.

Output and the gradient of x (whole tensor and worst row) at odd sizes, cos/sin as [B, T, R] or
[B, T, 1, R], fp32 or x's dtype, batch-broadcast cos/sin, head-major transposed inputs, partial
rotary (HF Qwen3.5's apply_rotary_pos_emb against our op), torch.compile, checkpoint, threads,
argument errors, sm_90 compile of the candidates, real sizes on a GPU.
"""

import threading

import pytest
import torch

from dflash_kernels.ops.rope import apply_rope, naive_apply_rope
from tests.helpers import check_close, device, rel_err, require_triton_kernels

OP = "rope"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (6e-3, 1.2e-2), torch.float16: (8e-4, 1.5e-3)}


@pytest.fixture(autouse=True)
def _require_kernels():
    require_triton_kernels(OP)


def _check(name, got, ref, dtype):
    check_close(name, got, ref, *TOL[dtype])


def cos_sin(B, T, R, positions=None, theta=10000.0, dtype=torch.float32, dev=None):
    dev = dev or device()
    pos = positions if positions is not None else torch.arange(T, device=dev)[None].expand(B, T) * 3 + 1
    inv = 1.0 / theta ** (torch.arange(0, R, 2, device=dev, dtype=torch.float64) / R)
    ang = pos.double()[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _compare(x, cos, sin, dtype):
    xo = x.detach().clone().requires_grad_()
    xr = x.detach().float().requires_grad_()
    y = apply_rope(xo, cos, sin)
    yr = naive_apply_rope(xr, cos, sin)
    assert y.dtype == x.dtype and y.shape == x.shape
    go = torch.randn(y.shape, device=y.device).to(dtype)
    (dx,) = torch.autograd.grad(y, (xo,), go)
    (dxr,) = torch.autograd.grad(yr, (xr,), go.float())
    _check("y", y, yr.to(dtype), dtype)
    _check("dx", dx, dxr, dtype)
    assert dx.dtype == x.dtype


@pytest.mark.parametrize("R", [32, 8], ids=["full", "partial"])
@pytest.mark.parametrize("cos_4d", [False, True], ids=["cos3d", "cos4d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, cos_4d, R):
    B, T, H, D = 2, 13, 3, 32
    x = torch.randn(B, T, H, D, device=device()).to(dtype)
    cos, sin = cos_sin(B, T, R)
    if dtype != torch.float32 and cos_4d:
        cos, sin = cos.to(dtype), sin.to(dtype)  # cos/sin in x's dtype, as the drafter and HF pass them
    if cos_4d:
        cos, sin = cos[:, :, None], sin[:, :, None]
    _compare(x, cos, sin, dtype)


def test_odd_heads_and_partial_width():
    """H = 5 (not a power of two), D = 40 with R = 12: a pass-through of 28 features."""
    x = torch.randn(1, 9, 5, 40, device=device())
    cos, sin = cos_sin(1, 9, 12)
    _compare(x, cos, sin, torch.float32)


def test_unequal_halves_and_batch_broadcast():
    """Arbitrary cos/sin (halves not equal) and a batch of 1 broadcast over B = 3."""
    x = torch.randn(3, 7, 2, 16, device=device())
    cos, sin = torch.randn(1, 7, 16, device=device()), torch.randn(1, 7, 16, device=device())
    _compare(x, cos, sin, torch.float32)


def test_head_major_transposed_input():
    """HF's q after ``.transpose(1, 2)``: a [B, H, T, D] tensor seen as [B, T, H, D]."""
    xh = torch.randn(2, 4, 11, 16, device=device())
    x = xh.transpose(1, 2)
    cos, sin = cos_sin(2, 11, 16)
    _compare(x, cos, sin, torch.float32)
    _compare(torch.randn(2, 11, 4, 32, device=device())[..., ::2], cos, sin, torch.float32)  # feature stride 2


def test_large_positions_stay_exact():
    """Angles made in fp64 (positions ~1e5): the op itself only multiplies, the error is the reference's."""
    pos = torch.tensor([[0, 1, 99_999, 100_000, 131_071]], device=device())
    cos, sin = cos_sin(1, 5, 64, positions=pos, theta=1e6)
    _compare(torch.randn(1, 5, 2, 64, device=device()), cos, sin, torch.float32)


def test_matches_hf_apply_rotary_pos_emb_partial():
    """transformers' Qwen3.5 apply_rotary_pos_emb (partial rotary: cos narrower than head_dim) in fp32."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    B, T, H, Hk, D, R = 2, 9, 4, 2, 32, 8
    q = torch.randn(B, H, T, D, device=device())
    k = torch.randn(B, Hk, T, D, device=device())
    cos, sin = cos_sin(B, T, R)
    qr, kr = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    qo = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)
    ko = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
    assert rel_err(qo, qr) < 1e-6 and rel_err(ko, kr) < 1e-6


def test_cos_sin_get_no_gradient_and_empty_input():
    x = torch.randn(1, 4, 2, 8, device=device(), requires_grad=True)
    cos, sin = cos_sin(1, 4, 8)
    cos.requires_grad_()
    y = apply_rope(x, cos, sin)
    (dx,) = torch.autograd.grad(y.sum(), (x,))
    assert dx.shape == x.shape
    e = torch.randn(1, 0, 2, 8, device=device(), requires_grad=True)
    c0, s0 = cos_sin(1, 0, 8)
    assert apply_rope(e, c0, s0).shape == (1, 0, 2, 8)


def test_torch_compile_no_graph_break():
    x = torch.randn(2, 7, 3, 16, device=device())
    cos, sin = cos_sin(2, 7, 16)

    def f(x):
        return apply_rope(x * 2, cos, sin).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = compiled(a)
    out.backward()
    ref = f(b)
    ref.backward()
    assert rel_err(out, ref) < 1e-6 and rel_err(a.grad, b.grad) < 1e-6


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint(reentrant):
    x = torch.randn(1, 9, 2, 16, device=device(), requires_grad=True)
    cos, sin = cos_sin(1, 9, 16)

    def f(x):
        return apply_rope(torch.tanh(x), cos, sin).square().sum()
    torch.utils.checkpoint.checkpoint(f, x, use_reentrant=reentrant).backward()
    g = x.grad.clone()
    x.grad = None
    f(x).backward()
    assert rel_err(g, x.grad) < 1e-6


def test_threads_on_fresh_shapes():
    errors = []
    shapes = [(1, 3 + 2 * i, 1 + i, 8 * (1 + i % 3), 8 * (1 + i % 3) - 4 * (i % 2)) for i in range(6)]
    cases = []
    for B, T, H, D, R in shapes:
        cases.append((torch.randn(B, T, H, D, device=device()),) + cos_sin(B, T, R))

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
    precompile([(OP, dict(B=1, T=6, H=2, D=16, R=8), torch.float32)], devices=[device()], verbose=False)
    x = torch.randn(1, 6, 2, 16, device=device(), requires_grad=True)
    cos, sin = cos_sin(1, 6, 8)
    with strict():
        apply_rope(x, cos, sin).sum().backward()


BAD = [
    (lambda a: dict(a, x=a["x"][0]), ValueError, "x: expected 4 dimensions"),
    (lambda a: dict(a, x=a["x"].long()), TypeError, "x: dtype torch.int64"),
    (lambda a: dict(a, cos=a["cos"][..., :6]), ValueError, "sin: shape .* differs from cos's"),
    (lambda a: dict(a, cos=torch.randn(2, 5, 18), sin=torch.randn(2, 5, 18)), ValueError, "2 <= R <= D=16"),
    (lambda a: dict(a, cos=a["cos"][..., :5], sin=a["sin"][..., :5]), ValueError, "R even"),
    (lambda a: dict(a, sin=a["sin"].half()), TypeError, "sin: dtype torch.float16 differs"),
    (lambda a: dict(a, cos=a["cos"][:, :, None].expand(2, 5, 3, 8), sin=a["sin"][:, :, None].expand(2, 5, 3, 8)),
     ValueError, r"cos: expected shape \[B, T, 1, R\]"),
    (lambda a: dict(a, cos=a["cos"][:, :4], sin=a["sin"][:, :4]), ValueError, "T=5"),
    (lambda a: dict(a, cos=a["cos"].double(), sin=a["sin"].double()), TypeError, "cos: dtype torch.float64"),
]


@pytest.mark.parametrize("change,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(change, exc, match):
    a = change(dict(x=torch.randn(2, 5, 3, 16), cos=torch.randn(2, 5, 8), sin=torch.randn(2, 5, 8)))
    with pytest.raises(exc, match=match):
        apply_rope(a["x"], a["cos"], a["sin"])


def test_kernel_configs_compile_for_hopper():
    from dflash_kernels.ops.rope.kernels import ROPE_CONFIGS
    from tests.helpers import H200_SHARED_MEMORY, hopper_shared_memory
    types = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": "*bf16"}
    shared = []
    for consts in [dict(H=32, D=128, R=128, BH=32, BR=64, BP=0, BACKWARD=False),
                   dict(H=16, D=256, R=64, BH=16, BR=32, BP=256, BACKWARD=True)]:
        shared += hopper_shared_memory("dflash_kernels.ops.rope.kernels", "_rope_kernel", types, consts,
                                       [(c.num_warps, c.num_stages, c.meta) for c in ROPE_CONFIGS])
    assert all(s <= H200_SHARED_MEMORY for s in shared), shared


# ------------------------------------------------------------------------------------ GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("shape,R,cos_dtype", [((1, 8192, 32, 128), 128, torch.bfloat16),
                                               ((1, 3072 + 8192, 8, 128), 128, torch.float32),
                                               ((2, 4099, 16, 256), 64, torch.bfloat16)],
                         ids=["q", "k", "hf-partial"])
def test_gpu_real_sizes_bf16(shape, R, cos_dtype):
    B, T, H, D = shape
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    cos, sin = cos_sin(B, T, R, theta=1e6, dtype=cos_dtype, dev=torch.device("cuda"))
    _compare(x, cos[:, :, None], sin[:, :, None], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_other_dtypes(dtype):
    x = torch.randn(2, 1000, 8, 128, device="cuda").to(dtype)
    cos, sin = cos_sin(2, 1000, 128, dev=torch.device("cuda"))
    _compare(x, cos, sin, dtype)
