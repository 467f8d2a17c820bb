"""The warp-specialized Gluon DFlash-mask backward (kernels_gluon_sm90_dflash_bwd.py) against the fp32 reference
(autograd through SDPA under the dense boolean mask) and the portable backward (``attention_bwd`` through the
op's autograd): DFlash masks with and without window, padding blocks, odd S and N, GQA 4 / 2 / 1, 8- and
32-position blocks, unsorted anchors, a batch-1 mask, bf16 / fp16, D = 128 / 64; non-finite K / V confined to
the gradients of the keys and queries that see them.

Needs a CUDA device of compute capability 9.x (no interpreter path): skips elsewhere. Output buffers are
NaN-filled before the launch (DFLASH_KERNELS_POISON), so an element a kernel does not write fails. The
launcher is called directly on the Gluon forward's o and lse (the op's dispatch runs it after that forward:
tests/ops/test_attention.py's Hopper tests).
"""

import math

import pytest
import torch

from tests.helpers import rel_err, worst_row_err
from tests.ops.test_attention_gluon_sm90 import DFLASH, SKIP, _dflash_case

needs_sm90 = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
ROW_TOL = {torch.bfloat16: 1.5e-1, torch.float16: 5e-2}


def _reference_grads(q, k, v, dense, do, scale):
    """fp32 dq, dk, dv of SDPA under the boolean mask (tests/ops/test_attention.py's dense reference)."""
    from tests.ops.test_attention import dense_reference

    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o, _ = dense_reference(qf, kf, vf, dense.expand(q.shape[0], -1, -1), scale)
    return torch.autograd.grad(o, (qf, kf, vf), do.float())


def _run(q, k, v, mask, do, scale):
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import attention_fwd_gluon_sm90_dflash
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import attention_bwd_gluon_sm90_dflash

    o, lse = attention_fwd_gluon_sm90_dflash(q, k, v, mask, scale)
    return attention_bwd_gluon_sm90_dflash(do, q, k, v, o, lse, mask, scale)


def _check(name, got, ref, dtype):
    err = rel_err(got, ref)
    assert err < TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"
    nz = ref.float().flatten(-1).abs().amax(-1) > 0  # rows / keys with a gradient at all
    if nz.any():
        row = worst_row_err(got[nz], ref[nz])
        assert row < ROW_TOL[dtype], f"{name}: worst row relative error {row:.2e} > {ROW_TOL[dtype]:.0e}"


@needs_sm90
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("case", list(DFLASH), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dflash_bwd_matches_reference(case, D, dtype, monkeypatch):
    from dflash_kernels.ops.attention import block_sparse_attention

    monkeypatch.setenv("DFLASH_KERNELS_POISON", "1")  # NaN-filled outputs: an unwritten element fails
    q, k, v, mask, dense = _dflash_case(case, D, dtype)
    scale = 1.0 / math.sqrt(D)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, dtype)
    dq, dk, dv = _run(q, k, v, mask, do, scale)
    torch.cuda.synchronize()
    for name, x, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert x.dtype == dtype and x.shape == like.shape, name
        assert not x.isnan().any(), f"{name}: an element was not written (NaN)"
    rq, rk, rv = _reference_grads(q, k, v, dense, do, scale)
    unseen_q = ~dense.any(-1)  # [MB, Tq]: rows that see nothing get dq 0
    assert (dq[unseen_q.expand(q.shape[0], -1)] == 0).all(), "a row that sees nothing has a nonzero dq"
    unseen_k = ~dense.any(-2)  # [MB, Tk]: keys nobody sees get dk, dv 0
    assert (dk[unseen_k.expand(k.shape[0], -1)] == 0).all() and (dv[unseen_k.expand(k.shape[0], -1)] == 0).all()
    _check("dq", dq, rq, dtype)
    _check("dk", dk, rk, dtype)
    _check("dv", dv, rv, dtype)
    # The portable backward on the same inputs.
    qp, kp, vp = (x.clone().requires_grad_() for x in (q, k, v))
    o = block_sparse_attention(qp, kp, vp, mask, scale=scale)
    pq, pk, pv = torch.autograd.grad(o, (qp, kp, vp), do)
    for name, x, p in (("dq", dq, pq), ("dk", dk, pk), ("dv", dv, pv)):
        err = rel_err(x, p)
        assert err < 2 * TOL[dtype], f"{name} against the portable backward: relative error {err:.2e}"


