"""chunk_gated_delta_rule / fused_recurrent_gated_delta_rule against the literal fp32 recurrence.

Outputs, final states and every gradient (q, k, v, g, beta, initial_state) are compared with
``naive.py`` by relative error. On the CPU the kernels run through the Triton interpreter
(TRITON_INTERPRET=1) at small sizes; tests marked ``gpu`` repeat them at real sizes on CUDA.
Output buffers are NaN-poisoned by the suite (tests/conftest.py), so an unwritten element fails.
The backward's local kernel runs in each of its modes (``DFLASH_KERNELS_GDN_BWD_LOCAL``: ``use_bwd_local``).
"""

import threading

import pytest
import torch
import torch.nn.functional as F

from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from dflash_kernels.ops.gated_delta_rule import gated_delta_rule as gdn_module
from dflash_kernels.ops.gated_delta_rule import kernels_bwd, kernels_fwd
from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from dflash_kernels.runtime import alloc, resolve
from tests.helpers import device, on_reference_device, rel_err, slow_param, worst_row_err


@pytest.fixture(autouse=True)
def _require_kernels():
    backend = resolve("gdn", device())
    if backend not in ("interpret", "triton"):
        pytest.fail(f"gdn tests need the Triton kernels (interpreter on the CPU), got backend {backend!r}; "
                    f"run with TRITON_INTERPRET=1")


def _tol(dtype, grad=False):
    """Bound on ||kernel - ref|| / ||ref||. fp32 on the GPU runs tl.dot in tf32 (10-bit mantissa);
    bf16 inputs keep the per-chunk states, U and A's products in bf16 as fla does."""
    if dtype == torch.float32:
        return 5e-3 if device().type == "cuda" else 1e-4
    return 5e-2 if grad else 3e-2


ROW_FACTOR = 4  # the worst row's bound, over the whole tensor's: a short row's rounding does not average out


def _inputs(B, T, Hk, Hv, K, V, dtype, h0=False, N=None, normalized=True):
    dev = device()
    q = torch.randn(B, T, Hk, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, Hk, K, device=dev, dtype=dtype)
    if normalized:  # without the in-kernel l2norm, callers pass unit keys (the delta rule needs |k| <= 1)
        k = F.normalize(k.float(), dim=-1).to(dtype)
    v = torch.randn(B, T, Hv, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, Hv, device=dev)).to(dtype) * 0.5
    beta = torch.rand(B, T, Hv, device=dev, dtype=dtype)
    state = torch.randn(N or B, Hv, K, V, device=dev) if h0 else None
    return q, k, v, g, beta, state


