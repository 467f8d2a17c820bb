"""Malformed calls of the public ops: each raises TypeError / ValueError naming the argument, before
any kernel runs (rank, dtype, device, shape, int32 overflow, zero sizes, non-finite scalars); and the
cases that are legitimately empty or strided give the result of a well-formed call."""

import math

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.ops.attention import (block_sparse_attention, causal_block_mask, dflash_block_mask)
from dflash_kernels.ops.attention import checks as attention_checks
from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from dflash_kernels.ops.gated_delta_rule import checks as gdn_checks
from dflash_kernels.ops.linear_cross_entropy import linear_cross_entropy

META = torch.device("meta")  # a second device on a CPU-only machine: enough for the device checks

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------------
# attention and its masks


def _attn(B=1, N=2, bs=4, S=8, Hq=2, Hkv=1, D=64, dtype=torch.float32):
    mask = dflash_block_mask(torch.tensor([[0, 5]] * B if B else [[0, 5]]), S, bs)
    q = torch.randn(B, N * bs, Hq, D, dtype=dtype)
    k = torch.randn(B, S + N * bs, Hkv, D, dtype=dtype)
    v = torch.randn(B, S + N * bs, Hkv, D, dtype=dtype)
    return q, k, v, mask


ATTENTION_CASES = [
    # id, transform of (q, k, v, mask, kwargs), exception, match
    ("q-rank", lambda q, k, v, m, kw: (q[0], k, v, m, kw), ValueError, "q: expected 4 dimensions"),
    ("k-rank", lambda q, k, v, m, kw: (q, k[..., None], v, m, kw), ValueError, "k: expected 4 dimensions"),
    ("q-int", lambda q, k, v, m, kw: (q.long(), k, v, m, kw), TypeError, "q: dtype"),
    ("v-float64", lambda q, k, v, m, kw: (q, k, v.double(), m, kw), TypeError, "v: dtype"),
    ("k-dtype-mismatch", lambda q, k, v, m, kw: (q, k.half(), v.half(), m, kw), TypeError, "k, v: dtypes"),
    ("k-device", lambda q, k, v, m, kw: (q, k.to(META), v, m, kw), ValueError, "k: is on meta"),
    ("v-shape", lambda q, k, v, m, kw: (q, k, v[:, :-1], m, kw), ValueError, "k, v: expected shape"),
    ("head-dim-32", lambda q, k, v, m, kw: (q[..., :32], k[..., :32], v[..., :32], m, kw), ValueError, "q: head dim"),
    ("head-dim-0", lambda q, k, v, m, kw: (q[..., :0], k[..., :0], v[..., :0], m, kw), ValueError, "q: head dim"),
    ("Hq-0", lambda q, k, v, m, kw: (q[:, :, :0], k, v, m, kw), ValueError, "q: the head count Hq"),
    ("Hkv-0", lambda q, k, v, m, kw: (q, k[:, :, :0], v[:, :, :0], m, kw), ValueError, "k: Hq=2 must be a multiple"),
    ("Hq-not-multiple", lambda q, k, v, m, kw: (q[:, :, :1], k.expand(-1, -1, 2, -1), v.expand(-1, -1, 2, -1), m, kw),
     ValueError, "k: Hq=1 must be a multiple of Hkv=2"),
    ("Tq-0", lambda q, k, v, m, kw: (q[:, :0], k, v, m, kw), ValueError, "mask: built for Tq=8"),
    ("Tk-0", lambda q, k, v, m, kw: (q, k[:, :0], v[:, :0], m, kw), ValueError, "mask: built for"),
    ("mask-type", lambda q, k, v, m, kw: (q, k, v, torch.ones(8, 16, dtype=torch.bool), kw), TypeError, "mask:"),
    ("mask-batch", lambda q, k, v, m, kw: (q, k, v, dflash_block_mask(torch.tensor([[0, 5]] * 3), 8, 4), kw),
     ValueError, "mask: batch size 3"),
    ("mask-device", lambda q, k, v, m, kw: (q, k, v, m.to(META), kw), ValueError, "mask: is on meta"),
    ("scale-nan", lambda q, k, v, m, kw: (q, k, v, m, dict(scale=NAN)), ValueError, "scale: must be finite"),
    ("scale-inf", lambda q, k, v, m, kw: (q, k, v, m, dict(scale=-INF)), ValueError, "scale: must be finite"),
    ("scale-bool", lambda q, k, v, m, kw: (q, k, v, m, dict(scale=True)), TypeError, "scale:"),
    ("scale-tensor", lambda q, k, v, m, kw: (q, k, v, m, dict(scale=torch.tensor(0.1))), TypeError, "scale:"),
]