@needs_sm90
def test_dflash_bwd_deterministic():
    """Two runs give bitwise the same gradients (fixed summation orders, no atomics)."""
    q, k, v, mask, _ = _dflash_case("train_S3072_window2048", 128, torch.bfloat16)
    do = torch.randn_like(q)
    a = _run(q, k, v, mask, do, 128 ** -0.5)
    b = _run(q, k, v, mask, do, 128 ** -0.5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_sm90
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_dflash_bwd_nonfinite_confined(D, where, value):
    """A NaN / Inf in K or V (the forward test's keys: one of block 5's own keys, one context key) changes
    only the gradients it can reach: dq of the rows that see it, dk / dv of the keys those rows see (their o,
    lse, delta are non-finite) and of the bad keys themselves. Every other row's dq and every other key's dk /
    dv equals the clean run's exactly."""
    q, k, v, mask, dense = _dflash_case("odd_gqa4", D, torch.bfloat16)
    B, Tq, Hq, _ = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    S = Tk - Tq
    scale = 1.0 / math.sqrt(D)
    own, ctx = S + 5 * 16 + 3, S // 2
    bad = torch.zeros(Tk, dtype=torch.bool, device=k.device)
    bad[[own, ctx]] = True
    dense = dense.expand(B, -1, -1)
    seers = (dense & bad).any(-1)  # [B, Tq]
    reached = (dense & seers[..., None]).any(1) | bad  # [B, Tk]: keys seen by a seer, and the bad keys
    do = torch.randn_like(q)
    clean = _run(q, k, v, mask, do, scale)
    k2, v2 = k.clone(), v.clone()
    (k2 if where == "k" else v2)[:, [own, ctx], 0, 7] = value  # kv head 0: query heads 0 .. 3
    dq, dk, dv = _run(q, k2, v2, mask, do, scale)
    torch.cuda.synchronize()
    hit_q = seers[..., None].expand(B, Tq, Hq).clone()
    hit_q[:, :, 4:] = False
    hit_k = reached[..., None].expand(B, Tk, Hkv).clone()
    hit_k[:, :, 1:] = False
    assert torch.equal(dq[~hit_q], clean[0][~hit_q]), "dq of a row that does not see the non-finite key changed"
    assert torch.equal(dk[~hit_k], clean[1][~hit_k]), "dk of a key no seer sees changed"
    assert torch.equal(dv[~hit_k], clean[2][~hit_k]), "dv of a key no seer sees changed"
    assert dq[~hit_q].isfinite().all() and dk[~hit_k].isfinite().all() and dv[~hit_k].isfinite().all()


def _portable_bwd(do, q, k, v, o, lse, mask, scale):
    """The portable launcher's backward (kernels.py) on the same o and lse."""
    from dflash_kernels.ops.attention.attention import attention_bwd

    fields = (mask.segments, mask.seg_count, mask.tiles, mask.rev_offsets, mask.rev_full, mask.rev_entries)
    return attention_bwd(do, q, k, v, o, lse, *(t.contiguous() for t in fields), mask.q_block, mask.kv_tile,
                         mask.tile_width, scale)


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "do", "both"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("case", ["odd_gqa4_window", "gqa4_unsorted_window"])
def test_dflash_bwd_nonfinite_q_do_confined(case, D, where, value, dtype):
    """A NaN / Inf in a few rows of q or of do (the upstream gradient) reaches only those rows' dq and the dk /
    dv of the keys those rows see (their kv head): every other element of dq, dk, dv equals the clean run's
    exactly. Where the portable backward (on the same o and lse) gives a non-finite value, so does this one.
    The window masks' anchors are not multiples of 64: the bad rows' items see part of a consumer's 64 keys,
    so the keys they do not see share MMAs with the bad rows (the case the dk / dv kernel zeroes and
    poisons; module docstring)."""
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import attention_fwd_gluon_sm90_dflash
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import attention_bwd_gluon_sm90_dflash

    q, k, v, mask, dense = _dflash_case(case, D, dtype)
    B, Tq, Hq, _ = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.device, dtype)
    dense = dense.expand(B, -1, -1)
    # (batch, position, head, element): rows of live groups (5, 20 and 30; the padding blocks are groups 2, 3
    # and N // 2), one of kv head 0, two of kv head 1; the last batch for the second.
    rows = [(0, 5 * 16 + 3, 1, 7), (B - 1, 20 * 16 + 15, 6, 0), (0, 30 * 16, 4, D - 1)]
    q2, do2 = q.clone(), do.clone()
    for n, (b, t, h, d) in enumerate(rows):
        target = {"q": q2, "do": do2, "both": q2 if n % 2 == 0 else do2}[where]
        target[b, t, h, d] = value
    hit_q = torch.zeros(B, Tq, Hq, dtype=torch.bool, device=q.device)
    hit_k = torch.zeros(B, Tk, Hkv, dtype=torch.bool, device=q.device)
    partial = False  # a bad row sees part of a 64-key block and not the rest
    for b, t, h, d in rows:
        assert dense[b, t].any(), "a bad row must see keys"
        hit_q[b, t, h] = True
        hit_k[b, :, h // G] |= dense[b, t]
        blocks = dense[b, t, :Tk // 64 * 64].view(-1, 64)
        partial |= bool((blocks.any(-1) & ~blocks.all(-1)).any())
    assert partial, "the case must hold an item that sees part of a 64-key block"

    clean = _run(q, k, v, mask, do, scale)
    o, lse = attention_fwd_gluon_sm90_dflash(q2, k, v, mask, scale)
    got = attention_bwd_gluon_sm90_dflash(do2, q2, k, v, o, lse, mask, scale)
    ref = _portable_bwd(do2, q2, k, v, o, lse, mask, scale)
    torch.cuda.synchronize()
    for name, x, c, p, hit in (("dq", got[0], clean[0], ref[0], hit_q), ("dk", got[1], clean[1], ref[1], hit_k),
                               ("dv", got[2], clean[2], ref[2], hit_k)):
        assert (~hit).any()
        assert torch.equal(x[~hit], c[~hit]), f"{name} outside what the bad rows reach differs from the clean run"
        assert x[~hit].isfinite().all(), name
        missing = ~p.isfinite() & x.isfinite()
        assert not missing.any(), f"{name}: finite where the portable backward is not ({int(missing.sum())})"
    assert not ref[1].isfinite().all(), "the portable backward reaches some dk with the non-finite rows"