def _run(fn, tensors, kwargs, final, do, dht):
    """Outputs and gradients of ``fn`` on leaf copies of ``tensors`` (None entries stay None)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    q, k, v, g, beta, h0 = leaves
    if fn.__name__.startswith("naive"):
        fn = on_reference_device(fn)
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=final, **kwargs)
    loss = (o.float() * do).sum()
    if final:
        loss = loss + (ht * dht).sum()
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, present)
    return o, ht, dict(zip([n for n, t in zip("q k v g beta h0".split(), leaves) if t is not None], grads))


def _compare(tensors, kwargs, final, dtype):
    q, k, v, g, beta, h0 = tensors
    do = torch.randn(*v.shape, device=v.device)
    N = h0.shape[0] if h0 is not None else (q.shape[0] if kwargs.get("cu_seqlens") is None
                                             else kwargs["cu_seqlens"].numel() - 1)
    dht = torch.randn(N, v.shape[2], q.shape[3], v.shape[3], device=v.device)
    o, ht, grads = _run(chunk_gated_delta_rule, tensors, kwargs, final, do, dht)
    ro, rht, rgrads = _run(naive_recurrent_gated_delta_rule, tensors, kwargs, final, do, dht)
    assert o.dtype == q.dtype and o.shape == ro.shape
    errors = {"o": rel_err(o, ro)}
    if final:
        assert ht.dtype == torch.float32 and ht.shape == rht.shape
        errors["final_state"] = rel_err(ht, rht)
    else:
        assert ht is None
    for name, grad in grads.items():
        ref = [t for n, t in zip("q k v g beta h0".split(), tensors) if n == name][0]
        assert grad.dtype == ref.dtype and grad.shape == ref.shape, name
        errors["d" + name] = rel_err(grad, rgrads[name])
    bad = {n: e for n, e in errors.items() if e > _tol(dtype, grad=n.startswith("d"))}
    assert not bad, f"relative errors over {_tol(dtype)} / {_tol(dtype, True)}: {bad} (all: {errors})"
    # The worst single row (a token's head vector; for dg and dbeta one head's values over time) too.
    pairs = [("o", o, ro)] + ([("final_state", ht, rht)] if final else [])
    pairs += [("d" + n, g_, rgrads[n]) for n, g_ in grads.items()]
    # Rows are floored at 0.1 of the mean row norm: the first tokens' dq is small (one token in the state)
    # and keeps the absolute rounding of the bf16 products.
    rows = {n: worst_row_err(x, r, row_dims=(1,) if x.dim() == 3 else (-1,), floor=0.1) for n, x, r in pairs}
    bad = {n: e for n, e in rows.items() if e > ROW_FACTOR * _tol(dtype, grad=n.startswith("d"))}
    assert not bad, f"worst-row relative errors over {ROW_FACTOR} x the bounds: {bad} (all: {rows})"


# (id, B, T, Hk, Hv, K, V, dtype, l2norm, initial state, final state)
CASES = [
    ("T63-fp32-gqa-l2-h0", 2, 63, 1, 2, 16, 32, torch.float32, True, True, True),
    ("T64-fp32-boundary", 1, 64, 1, 1, 16, 16, torch.float32, False, True, True),
    ("T130-bf16-nol2", 1, 130, 2, 2, 32, 16, torch.bfloat16, False, False, False),
    ("T128-bf16-gqa-l2-h0", 1, 128, 1, 2, 16, 16, torch.bfloat16, True, True, True),
    ("T130-fp32-gqa-K32-h0", 1, 130, 1, 2, 32, 32, torch.float32, True, True, True),
    # three value heads per q/k head (Qwen3.5/3.6: 48 over 16), with and without the l2norm that sums them
    ("T70-bf16-gqa3-l2", 1, 70, 2, 6, 16, 16, torch.bfloat16, True, False, True),
    ("T70-fp32-gqa3-nol2", 1, 70, 1, 3, 16, 16, torch.float32, False, False, False),
]


def _params(cases, default):
    """The cases as pytest params; those whose id is not in ``default`` run only under ``-m slow``."""
    assert set(default) <= {c[0] for c in cases}, default
    return [slow_param(*c[1:], id=c[0], slow=c[0] not in default) for c in cases]


# The backward's local kernel: DFLASH_KERNELS_GDN_BWD_LOCAL -> the launcher module's kernel it launches.
BWD_LOCAL = {"twopass": "gdn_bwd_local_kernel", "onepass": "gdn_bwd_onepass_kernel", "group": "gdn_bwd_group_kernel"}


class _Launches:
    """Stands in for one local kernel's ``ByPrecision`` in the launcher's module, recording each launch's mode."""

    def __init__(self, real, mode, launched):
        self.real, self.mode, self.launched = real, mode, launched

    def of(self, x):
        self.launched.append(self.mode)
        return self.real.of(x)


def use_bwd_local(monkeypatch, mode):
    """Make the backward run local kernel ``mode`` (``DFLASH_KERNELS_GDN_BWD_LOCAL``); returns the list of the
    modes of the local kernels launched from then on, for the caller to check that ``mode`` alone ran."""
    monkeypatch.setenv("DFLASH_KERNELS_GDN_BWD_LOCAL", mode)
    launched = []
    for name, attr in BWD_LOCAL.items():
        monkeypatch.setattr(gdn_module, attr, _Launches(getattr(gdn_module, attr), name, launched))
    return launched


def _mode_params(cases, default):
    """``(mode, *case)`` params for every mode of ``BWD_LOCAL`` and case; ``default``: mode -> the case ids
    that run by default, the others only under ``-m slow``."""
    assert set(default) == set(BWD_LOCAL) and all(set(d) <= {c[0] for c in cases} for d in default.values())
    return [slow_param(mode, *c[1:], id=f"{c[0]}-{mode}", slow=c[0] not in default[mode])
            for mode in BWD_LOCAL for c in cases]


