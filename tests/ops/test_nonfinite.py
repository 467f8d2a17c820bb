"""Non-finite values stay where they are: a NaN or Inf in one draft block (attention) never reaches the
outputs or gradients of rows that cannot see it; the rows that see it are non-finite.

Checked against a clean run of the same kernels (the dense reference itself multiplies masked zeros by
NaN, so it is no judge here)."""

import os

import pytest
import torch

from dflash_kernels.ops.attention import block_sparse_attention, causal_block_mask, dflash_block_mask
from dflash_kernels.ops.attention.naive import naive_dense_mask
from tests.helpers import device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = device()
needs_kernels = pytest.mark.skipif(DEVICE.type == "cpu" and not INTERPRET,
                                   reason="kernels need CUDA or TRITON_INTERPRET=1")


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


@needs_kernels
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["v", "k"])
def test_attention_nonfinite_in_a_blocks_own_keys_stays_in_the_block(value, where):
    """Block 0's own keys (S .. S + bs) hold a NaN/Inf: blocks 1..3 (stacked with block 0 in one tile,
    interpreter config GPB=2) stay exactly as in a clean run, outputs and gradients."""
    mask, q, k, v, do = _dflash_case()
    _check_confined(mask, q, k, v, do, bad_keys=(24, 26), value=value, where=(where,))


@needs_kernels
@pytest.mark.parametrize("where", ["v", "k"])
def test_attention_nonfinite_context_key_reaches_only_later_anchors(where):
    """A NaN in context key 12: blocks with anchors 3 and 10 do not see it, those with 17 and 24 do."""
    mask, q, k, v, do = _dflash_case()
    _check_confined(mask, q, k, v, do, bad_keys=(12,), where=(where,))


@needs_kernels
def test_attention_nonfinite_query_and_upstream_gradient_stay_in_their_rows():
    """A NaN query row of block 1 and a NaN upstream gradient row of block 2: other rows' dq and the
    dk, dv of keys those rows do not see stay clean."""
    mask, q, k, v, do = _dflash_case()
    _check_confined(mask, q, k, v, do, bad_q_rows=(5,), bad_do_rows=(9,))


@needs_kernels
def test_attention_nonfinite_with_a_window_and_a_batch():
    mask, q, k, v, do = _dflash_case(B=2, window=8, seed=1)
    _check_confined(mask, q, k, v, do, bad_keys=(12, 33))


@needs_kernels
def test_causal_nonfinite_key_reaches_only_later_queries():
    """Causal mask: the diagonal tiles hold rows that see a key and rows that do not."""
    T = 40
    mask = causal_block_mask(T, q_block=16, kv_tile=16, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, T, 2, 64, generator=g).to(DEVICE) for _ in range(4))
    k, v = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    _check_confined(mask, q, k, v, do, bad_keys=(20,))
