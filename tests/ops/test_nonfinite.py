"""Non-finite values stay where they are: a NaN or Inf in one draft block (attention), one sequence of a
batch or one document of a packed batch (gated delta rule: ``cu_seqlens``; causal conv1d: ``seq_idx``)
never reaches the outputs or gradients of rows that cannot see it; the rows that see it are non-finite.
Inside one document of the gated delta rule, a non-finite token reaches no output before it.

Each guarantee is checked on every backend that can run here: the Triton kernels (the interpreter on
the CPU) and the plain-torch ``reference`` backend (the CPU default without the interpreter), each against
a clean run of the same backend."""

import os

import pytest
import torch
import torch.nn.functional as F

from dflash_kernels import get_backend, set_backend
from dflash_kernels.ops.attention import block_sparse_attention, causal_block_mask, dflash_block_mask
from dflash_kernels.ops.attention.naive import naive_dense_mask
from dflash_kernels.ops.conv1d import causal_conv1d
from dflash_kernels.ops.conv1d import cuda as conv_cuda
from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tests.helpers import device, require_triton_kernels, slow_param

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = device()
needs_kernels = pytest.mark.skipif(DEVICE.type == "cpu" and not INTERPRET,
                                   reason="kernels need CUDA or TRITON_INTERPRET=1")
# The interpreter computes with numpy, which warns about the NaN / Inf arithmetic these tests cause on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def _use_backend(op, name):
    """``set_backend(op, ...)`` for one test: ``kernels`` the Triton kernels (interpreted on the CPU; skipped
    where they cannot run), ``reference`` the plain-torch backend; ``auto`` again afterwards."""
    if name == "kernels":
        if DEVICE.type == "cpu" and not INTERPRET:
            pytest.skip("kernels need CUDA or TRITON_INTERPRET=1")
        set_backend(op, "triton" if DEVICE.type == "cuda" else "interpret")
    else:
        set_backend(op, name)
    yield name
    set_backend(op, "auto")


BACKENDS = ["kernels", "reference"]


@pytest.fixture(params=BACKENDS)
def attention_backend(request):
    yield from _use_backend("attention", request.param)


@pytest.fixture(params=BACKENDS)
def gdn_backend(request):
    yield from _use_backend("gdn", request.param)


