"""fla 0.6.0's keywords of chunk_gated_delta_rule / fused_recurrent_gated_delta_rule against the fp32
reference of ``naive.py``: the in-kernel gate (``use_gate_in_kernel`` with ``A_log``, ``dt_bias``), beta
as logits (``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval``), V-first states (``state_v_first``),
precomputed varlen metadata (``cu_seqlens_cpu``, ``chunk_indices``), mixed q/k/v dtypes, and the
errors for what is not supported.

Every output, final state and gradient (q, k, v, raw g, beta logits, A_log, dt_bias, initial_state) is
compared by its relative error and by the worst row's: the largest relative error over the (token, head)
rows (``_worst_row``). CPU: the interpreter at small sizes; ``gpu``: Qwen-sized heads on CUDA, and fla
itself where it is importable.
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from dflash_kernels.ops.gated_delta_rule.naive import naive_gdn_gate, naive_recurrent_gated_delta_rule
from dflash_kernels.runtime import resolve
from tests.helpers import device, rel_err, slow_param

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


@pytest.fixture(autouse=True)
def _require_kernels():
    backend = resolve("gdn", device())
    if backend not in ("interpret", "triton"):
        pytest.fail(f"gdn tests need the Triton kernels (interpreter on the CPU), got backend {backend!r}; "
                    f"run with TRITON_INTERPRET=1")


def _cuda():
    return device().type == "cuda"


def _tol(dtype, grad=False):
    """Bound on the relative error (as test_gated_delta_rule.py: tf32 dots for fp32 on the GPU)."""
    if dtype == torch.float32:
        return 5e-3 if _cuda() else 1e-4
    return 5e-2 if grad else 3e-2


def _row_tol(dtype):
    """Bound on the worst row's relative error (a row's error is floored by a tenth of the mean row norm:
    a row near zero in the reference has no meaningful relative error)."""
    if dtype == torch.float32:
        return 5e-2 if _cuda() else 1e-3
    return 0.25


def _worst_row(a, b, name):
    """Max over rows of ||a_row - b_row|| / max(||b_row||, 0.1 * mean row norm). Rows: the last dim of
    per-(token, head) vectors (o, q, k, v: [..., D]); the heads of one token for per-(token, head)
    scalars (g, beta: [B, T, Hv]); V (or K) columns of states; A_log and dt_bias are one row."""
    a64, b64 = a.detach().double(), b.detach().double()
    if torch.isnan(a64).any():
        return float("inf")
    if name in ("A_log", "dt_bias"):
        a64, b64 = a64.reshape(1, -1), b64.reshape(1, -1)
    else:
        a64, b64 = a64.reshape(-1, a64.shape[-1]), b64.reshape(-1, b64.shape[-1])
    norms = b64.norm(dim=1)
    floor = 0.1 * norms.mean().clamp_min(1e-30)
    return ((a64 - b64).norm(dim=1) / torch.maximum(norms, floor)).max().item()


def _contributions(name, tensors, dg_raw):
    """Per-token terms [B*T, Hv] of the A_log / dt_bias gradient from the reference's raw-gate gradient:
    ddt_bias = sum dg_raw; dA_log = sum dg_decay * decay = sum dg_raw * softplus(x) / sigmoid(x)."""
    dg_raw = dg_raw.detach().double().reshape(-1, dg_raw.shape[-1])
    if name == "ddt_bias":
        return dg_raw
    x = tensors[3].detach().double().reshape(dg_raw.shape)
    if tensors[6] is not None:
        x = x + tensors[6].detach().double()
    return dg_raw * F.softplus(x) / torch.sigmoid(x)


def _sum_err(a, b, terms):
    """max over heads of |a_h - b_h| / sqrt(sum_t terms_th^2)."""
    scale = terms.norm(dim=0).clamp_min(1e-30)
    return ((a.detach().double().reshape(-1) - b.detach().double().reshape(-1)).abs() / scale).max().item()


def _inputs(B, T, Hk, Hv, K, V, dtype, h0=False, N=None, state_v_first=False, dt_bias=True, v_dtype=None,
            seed=0):
    """q, k, v, raw gate g, beta logits, A_log, dt_bias, initial state (keys unit-norm, no l2norm)."""
    dev = device()
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dt)
    q = rand(B, T, Hk, K, dt=dtype)
    k = F.normalize(rand(B, T, Hk, K), dim=-1).to(dtype)
    v = rand(B, T, Hv, V, dt=v_dtype or dtype)
    g = rand(B, T, Hv, dt=dtype)  # raw gate: softplus(g + dt_bias) spans (0, ~4)
    beta = rand(B, T, Hv, dt=dtype)  # logits
    A_log = (torch.rand(Hv, generator=gen) * 2 - 2.5).to(dev)  # exp(A_log) in (0.08, 0.6): decays 0.2-1
    bias = rand(Hv) if dt_bias else None
    shape = (N or B, Hv, V, K) if state_v_first else (N or B, Hv, K, V)
    state = rand(*shape) if h0 else None
    return [q, k, v, g, beta, A_log, bias, state]


def _run(fn, tensors, kwargs, final, do, dht, grad=True):
    leaves = [None if t is None else t.detach().clone().requires_grad_(grad) for t in tensors]
    q, k, v, g, beta, A_log, dt_bias, h0 = leaves
    if fn is naive_recurrent_gated_delta_rule:  # metadata only: the reference reads cu_seqlens
        kwargs = {n: a for n, a in kwargs.items() if n not in ("cu_seqlens_cpu", "chunk_indices")}
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=final, A_log=A_log, dt_bias=dt_bias,
               **kwargs)
    if not grad:
        return o, ht, {}
    loss = (o.float() * do).sum()
    if final:
        loss = loss + (ht * dht).sum()
    present = [(n, t) for n, t in zip(NAMES, leaves) if t is not None]
    grads = torch.autograd.grad(loss, [t for _, t in present])
    return o, ht, dict(zip([n for n, _ in present], grads))


def _compare(tensors, kwargs, final, dtype, fn=chunk_gated_delta_rule, ref=naive_recurrent_gated_delta_rule,
             tol_scale=1.0):
    """Outputs and every gradient of ``fn`` against ``ref``; fails listing every error over its bound
    (the relative-error bound times ``tol_scale``; the worst-row bound as it is)."""
    q, v, h0 = tensors[0], tensors[2], tensors[7]
    cu = kwargs.get("cu_seqlens")
    N = q.shape[0] if cu is None else cu.numel() - 1
    K, V, Hv = q.shape[3], v.shape[3], v.shape[2]
    gen = torch.Generator(device="cpu").manual_seed(1)
    do = torch.randn(*v.shape, generator=gen).to(device())
    dht = torch.randn(N, Hv, *((V, K) if kwargs.get("state_v_first") else (K, V)), generator=gen).to(device())
    o, ht, grads = _run(fn, tensors, kwargs, final, do, dht)
    ro, rht, rgrads = _run(ref, tensors, kwargs, final, do, dht)
    assert o.dtype == q.dtype and o.shape == ro.shape
    pairs = {"o": (o, ro)}
    if final:
        assert ht.dtype == torch.float32 and ht.shape == rht.shape
        pairs["final_state"] = (ht, rht)
    else:
        assert ht is None
    for name, grad in grads.items():
        src = tensors[NAMES.index(name)]
        assert grad.dtype == src.dtype and grad.shape == src.shape, (name, grad.dtype, grad.shape)
        pairs["d" + name] = (grad, rgrads[name])
    assert set(grads) == {n for n, t in zip(NAMES, tensors) if t is not None}
    errors, rows, bad = {}, {}, {}
    for name, (a, b) in pairs.items():
        errors[name] = rel_err(a, b)
        rows[name] = _worst_row(a, b, name[1:] if name.startswith("d") else name)
        if name in ("dA_log", "dt_bias", "ddt_bias"):
            # Sums over every token of terms of both signs: the sum can be much smaller than its terms,
            # so its error is bounded relative to the terms' root-sum-square per head (the scale of
            # summed independent per-token errors), the worst head's.
            rows[name] = _sum_err(a, b, _contributions(name, tensors, rgrads["g"]))
        grad = name.startswith("d")
        if rows[name] > _row_tol(dtype) or (errors[name] > tol_scale * _tol(dtype, grad)
                                            and name not in ("dA_log", "ddt_bias")):
            bad[name] = (errors[name], rows[name])
    assert not bad, f"(rel, worst row) over ({tol_scale * _tol(dtype)}|{tol_scale * _tol(dtype, True)}, " \
                    f"{_row_tol(dtype)}): {bad}; " \
                    f"all rel {errors}; all worst rows {rows}"
    return errors, rows


def prepare_chunk_indices(cu_seqlens, chunk_size=64):
    """fla's ``prepare_chunk_indices``: [chunks, 2] (sequence, chunk within it), cu_seqlens' dtype and device."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    rows = [(n, i) for n, L in enumerate(lens) for i in range((L + chunk_size - 1) // chunk_size)]
    return torch.tensor(rows, dtype=cu_seqlens.dtype).reshape(-1, 2).to(cu_seqlens.device)


