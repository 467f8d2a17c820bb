"""linear_cross_entropy (fused LM head + weighted cross-entropy) against the plain fp32 reference.

Losses, log-sum-exps, argmaxes and the gradients of hidden, weight and bias, with relative-error
metrics over the whole tensor and per row (the worst row), at odd sizes (V not a multiple of any block
size), with per-row weights, ignored rows, softcap and every reduction. On the CPU the Triton kernel
runs through the interpreter (TRITON_INTERPRET=1, as .ci/run sets it) and the chunk size is shrunk so
that 37 rows make three chunks; tests marked ``gpu`` repeat the comparison at real sizes in bf16 with
the default chunking and check the memory bound of the frozen-head case.
"""

import importlib
import threading

import pytest
import torch
import torch.nn.functional as F

from dflash_kernels.ops.linear_cross_entropy import linear_cross_entropy, naive_linear_cross_entropy
from dflash_kernels.runtime import resolve
from tests.helpers import device, rel_err

# The module (the package's attribute of that name is the function).
lce_mod = importlib.import_module("dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy")
OP = "linear_cross_entropy"
N, H, V = 37, 67, 1007  # V = 1007: not a multiple of any block size; three chunks of 16, 16, 5 rows


@pytest.fixture(autouse=True)
def _require_kernels():
    backend = resolve(OP, device())
    if backend not in ("interpret", "triton"):
        pytest.fail(f"{OP} tests need the Triton kernels (interpreter on the CPU), got backend {backend!r}; "
                    f"run with TRITON_INTERPRET=1")


@pytest.fixture
def small_chunks(monkeypatch):
    """16-row chunks (on the CPU): the chunk loop, the last partial chunk and the dW accumulation run."""
    if device().type == "cpu":
        monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 1)
        monkeypatch.setattr(lce_mod, "CHUNK_ROWS_MULTIPLE", 16)


# ------------------------------------------------------------------------------------------ helpers
def _tol(dtype):
    """(whole-tensor, worst-row) bounds on relative errors against the fp32 reference on the same inputs.
    In bf16/fp16 the logits and the logits gradient are rounded to the input dtype (as F.linear's are)."""
    return {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 8e-2), torch.float16: (4e-3, 1.5e-2)}[dtype]


def _loss_tol(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 3e-3, torch.float16: 1e-3}[dtype]


def worst_row_err(got, ref):
    """max over rows of ||got_r - ref_r|| / max(||ref_r||, rms row norm): a single bad row shows even
    when the whole-tensor error is small."""
    g = got.detach().double().reshape(got.shape[0], -1) if got.dim() > 1 else got.detach().double()[:, None]
    r = ref.detach().double().reshape(ref.shape[0], -1) if ref.dim() > 1 else ref.detach().double()[:, None]
    if torch.isnan(g).any() or torch.isnan(r).any():
        return float("inf")
    rn = r.norm(dim=1)
    floor = rn.square().mean().sqrt().clamp_min(1e-30)
    return ((g - r).norm(dim=1) / torch.maximum(rn, floor)).max().item()


def _check(name, got, ref, dtype, rows=True):
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    tol, row_tol = _tol(dtype)
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    if rows and got.dim() >= 1 and got.numel():
        werr = worst_row_err(got, ref)
        assert werr <= row_tol, f"{name}: worst row relative error {werr:.3g} > {row_tol:.3g}"


def _inputs(n, h, v, dtype, bias=True, weights=True, ignore=(3, 10, 11), scale=3.0, dev=None):
    dev = dev or device()
    hidden = torch.randn(n, h, device=dev).to(dtype)
    weight = (torch.randn(v, h, device=dev) * (scale / h ** 0.5)).to(dtype)
    b = torch.randn(v, device=dev).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), device=dev)
    for i in ignore:
        if i < n:
            labels[i] = -100
    w = torch.rand(n, device=dev) + 0.1 if weights else None
    return hidden, weight, b, labels, w


def _leaves(tensors, req, fp32=False):
    out = []
    for t, r in zip(tensors, req):
        if t is None:
            out.append(None)
            continue
        t = t.detach().clone()
        if fp32:
            t = t.float()
        out.append(t.requires_grad_(r))
    return out