@pytest.mark.parametrize("local,B,T,Hk,Hv,K,V,dtype,l2,h0,final", _mode_params(CASES, {
    "twopass": ("T64-fp32-boundary", "T130-bf16-nol2", "T128-bf16-gqa-l2-h0", "T70-fp32-gqa3-nol2"),
    "onepass": ("T63-fp32-gqa-l2-h0", "T130-bf16-nol2"),
    "group": ("T63-fp32-gqa-l2-h0", "T70-bf16-gqa3-l2", "T70-fp32-gqa3-nol2")}))
def test_chunk_matches_reference(monkeypatch, local, B, T, Hk, Hv, K, V, dtype, l2, h0, final):
    launched = use_bwd_local(monkeypatch, local)
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, normalized=not l2)
    _compare(tensors, dict(use_qk_l2norm_in_kernel=l2), final, dtype)
    assert launched and set(launched) == {local}, launched


@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,l2,h0,final", _params(CASES[::2], ("T70-fp32-gqa3-nol2",)))
def test_saved_states_match_recompute(monkeypatch, B, T, Hk, Hv, K, V, dtype, l2, h0, final):
    # DFLASH_KERNELS_GDN_SAVE_STATES=1: the forward keeps w, h and v_new; the backward must then give
    # exactly what it gives when it recomputes them (same kernels, same order), and match the reference.
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, normalized=not l2)
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(B, Hv, K, V, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=l2)
    o, ht, grads = _run(chunk_gated_delta_rule, tensors, kwargs, final, do, dht)
    monkeypatch.setenv("DFLASH_KERNELS_GDN_SAVE_STATES", "1")

    def no_recompute(*args, **kwargs):
        raise AssertionError("the backward recomputed the states the forward was to keep")
    monkeypatch.setattr(gdn_module, "_wy_and_states", no_recompute)
    o_s, ht_s, grads_s = _run(chunk_gated_delta_rule, tensors, kwargs, final, do, dht)
    assert torch.equal(o_s, o)
    if final:
        assert torch.equal(ht_s, ht)
    for name, grad in grads.items():
        assert torch.equal(grads_s[name], grad), name
    _compare(tensors, kwargs, final, dtype)


def _same(a, b):
    """Bit-identical on the CPU (the interpreter runs the same products); one rounding apart on a GPU,
    where the two paths may be tuned to different V blocks."""
    if a is None or b is None:
        return a is None and b is None
    if device().type == "cpu":
        return torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return bool(torch.isnan(a).eq(torch.isnan(b)).all()) and rel_err(a.nan_to_num(), b.nan_to_num()) < 1e-2


SPLIT_CASES = [CASES[0], CASES[2], CASES[5]]


@pytest.mark.parametrize("save", [False, slow_param(True)], ids=["recompute", "save"])
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,l2,h0,final", _params(SPLIT_CASES, ("T63-fp32-gqa-l2-h0",)))
def test_split_forward_matches_fused(monkeypatch, save, B, T, Hk, Hv, K, V, dtype, l2, h0, final):
    """DFLASH_KERNELS_GDN_FWD_SPLIT=1 (the state scan, then the output over all chunks at once): the fused
    forward's output, final state and gradients (with the states kept for the backward or recomputed),
    and the reference's."""
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, normalized=not l2)
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(B, Hv, K, V, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=l2)
    if save:
        monkeypatch.setenv("DFLASH_KERNELS_GDN_SAVE_STATES", "1")
    monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "0")
    fused = _run(chunk_gated_delta_rule, tensors, kwargs, final, do, dht)
    monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "1")
    launched = []
    real = kernels_fwd.gdn_fwd_output_kernel.of

    def counting(x):
        launched.append(x.dtype)
        return real(x)
    monkeypatch.setattr(kernels_fwd.gdn_fwd_output_kernel, "of", counting)
    split = _run(chunk_gated_delta_rule, tensors, kwargs, final, do, dht)
    assert launched, "the split forward did not launch the output kernel"
    assert _same(split[0], fused[0]) and _same(split[1], fused[1])
    for name, grad in fused[2].items():
        assert _same(split[2][name], grad), name
    _compare(tensors, kwargs, final, dtype)


