"""The warp-specialized Gluon backward for dense causal attention (kernels_gluon_sm90_causal_bwd.py) against the fp32
reference (autograd through tests/ops/test_attention_gluon_sm90.py's ``reference``: top-left causal, the
convention of ``causal_block_mask`` and of the Gluon forward) and the portable backward on the same o and lse:
D = 128 / 64, bf16 / fp16, GQA 1, 4 and 8, lengths 128, 333 and 1001, Tq < Tk and Tq > Tk; determinism; non-finite
K / V confined to the rows that see them, non-finite q / do rows confined to their dq and the keys they see.

The op runs this backward after the Gluon causal forward (attention.py; tests/ops/test_attention.py,
``test_op_runs_the_gluon_causal_backward``). Diagnostic: ``python -m tools.studies.debug_causal_bwd``.

Needs a CUDA device of compute capability 9.x (no interpreter path): skips elsewhere. Output buffers are
NaN-filled before the launch (DFLASH_KERNELS_POISON), so an element a kernel does not write fails.
"""

import math

import pytest
import torch

from tests.helpers import rel_err, worst_row_err, worst_row_err_rms
from tests.ops.test_attention_gluon_sm90 import SKIP, _inputs, reference

needs_sm90 = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
ROW_TOL = {torch.bfloat16: 1.5e-1, torch.float16: 5e-2}

# (B, Tq, Tk, Hq, Hkv): one tile, odd lengths (neither a multiple of the 64-row nor of the 128-key tiles), keys
# past the last query (seen by nobody: dk, dv 0), queries past the last key (they see every key).
SHAPES = {"T128_gqa1": (2, 128, 128, 4, 4), "T333_gqa4": (2, 333, 333, 8, 2), "T1001_gqa4": (1, 1001, 1001, 4, 1),
          "T1001_gqa1": (1, 1001, 1001, 2, 2), "q333_k401_gqa4": (2, 333, 401, 8, 2),
          "q300_k77_gqa1": (1, 300, 77, 2, 2), "T333_gqa8": (1, 333, 333, 8, 1)}


def _run(q, k, v, do, scale):
    """The Gluon causal forward, then this backward on its o and lse."""
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90
    from dflash_kernels.ops.attention.kernels_gluon_sm90_causal_bwd import attention_bwd_gluon_sm90_causal

    o, lse = attention_fwd_gluon_sm90(q, k, v, True, scale)
    return attention_bwd_gluon_sm90_causal(do, q, k, v, o, lse, scale), o, lse


def _reference_grads(q, k, v, do, scale):
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o, _ = reference(qf, kf, vf, True, scale)
    return torch.autograd.grad(o, (qf, kf, vf), do.float())


def _portable_bwd(do, q, k, v, o, lse, scale):
    """The portable launcher's backward (kernels.py) for ``causal_block_mask`` on the same o and lse."""
    from dflash_kernels.ops.attention import causal_block_mask
    from dflash_kernels.ops.attention.attention import attention_bwd

    mask = causal_block_mask(q.shape[1], k.shape[1], device=q.device)
    fields = (mask.segments, mask.seg_count, mask.tiles, mask.rev_offsets, mask.rev_full, mask.rev_entries)
    return attention_bwd(do, q, k, v, o, lse, *(t.contiguous() for t in fields), mask.q_block, mask.kv_tile,
                         mask.tile_width, scale)


def _check(name, got, ref, dtype):
    err = rel_err(got, ref)
    assert err < TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"
    nz = ref.float().flatten(-1).abs().amax(-1) > 0  # rows / keys with a gradient at all
    if nz.any():
        # dq: the first query sees one key, its dq is a rounding residual (rows floored at the RMS row norm).
        row = (worst_row_err_rms if name == "dq" else worst_row_err)(got[nz], ref[nz])
        assert row < ROW_TOL[dtype], f"{name}: worst row relative error {row:.2e} > {ROW_TOL[dtype]:.0e}"


@needs_sm90
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_causal_bwd_matches_reference(shape, D, dtype, monkeypatch):
    monkeypatch.setenv("DFLASH_KERNELS_POISON", "1")  # NaN-filled outputs: an unwritten element fails
    B, Tq, Tk, Hq, Hkv = SHAPES[shape]
    q, k, v = _inputs(B, Tq, Tk, Hq, Hkv, D, dtype)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, dtype)
    scale = 1.0 / math.sqrt(D)
    (dq, dk, dv), o, lse = _run(q, k, v, do, scale)
    torch.cuda.synchronize()
    for name, x, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert x.dtype == dtype and x.shape == like.shape, name
        assert not x.isnan().any(), f"{name}: an element was not written (NaN)"
    if Tk > Tq:  # keys nobody sees get dk, dv exactly 0
        assert (dk[:, Tq:] == 0).all() and (dv[:, Tq:] == 0).all()
    rq, rk, rv = _reference_grads(q, k, v, do, scale)
    _check("dq", dq, rq, dtype)
    _check("dk", dk, rk, dtype)
    _check("dv", dv, rv, dtype)
    pq, pk, pv = _portable_bwd(do, q, k, v, o, lse, scale)
    for name, x, p in (("dq", dq, pq), ("dk", dk, pk), ("dv", dv, pv)):
        err = rel_err(x, p)
        assert err < 2 * TOL[dtype], f"{name} against the portable backward: relative error {err:.2e}"