def _run(hidden, weight, bias, labels, weights, req=(True, True, True), reduction="mean", softcap=None):
    """Ours and the reference (fp32 copies of the same inputs); returns (outputs, grads) of each."""
    ours = _leaves((hidden, weight, bias), req)
    refs = _leaves((hidden, weight, bias), req, fp32=True)
    kw = dict(weights=weights, reduction=reduction, softcap=softcap, return_lse=True, return_argmax=True)
    out = linear_cross_entropy(ours[0], ours[1], labels, bias=ours[2], **kw)
    ref = naive_linear_cross_entropy(refs[0], refs[1], labels, bias=refs[2], **kw)
    go = torch.randn_like(ref[0]) if reduction == "none" else torch.tensor(1.7, device=ref[0].device)
    leaves_o = [t for t in ours if t is not None and t.requires_grad]
    leaves_r = [t for t in refs if t is not None and t.requires_grad]
    grads_o = torch.autograd.grad(out[0], leaves_o, go) if leaves_o else ()
    grads_r = torch.autograd.grad(ref[0], leaves_r, go) if leaves_r else ()
    return out, ref, grads_o, grads_r, [t for t in ours if t is not None]


def _check_argmax(am, hidden, weight, bias, softcap, dtype):
    """The argmax is a maximal logit of the reference logits (up to the input dtype's rounding)."""
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    assert am.dtype == torch.int64 and am.shape == logits.shape[:1]
    picked = logits.gather(1, am[:, None]).squeeze(1)
    best = logits.max(1).values
    slack = 0 if dtype == torch.float32 else 2 ** -7 * best.abs() + 1e-3
    assert (picked >= best - slack - 1e-5).all(), "argmax is not a maximal logit"


def _check_all(out, ref, go, gr, dtype, names):
    loss, lse, am = out
    rloss, rlse, ram = ref
    assert loss.dtype == torch.float32 and loss.shape == rloss.shape
    err = rel_err(loss, rloss)
    assert err <= _loss_tol(dtype), f"loss: relative error {err:.3g}"
    if loss.dim():
        _check("loss rows", loss, rloss, dtype, rows=False)
        assert worst_row_err(loss, rloss) <= 10 * _loss_tol(dtype)
    assert lse.dtype == torch.float32
    assert rel_err(lse, rlse) <= _loss_tol(dtype)
    for name, g, r in zip(names, go, gr):
        assert g.dtype == (dtype if name != "dloss" else torch.float32)
        _check(name, g, r.to(g.dtype), dtype)


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("softcap", [None, 7.5], ids=["nocap", "cap"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(dtype, reduction, softcap, small_chunks):
    hidden, weight, bias, labels, w = _inputs(N, H, V, dtype)
    out, ref, go, gr, leaves = _run(hidden, weight, bias, labels, w, reduction=reduction, softcap=softcap)
    _check_all(out, ref, go, gr, dtype, ["dhidden", "dweight", "dbias"])
    _check_argmax(out[2], hidden, weight, bias, softcap, dtype)
    if dtype == torch.float32:
        assert torch.equal(out[2], ref[2])
    ignored = labels == -100
    assert not go[0][ignored].any(), "ignored rows get a zero hidden gradient"
    if reduction == "none":
        assert not out[0][ignored].any(), "ignored rows have loss 0"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("req", [(True, False, False), (False, True, False), (False, False, True),
                                 (True, True, False), (True, False, True), (False, True, True)],
                         ids=lambda r: "".join(n for n, x in zip(("h", "w", "b"), r) if x))
def test_requires_grad_combinations(req, reduction, small_chunks):
    hidden, weight, bias, labels, w = _inputs(N, H, V, torch.float32)
    out, ref, go, gr, leaves = _run(hidden, weight, bias, labels, w, req=req, reduction=reduction)
    names = [n for n, r in zip(("dhidden", "dweight", "dbias"), req) if r]
    _check_all(out, ref, go, gr, torch.float32, names)


def _count_dw(monkeypatch):
    calls = []
    real = lce_mod._dw_update

    def counting(acc, g, h):
        calls.append(g.shape[0])
        return real(acc, g, h)
    monkeypatch.setattr(lce_mod, "_dw_update", counting)
    return calls


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_frozen_head_runs_no_weight_gradient_gemm(reduction, small_chunks, monkeypatch):
    calls = _count_dw(monkeypatch)
    hidden, weight, bias, labels, w = _inputs(N, H, V, torch.float32)
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, bias=bias, weights=w, reduction=reduction)
    (loss.sum() if reduction == "none" else loss).backward()
    assert calls == [], f"weight-gradient GEMM ran for a frozen head: {calls}"
    assert h.grad is not None and not torch.isnan(h.grad).any()
    # The same call with a trainable head runs it once per chunk (16 + 16 + 5 rows on the CPU).
    wt = weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, wt, labels, bias=bias, weights=w, reduction=reduction)
    (loss.sum() if reduction == "none" else loss).backward()
    assert sum(calls) == N and (len(calls) == 3 or device().type == "cuda"), calls