OPTIONS = dict(gate=dict(use_gate_in_kernel=True),
               sigmoid=dict(use_beta_sigmoid_in_kernel=True),
               negeig=dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
               vfirst=dict(state_v_first=True))


def _kwargs(opts):
    kw = {}
    for o in opts.split("+"):
        kw.update(OPTIONS[o])
    return kw


def _prepare(tensors, kwargs):
    """Without the in-kernel gate / sigmoid the test passes what fla would then expect: the log decay
    and beta in (0, 1) made from the same raw numbers (A_log, dt_bias unused)."""
    tensors = list(tensors)
    if not kwargs.get("use_gate_in_kernel"):
        tensors[3] = naive_gdn_gate(tensors[3], tensors[5], tensors[6]).to(tensors[3].dtype)
        tensors[5] = tensors[6] = None
    if not kwargs.get("use_beta_sigmoid_in_kernel"):
        tensors[4] = tensors[4].float().sigmoid().to(tensors[4].dtype)
    return tensors


# (id, B, T, Hk, Hv, K, V, dtype, options, h0, final, dt_bias)
CASES = [
    ("T63-fp32-gate-sigmoid-h0", 2, 63, 1, 2, 16, 16, torch.float32, "gate+sigmoid", True, True, True),
    ("T70-fp32-gate-nobias-negeig-vfirst", 1, 70, 1, 2, 16, 32, torch.float32, "gate+negeig+vfirst", True, True,
     False),
    ("T65-bf16-gate-negeig-vfirst", 1, 65, 1, 2, 16, 16, torch.bfloat16, "gate+negeig+vfirst", True, True, True),
    ("T50-fp32-vfirst-only", 1, 50, 2, 2, 16, 16, torch.float32, "vfirst", True, True, True),
    ("T40-fp32-sigmoid-only-nostate", 1, 40, 1, 3, 16, 16, torch.float32, "sigmoid", False, False, True),
]