@needs_sm90
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_causal_bwd_deterministic(D):
    """Two runs give bitwise the same gradients (fixed summation orders, no atomics)."""
    q, k, v = _inputs(1, 1001, 1001, 8, 2, D, torch.bfloat16)
    do = torch.randn_like(q)
    a, _, _ = _run(q, k, v, do, D ** -0.5)
    b, _, _ = _run(q, k, v, do, D ** -0.5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@needs_sm90
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_causal_bwd_nonfinite_kv_confined(D, where, value):
    """A NaN / Inf in one K or V row (key 150 of kv head 0: inside a 64-row tile, so rows 128 .. 149 share the
    diagonal tiles with it and do not see it) reaches only the rows that see it: dq of every row before it and
    of every other kv head's query heads, dk / dv of every other kv head, and dk / dv of the keys nobody sees,
    equal the clean run's exactly (and are finite)."""
    B, Tq, Tk, Hq, Hkv = 1, 333, 401, 8, 2
    G = Hq // Hkv
    bad = 150
    q, k, v = _inputs(B, Tq, Tk, Hq, Hkv, D, torch.bfloat16)
    do = torch.randn_like(q)
    scale = D ** -0.5
    clean, _, _ = _run(q, k, v, do, scale)
    k2, v2 = k.clone(), v.clone()
    (k2 if where == "k" else v2)[:, bad, 0, 7] = value
    (dq, dk, dv), _, _ = _run(q, k2, v2, do, scale)
    torch.cuda.synchronize()
    keep_q = torch.ones(B, Tq, Hq, dtype=torch.bool, device=q.device)
    keep_q[:, bad:, :G] = False  # rows that see the key, of kv head 0's query heads
    keep_k = torch.ones(B, Tk, Hkv, dtype=torch.bool, device=q.device)
    keep_k[:, :Tq, 0] = False  # the seers see every key before Tq of kv head 0
    assert torch.equal(dq[keep_q], clean[0][keep_q]), "dq of a row that does not see the non-finite key changed"
    assert torch.equal(dk[keep_k], clean[1][keep_k]) and torch.equal(dv[keep_k], clean[2][keep_k])
    assert dq[keep_q].isfinite().all() and dk[keep_k].isfinite().all() and dv[keep_k].isfinite().all()
    assert not dq[:, bad:, :G].isfinite().all(), "the rows that see the non-finite key are finite"


@needs_sm90
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "do"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_causal_bwd_nonfinite_q_do_confined(D, where, value):
    """A NaN / Inf in a few rows of q or of do (the upstream gradient) reaches only those rows' dq and the dk / dv
    of the keys those rows see (``j <= t``, their kv head): every other element of dq, dk, dv equals the clean
    run's exactly. The rows lie inside 64-row tiles, so the keys just after them share the diagonal items with
    them (the case the dk / dv producer zeroes and marks; module docstring). Where the portable backward (on the
    same o and lse) gives a non-finite value, so does this one."""
    B, Tq, Tk, Hq, Hkv = 2, 333, 401, 8, 2
    G = Hq // Hkv
    q, k, v = _inputs(B, Tq, Tk, Hq, Hkv, D, torch.bfloat16)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.device, torch.bfloat16)
    scale = D ** -0.5
    rows = [(0, 150, 1, 7), (B - 1, 37, 6, 0), (0, 300, 4, D - 1)]  # (batch, position, head, element)
    q2, do2 = q.clone(), do.clone()
    hit_q = torch.zeros(B, Tq, Hq, dtype=torch.bool, device=q.device)
    hit_k = torch.zeros(B, Tk, Hkv, dtype=torch.bool, device=q.device)
    for b, t, h, d in rows:
        (q2 if where == "q" else do2)[b, t, h, d] = value
        hit_q[b, t, h] = True
        hit_k[b, :t + 1, h // G] = True
    clean, _, _ = _run(q, k, v, do, scale)
    got, o, lse = _run(q2, k, v, do2, scale)
    ref = _portable_bwd(do2, q2, k, v, o, lse, scale)
    torch.cuda.synchronize()
    for name, x, c, p, hit in (("dq", got[0], clean[0], ref[0], hit_q), ("dk", got[1], clean[1], ref[1], hit_k),
                               ("dv", got[2], clean[2], ref[2], hit_k)):
        assert torch.equal(x[~hit], c[~hit]), f"{name} outside what the bad rows reach differs from the clean run"
        assert x[~hit].isfinite().all(), name
        missing = ~p.isfinite() & x.isfinite()
        assert not missing.any(), f"{name}: finite where the portable backward is not ({int(missing.sum())})"