def test_split_forward_choice(monkeypatch):
    """The library splits the forward on a GPU when the sequence-heads fill at most a quarter of its SMs, keeps
    the fused scan on the CPU, and obeys DFLASH_KERNELS_GDN_FWD_SPLIT=1 / 0; another value is refused by name."""
    from dflash_kernels.runtime import devices

    monkeypatch.setattr(devices.torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"multi_processor_count": 132})())
    devices.sm_count.cache_clear()
    try:
        cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
        monkeypatch.delenv("DFLASH_KERNELS_GDN_FWD_SPLIT", raising=False)
        assert gdn_module._split_forward(1, 32, cuda) and gdn_module._split_forward(1, 33, cuda)
        assert not gdn_module._split_forward(1, 34, cuda) and not gdn_module._split_forward(2, 32, cuda)
        assert not gdn_module._split_forward(4, 48, cuda) and not gdn_module._split_forward(1, 1, cpu)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "1")
        assert gdn_module._split_forward(4, 48, cuda) and gdn_module._split_forward(1, 1, cpu)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "0")
        assert not gdn_module._split_forward(1, 32, cuda)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "auto")
        assert gdn_module._split_forward(1, 32, cuda)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "maybe")
        with pytest.raises(ValueError, match="DFLASH_KERNELS_GDN_FWD_SPLIT.*maybe"):
            gdn_module._split_forward(1, 32, cuda)
    finally:
        devices.sm_count.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_forward_varlen_and_nonfinite(monkeypatch, dtype):
    """The split forward on packed sequences (shorter than a chunk, empty, off the boundary) with a NaN in
    one sequence's v: the fused forward's outputs, NaN where they are NaN (from the bad token on, in its
    sequence only), and the final states."""
    bounds = [0, 30, 94, 94, 160]
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=device())
    q, k, v, g, beta, h0 = _inputs(1, bounds[-1], 1, 2, 16, 16, dtype, h0=True, N=len(bounds) - 1)
    v = v.clone()
    v[0, 110, 1, 3] = float("nan")  # sequence 3 (rows 94..159), value head 1, chunk-local row 16
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    with torch.no_grad():
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "0")
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "1")
        o_s, ht_s = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert _same(o_s, o) and _same(ht_s, ht)
    assert torch.isnan(o_s[0, 110:, 1]).all() and not torch.isnan(o_s[0, :110]).any()
    assert not torch.isnan(o_s[0, :, 0]).any()


@pytest.mark.parametrize("save", [False, True], ids=["recompute", "save"])
def test_forward_custom_op_checks(save):
    # Schema, fake (the saved states' shapes) and autograd registration of the forward custom op.
    q, k, v, g, beta, _ = _inputs(1, 70, 1, 2, 16, 16, torch.float32)
    args = ([t.requires_grad_() for t in (q, k, v, g, beta)] + [None] * 6
            + [16 ** -0.5, False, False, save, 0, False])
    result = torch.library.opcheck(gdn_module._gdn_chunk_fwd_op, tuple(args),
                                   test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("B,l2", [(1, True), (2, True), (2, False)], ids=["B1-l2", "B2-l2", "B2-nol2"])
def test_row_strided_views_read_in_place(B, l2):
    # The GDN layer splits its conv output [B, T, W] into q, k and v views (row stride W): the kernels read
    # them in place (v always, q and k through the l2norm) with outputs and gradients bit for bit those of
    # contiguous copies; the columns past the three views get no gradient.
    Hk, Hv, K, V, T, pad = 1, 2, 16, 16, 70, 8
    dtype, dev = torch.bfloat16, device()
    _, _, _, g, beta, _ = _inputs(B, T, Hk, Hv, K, V, dtype)
    widths = [Hk * K, Hk * K, Hv * V]
    mixed = torch.randn(B, T, sum(widths) + pad, device=dev, dtype=dtype)
    if not l2:  # unit keys without the in-kernel l2norm
        mixed[..., K * Hk:2 * K * Hk] = F.normalize(mixed[..., K * Hk:2 * K * Hk].float().view(B, T, Hk, K),
                                                    dim=-1).view(B, T, -1).to(dtype)
    mixed.requires_grad_()

    def views(x):
        q, k, v = torch.split(x[..., :sum(widths)], widths, dim=-1)
        return q.reshape(B, T, Hk, K), k.reshape(B, T, Hk, K), v.reshape(B, T, Hv, V)

    q, k, v = views(mixed)
    assert gdn_module.row_stride(v) == mixed.shape[-1] and gdn_module.rows(v) is v
    assert gdn_module.rows(q) is q and gdn_module.rows(k) is k
    # a channel-first conv output seen as [B, T, W] has no row stride: copied
    assert gdn_module.row_stride(views(mixed.detach().transpose(1, 2).contiguous().transpose(1, 2))[2]) is None
    do = torch.randn(B, T, Hv, V, device=dev)
    dht = torch.randn(B, Hv, K, V, device=dev)

    def run(q, k, v, wrt):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=l2, output_final_state=True)
        return o, ht, torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), wrt)

    o, ht, (dmixed,) = run(q, k, v, [mixed])
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    o2, ht2, grads = run(*dense, dense)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    for got, want in zip(torch.split(dmixed[..., :sum(widths)], widths, dim=-1), grads):
        assert torch.equal(got, want.reshape(B, T, -1))
    assert torch.count_nonzero(dmixed[..., sum(widths):]) == 0
    assert rel_err(o, naive_recurrent_gated_delta_rule(*(t.detach() for t in (q, k, v)), g, beta,
                                                       use_qk_l2norm_in_kernel=l2)[0]) <= _tol(dtype)