def _run(q, k, v, do, mask):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = block_sparse_attention(q, k, v, mask, return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, lse, dq, dk, dv


def _check_confined(mask, q, k, v, do, bad_q_rows=(), bad_keys=(), bad_do_rows=(), value=float("nan"),
                    where=("k", "v")):
    """Poison rows / keys, then: rows that see no poisoned key (and are not poisoned) and keys that no
    affected row sees give exactly the clean run's o, lse, dq, dk, dv; affected ones are non-finite."""
    B, Tq, Hq, D = q.shape
    clean = _run(q, k, v, do, mask)
    for x in clean:
        assert x.isfinite().all()
    q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
    for t in bad_q_rows:
        q2[:, t, 0, 3] = value
    for kv in bad_keys:
        if "k" in where:
            k2[:, kv, 0, 5] = value
        if "v" in where:
            v2[:, kv, 0, 7] = value
    for t in bad_do_rows:
        do2[:, t, 0, 1] = value
    got = _run(q2, k2, v2, do2, mask)
    vis = naive_dense_mask(mask).expand(B, -1, -1).cpu()  # [B, Tq, Tk]
    bad_key = torch.zeros(vis.shape[2], dtype=torch.bool)
    bad_key[list(bad_keys)] = True
    row_bad = (vis & bad_key).any(-1)  # [B, Tq]: rows that see a poisoned key
    row_bad[:, list(bad_q_rows)] = True
    row_bad_fwd = row_bad.clone()
    row_bad[:, list(bad_do_rows)] = True  # a non-finite do reaches the backward only
    key_bad = (vis & row_bad[..., None]).any(1) | bad_key  # [B, Tk]: keys an affected row sees
    o, lse, dq, dk, dv = (x.detach().cpu() for x in got)
    co, clse, cdq, cdk, cdv = (x.detach().cpu() for x in clean)
    ok_rows, ok_keys = ~row_bad, ~key_bad
    assert ok_rows.any() and row_bad.any()
    assert torch.equal(o[~row_bad_fwd], co[~row_bad_fwd]), "a row that sees no poisoned key changed"
    assert torch.equal(lse.transpose(1, 2)[~row_bad_fwd], clse.transpose(1, 2)[~row_bad_fwd])
    assert torch.equal(dq[ok_rows], cdq[ok_rows]), "dq of a row that sees no poisoned key changed"
    assert torch.equal(dk[ok_keys], cdk[ok_keys]), "dk of a key no affected row sees changed"
    assert torch.equal(dv[ok_keys], cdv[ok_keys]), "dv of a key no affected row sees changed"
    # The affected rows are non-finite where the math makes them so.
    seen = row_bad_fwd & vis.any(-1)
    assert (~o.isfinite()).flatten(2).any(-1)[seen].all(), "a row that sees a poisoned key stayed finite"
    if bad_do_rows:
        hit = (vis & torch.isin(torch.arange(Tq), torch.tensor(bad_do_rows))[None, :, None]).any(1)
        assert (~dv.isfinite()).flatten(2).any(-1)[hit].all(), "dv of a key seen by a non-finite do stayed finite"
    return got


def _dflash_case(B=1, S=24, N=4, bs=4, Hq=4, Hkv=1, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([[3, 10, 17, 24]] * B)
    mask = dflash_block_mask(anchors.to(DEVICE), S, bs, window=window, kv_tile=16)
    q = torch.randn(B, N * bs, Hq, 64, generator=g).to(DEVICE)
    k = torch.randn(B, S + N * bs, Hkv, 64, generator=g).to(DEVICE)
    v = torch.randn(B, S + N * bs, Hkv, 64, generator=g).to(DEVICE)
    do = torch.randn(B, N * bs, Hq, 64, generator=g).to(DEVICE)
    return mask, q, k, v, do


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["v", "k"])
def test_attention_nonfinite_in_a_blocks_own_keys_stays_in_the_block(attention_backend, value, where):
    """Block 0's own keys (S .. S + bs) hold a NaN/Inf: blocks 1..3 (stacked with block 0 in one tile,
    interpreter config GPB=2) stay exactly as in a clean run, outputs and gradients."""
    mask, q, k, v, do = _dflash_case()
    _check_confined(mask, q, k, v, do, bad_keys=(24, 26), value=value, where=(where,))


@pytest.mark.parametrize("where", ["v", "k"])
def test_attention_nonfinite_context_key_reaches_only_later_anchors(attention_backend, where):
    """A NaN in context key 12: blocks with anchors 3 and 10 do not see it, those with 17 and 24 do."""
    mask, q, k, v, do = _dflash_case()
    _check_confined(mask, q, k, v, do, bad_keys=(12,), where=(where,))


def test_attention_nonfinite_query_and_upstream_gradient_stay_in_their_rows(attention_backend):
    """A NaN query row of block 1 and a NaN upstream gradient row of block 2: other rows' dq and the
    dk, dv of keys those rows do not see stay clean."""
    mask, q, k, v, do = _dflash_case()
    _check_confined(mask, q, k, v, do, bad_q_rows=(5,), bad_do_rows=(9,))


def test_attention_nonfinite_with_a_window_and_a_batch(attention_backend):
    mask, q, k, v, do = _dflash_case(B=2, window=8, seed=1)
    _check_confined(mask, q, k, v, do, bad_keys=(12, 33))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_nonfinite_key_reaches_only_later_queries(attention_backend, dtype):
    """Causal mask: the diagonal tiles hold rows that see a key and rows that do not. In bf16 on an sm_90 GPU
    the op runs the Gluon causal forward and backward (kernels_gluon_sm90*.py), in fp32 the portable kernels."""
    T = 40
    mask = causal_block_mask(T, q_block=16, kv_tile=16, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, T, 2, 64, generator=g).to(DEVICE, dtype) for _ in range(4))
    k, v = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    _check_confined(mask, q, k, v, do, bad_keys=(20,))