# The backward's local kernel modes (test_gated_delta_rule.use_bwd_local): each case in twopass, a few in the others.
_MODE_DEFAULT = {"twopass": {c[0] for c in CASES}, "onepass": {"T70-fp32-gate-nobias-negeig-vfirst"},
                 "group": {"T63-fp32-gate-sigmoid-h0", "T65-bf16-gate-negeig-vfirst"}}


@pytest.mark.parametrize("local,B,T,Hk,Hv,K,V,dtype,opts,h0,final,bias", [
    slow_param(m, *c[1:], id=f"{c[0]}-{m}", slow=c[0] not in _MODE_DEFAULT[m]) for m in _MODE_DEFAULT for c in CASES])
def test_chunk_options(monkeypatch, local, B, T, Hk, Hv, K, V, dtype, opts, h0, final, bias):
    from tests.ops.test_gated_delta_rule import use_bwd_local

    launched = use_bwd_local(monkeypatch, local)
    kwargs = _kwargs(opts)
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, state_v_first=kwargs.get("state_v_first", False),
                      dt_bias=bias)
    _compare(_prepare(tensors, kwargs), kwargs, final, dtype)
    assert launched and set(launched) == {local}, launched


@pytest.mark.parametrize("meta,local", [slow_param("cu_seqlens_cpu", "twopass"), slow_param("chunk_indices", "twopass"),
                                        ("both", "twopass"), slow_param("both", "onepass"), ("both", "group")])