@pytest.mark.parametrize("local,dtype", [
    pytest.param(m, d, id=f"{m}-{n}", marks=pytest.mark.slow if (m, n) in (("onepass", "fp32"), ("group", "bf16"))
                 else ()) for m in BWD_LOCAL for d, n in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))])
def test_chunk_varlen(monkeypatch, local, dtype):
    # Uneven packed sequences: shorter than a chunk, exactly one chunk, empty, off the boundary.
    launched = use_bwd_local(monkeypatch, local)
    bounds = [0, 30, 94, 94, 160]
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=device())
    tensors = _inputs(1, bounds[-1], 1, 2, 16, 16, dtype, h0=True, N=len(bounds) - 1)
    _compare(tensors, dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens), True, dtype)
    assert launched and set(launched) == {local}, launched


# (id, B, T, Hk, Hv, K, V, dtype, l2, varlen bounds or None): the cases on which every mode must give twopass's
# gradients (beside the reference's): GQA 2 and 3, odd lengths, packed sequences, l2norm on and off
AGREE_CASES = [
    ("T63-fp32-gqa2-l2", 2, 63, 1, 2, 16, 16, torch.float32, True, None),
    ("varlen-bf16-gqa3-nol2", 1, 150, 1, 3, 16, 32, torch.bfloat16, False, (0, 17, 81, 150)),
    ("T130-bf16-gqa2-l2-K32", 1, 130, 2, 4, 32, 16, torch.bfloat16, True, None),
]


@pytest.mark.parametrize("local", ["onepass", "group"])
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,l2,bounds", _params(AGREE_CASES, ("T63-fp32-gqa2-l2",
                                                                               "varlen-bf16-gqa3-nol2")))