def test_eval_runs_no_gradient_pass(small_chunks, monkeypatch):
    """Without any input requiring grad (or under no_grad) only the loss sweep runs."""
    passes = []
    real = lce_mod._row_pass

    def recording(*args):
        passes.append(args[-1])
        return real(*args)
    monkeypatch.setattr(lce_mod, "_row_pass", recording)
    hidden, weight, bias, labels, w = _inputs(N, H, V, torch.float32)
    ref = naive_linear_cross_entropy(hidden, weight, labels, bias=bias, weights=w)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(), weight, labels, bias=bias, weights=w)
    assert rel_err(loss, ref) < 1e-5 and not loss.requires_grad
    assert passes and not any(passes), passes
    loss = linear_cross_entropy(hidden.detach(), weight, labels, bias=bias, weights=w)
    assert rel_err(loss, ref) < 1e-5 and not any(passes)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_row_ignored(reduction, small_chunks):
    hidden, weight, bias, labels, w = _inputs(N, H, V, torch.float32)
    labels = torch.full_like(labels, -100)
    out, ref, go, gr, _ = _run(hidden, weight, bias, labels, w, reduction=reduction)
    loss = out[0]
    assert not torch.isnan(loss).any() and not loss.any(), loss
    for g in go:
        assert not torch.isnan(g).any() and not g.any(), "every gradient is 0"


def test_zero_weight_sum_gives_zero_mean(small_chunks):
    hidden, weight, bias, labels, _ = _inputs(N, H, V, torch.float32)
    w = torch.zeros(N, device=device())
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, bias=bias, weights=w)
    loss.backward()
    assert loss.item() == 0 and not torch.isnan(h.grad).any() and not h.grad.any()


def test_unweighted_mean_is_torch_cross_entropy(small_chunks):
    """Without weights, "mean" is F.cross_entropy's mean over the rows not ignored."""
    hidden, weight, bias, labels, _ = _inputs(N, H, V, torch.float32, ignore=(0, 36))
    h = hidden.clone().requires_grad_()
    h_ref = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, bias=bias, ignore_index=-100)
    ref = F.cross_entropy(F.linear(h_ref, weight, bias), labels, ignore_index=-100)
    loss.backward()
    ref.backward()
    assert rel_err(loss, ref) < 1e-5 and rel_err(h.grad, h_ref.grad) < 1e-5


def test_other_ignore_index_int32_labels_and_batched_shape(small_chunks):
    """hidden ``[B, T, H]``, int32 labels ``[B, T]``, ignore_index 7 (a real token id that then counts
    for nothing): outputs keep the labels' shape."""
    hidden, weight, bias, labels, w = _inputs(N + 1, H, V, torch.float32, ignore=())
    labels[:5] = 7
    hidden, labels, w = hidden.view(2, 19, H), labels.view(2, 19).to(torch.int32), w.view(2, 19)
    kw = dict(bias=bias, weights=w, ignore_index=7, reduction="none", return_lse=True, return_argmax=True)
    h = hidden.clone().requires_grad_()
    out = linear_cross_entropy(h, weight, labels, **kw)
    h_ref = hidden.clone().requires_grad_()
    ref = naive_linear_cross_entropy(h_ref, weight, labels, **kw)
    for o, r in zip(out, ref):
        assert o.shape == (2, 19)
    assert rel_err(out[0], ref[0]) < 1e-5 and rel_err(out[1], ref[1]) < 1e-5 and torch.equal(out[2], ref[2])
    assert not out[0].view(-1)[:5].any()
    go = torch.randn(2, 19, device=device())
    out[0].backward(go)
    ref[0].backward(go)
    assert h.grad.shape == hidden.shape and rel_err(h.grad, h_ref.grad) < 1e-5