def test_chunk_varlen_metadata(monkeypatch, meta, local):
    # Packed sequences (short, one chunk, empty, off the boundary), V-first states, the fused gate and
    # sigmoid; the metadata given in each of fla's forms, and cu_seqlens never copied to the host.
    bounds = [0, 30, 94, 94, 160]
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=device())
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                  cu_seqlens=cu_seqlens)
    if meta in ("cu_seqlens_cpu", "both"):
        kwargs["cu_seqlens_cpu"] = torch.tensor(bounds, dtype=torch.long)
    if meta in ("chunk_indices", "both"):
        kwargs["chunk_indices"] = prepare_chunk_indices(cu_seqlens)
    tensors = _inputs(1, bounds[-1], 1, 2, 16, 16, torch.float32, h0=True, N=len(bounds) - 1, state_v_first=True)
    from dflash_kernels.ops.gated_delta_rule import checks, gated_delta_rule as gdn_module
    from tests.ops.test_gated_delta_rule import use_bwd_local

    launched = use_bwd_local(monkeypatch, local)

    real_tolist = torch.Tensor.tolist

    def no_host_copy(t):
        if t is cu_seqlens:
            raise AssertionError("cu_seqlens was copied to the host despite the precomputed metadata")
        return real_tolist(t)
    real_layout = gdn_module._varlen_layout

    def layout(cu, *args):
        if cu is cu_seqlens and args[-1] is None and args[-2] is None:
            raise AssertionError("the layout was built from cu_seqlens alone")
        return real_layout(cu, *args)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", no_host_copy)
        m.setattr(gdn_module, "_varlen_layout", layout)
        ours = _run(chunk_gated_delta_rule, tensors, kwargs, True, torch.ones(1, 160, 2, 16, device=device()),
                    torch.ones(4, 2, 16, 16, device=device()))
    assert ours[0].shape == (1, 160, 2, 16) and checks is not None
    _compare(tensors, kwargs, True, torch.float32)
    assert launched and set(launched) == {local}, launched


def test_chunk_mixed_dtypes():
    # fp32 q/k with bf16 v (as fla takes): computed in fp32, o in q's dtype, each gradient in its input's.
    tensors = _inputs(1, 70, 1, 2, 16, 16, torch.float32, h0=True, v_dtype=torch.bfloat16)
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    _compare(tensors, kwargs, True, torch.float32)
    q, k, v = tensors[:3]
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, tensors[3], tensors[4], A_log=tensors[5], dt_bias=tensors[6],
                                            **kwargs)
    assert o.dtype == torch.bfloat16  # fla's recurrent returns v's dtype


@pytest.mark.parametrize("opts,dtype,cu", [("gate+negeig+vfirst", torch.float32, None),
                                            ("gate+sigmoid", torch.bfloat16, [0, 5, 5, 17]),
                                            ("vfirst", torch.float32, [0, 3, 11])],
                         ids=["fp32-all", "bf16-varlen-gate-sigmoid", "fp32-varlen-vfirst"])
def test_recurrent_options(opts, dtype, cu):
    kwargs = _kwargs(opts)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.long, device=device())
    B, T = (2, 9) if cu is None else (1, cu[-1])
    N = B if cu is None else len(cu) - 1
    tensors = _prepare(_inputs(B, T, 1, 2, 16, 32, dtype, h0=True, N=N,
                               state_v_first=kwargs.get("state_v_first", False)), kwargs)
    if cu is not None:
        kwargs.update(cu_seqlens=cu_seqlens, cu_seqlens_cpu=torch.tensor(cu))
    o, ht, _ = _run(fused_recurrent_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
    ro, rht, _ = _run(naive_recurrent_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
    assert o.dtype == tensors[2].dtype and ht.shape == rht.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(o, ro) <= tol and rel_err(ht, rht) <= tol
    assert _worst_row(o, ro, "o") <= 10 * tol and _worst_row(ht, rht, "h0") <= 10 * tol


def test_recurrent_defaults_g_and_beta():
    # fla: g None is no decay, beta None is beta = 1.
    q, k, v, *_ = _inputs(1, 5, 1, 2, 16, 16, torch.float32)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, output_final_state=True)
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, torch.zeros(1, 5, 2, device=q.device), torch.ones(1, 5, 2, device=q.device),
                                               output_final_state=True)
    assert rel_err(o, ro) <= _tol(torch.float32) and rel_err(ht, rht) <= _tol(torch.float32)