def test_bwd_local_modes_agree(monkeypatch, local, B, T, Hk, Hv, K, V, dtype, l2, bounds):
    """``onepass`` and ``group`` against ``twopass`` on the same inputs: every gradient within a rounding of the
    products (fp32: the order of the sums; bf16: dA^T dw formed as (A^T dU) S0^T, and in ``group`` the row
    scalings applied to the bf16 tiles), with the initial state's gradient and the final state's."""
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=device())
    N = B if cu is None else len(bounds) - 1
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=True, N=N, normalized=not l2)
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(N, Hv, K, V, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    results = {}
    for mode in ("twopass", local):
        with monkeypatch.context() as m:
            launched = use_bwd_local(m, mode)
            results[mode] = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
            assert set(launched) == {mode}, launched
    tol = 1e-5 if dtype == torch.float32 and device().type == "cpu" else 1e-2
    assert torch.equal(results[local][0], results["twopass"][0])  # the forward does not depend on the mode
    for name, grad in results["twopass"][2].items():
        got = results[local][2][name]
        assert got.dtype == grad.dtype and got.shape == grad.shape, name
        assert rel_err(got, grad) <= tol, (name, rel_err(got, grad))
    with monkeypatch.context() as m:
        use_bwd_local(m, local)
        _compare(tensors, kwargs, True, dtype)


@pytest.mark.parametrize("local", list(BWD_LOCAL))
def test_bwd_local_nonfinite_stays_in_its_sequence(monkeypatch, local):
    """A NaN in one packed sequence's v: each mode's gradients are NaN exactly where twopass's are (nowhere in
    the other sequences), and equal to twopass's elsewhere up to rounding."""
    bounds = [0, 40, 130]
    cu = torch.tensor(bounds, dtype=torch.long, device=device())
    tensors = list(_inputs(1, bounds[-1], 1, 2, 16, 16, torch.float32, h0=True, N=2, normalized=False))
    tensors[2] = tensors[2].clone()
    tensors[2][0, 90, 1, 5] = float("nan")  # sequence 1, value head 1
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(2, 2, 16, 16, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    results = {}
    for mode in dict.fromkeys(("twopass", local)):
        with monkeypatch.context() as m:
            use_bwd_local(m, mode)
            results[mode] = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)[2]
    for name, grad in results["twopass"].items():
        got = results[local][name]
        assert torch.equal(torch.isnan(got), torch.isnan(grad)), name
        if name != "h0":
            assert not torch.isnan(got[:, :40]).any(), name
        assert rel_err(got.nan_to_num(), grad.nan_to_num()) <= 1e-5, name
    assert not torch.isnan(results[local]["h0"][0]).any()


def test_bwd_local_bad_value(monkeypatch):
    """DFLASH_KERNELS_GDN_BWD_LOCAL other than twopass, onepass or group: the backward raises, naming both."""
    monkeypatch.setenv("DFLASH_KERNELS_GDN_BWD_LOCAL", "threepass")
    q, k, v, g, beta, _ = _inputs(1, 20, 1, 1, 16, 16, torch.float32)
    q.requires_grad_()
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)  # the forward does not read it
    with pytest.raises(ValueError, match="DFLASH_KERNELS_GDN_BWD_LOCAL.*threepass"):
        torch.autograd.grad(o.sum(), q)


def test_chunk_scale_and_no_grad_state():
    q, k, v, g, beta, _ = _inputs(1, 40, 1, 1, 16, 16, torch.float32)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, output_final_state=True)
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, output_final_state=True)
    assert rel_err(o, ro) <= _tol(torch.float32) and rel_err(ht, rht) <= _tol(torch.float32)


@pytest.mark.parametrize("dtype,cu", [(torch.float32, None), (torch.bfloat16, [0, 5, 5, 17])],
                         ids=["fp32", "bf16-varlen"])
def test_fused_recurrent(dtype, cu):
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.long, device=device())
    B, T = (2, 9) if cu is None else (1, cu[-1])
    N = B if cu is None else len(cu) - 1
    q, k, v, g, beta, h0 = _inputs(B, T, 1, 2, 16, 32, dtype, h0=True, N=N)
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert o.dtype == dtype
    # fp32 state in registers, one rounding of the output: tighter than the chunked path
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, ro) <= tol and rel_err(ht, rht) <= tol


def test_decode_continues_prefill():
    """Prefill with the chunked scan, then decode token by token: same as one pass over everything."""
    q, k, v, g, beta, _ = _inputs(1, 70, 1, 2, 16, 16, torch.float32)
    o_all, h_all = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    _, h = chunk_gated_delta_rule(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], output_final_state=True)
    for t in range(67, 70):
        o, h = fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                beta[:, t:t + 1], initial_state=h, output_final_state=True)
        # The prefill's state comes from the chunked kernels: tf32 dots on the GPU (see _tol).
        assert rel_err(o, o_all[:, t:t + 1]) <= _tol(torch.float32)
    assert rel_err(h, h_all) <= _tol(torch.float32)