@pytest.mark.parametrize("make,exc,match", [c[1:] for c in ATTENTION_CASES], ids=[c[0] for c in ATTENTION_CASES])
def test_attention_malformed(make, exc, match):
    q, k, v, mask, kwargs = make(*_attn(), {})
    with pytest.raises(exc, match=match):
        block_sparse_attention(q, k, v, mask, **kwargs)


def test_attention_element_offsets_overflow_int32():
    """T * H * D beyond int32 inside one batch element: refused before the mask is looked at
    (expanded tensors: nothing large is allocated)."""
    mask = dflash_block_mask(torch.tensor([[0, 5]]), 8, 16)
    q = torch.zeros(1, 1, 1, 128).expand(1, 32, 2048, 128)
    k = torch.zeros(1, 1, 1, 128).expand(1, 2**23 + 32, 2048, 128)  # 2**23 * 2**11 * 2**7 elements and more
    with pytest.raises(ValueError, match=r"k, v: T \* H \* D = 8388640 \* 2048 \* 128"):
        block_sparse_attention(q, k, k, mask)
    q = torch.zeros(1, 1, 1, 256).expand(1, 2**20, 2**13, 256)
    k = torch.zeros(1, 1, 1, 256).expand(1, 40, 1, 256)
    with pytest.raises(ValueError, match=r"q: T \* H \* D"):
        block_sparse_attention(q, k, k, mask)


def test_attention_kernel_grid_limit():
    """The grids are flat: B * Hq * tiles programs on one axis (2**31 - 1 of them)."""
    with pytest.raises(ValueError, match=r"q: B \* Hq \* max\(row tiles, 2 \* key tiles\) = 4096 \* 32 \* 16384"):
        attention_checks.check_kernel_grid(4096, 32, 16384, 64)
    with pytest.raises(ValueError, match=r"= 4096 \* 32 \* 16384 exceeds"):
        attention_checks.check_kernel_grid(4096, 32, 10, 8192)
    attention_checks.check_kernel_grid(4096, 32, 16383, 64)  # the old 65535-program second axis is gone


DFLASH_MASK_CASES = [
    # id, args, kwargs, exception, match
    ("context-len-wraps-int32", (torch.tensor([[0, 5]]), 2**31 - 8), {}, ValueError, "context_len: 2147483640"),
    ("context-len-beyond-int32", (torch.tensor([[0, 5]]), 2**31 + 100), {}, ValueError, "context_len: 2147483748"),
    ("context-plus-blocks-beyond-int32", (torch.zeros(1, 2**20, dtype=torch.long), 2**31 - 2**24), dict(block_size=16),
     ValueError, "context_len"),
    ("queries-beyond-int32", (torch.zeros(1, 2**26, dtype=torch.long), 8), dict(block_size=16), ValueError,
     "anchors: 1073741824 query positions"),
    ("anchor-beyond-int32", (torch.tensor([[0, 2**32 + 1]]), 8), {}, ValueError, r"anchors\[0, 1\] = 4294967297"),
    ("context-len-0", (torch.tensor([[0, 0]]), 0), {}, ValueError, "context_len: must be >= 1"),
    ("context-len-float", (torch.tensor([[0, 5]]), 8.0), {}, TypeError, "context_len"),
    ("block-size-0", (torch.tensor([[0, 5]]), 8), dict(block_size=0), ValueError, "block_size: must be >= 1"),
    ("window-0", (torch.tensor([[0, 5]]), 8), dict(window=0), ValueError, "window"),
    ("kv-tile-not-pow2", (torch.tensor([[0, 5]]), 8), dict(kv_tile=48), ValueError, "kv_tile"),
    ("anchors-float", (torch.tensor([[0.0, 5.0]]), 8), {}, TypeError, "anchors: dtype"),
    ("anchors-rank", (torch.tensor([0, 5]), 8), {}, ValueError, "anchors: expected shape"),
    ("anchors-empty", (torch.zeros(1, 0, dtype=torch.long), 8), {}, ValueError, "anchors: expected shape"),
    ("anchors-batch-0", (torch.zeros(0, 2, dtype=torch.long), 8), {}, ValueError, "anchors: expected shape"),
    ("anchor-negative", (torch.tensor([[-1, 5]]), 8), {}, ValueError, "anchors"),
    ("valid-dtype", (torch.tensor([[0, 5]]), 8), dict(valid=torch.ones(1, 2)), TypeError, "valid"),
    ("valid-shape", (torch.tensor([[0, 5]]), 8), dict(valid=torch.ones(1, 3, dtype=torch.bool)), ValueError, "valid"),
    ("valid-device", (torch.tensor([[0, 5]]), 8), dict(valid=torch.ones(1, 2, dtype=torch.bool, device=META)),
     ValueError, "valid: is on meta"),
]