def test_decode_continues_prefill_v_first():
    # Prefill (chunked) then decode (recurrent) with V-first states and the fused gate and sigmoid.
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    q, k, v, g, beta, A_log, dt_bias, _ = _inputs(1, 70, 1, 2, 16, 16, torch.float32)
    o_all, h_all = naive_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True, A_log=A_log,
                                                    dt_bias=dt_bias, **kwargs)
    _, h = chunk_gated_delta_rule(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], output_final_state=True,
                                  A_log=A_log, dt_bias=dt_bias, **kwargs)
    for t in range(67, 70):
        o, h = fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                beta[:, t:t + 1], initial_state=h, output_final_state=True,
                                                A_log=A_log, dt_bias=dt_bias, **kwargs)
        assert rel_err(o, o_all[:, t:t + 1]) <= _tol(torch.float32)
    assert h.shape == (1, 2, 16, 16) and rel_err(h, h_all) <= _tol(torch.float32)


def test_gate_matches_fla_formula():
    # fla's naive_gdn_gate: -exp(A_log) * softplus(g + dt_bias), softplus the identity above 20.
    g = torch.tensor([[[-30.0, 0.0, 19.0, 25.0]]])
    A_log, dt_bias = torch.tensor([0.0, 1.0, -1.0, 0.5]), torch.tensor([0.0, 0.5, 0.5, 0.0])
    x = g + dt_bias
    expected = -A_log.exp() * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert torch.allclose(naive_gdn_gate(g, A_log, dt_bias), expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
def test_gate_large_A_log_stays_finite(fn):
    """The in-kernel gate where exp(A_log) alone overflows fp32 (A_log >= 88.7) or its decays sum past fp32's
    range in a chunk: head 0 with A_log 90 and raw gates near -100 (finite decays, e^-3 .. e^-20), head 1 with
    A_log 88.5 (decays near -1e38 whose chunk sums overflow), head 2 ordinary. Output, final state and every
    gradient (the chunked op; the recurrent one is inference only) are finite and match the recurrence."""
    tensors = _inputs(1, 70, 1, 3, 16, 16, torch.float32, h0=True, dt_bias=False)
    gen = torch.Generator().manual_seed(3)
    g = tensors[3].clone()
    g[..., 0] = -93.0 - 17.0 * torch.rand(g.shape[:-1], generator=gen).to(g.device)
    tensors[3] = g
    tensors[5] = torch.tensor([90.0, 88.5, 0.3], device=g.device)
    kwargs = dict(use_gate_in_kernel=True)
    grad = fn is chunk_gated_delta_rule
    o, ht, grads = _run(fn, tensors, kwargs, True, torch.ones_like(tensors[2]), torch.ones(1, 3, 16, 16, device=g.device),
                        grad=grad)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert all(torch.isfinite(d).all() for d in grads.values()), {n: torch.isfinite(d).all().item()
                                                                  for n, d in grads.items()}
    if grad:
        # Head 0's decays are e^-3 .. e^-20 per token, so its state sums all 70 tokens at nearly full weight:
        # on a GPU (fp32 dots in tf32) the rounding of every product reaches the end and the backward's
        # gradients through the solve (dk, dbeta) land just past the common 5e-3 bound, every worst row within
        # its own. The CPU (exact fp32 dots) keeps the common bound.
        _compare(tensors, kwargs, True, torch.float32, fn=fn, tol_scale=2.0 if _cuda() else 1.0)
    else:
        ro, rht, _ = _run(naive_recurrent_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
        assert rel_err(o, ro) <= _tol(torch.float32) and rel_err(ht, rht) <= _tol(torch.float32)


def _small(**overrides):
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 8, 1, 2, 16, 16, torch.float32, h0=True)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    args.update(overrides)
    return args


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
@pytest.mark.parametrize("overrides,error,match", [
    (dict(head_first=False), TypeError, r"unexpected keyword argument\(s\): head_first"),
    (dict(bogus=1, other=2), TypeError, r"unexpected keyword argument\(s\): bogus, other"),
    (dict(cp_context=object()), NotImplementedError, "cp_context: context parallelism"),
    (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval: True requires use_beta_sigmoid_in_kernel"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log: must be given when use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True, A_log="x"), TypeError, "A_log: expected a tensor"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, "A_log: expected Hv=2 elements"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(4)), ValueError,
     "dt_bias: expected Hv=2 elements"),
    (dict(state_v_first=True, initial_state=torch.zeros(1, 2, 16, 8)), ValueError,
     r"initial_state: expected shape \[N, Hv, V, K\] \(state_v_first\)"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 8])), ValueError, "cu_seqlens_cpu: given without cu_seqlens"),
    (dict(initial_state=None, cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 3, 8])), ValueError,
     "cu_seqlens_cpu: expected an integer tensor of cu_seqlens' shape"),
    (dict(initial_state=None, cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 9])), ValueError,
     "cu_seqlens: must rise from 0 to T=8"),
    (dict(initial_state=None, cu_seqlens=torch.tensor([0, 8]), chunk_indices=torch.zeros(3)), TypeError,
     r"chunk_indices: expected an integer tensor \[chunks, 2\]"),
    (dict(initial_state=None, cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 8]),
          chunk_indices=torch.zeros(2, 2, dtype=torch.long)), ValueError, "chunk_indices: expected 1 rows"),
    (dict(transpose_state_layout=True, state_v_first=True), ValueError, "transpose_state_layout: cannot be passed"),
])
def test_bad_keywords(fn, overrides, error, match):
    overrides = {n: (t.to(device()) if isinstance(t, torch.Tensor) and n != "cu_seqlens_cpu" else t)
                 for n, t in overrides.items()}
    with pytest.raises(error, match=match):
        fn(**_small(**overrides))