def test_return_order():
    hidden, weight, bias, labels, w = _inputs(9, 16, 50, torch.float32)
    loss = linear_cross_entropy(hidden, weight, labels)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    loss2, lse = linear_cross_entropy(hidden, weight, labels, return_lse=True)
    loss3, am = linear_cross_entropy(hidden, weight, labels, return_argmax=True)
    assert lse.dtype == torch.float32 and am.dtype == torch.int64
    assert torch.equal(loss, loss2) and torch.equal(loss, loss3)


def test_argmax_takes_the_first_of_ties():
    """Equal maximal logits: the lowest token id, as torch.argmax (ties inside one block, across
    blocks in the same lane and across lanes)."""
    v, h = 1007, 8
    weight = torch.randn(v, h, device=device()) * 0.01
    hidden = torch.zeros(3, h, device=device())
    hidden[:, 0] = 1.0
    weight[[5, 7, 261, 900], 0] = 4.0  # 5 and 261: one lane of the interpreter's 256-wide blocks
    labels = torch.tensor([1, 2, 3], device=device())
    _, am = linear_cross_entropy(hidden, weight, labels, return_argmax=True)
    assert am.tolist() == [5, 5, 5]
    weight[5, 0] = 0.0
    _, am = linear_cross_entropy(hidden, weight, labels, return_argmax=True)
    assert am.tolist() == [7, 7, 7]
    weight[7, 0] = 0.0
    _, am = linear_cross_entropy(hidden, weight, labels, softcap=1.0, return_argmax=True)
    assert am.tolist() == [261, 261, 261]


def test_threads_on_fresh_shapes():
    """8 threads, each its own (N, H, V): compiles (GPU) or interpreted launches race; every result checked."""
    shapes = [(5 + 3 * i, 16 + 5 * i, 300 + 97 * i) for i in range(8)]
    errors = []
    gen = torch.Generator().manual_seed(1)
    cases = []
    for n, h, v in shapes:
        hidden = torch.randn(n, h, generator=gen).to(device())
        weight = (torch.randn(v, h, generator=gen) / h ** 0.5).to(device())
        labels = torch.randint(0, v, (n,), generator=gen).to(device())
        w = torch.rand(n, generator=gen).to(device())
        cases.append((hidden, weight, labels, w))

    def work(i):
        try:
            hidden, weight, labels, w = cases[i]
            h = hidden.clone().requires_grad_()
            loss, am = linear_cross_entropy(h, weight, labels, weights=w, return_argmax=True)
            loss.backward()
            h_ref = hidden.clone().requires_grad_()
            ref, ram = naive_linear_cross_entropy(h_ref, weight, labels, weights=w, return_argmax=True)
            ref.backward()
            assert rel_err(loss, ref) < 1e-5 and rel_err(h.grad, h_ref.grad) < 1e-4 and torch.equal(am, ram)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_torch_compile_no_graph_break():
    hidden, weight, bias, labels, w = _inputs(N, H, V, torch.float32)

    def f(h, wt, b):
        loss, am = linear_cross_entropy(h * 2, wt, labels, bias=b, weights=w, softcap=5.0, return_argmax=True)
        return loss * 3, am

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = _leaves((hidden, weight, bias), (True, True, True))
    exp = _leaves((hidden, weight, bias), (True, True, True))
    loss, am = compiled(*got)
    loss.backward()
    ref, ram = f(*exp)
    ref.backward()
    assert rel_err(loss, ref) < 1e-6 and torch.equal(am, ram)
    for g, e in zip(got, exp):
        assert rel_err(g.grad, e.grad) < 1e-6


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint(reentrant):
    hidden, weight, bias, labels, w = _inputs(N, H, V, torch.float32)
    h, wt = _leaves((hidden, weight), (True, True))

    def f(h, wt):
        return linear_cross_entropy(torch.tanh(h), wt, labels, weights=w, reduction="sum")
    loss = torch.utils.checkpoint.checkpoint(f, h, wt, use_reentrant=reentrant)
    loss.backward()
    gh, gw = h.grad.clone(), wt.grad.clone()
    h.grad = wt.grad = None
    ref = f(h, wt)
    ref.backward()
    assert rel_err(loss, ref) < 1e-6 and rel_err(gh, h.grad) < 1e-6 and rel_err(gw, wt.grad) < 1e-6