@pytest.mark.parametrize("args,kwargs,exc,match", [c[1:] for c in DFLASH_MASK_CASES],
                         ids=[c[0] for c in DFLASH_MASK_CASES])
def test_dflash_block_mask_malformed(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        dflash_block_mask(*args, **kwargs)


def test_dflash_block_mask_largest_context_is_accepted_by_the_checks():
    """The bound is exact: the largest context the kernels index passes the argument check."""
    N, bs, kv_tile = 2, 16, 64
    limit = 2**31 - 1 - attention_checks.MAX_TILE - N * bs
    attention_checks.check_dflash_block_mask_args(torch.tensor([[0, 5]]), limit, bs, None, None, kv_tile, True)
    with pytest.raises(ValueError, match="context_len"):
        attention_checks.check_dflash_block_mask_args(torch.tensor([[0, 5]]), limit + 1, bs, None, None, kv_tile, True)


@pytest.mark.parametrize("args,kwargs,match", [
    ((2**31 - 8,), {}, "q_len: 2147483640 query positions"),
    ((8, 2**31 + 100), {}, "kv_len: 2147483748 keys"),
    ((2**30,), dict(kv_len=8), "q_len: 1073741824 query positions"),
    ((0,), {}, "q_len: must be >= 1"),
    ((8,), dict(q_block=256), "q_block: at most 128"),
], ids=["q-and-kv-wrap", "kv-beyond-int32", "q-beyond-int32", "q-len-0", "q-block-too-large"])
def test_causal_block_mask_malformed(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        causal_block_mask(*args, **kwargs)


def test_attention_empty_batch_gives_empty_output():
    q, k, v, mask = _attn(B=0)
    o, lse = block_sparse_attention(q, k, v, mask, return_lse=True)
    assert o.shape == q.shape and lse.shape == (0, q.shape[2], q.shape[1])


# ---------------------------------------------------------------------------------------------------
# gated delta rule, chunked and recurrent


def _gdn(B=1, T=8, Hk=2, Hv=2, K=16, V=16):
    q = torch.randn(B, T, Hk, K)
    k = torch.randn(B, T, Hk, K)
    v = torch.randn(B, T, Hv, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv))
    beta = torch.rand(B, T, Hv)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def _with(**changes):
    def make(a):
        a = dict(a)
        for name, f in changes.items():
            a[name] = f(a) if callable(f) else f
        return a
    return make


GDN_CASES = [
    # id, transform of the keyword arguments, exception, match
    ("q-rank", _with(q=lambda a: a["q"][0]), ValueError, "q: expected 4 dimensions"),
    ("g-rank", _with(g=lambda a: a["g"][..., None]), ValueError, "g: expected 3 dimensions"),
    ("q-int", _with(q=lambda a: a["q"].long()), TypeError, "q: dtype"),
    ("beta-float64", _with(beta=lambda a: a["beta"].double()), TypeError, "beta: dtype"),
    ("v-device", _with(v=lambda a: a["v"].to(META)), ValueError, "v: is on meta"),
    ("k-shape", _with(k=lambda a: a["k"][:, :-1]), ValueError, "k: expected the shape of q"),
    ("v-shape", _with(v=lambda a: a["v"][:, :-1]), ValueError, "v: expected"),
    ("g-shape", _with(g=lambda a: a["g"][..., :1]), ValueError, "g: expected shape"),
    ("Hk-0", _with(q=lambda a: a["q"][:, :, :0], k=lambda a: a["k"][:, :, :0]), ValueError, "q, k: the head count"),
    ("K-0", _with(q=lambda a: a["q"][..., :0], k=lambda a: a["k"][..., :0]), ValueError, "q, k: .* head dim K"),
    ("Hv-0", _with(v=lambda a: a["v"][:, :, :0], g=lambda a: a["g"][..., :0], beta=lambda a: a["beta"][..., :0]),
     ValueError, "v: the head count Hv"),
    ("V-0", _with(v=lambda a: a["v"][..., :0]), ValueError, "v: .* head dim V"),
    ("Hv-not-multiple", _with(q=lambda a: torch.randn(1, 8, 3, 16), k=lambda a: torch.randn(1, 8, 3, 16)),
     ValueError, "v: its head count Hv=2 must be a multiple"),
    ("T-0", _with(q=lambda a: a["q"][:, :0], k=lambda a: a["k"][:, :0], v=lambda a: a["v"][:, :0],
                  g=lambda a: a["g"][:, :0], beta=lambda a: a["beta"][:, :0]), ValueError, "q: T must be at least 1"),
    ("K-too-large", _with(q=lambda a: torch.randn(1, 8, 2, 512), k=lambda a: torch.randn(1, 8, 2, 512)),
     ValueError, "q, v: head dims"),
    ("scale-nan", _with(scale=NAN), ValueError, "scale: must be finite"),
    ("scale-inf", _with(scale=INF), ValueError, "scale: must be finite"),
    ("scale-str", _with(scale="0.1"), TypeError, "scale:"),
    ("initial-state-shape", _with(initial_state=torch.zeros(1, 2, 16, 8)), ValueError, "initial_state: expected shape"),
    ("initial-state-rank", _with(initial_state=torch.zeros(2, 16, 16)), ValueError, "initial_state: expected 4"),
    ("initial-state-device", _with(initial_state=torch.zeros(1, 2, 16, 16, device=META)), ValueError,
     "initial_state: is on meta"),
    ("cu-seqlens-float", _with(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens"),
    ("cu-seqlens-not-ending-at-T", _with(cu_seqlens=torch.tensor([0, 3, 7])), ValueError, "cu_seqlens: must rise"),
    ("cu-seqlens-decreasing", _with(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "cu_seqlens: must rise"),
    ("cu-seqlens-beyond-int32", _with(cu_seqlens=torch.tensor([0, 2**32 + 3, 8])), ValueError, "cu_seqlens: must rise"),
    ("cu-seqlens-batch-2", _with(**{n: (lambda a, n=n: a[n].expand(2, *a[n].shape[1:])) for n in ("q", "k", "v", "g", "beta")},
                                 cu_seqlens=torch.tensor([0, 8])),
     ValueError, "q: with cu_seqlens"),
    ("A-log-missing", _with(use_gate_in_kernel=True), ValueError, "A_log: must be given"),
    ("neg-eigval-without-sigmoid", _with(allow_neg_eigval=True), ValueError, "allow_neg_eigval"),
    ("unknown-keyword", _with(foo=1), TypeError, "foo"),
]


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("make,exc,match", [c[1:] for c in GDN_CASES], ids=[c[0] for c in GDN_CASES])
def test_gdn_malformed(fn, make, exc, match):
    kwargs = make(_gdn())
    with pytest.raises(exc, match=match):
        fn(**kwargs)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_gdn_tokens_beyond_int32(fn):
    """T beyond the kernels' int32 token positions (expanded tensors: nothing large is allocated)."""
    T = 2**31
    a = {n: t[:, :1].expand(t.shape[0], T, *t.shape[2:]) for n, t in _gdn().items()}
    with pytest.raises(ValueError, match="q: T=2147483648 tokens"):
        fn(**a)


def test_gdn_kernel_grid_limit():
    with pytest.raises(ValueError, match="cu_seqlens: N \\* Hv"):
        gdn_checks.check_kernel_grid(4096, 32, True)
    with pytest.raises(ValueError, match="q: N \\* Hv"):
        gdn_checks.check_kernel_grid(4096, 32, False)
    gdn_checks.check_kernel_grid(2047, 32, False)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_gdn_empty_batch_gives_empty_output(fn):
    a = {n: t[:0] for n, t in _gdn().items()}
    o, ht = fn(**a, output_final_state=True)
    assert o.shape == a["v"].shape and ht.shape == (0, 2, 16, 16)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule], ids=["chunk", "recurrent"])
def test_gdn_expanded_inputs_and_state_are_read_not_written(fn):
    """Stride-0 (expanded) inputs and initial state: the same result as materialized copies, and the
    initial state is only read (the final state is a new tensor)."""
    a = _gdn(B=2)
    a["q"] = a["q"][:1].expand(2, -1, -1, -1)
    h0 = torch.randn(1, 2, 16, 16).expand(2, -1, -1, -1)
    h0_before = h0.clone()
    o, ht = fn(**a, initial_state=h0, output_final_state=True)
    ro, rht = fn(**{n: t.contiguous() for n, t in a.items()}, initial_state=h0.contiguous(), output_final_state=True)
    assert torch.equal(h0, h0_before) and ht.data_ptr() != h0.data_ptr()
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(ht, rht)


# ---------------------------------------------------------------------------------------------------
# linear cross-entropy


def _lce(N=4, H=32, V=50):
    return dict(hidden=torch.randn(N, H), weight=torch.randn(V, H), labels=torch.randint(0, V, (N,)))


LCE_CASES = [
    ("hidden-int", _with(hidden=lambda a: a["hidden"].long()), TypeError, "hidden: dtype"),
    ("hidden-H-0", _with(hidden=lambda a: a["hidden"][:, :0], weight=lambda a: a["weight"][:, :0]), ValueError,
     "hidden: expected shape"),
    ("weight-rank", _with(weight=lambda a: a["weight"][0]), ValueError, "weight: expected 2 dimensions"),
    ("weight-V-0", _with(weight=lambda a: a["weight"][:0]), ValueError, "weight: expected shape"),
    ("weight-H-mismatch", _with(weight=lambda a: a["weight"][:, :8]), ValueError, "weight: expected shape"),
    ("weight-dtype", _with(weight=lambda a: a["weight"].half()), TypeError, "weight: dtype"),
    ("weight-device", _with(weight=lambda a: a["weight"].to(META)), ValueError, "weight: is on meta"),
    ("labels-float", _with(labels=lambda a: a["labels"].float()), TypeError, "labels: dtype"),
    ("labels-shape", _with(labels=lambda a: a["labels"][:2]), ValueError, "labels: expected shape"),
    ("labels-out-of-range", _with(labels=torch.tensor([0, 1, 50, 2])), ValueError, "labels: values"),
    ("bias-shape", _with(bias=torch.zeros(49)), ValueError, "bias: expected shape"),
    ("weights-shape", _with(weights=torch.ones(3)), ValueError, "weights: expected"),
    ("reduction", _with(reduction="avg"), ValueError, "reduction"),
    ("ignore-index-float", _with(ignore_index=-100.0), TypeError, "ignore_index"),
    ("softcap-nan", _with(softcap=NAN), ValueError, "softcap"),
    ("softcap-inf", _with(softcap=INF), ValueError, "softcap"),
    ("softcap-0", _with(softcap=0.0), ValueError, "softcap"),
]


@pytest.mark.parametrize("make,exc,match", [c[1:] for c in LCE_CASES], ids=[c[0] for c in LCE_CASES])
def test_linear_cross_entropy_malformed(make, exc, match):
    with pytest.raises(exc, match=match):
        linear_cross_entropy(**make(_lce()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_empty_batch(reduction):
    """N = 0 rows: an empty loss ('none') or 0 ('mean', 'sum'), never NaN, with zero gradients."""
    a = _lce(N=0)
    a["weight"].requires_grad_(True)
    loss = linear_cross_entropy(**a, reduction=reduction)
    if reduction == "none":
        assert loss.shape == (0,)
    else:
        assert loss.shape == () and loss.item() == 0.0 and not math.isnan(loss.item())
    loss.sum().backward()
    assert torch.equal(a["weight"].grad, torch.zeros_like(a["weight"]))


# ------------------------------------------------------------------------------------- causal conv1d
@pytest.mark.parametrize("x,weight,match", [
    (torch.randn(1, 0, 8), torch.randn(0, 4), r"x: the channel dimension D is empty"),
    (torch.empty(1, 1, 1).expand(1, 2 ** 16, 2 ** 15), torch.randn(2 ** 16, 4), r"x: D \* T = 2147483648"),
    (torch.empty(1, 4, 8).expand(65536, 4, 8), torch.randn(4, 4), r"x: batch size B=65536"),
], ids=["D=0", "int32-offsets", "grid"])
def test_conv1d_sizes_the_kernels_cannot_index(x, weight, match):
    with pytest.raises(ValueError, match=match):
        dk.causal_conv1d(x, weight, activation="silu")


def test_conv1d_update_batch_beyond_the_grid():
    x = torch.empty(1, 4).expand(65536, 4)
    state = torch.zeros(65536, 4, 3)
    with pytest.raises(ValueError, match=r"x: batch size B=65536"):
        dk.causal_conv1d_update(x, state, torch.randn(4, 4), activation="silu")