def test_recurrent_rejects_gk_and_accepts_none():
    args = _small()
    with pytest.raises(TypeError, match="gk: fla's per-key decay is not supported"):
        fused_recurrent_gated_delta_rule(**args, gk=torch.zeros(1, 8, 2, 16, device=device()))
    fused_recurrent_gated_delta_rule(**args, gk=None, gv=None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): gk"):
        chunk_gated_delta_rule(**args, gk=None)


def test_transpose_state_layout_is_the_deprecated_state_v_first():
    args = _small(initial_state=None)
    with pytest.warns(DeprecationWarning, match="renamed to state_v_first"):
        _, ht = chunk_gated_delta_rule(**args, output_final_state=True, transpose_state_layout=True)
    _, ref = chunk_gated_delta_rule(**args, output_final_state=True, state_v_first=True)
    assert torch.equal(ht, ref)


def test_chunk_size_keyword():
    args = _small(initial_state=None)
    with pytest.raises(ValueError, match="chunk_size: must be 16, 32 or 64"):
        chunk_gated_delta_rule(**args, chunk_size=128)
    o, _ = chunk_gated_delta_rule(**args, chunk_size=32)
    assert torch.equal(o, chunk_gated_delta_rule(**args)[0])


def test_reference_backend_takes_the_keywords():
    import dflash_kernels as dk
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                  state_v_first=True)
    tensors = _inputs(1, 20, 1, 2, 16, 16, torch.float32, h0=True, state_v_first=True)
    ours = _run(chunk_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
    previous = dk.get_backend("gdn")
    dk.set_backend("gdn", "reference")
    try:
        ref = _run(chunk_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
        rec = _run(fused_recurrent_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
    finally:
        dk.set_backend("gdn", previous)
    assert rel_err(ours[0], ref[0]) <= _tol(torch.float32) and rel_err(ours[1], ref[1]) <= _tol(torch.float32)
    assert rel_err(rec[0], ref[0]) <= 1e-6


def test_saved_states_with_gate_and_sigmoid(monkeypatch):
    # DFLASH_KERNELS_GDN_SAVE_STATES=1 (the backward reuses the forward's states) with the fused gate,
    # beta logits and V-first states: the same gradients as the recompute, bit for bit.
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                  state_v_first=True)
    tensors = _inputs(1, 70, 1, 2, 16, 16, torch.float32, h0=True, state_v_first=True)
    do, dht = torch.randn(1, 70, 2, 16, device=device()), torch.randn(1, 2, 16, 16, device=device())
    first = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    monkeypatch.setenv("DFLASH_KERNELS_GDN_SAVE_STATES", "1")
    from dflash_kernels.ops.gated_delta_rule import gated_delta_rule as gdn_module

    def no_recompute(*args, **kwargs):
        raise AssertionError("the backward recomputed the states the forward was to keep")
    monkeypatch.setattr(gdn_module, "_wy_and_states", no_recompute)
    second = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name


# ---------------------------------------------------------------- real sizes, on the GPU only
# Qwen3.5-style GDN heads: Hk=16, Hv=32, K=V=128, odd T.

GPU_CASES = [
    ("B2-T1001-bf16-gate-sigmoid-vfirst-h0", 2, 1001, torch.bfloat16, "gate+sigmoid+vfirst", True, True, True),
    ("B2-T999-bf16-gate-negeig-nobias", 2, 999, torch.bfloat16, "gate+negeig", True, True, False),
    ("B1-T777-fp32-gate-sigmoid-vfirst", 1, 777, torch.float32, "gate+sigmoid+vfirst", True, True, True),
    ("B2-T1001-bf16-vfirst-only", 2, 1001, torch.bfloat16, "vfirst", True, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,dtype,opts,h0,final,bias", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_gpu_chunk_options(B, T, dtype, opts, h0, final, bias):
    kwargs = _kwargs(opts)
    tensors = _inputs(B, T, 16, 32, 128, 128, dtype, h0=h0, state_v_first=kwargs.get("state_v_first", False),
                      dt_bias=bias)
    errors, rows = _compare(_prepare(tensors, kwargs), kwargs, final, dtype)
    print(f"\nrel {errors}\nworst rows {rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("meta", ["cu_seqlens_cpu", "chunk_indices"])
def test_gpu_varlen_metadata(meta):
    bounds = [0, 1, 700, 764, 1500, 1501, 2003]
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=device())
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                  cu_seqlens=cu_seqlens)
    if meta == "cu_seqlens_cpu":
        kwargs["cu_seqlens_cpu"] = torch.tensor(bounds, dtype=torch.long)
    else:
        kwargs["chunk_indices"] = prepare_chunk_indices(cu_seqlens)
    tensors = _inputs(1, bounds[-1], 16, 32, 128, 128, torch.bfloat16, h0=True, N=len(bounds) - 1,
                      state_v_first=True)
    errors, rows = _compare(tensors, kwargs, True, torch.bfloat16)
    print(f"\nrel {errors}\nworst rows {rows}")


@pytest.mark.gpu
def test_gpu_chunk_indices_forward_backward_never_sync():
    # With chunk_indices (and without cu_seqlens_cpu) a forward and backward make no device-to-host
    # synchronization (CUDA sync debug mode raises on one); a first call compiles and tunes outside it.
    bounds = [0, 300, 301, 1000]
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=device())
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens,
                  chunk_indices=prepare_chunk_indices(cu_seqlens))
    tensors = _inputs(1, bounds[-1], 16, 32, 128, 128, torch.bfloat16, h0=True, N=3)
    do = torch.randn(1, 1000, 32, 128, device=device())
    dht = torch.randn(3, 32, 128, 128, device=device())
    _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_mixed_dtypes():
    tensors = _inputs(2, 513, 16, 32, 128, 128, torch.float32, h0=True, v_dtype=torch.bfloat16)
    errors, rows = _compare(tensors, dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True), True,
                            torch.float32)
    print(f"\nrel {errors}\nworst rows {rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("B", [64, 256])
@pytest.mark.parametrize("vfirst", [False, True], ids=["kv", "vfirst"])
def test_gpu_decode_step(B, vfirst):
    # One decode token per sequence at the GDN shapes, state fp32 in and out, against the reference.
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=vfirst,
                  use_qk_l2norm_in_kernel=True)
    tensors = _inputs(B, 1, 16, 32, 128, 128, torch.bfloat16, h0=True, state_v_first=vfirst)
    o, ht, _ = _run(fused_recurrent_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
    ro, rht, _ = _run(naive_recurrent_gated_delta_rule, tensors, kwargs, True, None, None, grad=False)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32 and ht.shape == rht.shape
    assert rel_err(o, ro) <= 1e-2 and rel_err(ht, rht) <= 1e-5, (rel_err(o, ro), rel_err(ht, rht))
    assert _worst_row(o, ro, "o") <= 5e-2 and _worst_row(ht, rht, "h0") <= 1e-4


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception as e:  # noqa: BLE001 - fla absent or broken here
        pytest.skip(f"fla is not importable: {e!r}")
    return fla_chunk, fla_recurrent


@pytest.mark.gpu
@pytest.mark.parametrize("opts", ["gate+sigmoid+vfirst", "gate+negeig"])
def test_gpu_matches_fla(opts):
    """The same call to fla 0.6.0 and to dflash_kernels: outputs, final states and (where fla's backward
    runs on this stack) every gradient agree to bf16 precision; both against the fp32 reference too."""
    fla_chunk, fla_recurrent = _fla()
    kwargs = _kwargs(opts)
    tensors = _inputs(2, 1001, 16, 32, 128, 128, torch.bfloat16, h0=True,
                      state_v_first=kwargs.get("state_v_first", False))
    gen = torch.Generator(device="cpu").manual_seed(1)
    do = torch.randn(2, 1001, 32, 128, generator=gen).to(device())
    dht = torch.randn(*tensors[7].shape, generator=gen).to(device())
    ours = _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht)
    try:
        theirs = _run(fla_chunk, tensors, kwargs, True, do, dht)
        grads = True
    except Exception as e:  # noqa: BLE001 - fla's backward refuses on some triton versions
        print(f"fla backward: {type(e).__name__}: {str(e)[:200]}; comparing the forward only")
        theirs = _run(fla_chunk, tensors, kwargs, True, do, dht, grad=False)
        grads = False
    errors = {"o": rel_err(ours[0], theirs[0]), "final_state": rel_err(ours[1], theirs[1])}
    if grads:
        errors.update({"d" + n: rel_err(ours[2][n], theirs[2][n]) for n in ours[2]})
        # the per-head sums over every token: bounded against their terms' scale (_compare says why)
        for n in ("A_log", "dt_bias"):
            if n in ours[2]:
                errors[f"d{n} (vs its terms)"] = _sum_err(ours[2][n], theirs[2][n],
                                                          _contributions("d" + n, tensors, ours[2]["g"]))
    print(f"\nours vs fla: {errors}")
    bounds = {"dA_log": 1.0, "ddt_bias": 1.0, "dA_log (vs its terms)": 0.25, "ddt_bias (vs its terms)": 0.25}
    bad = {n: e for n, e in errors.items() if e > bounds.get(n, 0.08 if n.startswith("d") else 0.05)}
    assert not bad, (bad, errors)
    # decode: one token, the same options
    step = [None if t is None else t[:, :1] if t.dim() >= 3 and t.shape[1] == 1001 else t for t in tensors]
    o1, h1, _ = _run(fused_recurrent_gated_delta_rule, step, kwargs, True, None, None, grad=False)
    o2, h2, _ = _run(fla_recurrent, step, kwargs, True, None, None, grad=False)
    ro, rh, _ = _run(naive_recurrent_gated_delta_rule, [None if t is None else t.float() for t in step], kwargs,
                     True, None, None, grad=False)
    # Ours against the fp32 reference on every (sequence, head).
    assert rel_err(o1, ro) <= 1e-2 and rel_err(h1, rh) <= 1e-5, (rel_err(o1, ro), rel_err(h1, rh))
    # Against fla where fla's own step agrees with the fp32 recurrence. On the H200 with triton 3.6.0,
    # fla 0.6.0's compiled fused_recurrent kernel returns NaN on a few heads of this one-token step
    # with an initial state and values far from the recurrence on the others (also without any of
    # these keywords), while the same kernel under the Triton interpreter matches the recurrence:
    # there the comparison with fla says nothing about ours, and the test says so instead.
    fla_vs_ref = (rel_err(o2, ro), rel_err(h2, rh))
    if fla_vs_ref[0] <= 1e-2 and fla_vs_ref[1] <= 1e-4:
        assert rel_err(o1, o2) <= 1e-2 and rel_err(h1, h2) <= 1e-4, (rel_err(o1, o2), rel_err(h1, h2))
    else:
        bad = (~torch.isfinite(h2).flatten(2).all(-1)).nonzero().tolist()
        print(f"fla's recurrent step disagrees with the fp32 recurrence (o, state rel {fla_vs_ref}; "
              f"non-finite (sequence, head) pairs {bad}): ours checked against the reference only")