def test_precompile_then_strict():
    from dflash_kernels.runtime import precompile, strict
    precompile([(OP, dict(N=20, H=16, V=333), torch.float32)], devices=[device()], verbose=False)
    hidden, weight, bias, labels, w = _inputs(20, 16, 333, torch.float32, bias=False)
    with strict():
        linear_cross_entropy(hidden.requires_grad_(), weight, labels, weights=w, return_argmax=True)[0].backward()


BAD = [
    (lambda a: dict(a, hidden=a["hidden"].long()), TypeError, "hidden: dtype torch.int64"),
    (lambda a: dict(a, hidden="h"), TypeError, "hidden: expected a tensor"),
    (lambda a: dict(a, weight=a["weight"][:, :5]), ValueError, r"weight: expected shape \[V, H=8\]"),
    (lambda a: dict(a, weight=a["weight"][0]), ValueError, "weight: expected 2 dimensions"),
    (lambda a: dict(a, weight=a["weight"].double()), TypeError, "weight: dtype torch.float64"),
    (lambda a: dict(a, hidden=a["hidden"].half()), TypeError, "weight: dtype torch.float32 differs"),
    (lambda a: dict(a, labels=a["labels"].float()), TypeError, "labels: dtype torch.float32"),
    (lambda a: dict(a, labels=a["labels"][:3]), ValueError, r"labels: expected shape \(6,\)"),
    (lambda a: dict(a, labels=a["labels"] + 40), ValueError,
     r"labels: values must lie in \[0, V=11\).*got (4[0-9]|50) "),
    (lambda a: dict(a, labels=a["labels"] * 0 - 1), ValueError, r"labels: .*got -1 at flat index 0"),
    (lambda a: dict(a, bias=torch.zeros(10)), ValueError, r"bias: expected shape \[V=11\]"),
    (lambda a: dict(a, bias=torch.zeros(11, dtype=torch.float16)), TypeError, "bias: dtype torch.float16 differs"),
    (lambda a: dict(a, weights=torch.ones(5)), ValueError, r"weights: expected one weight per row, shape \(6,\)"),
    (lambda a: dict(a, weights=torch.ones(6, dtype=torch.int64)), TypeError, "weights: dtype torch.int64"),
    (lambda a: dict(a, ignore_index=1.5), TypeError, "ignore_index: expected an int, got 1.5"),
    (lambda a: dict(a, reduction="avg"), ValueError, "reduction: expected one of .*'avg'"),
    (lambda a: dict(a, softcap=0.0), ValueError, "softcap: .* got 0.0"),
    (lambda a: dict(a, softcap=-3), ValueError, "softcap: .* got -3"),
    (lambda a: dict(a, softcap=float("inf")), ValueError, "softcap: .* got inf"),
    (lambda a: dict(a, softcap=float("nan")), ValueError, "softcap: .* got nan"),
    (lambda a: dict(a, softcap="30"), TypeError, "softcap: .* got '30'"),
    (lambda a: dict(a, weight=a["weight"].to("meta")), ValueError, "weight: is on meta"),
]


@pytest.mark.parametrize("change,exc,match", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input(change, exc, match):
    args = dict(hidden=torch.randn(6, 8), weight=torch.randn(11, 8), labels=torch.randint(0, 11, (6,)))
    a = change(args)
    with pytest.raises(exc, match=match):
        linear_cross_entropy(a.pop("hidden"), a.pop("weight"), a.pop("labels"), **a)


def test_chunk_rows(monkeypatch):
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 512 << 20)
    assert lce_mod.chunk_rows(8192, 248320, 2) == 1024  # 1024 * 248320 * 2 B = 485 MiB <= 512 MiB
    assert lce_mod.chunk_rows(100, 248320, 2) == 100
    assert lce_mod.chunk_rows(8192, 248320, 4) == 512
    assert lce_mod.chunk_rows(10 ** 6, 2 ** 24, 4) == 128  # at least 128 rows