def _hf_chunk():
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except Exception as e:  # not installed, or a version without Qwen3.5
        pytest.skip(f"HF transformers' qwen3_5 torch_chunk_gated_delta_rule is not importable: {e!r}")
    return torch_chunk_gated_delta_rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_hf_transformers(dtype):
    hf_chunk = _hf_chunk()
    q, k, v, g, beta, h0 = _inputs(2, 100, 1, 2, 16, 32, dtype, h0=True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    ho, hht = hf_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == ho.dtype == dtype
    assert rel_err(o, ho) <= _tol(dtype) and rel_err(ht, hht.float()) <= _tol(dtype)


def test_outputs_are_poisoned_in_this_suite():
    # The guarantee "an unwritten element fails" rests on the suite's NaN poisoning being on.
    assert alloc.poisoning()


def _bad(**overrides):
    q, k, v, g, beta, h0 = _inputs(1, 8, 1, 2, 16, 16, torch.float32, h0=True)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    # The bad tensors live on the test device too, so the check under test is the one that fires.
    args.update({n: t.to(q.device) if isinstance(t, torch.Tensor) else t for n, t in overrides.items()})
    return args


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
@pytest.mark.parametrize("overrides,error,match", [
    (dict(q=None), TypeError, "q: expected a tensor"),
    (dict(k=torch.zeros(1, 8, 1, 8)), ValueError, r"k: expected the shape of q"),
    (dict(q=torch.zeros(1, 8, 2, 16), k=torch.zeros(1, 8, 2, 16), v=torch.zeros(1, 8, 3, 16)), ValueError,
     r"v: its head count Hv=3 must be a multiple of q/k's Hk=2"),
    (dict(g=torch.zeros(1, 8, 1)), ValueError, r"g: expected shape \[B, T, Hv\]"),
    (dict(beta=torch.zeros(1, 8, 2, 1)), ValueError, r"beta: expected 3 dimensions"),
    (dict(q=torch.zeros(1, 8, 1, 16, dtype=torch.int32)), TypeError, "q: dtype torch.int32"),
    (dict(initial_state=torch.zeros(2, 2, 16, 16)), ValueError, r"initial_state: expected shape"),
    (dict(scale="0.5"), TypeError, "scale: expected a float"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "cu_seqlens: must rise from 0 to T=8"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens: expected a 1-D integer tensor"),
    (dict(q=torch.zeros(1, 8, 1, 512), k=torch.zeros(1, 8, 1, 512)), ValueError, "at most 256"),
])
def test_bad_inputs(fn, overrides, error, match):
    args = _bad(**overrides)
    if "cu_seqlens" in overrides:
        args["initial_state"] = None
    with pytest.raises(error, match=match):
        fn(**args)


def test_varlen_needs_batch_one():
    q, k, v, g, beta, _ = _inputs(2, 8, 1, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="q: with cu_seqlens the batch size must be 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8], device=q.device))


# ---------------------------------------------------------------- real sizes, on the GPU only

GPU_CASES = [
    ("T1000-bf16-l2-h0", 2, 1000, 4, 12, 128, 128, torch.bfloat16, True, True, True),
    ("T500-fp32-gqa", 1, 500, 2, 6, 128, 64, torch.float32, True, True, True),
    ("T4096-bf16-nostate", 1, 4096, 2, 6, 128, 128, torch.bfloat16, True, False, False),
    ("T777-bf16-K256", 1, 777, 1, 2, 256, 256, torch.bfloat16, True, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,l2,h0,final", [c[1:] for c in GPU_CASES],
                         ids=[c[0] for c in GPU_CASES])
def test_gpu_chunk_matches_reference(B, T, Hk, Hv, K, V, dtype, l2, h0, final):
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, normalized=not l2)
    _compare(tensors, dict(use_qk_l2norm_in_kernel=l2), final, dtype)


_SCANS = {"state_output": kernels_fwd.gdn_fwd_scan_kernel.default,
          "bwd_state": kernels_bwd.gdn_bwd_state_kernel.default,
          "bwd_local": kernels_bwd.gdn_bwd_local_kernel.default,
          "bwd_onepass": kernels_bwd.gdn_bwd_onepass_kernel.default,
          "bwd_group": kernels_bwd.gdn_bwd_group_kernel.default}
# The local kernels launched only in their DFLASH_KERNELS_GDN_BWD_LOCAL mode.
_SCAN_MODES = {"bwd_onepass": "onepass", "bwd_group": "group"}


@pytest.mark.gpu
@pytest.mark.parametrize("name,index", [(n, i) for n, k in _SCANS.items() for i in range(len(k.configs))])
def test_gpu_every_scan_candidate(monkeypatch, name, index):
    """Each tuning candidate of the forward scan and the backward's state and local kernels, forced as the
    only config: the output and every gradient against the reference at a Qwen-sized head (the tuner
    may pick any of them on some shape)."""
    kernel = _SCANS[name]
    monkeypatch.setattr(kernel, "configs", [kernel.configs[index]])
    monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "0")  # the fused scan (auto splits at 1 x 6 heads)
    monkeypatch.setenv("DFLASH_KERNELS_GDN_BWD_LOCAL", _SCAN_MODES.get(name, "twopass"))
    kernel.reset()
    try:
        tensors = _inputs(1, 333, 2, 6, 128, 128, torch.bfloat16, h0=True)
        _compare(tensors, dict(use_qk_l2norm_in_kernel=True), True, torch.bfloat16)
        assert kernel.cache_info(), f"{name}: not launched"
    finally:
        kernel.reset()


@pytest.mark.gpu
def test_gpu_varlen():
    bounds = [0, 1, 700, 764, 2000, 2003]
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=device())
    tensors = _inputs(1, bounds[-1], 4, 12, 128, 128, torch.bfloat16, h0=True, N=len(bounds) - 1)
    _compare(tensors, dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens), True, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    tensors = _inputs(1, 1000, 2, 6, 128, 128, torch.bfloat16, h0=True)
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(1, 6, 128, 128, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    _, _, first = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    _, _, second = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.gpu
def test_gpu_threads_on_fresh_shapes():
    """Four threads, each on a shape no one compiled yet (cold cache), forward and backward."""
    from dflash_kernels.runtime import reset_cache

    reset_cache()
    shapes = [(1, 300 + 37 * i, 2, 6, 128, 128) for i in range(4)]
    inputs = [_inputs(*s, torch.bfloat16, h0=True) for s in shapes]
    errors, results = [], [None] * len(shapes)

    def work(i):
        try:
            tensors = inputs[i]
            do = torch.randn(*tensors[2].shape, device=device())
            dht = torch.randn(tensors[5].shape, device=device())
            kwargs = dict(use_qk_l2norm_in_kernel=True)
            results[i] = (_run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht),
                          _run(naive_recurrent_gated_delta_rule, tensors, kwargs, True, do, dht))
            torch.cuda.synchronize()
        except Exception as e:  # reported below with the thread's index
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(shapes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (o, ht, grads), (ro, rht, rgrads) in results:
        assert rel_err(o, ro) <= _tol(torch.bfloat16) and rel_err(ht, rht) <= _tol(torch.bfloat16)
        for name in grads:
            assert rel_err(grads[name], rgrads[name]) <= _tol(torch.bfloat16, grad=True), name


@pytest.mark.parametrize("kernel,K", [("gdn_bwd_local_kernel", 128), ("gdn_bwd_local_kernel", 256),
                                      slow_param("gdn_bwd_onepass_kernel", 128), ("gdn_bwd_onepass_kernel", 256),
                                      slow_param("gdn_bwd_group_kernel", 128), ("gdn_bwd_group_kernel", 256)])
def test_backward_local_kernel_fits_hopper_shared_memory(kernel, K):
    """Every bf16 candidate of the backward's local kernels fits Hopper's shared memory, K=256
    included (compiled for sm_90 with Triton's toolchain: no GPU needed): with fp32 K-wide operands
    in its dots the two-pass kernel would not fit at K=256."""
    from tests.helpers import H200_SHARED_MEMORY, hopper_shared_memory

    group = kernel == "gdn_bwd_group_kernel"  # dq and dk in the inputs' dtype, [B, T, Hk, K]
    types = {n: "*fp32" for n in ("gcum_ptr", "dbeta_ptr", "dg_ptr", "A_ptr", "q_rstd_ptr", "k_rstd_ptr")}
    types.update({p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "h_ptr", "dh_ptr", "vnew_ptr",
                                       "dvnew_ptr", "do_ptr", "dv_ptr", "q_in_ptr", "k_in_ptr")})
    types.update({p: "*bf16" if group else "*fp32" for p in ("dq_ptr", "dk_ptr")})
    types.update({"cu_seqlens_ptr": "*i32", "chunk_indices_ptr": "*i32", "scale": "fp32"})
    wrapper = getattr(kernels_bwd, kernel).default
    configs = wrapper.configs
    consts = dict(HK=16, HV=48, K=K, V=K, BT=64, BK=K, IS_VARLEN=False)
    if group:
        consts.update(GROUP=True, L2NORM=True)
    smem = hopper_shared_memory("dflash_kernels.ops.gated_delta_rule.kernels_bwd", wrapper.fn.fn.__name__,
                                types, consts, [(c.num_warps, c.num_stages, dict(c.meta)) for c in configs])
    assert len(smem) == len(configs) and all(0 < b <= H200_SHARED_MEMORY for b in smem), list(zip(configs, smem))