# ------------------------------------------------------------------------------------ gated delta rule

GDN_INPUTS = ("q", "k", "v", "g", "beta")
GDN_DOCS = (37, 70, 45)  # packed documents: the middle one runs past a 64-token chunk into a partial one


def _gdn_inputs(B, T, dtype, N, H=(1, 2), K=16, V=16, seed=0, gate=False):
    """q, k [B, T, Hk, K], v [B, T, Hv, V], g, beta [B, T, Hv], initial_state [N, Hv, K, V] on the test
    device; k unit rows (the kernels' l2norm is off unless asked). gate: g and beta are the raw gate and
    beta's logits (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``), with A_log and dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    Hk, Hv = H
    x = dict(q=torch.randn(B, T, Hk, K, generator=gen), k=F.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1),
             v=torch.randn(B, T, Hv, V, generator=gen))
    if gate:
        x.update(g=torch.randn(B, T, Hv, generator=gen), beta=torch.randn(B, T, Hv, generator=gen))
    else:
        x.update(g=F.logsigmoid(torch.randn(B, T, Hv, generator=gen)) * 0.5, beta=torch.rand(B, T, Hv, generator=gen))
    x["initial_state"] = torch.randn(N, Hv, K, V, generator=gen) * 0.1
    x = {n: t.to(DEVICE, dtype if n in ("q", "k", "v", "beta") else torch.float32) for n, t in x.items()}
    kwargs = {}
    if gate:
        kwargs = dict(use_gate_in_kernel=True, A_log=torch.randn(Hv, generator=gen).to(DEVICE) * 0.5,
                      dt_bias=torch.randn(Hv, generator=gen).to(DEVICE), use_beta_sigmoid_in_kernel=True)
    return x, kwargs


def _gdn_poison(x, name, b, t, value):
    """A copy of the inputs with ``name`` non-finite at token t of batch row b (one element; head 0 for
    q, k, the last value head for v, g, beta)."""
    x = dict(x)
    p = x[name].clone()
    if p.dim() == 4:
        p[b, t, -1 if name == "v" else 0, 3] = value
    else:
        p[b, t, -1] = value
    x[name] = p
    return x


def _gdn_run(fn, x, kwargs, upstream=None):
    """o, final state and (given ``upstream = (do, dht)``, a finite upstream gradient) the gradients of
    q, k, v, g, beta and initial_state."""
    names = GDN_INPUTS + ("initial_state",)
    with torch.set_grad_enabled(upstream is not None):
        leaves = {n: x[n].detach().clone().requires_grad_(upstream is not None) for n in names}
        extra = {n: (t.detach().clone().requires_grad_(upstream is not None) if n in ("A_log", "dt_bias") else t)
                 for n, t in kwargs.items()}
        o, ht = fn(**leaves, output_final_state=True, **extra)
        grads = {}
        if upstream is not None:
            do, dht = upstream
            # A_log and dt_bias (with use_gate_in_kernel) require grad too, as in training, but are
            # not asked for: every row of every sequence shares them, so their gradients legitimately
            # see the non-finite value.
            grads = dict(zip(names, torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(),
                                                        [leaves[n] for n in names])))
    return o.detach(), ht.detach(), grads


_GDN_CLEAN = {}


def _gdn_clean(fn, x, kwargs, upstream=None):
    """``_gdn_run`` of the unpoisoned inputs, once per case (the parametrized tests share their inputs;
    the interpreter is slow); all finite."""
    key = (fn.__name__, get_backend("gdn"), upstream is not None, x["v"].dtype, tuple(x["v"].shape),
           tuple(sorted(kwargs)))
    if key not in _GDN_CLEAN:
        result = _gdn_run(fn, x, kwargs, upstream)
        for c in (result[0], result[1], *result[2].values()):
            assert c.isfinite().all()
        _GDN_CLEAN[key] = result
    return _GDN_CLEAN[key]


def _gdn_shows(name, value, kwargs):
    """Whether the poisoned token's own output must be non-finite. Not for an infinite raw gate
    (softplus(inf) = inf: decay exp(-inf) = 0, a finite state reset) or infinite beta logits
    (sigmoid(inf) = 1): there the recurrence itself stays finite (the chunked form may not)."""
    return not (value == float("inf") and ((name == "g" and kwargs.get("use_gate_in_kernel"))
                                           or (name == "beta" and kwargs.get("use_beta_sigmoid_in_kernel"))))


def _gdn_check_confined(fn, x, kwargs, segments, bad, name, t, value, grad):
    """Poison ``name`` at token t of sequence ``bad`` (segments: (batch row, row slice) per sequence, in
    initial-state order): every other sequence's o, final state and (grad) gradients of q, k, v, g, beta
    and initial_state are exactly the clean run's; the poisoned token's own output is non-finite (where
    ``_gdn_shows``)."""
    b, rows = segments[bad]
    gen = torch.Generator().manual_seed(1)
    upstream = None
    if grad:
        upstream = (torch.randn(x["v"].shape, generator=gen).to(DEVICE),
                    torch.randn(x["initial_state"].shape, generator=gen).to(DEVICE))
    co, cht, cgrads = _gdn_clean(fn, x, kwargs, upstream)
    o, ht, grads = _gdn_run(fn, _gdn_poison(x, name, b, rows.start + t, value), kwargs, upstream)
    for n, (bb, rr) in enumerate(segments):
        if n == bad:
            continue
        assert torch.equal(o[bb, rr], co[bb, rr]), f"o of sequence {n} changed"
        assert torch.equal(ht[n], cht[n]), f"final state of sequence {n} changed"
        for gname, d in grads.items():
            at = (n,) if gname == "initial_state" else (bb, rr)  # the initial state: one per sequence
            assert torch.equal(d[at], cgrads[gname][at]), f"d{gname} of sequence {n} changed"
    if _gdn_shows(name, value, kwargs):
        assert not o[b, rows.start + t].isfinite().all(), "the poisoned token's output stayed finite"


@pytest.mark.parametrize("value", [float("nan"), slow_param(float("inf"))], ids=["nan", "inf"])
@pytest.mark.parametrize("name", GDN_INPUTS)
def test_gdn_nonfinite_stays_in_its_sequence(gdn_backend, name, value):
    """B = 2 sequences of 70 tokens (a full chunk and a partial one), fp32, a GQA group of 2 value heads:
    a NaN / Inf at token 20 of sequence 1 (where the rows of sequence 0's partial chunk would run on to)
    leaves sequence 0's o, final state and gradients (q, k, v, g, beta, initial_state) exactly as in a
    clean run."""
    if gdn_backend == "kernels":
        require_triton_kernels("gdn")
    x, kwargs = _gdn_inputs(2, 70, torch.float32, N=2)
    segments = [(0, slice(0, 70)), (1, slice(0, 70))]
    _gdn_check_confined(chunk_gated_delta_rule, x, kwargs, segments, 1, name, 20, value, grad=True)
    _gdn_check_confined(fused_recurrent_gated_delta_rule, x, kwargs, segments, 1, name, 20, value, grad=False)


def _gdn_packed_docs():
    """(inputs, kwargs, bounds) of the GDN_DOCS documents packed with cu_seqlens: bf16, the raw gate and
    beta logits in the kernel, q/k l2norm in the kernel."""
    bounds = [0]
    for n in GDN_DOCS:
        bounds.append(bounds[-1] + n)
    x, kwargs = _gdn_inputs(1, bounds[-1], torch.bfloat16, N=len(GDN_DOCS), gate=True)
    kwargs.update(cu_seqlens=torch.tensor(bounds, device=DEVICE), use_qk_l2norm_in_kernel=True)
    return x, kwargs, bounds


@pytest.mark.parametrize("value", [float("nan"), slow_param(float("inf"))], ids=["nan", "inf"])
@pytest.mark.parametrize("name", [slow_param(n, slow=n not in ("v", "g")) for n in GDN_INPUTS])
def test_gdn_nonfinite_stays_in_its_document(gdn_backend, name, value):
    """Packed documents of 37, 70 and 45 tokens (cu_seqlens), bf16, the raw gate and beta logits in the
    kernel, q/k l2norm in the kernel: a NaN / Inf at token 20 of the middle document (where the rows of
    the first document's partial chunk would run on to) leaves the first and last documents' o, final
    states and gradients exactly as in a clean run."""
    if gdn_backend == "kernels":
        require_triton_kernels("gdn")
    x, kwargs, bounds = _gdn_packed_docs()
    segments = [(0, slice(bounds[n], bounds[n + 1])) for n in range(len(GDN_DOCS))]
    _gdn_check_confined(chunk_gated_delta_rule, x, kwargs, segments, 1, name, 20, value, grad=True)
    _gdn_check_confined(fused_recurrent_gated_delta_rule, x, kwargs, segments, 1, name, 20, value, grad=False)


# One value head per poisoned token: the tokens' places in a chunk (rows 20, 40, 60 of a full chunk: the
# solve's 16-row blocks 1, 2, 3; row 5 of the partial chunk: block 0) take the kernels' different paths.
GDN_TOKENS = (64 + 20, 64 + 40, 64 + 60, 128 + 5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, slow_param(torch.bfloat16)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("value", [float("nan"), slow_param(float("inf"))], ids=["nan", "inf"])
@pytest.mark.parametrize("name", [slow_param(n, slow=n not in ("q", "v")) for n in GDN_INPUTS])
def test_gdn_nonfinite_token_reaches_no_earlier_token(name, value, dtype):
    """Inside one sequence (150 tokens: two full chunks, a partial one), forward: head h holds a NaN / Inf
    at token GDN_TOKENS[h]. Its outputs before that token are exactly the clean run's (they cannot see
    it); the token's own output and every later one are non-finite (the state carries the value on),
    except for q, which reaches its own token only: every other output is the clean run's. In the
    chunked form every product inside a chunk is lower triangular (row i sums over rows <= i), and its
    exact zeros above the diagonal must not multiply the non-finite rows below: the forward reads a
    chunk's rows from its first non-finite one on as 0 and makes their outputs NaN (kernels_fwd.py)."""
    require_triton_kernels("gdn")
    H = len(GDN_TOKENS)
    x, kwargs = _gdn_inputs(1, 150, dtype, N=1, H=(H, H))
    bad = dict(x)
    p = bad[name].clone()
    for h, t in enumerate(GDN_TOKENS):
        if p.dim() == 4:
            p[0, t, h, 3] = value
        else:
            p[0, t, h] = value
    bad[name] = p
    # The recurrent kernel reads every input in fp32 whatever its dtype: its fp32 run covers it.
    fns = (chunk_gated_delta_rule,) + ((fused_recurrent_gated_delta_rule,) if dtype == torch.float32 else ())
    for fn in fns:
        co = _gdn_clean(fn, x, kwargs)[0]
        o, _, _ = _gdn_run(fn, bad, kwargs)
        for h, t in enumerate(GDN_TOKENS):
            where = f"{fn.__name__}: head {h}, non-finite token {t}"
            assert torch.equal(o[0, :t, h], co[0, :t, h]), f"{where}: an output before it changed"
            seen = (~o[0, :, h].isfinite()).any(-1)
            if name == "q":
                assert seen[t] and seen.sum() == 1, f"{where}: q reached other tokens or none"
                assert torch.equal(o[0, t + 1:, h], co[0, t + 1:, h]), f"{where}: an output after it changed"
            else:
                assert seen[t:].all(), f"{where}: an output from it on stayed finite"


@needs_kernels
@pytest.mark.parametrize("t", [20, slow_param(66)], ids=["full_chunk", "partial_chunk"])
@pytest.mark.parametrize("name", ["k", "v", "g", "beta"])
def test_gdn_nonfinite_token_reaches_no_earlier_token_of_its_document(name, t):
    """The packed documents of test_gdn_nonfinite_stays_in_its_document (bf16, the raw gate and beta
    logits, l2norm, a GQA group of 2 value heads), forward: a NaN at token t of the middle document (row
    20 of its full chunk, or row 2 of its partial one). Its outputs before t are the clean run's, those
    from t to the document's end non-finite in the heads it reaches (both value heads of the key head
    for k, the last value head otherwise), the other head's and the other documents' outputs and final
    states the clean run's."""
    require_triton_kernels("gdn")
    x, kwargs, bounds = _gdn_packed_docs()
    co, cht, _ = _gdn_clean(chunk_gated_delta_rule, x, kwargs)
    start, end = bounds[1], bounds[2]
    o, ht, _ = _gdn_run(chunk_gated_delta_rule, _gdn_poison(x, name, 0, start + t, float("nan")), kwargs)
    o, ht, co, cht = (y.cpu() for y in (o, ht, co, cht))
    assert torch.equal(o[0, :start + t], co[0, :start + t]), "an output before the token changed"
    assert torch.equal(o[0, end:], co[0, end:]), "an output of the last document changed"
    assert torch.equal(ht[0], cht[0]) and torch.equal(ht[2], cht[2]), "another document's final state changed"
    reached = (0, 1) if name == "k" else (1,)
    for h in range(2):
        if h in reached:
            assert (~o[0, start + t:end, h].isfinite()).any(-1).all(), f"head {h}: an output from it on stayed finite"
            assert not ht[1, h].isfinite().all(), f"head {h}: the document's final state stayed finite"
        else:
            assert torch.equal(o[0, :, h], co[0, :, h]) and torch.equal(ht[1, h], cht[1, h]), f"head {h} changed"


# ------------------------------------------------------------------------------------ causal conv1d

CONV_W = 4
# seq_idx of the two batch rows (T = 90; the interpreter's tiles are 32 times): row 0 has segments
# 0 [0, 29), 1 [29, 49), padding [49, 52), 2 [52, 90); row 1 has 0 [0, 32) and 1 [32, 90), the
# boundary on a tile edge.
CONV_SEQ = [[0] * 29 + [1] * 20 + [-1] * 3 + [2] * 38, [0] * 32 + [1] * 58]
# (batch row, time) of the non-finite x: the first time of a segment, the last before the next segment
# (inside a tile, and on a tile edge), the last before padding, a padding time.
CONV_SPOTS = {"first": (0, 29), "last": (0, 28), "tile_edge": (1, 31), "before_padding": (0, 48),
              "padding": (0, 50)}


def _conv_run(x, weight, bias, seq_idx, dy):
    """y, dx, dweight, dbias of the silu conv for the upstream gradient dy."""
    xl, wl, bl = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    y = causal_conv1d(xl, wl, bl, activation="silu", seq_idx=seq_idx)
    dx, dw, db = torch.autograd.grad(y, (xl, wl, bl), dy)
    return y.detach(), dx, dw, db


_CONV_CLEAN = {}


def _conv_case(layout, impl):
    """x [2, 24, 90] (two channel tiles in the interpreter), weight, bias, dy, seq_idx (CONV_SEQ) and the
    clean run's (y, dx, dweight, dbias), all finite; the clean run once per layout and implementation."""
    B, D, T = 2, 24, 90
    gen = torch.Generator().manual_seed(3)
    if layout == "channel_last":
        x = torch.randn(B, T, D, generator=gen).to(DEVICE).transpose(1, 2)
    else:
        x = torch.randn(B, D, T, generator=gen).to(DEVICE)
    weight = (torch.randn(D, CONV_W, generator=gen) / CONV_W).to(DEVICE)
    bias = torch.randn(D, generator=gen).to(DEVICE)
    dy = torch.randn(B, D, T, generator=gen).to(DEVICE)
    seq_idx = torch.tensor(CONV_SEQ, dtype=torch.int32, device=DEVICE)
    if (layout, impl) not in _CONV_CLEAN:
        clean = _conv_run(x, weight, bias, seq_idx, dy)
        assert all(c.isfinite().all() for c in clean)
        _CONV_CLEAN[layout, impl] = clean
    return (x, weight, bias, seq_idx, dy), _CONV_CLEAN[layout, impl]


def _conv_poisoned(case, spot, value, d=17):
    x, weight, bias, seq_idx, dy = case
    b, t = CONV_SPOTS[spot]
    x2 = x.clone()  # keeps the layout
    x2[b, d, t] = value
    assert x2.stride() == x.stride()
    return _conv_run(x2, weight, bias, seq_idx, dy)


@pytest.fixture
def conv_impl(request):
    """The conv's implementation under test: the Triton kernels (interpreter on the CPU), the CUDA
    extension where it is built, or the plain-torch reference backend."""
    if request.param == "cuda":
        if DEVICE.type != "cuda" or not conv_cuda.available():
            pytest.skip("the conv1d CUDA extension is not built here")
        set_backend("conv1d", "cuda")
    elif request.param == "reference":
        set_backend("conv1d", "reference")
    else:
        if DEVICE.type == "cpu" and not INTERPRET:
            pytest.skip("kernels need CUDA or TRITON_INTERPRET=1")
        set_backend("conv1d", "triton" if DEVICE.type == "cuda" else "interpret")
    yield request.param
    set_backend("conv1d", "auto")


@pytest.mark.parametrize("conv_impl", ["triton", "cuda", "reference"], indirect=True)
@pytest.mark.parametrize("value", [float("nan"), slow_param(float("inf"))], ids=["nan", "inf"])
@pytest.mark.parametrize("layout", ["channel_first", slow_param("channel_last")])
@pytest.mark.parametrize("spot", list(CONV_SPOTS))
def test_conv1d_nonfinite_stays_in_its_segment(conv_impl, spot, layout, value):
    """W = 4, silu, packed segments (CONV_SEQ); channel 17 of x is NaN / Inf at one time. y is non-finite
    exactly at the W outputs of its own segment that read that time, dx at most at the 2W - 1 times of
    its segment around it (silu' of the non-finite pre-activations); every other element of y and dx
    (other channels, segments, batch rows, padding) is the clean run's. A padding time reaches neither.
    dweight and dbias sum over every time of a channel and legitimately see a value inside a segment:
    not compared here (a padding time: test_conv1d_nonfinite_padding_reaches_no_weight_gradient)."""
    case, (cy, cdx, _, _) = _conv_case(layout, conv_impl)
    y, dx, _, _ = _conv_poisoned(case, spot, value)
    B, D, T = y.shape
    b, t = CONV_SPOTS[spot]
    d = 17
    seg = case[3][b].cpu()
    times = torch.arange(T)
    same = (seg == seg[t]) & (seg[t] >= 0)
    y_bad = torch.zeros(B, D, T, dtype=torch.bool)
    y_bad[b, d] = same & (times >= t) & (times <= t + CONV_W - 1)
    dx_bad = torch.zeros(B, D, T, dtype=torch.bool)
    dx_bad[b, d] = same & (times >= t - (CONV_W - 1)) & (times <= t + CONV_W - 1)
    y, dx, cy, cdx = (v.cpu() for v in (y, dx, cy, cdx))
    assert torch.equal(y[~y_bad], cy[~y_bad]), "an output that does not read the non-finite x changed"
    assert torch.equal(dx[~dx_bad], cdx[~dx_bad]), "dx outside the non-finite x's reach changed"
    assert (~y.isfinite())[y_bad].all(), "an output that reads the non-finite x stayed finite"
    if spot != "padding":
        assert not dx[b, d, t].isfinite(), "dx at the non-finite x stayed finite"


@pytest.mark.parametrize("conv_impl", ["triton", "cuda", "reference"], indirect=True)
@pytest.mark.parametrize("layout", ["channel_first", "channel_last"])
def test_conv1d_nonfinite_padding_reaches_no_weight_gradient(conv_impl, layout):
    """x at a padding time (seq_idx -1) feeds no output and no gradient (causal_conv1d's docstring): a
    NaN there leaves dweight and dbias exactly as in a clean run."""
    case, (_, _, cdw, cdb) = _conv_case(layout, conv_impl)
    _, _, dw, db = _conv_poisoned(case, "padding", float("nan"))
    assert torch.equal(db, cdb), "dbias changed"
    assert torch.equal(dw, cdw), "dweight changed"