def test_kernel_configs_compile_for_hopper():
    """Every tuning candidate compiles for sm_90 (Triton's own toolchain, no GPU) and fits its shared
    memory, with every constexpr branch on (weights, softcap, argmax, gradient)."""
    from dflash_kernels.ops.linear_cross_entropy.kernels import ROWS_CONFIGS
    from tests.helpers import H200_SHARED_MEMORY, hopper_shared_memory
    types = {"logits_ptr": "*bf16", "labels_ptr": "*i64", "weights_ptr": "*fp32", "loss_ptr": "*fp32",
             "lse_ptr": "*fp32", "argmax_ptr": "*i64", "softcap": "fp32"}
    consts = dict(HAS_WEIGHTS=True, SOFTCAP=True, ARGMAX=True, GRAD=True)
    shared = hopper_shared_memory("dflash_kernels.ops.linear_cross_entropy.kernels", "_linear_ce_rows_kernel",
                                  types, consts, [(c.num_warps, c.num_stages, c.meta) for c in ROWS_CONFIGS])
    assert all(s <= H200_SHARED_MEMORY for s in shared), shared


# ------------------------------------------------------------------------------------ GPU, real sizes
def _gpu_compare(n, h, v, dtype, req=(True, False, False), bias=False, reduction="mean", softcap=None):
    # Logits of std 2.5 (max ~ 15), as an LM head's: their bf16 rounding (what F.linear gives too) moves
    # the softmax by up to ~3% at the top logits, the gradients' errors against fp32 logits ~0.3%.
    hidden, weight, b, labels, w = _inputs(n, h, v, dtype, bias=bias, ignore=range(0, n, 10), scale=2.5)
    out, ref, go, gr, _ = _run(hidden, weight, b, labels, w, req=req, reduction=reduction, softcap=softcap)
    names = [nm for nm, r in zip(("dhidden", "dweight", "dbias"), req) if r]
    _check_all(out, ref, go, gr, dtype, names)
    _check_argmax(out[2], hidden, weight, b, softcap, dtype)
    ignored = labels == -100
    if req[0]:
        assert not go[0][ignored].any()
    del out, ref, go, gr
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,v", [(4096, 2560, 151936), (3001, 1031, 50257)], ids=lambda x: str(x))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_frozen_head_bf16(n, h, v, reduction):
    _gpu_compare(n, h, v, torch.bfloat16, reduction=reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpu_trained_head_with_bias_and_softcap(reduction):
    _gpu_compare(2048, 1024, 100003, torch.bfloat16, req=(True, True, True), bias=True, reduction=reduction,
                 softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_other_dtypes(dtype):
    _gpu_compare(1500, 1024, 32001, dtype, req=(True, True, False))


@pytest.mark.gpu
def test_gpu_real_preset_memory_and_frozen_path(monkeypatch):
    """N=8192, H=2560, V=248320 bf16, frozen head: fwd+bwd peak memory above the inputs <= 1 GiB (the
    [N, V] logits alone would be 3.8 GiB), no weight-gradient GEMM, finite loss and gradient."""
    calls = _count_dw(monkeypatch)
    n, h, v = 8192, 2560, 248320
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::10] = -100
    w = torch.rand(n, device="cuda")

    def step():
        loss, am = linear_cross_entropy(hidden, weight, labels, weights=w, return_argmax=True)
        (dh,) = torch.autograd.grad(loss, (hidden,))
        return loss, am, dh

    step()  # compile and tune outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, am, dh = step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 2 ** 30, f"peak extra memory {extra / 2 ** 20:.0f} MiB > 1024 MiB"
    assert calls == [] and torch.isfinite(loss) and torch.isfinite(dh).all()
    # Spot-check rows against the fp32 reference (the reference's full logits would be 7.6 GiB).
    rows = torch.arange(0, n, 97, device="cuda")
    hr = hidden.detach()[rows].float().requires_grad_()
    ref = naive_linear_cross_entropy(hr, weight.float(), labels[rows], weights=w[rows], reduction="none")
    (gref,) = torch.autograd.grad(ref.sum(), (hr,))
    got = linear_cross_entropy(hidden.detach()[rows], weight, labels[rows], weights=w[rows], reduction="none")
    assert rel_err(got, ref) < 3e-3
    denom = (w * (labels != -100)).sum()
    assert rel_err(dh[rows].float() * denom, gref) < 2e-2


@pytest.mark.gpu
def test_gpu_out_of_range_label_gives_nan_not_a_fault():
    hidden, weight, _, labels, w = _inputs(300, 256, 5000, torch.bfloat16, bias=False)
    labels[7] = 5000
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, reduction="none")
    loss.sum().backward()
    torch.cuda.synchronize()
    assert torch.isnan(loss[7]) and torch.isfinite(loss[8:]).all() and torch.isfinite(h.grad[8:]).all()
