"""The warp-specialized Gluon attention forwards against plain fp32 PyTorch references: the dense one
(kernels_gluon_sm90.py: o and lse, dense and causal, GQA ratios 1 and 4, D = 64 and 128, lengths that are not
multiples of the tiles) and the DFlash-mask one (kernels_gluon_sm90_dflash.py: DFlash masks with and without
window and padding blocks, B = 1 and 2, odd S and N, GQA 4, 2 and 1, sorted and unsorted anchors, the portable
op's outputs alongside; non-finite K / V confined to the rows that see them).

Gluon kernels run only on the GPU they are written for (no interpreter path): those tests need a CUDA device
of compute capability 9.x and skip elsewhere, the interpreter included. The mask checks of the DFlash launcher
run everywhere. The launchers are called directly (tests/ops/test_attention.py's Hopper tests go through the
op's dispatch, which chooses these kernels). Output
buffers are NaN-filled before the launch (DFLASH_KERNELS_POISON), so an element a kernel does not write fails.
"""

import math
import os

import pytest
import torch

from tests.helpers import rel_err, worst_row_err


def _skip_reason():
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Gluon kernels do not run under the Triton interpreter (TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "the Gluon sm_90 forward needs a CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the Gluon sm_90 forward needs a Hopper GPU (compute capability 9.x), found {major}.{minor}"
    return None


SKIP = _skip_reason()
needs_sm90 = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
ROW_TOL = {torch.bfloat16: 8e-2, torch.float16: 2e-2}


def reference(q, k, v, causal, scale):
    """fp32 ``softmax(Q K^T * scale) V`` and the natural-log lse of the scaled scores: o ``[B, Lq, H, D]``,
    lse ``[B, H, Lq]``. Query head h reads kv head ``h // (H // Hkv)``; causal: key j visible to query i iff
    ``j <= i`` (top-left aligned)."""
    H, Hkv = q.shape[2], k.shape[2]
    qf = q.float().transpose(1, 2)  # [B, H, Lq, D]
    kf = k.float().repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(H // Hkv, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(q.shape[1], device=q.device)[:, None]
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ vf
    return o.transpose(1, 2), lse


def _inputs(B, Lq, Lk, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g).to("cuda", dtype)
    k = torch.randn(B, Lk, Hkv, D, generator=g).to("cuda", dtype)
    v = torch.randn(B, Lk, Hkv, D, generator=g).to("cuda", dtype)
    return q, k, v


# (B, Lq, Lk, H, Hkv): odd lengths (neither a multiple of the 128-row nor of the 128-key tile), more queries
# than keys, one short of a tile, a single row.
SHAPES = {"odd_gqa1": (2, 200, 333, 2, 2), "odd_gqa4": (1, 251, 190, 8, 2), "q_longer_gqa4": (2, 300, 77, 4, 1),
          "short_gqa1": (1, 5, 3, 3, 3), "long_gqa4": (1, 1000, 1100, 4, 1)}


def _check_outputs(o, lse, q, dtype, ro, rlse):
    """o and lse against the fp32 reference's ``ro``, ``rlse``: dtypes and shapes, every element written (the
    outputs are NaN-poisoned first), the same rows seeing nothing (lse -inf, o exactly 0), lse to 1e-5, o by the
    whole-tensor and the worst-row relative error."""
    torch.cuda.synchronize()
    B, Lq, H, _ = q.shape
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32 and lse.shape == (B, H, Lq)
    assert not o.isnan().any() and not lse.isnan().any(), "an output element was not written (NaN)"
    assert torch.equal(lse.isinf(), rlse.isinf()), "the rows that see nothing differ from the reference's"
    finite = rlse.isfinite()
    err = rel_err(lse[finite], rlse[finite])
    assert err < 1e-5, f"lse: relative error {err:.2e} > 1e-5"
    zero = (ro == 0).flatten(-1).all(-1)  # rows that see no key: exactly 0
    assert (o[zero] == 0).all(), "a row that sees no key is not 0"
    err = rel_err(o, ro)
    assert err < TOL[dtype], f"o: relative error {err:.2e} > {TOL[dtype]:.0e}"
    row = worst_row_err(o[~zero], ro[~zero])
    assert row < ROW_TOL[dtype], f"o: worst row relative error {row:.2e} > {ROW_TOL[dtype]:.0e}"


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(shape, D, causal, dtype, monkeypatch):
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90

    monkeypatch.setenv("DFLASH_KERNELS_POISON", "1")  # NaN-filled outputs: an unwritten element fails
    B, Lq, Lk, H, Hkv = SHAPES[shape]
    q, k, v = _inputs(B, Lq, Lk, H, Hkv, D, dtype)
    scale = 1.0 / math.sqrt(D)
    o, lse = attention_fwd_gluon_sm90(q, k, v, causal, scale)
    _check_outputs(o, lse, q, dtype, *reference(q, k, v, causal, scale))


@needs_sm90
def test_no_keys():
    """Lk = 0: every row sees nothing, o is 0 and lse -inf (the portable forward's convention)."""
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90

    q, k, v = _inputs(1, 70, 0, 2, 2, 64, torch.bfloat16)
    o, lse = attention_fwd_gluon_sm90(q, k, v, True, 0.125)
    assert (o == 0).all() and (lse == float("-inf")).all()


# ---------------------------------------------------------------------------------------- DFlash-mask forward
# (B, S, N, Hq, Hkv, block_size, window, anchors): odd S and N (an odd N leaves the last program's second
# consumer without a group), GQA 4, 2 (two heads x 16 positions: dead rows) and 1, a batch-1 mask over B = 2,
# 8- and 32-position blocks, sorted anchors (the trainer's order) and unsorted ones (a program's two groups
# then walk a wide union).
DFLASH = {
    "tiny_gqa4": (1, 45, 3, 4, 1, 16, None, "sorted"),
    "odd_gqa4": (2, 333, 37, 8, 2, 16, None, "sorted"),
    "odd_gqa4_window": (2, 333, 37, 8, 2, 16, 100, "sorted"),
    "odd_gqa1": (1, 1001, 61, 4, 4, 16, None, "sorted"),
    "odd_gqa1_window": (2, 517, 21, 2, 2, 16, 77, "sorted"),
    "gqa2_unsorted": (2, 700, 33, 4, 2, 16, None, "random"),
    "gqa4_unsorted_window": (1, 700, 33, 8, 2, 16, 250, "random"),
    "block8_gqa4": (1, 300, 25, 4, 1, 8, None, "sorted"),
    "block32_gqa4": (2, 300, 11, 4, 1, 32, 64, "sorted"),
    "batch1_mask": (2, 400, 19, 4, 1, 16, None, "shared"),
    "train_S3072": (1, 3072, 512, 8, 2, 16, None, "sorted"),
    "train_S3072_window2048": (1, 3072, 512, 8, 2, 16, 2048, "sorted"),
}


def _dflash_case(name, D, dtype):
    """Inputs of a DFlash case: q, k, v on the GPU, the mask and its dense boolean form ``[MB, Tq, Tk]`` built
    from the anchors (tests/ops/test_attention.py's definition, independent of the mask's segments)."""
    from dflash_kernels.ops.attention import dflash_block_mask
    from tests.ops.test_attention import dflash_dense_mask

    B, S, N, Hq, Hkv, bs, window, order = DFLASH[name]
    g = torch.Generator().manual_seed(S + N)
    MB = 1 if order == "shared" else B
    anchors = torch.randint(0, S + 1, (MB, N), generator=g)
    anchors[0, 0], anchors[0, -1] = 0, S  # no context at all; the whole context
    if order != "random":
        anchors = torch.sort(anchors, dim=1).values
    valid = torch.ones(MB, N, dtype=torch.bool)
    valid[-1, N // 2] = False  # a padding block: sees nothing
    if N > 4:
        valid[0, 2:4] = False  # both groups of one program (groups 2 and 3) padding: no key tile at all
    anchors, valid = anchors.cuda(), valid.cuda()
    mask = dflash_block_mask(anchors, S, bs, window=window, valid=valid)
    dense = dflash_dense_mask(anchors, S, bs, window=window, valid=valid)
    q, k, v = _inputs(B, N * bs, S + N * bs, Hq, Hkv, D, dtype, seed=S)
    return q, k, v, mask, dense


def _dense_reference(q, k, v, dense, scale):
    """fp32 SDPA under the boolean mask (tests/ops/test_attention.py): o ``[B, Tq, Hq, D]``, lse ``[B, Hq, Tq]``;
    rows that see nothing give 0 and -inf."""
    from tests.ops.test_attention import dense_reference

    return dense_reference(q.float(), k.float(), v.float(), dense.expand(q.shape[0], -1, -1), scale)


@needs_sm90
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("case", list(DFLASH), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dflash_matches_reference(case, D, dtype, monkeypatch):
    from dflash_kernels.ops.attention import block_sparse_attention
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import attention_fwd_gluon_sm90_dflash

    monkeypatch.setenv("DFLASH_KERNELS_POISON", "1")  # NaN-filled outputs: an unwritten element fails
    q, k, v, mask, dense = _dflash_case(case, D, dtype)
    B, Tq, Hq, _ = q.shape
    scale = 1.0 / math.sqrt(D)
    o, lse = attention_fwd_gluon_sm90_dflash(q, k, v, mask, scale)
    _check_outputs(o, lse, q, dtype, *_dense_reference(q, k, v, dense, scale))
    # The portable forward on the same inputs: the same rows seen, outputs as close as two roundings allow.
    with torch.no_grad():
        po, plse = block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)
    assert torch.equal(lse.isinf(), plse.isinf())
    err = rel_err(o, po)
    assert err < 2 * TOL[dtype], f"o against the portable forward: relative error {err:.2e}"


@needs_sm90
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_dflash_nonfinite_confined(D, where, value):
    """The module docstring's non-finite behaviour, as tests/ops/test_nonfinite.py checks it for the portable
    op: a NaN / Inf in K or V reaches only the rows that see its key. The rows that do not (those of the groups
    whose loaded tiles hold it included: the bad keys sit in the own block of one group of a program and at a
    context key that later anchors see, inside the ragged last box of earlier ones) give exactly the clean
    run's o and lse, finite and within the reference's tolerance; the rows that see a NaN, or an infinite value,
    are non-finite."""
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import attention_fwd_gluon_sm90_dflash

    q, k, v, mask, dense = _dflash_case("odd_gqa4", D, torch.bfloat16)
    B, Tq, Hq, _ = q.shape
    S = k.shape[1] - Tq
    scale = 1.0 / math.sqrt(D)
    own = S + 5 * 16 + 3  # a key of block 5's own block: block 5's rows alone see it (block 4 shares its box)
    ctx = S // 2  # a context key: the groups with a later anchor see it
    bad = torch.zeros(k.shape[1], dtype=torch.bool, device=k.device)
    bad[[own, ctx]] = True
    seers = (dense & bad).any(-1).expand(B, -1)  # [B, Tq]
    assert seers.any() and (~seers).any()
    clean_o, clean_lse = attention_fwd_gluon_sm90_dflash(q, k, v, mask, scale)
    k2, v2 = k.clone(), v.clone()
    x = k2 if where == "k" else v2
    x[:, [own, ctx], 0, 7] = value  # kv head 0: query heads 0 .. 3
    o, lse = attention_fwd_gluon_sm90_dflash(q, k2, v2, mask, scale)
    torch.cuda.synchronize()
    hit = seers[..., None].expand(B, Tq, Hq).clone()  # [B, Tq, Hq]
    hit[:, :, 4:] = False  # the other kv heads' rows never see it
    if not (where == "k" and value == float("inf")):  # an infinite K element can give a score of -inf
        assert (~o.isfinite()).any(-1)[hit].all(), "a row that sees a non-finite key or value stayed finite"
    assert torch.equal(o[~hit], clean_o[~hit]), "a row that does not see the non-finite key changed"
    assert torch.equal(lse.transpose(1, 2)[~hit], clean_lse.transpose(1, 2)[~hit])
    assert o[~hit].isfinite().all()
    ro, _ = _dense_reference(q, k, v, dense, scale)
    err = rel_err(o[~hit], ro[~hit])
    assert err < TOL[torch.bfloat16], f"o of the rows that do not see it: relative error {err:.2e}"


@needs_sm90
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_causal_nonfinite_confined(D, where, value):
    """Dense causal (the module docstring's non-finite paragraph): a NaN / Inf in K or V at key 150 of kv head 0
    (inside a 64-row tile: rows 128 .. 149 share the diagonal tile with it and do not see it) reaches only the
    rows that see it: o and lse of every earlier
    row and of the other kv head's query heads equal the clean run's exactly; the rows that see a NaN are
    non-finite."""
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90

    B, T, Hq, Hkv = 1, 333, 8, 2
    q, k, v = _inputs(B, T, T, Hq, Hkv, D, torch.bfloat16)
    scale = D ** -0.5
    clean_o, clean_lse = attention_fwd_gluon_sm90(q, k, v, True, scale)
    k2, v2 = k.clone(), v.clone()
    (k2 if where == "k" else v2)[:, 150, 0, 7] = value
    o, lse = attention_fwd_gluon_sm90(q, k2, v2, True, scale)
    torch.cuda.synchronize()
    hit = torch.zeros(B, T, Hq, dtype=torch.bool, device=q.device)
    hit[:, 150:, :Hq // Hkv] = True
    assert torch.equal(o[~hit], clean_o[~hit]), "a row that does not see the non-finite key changed"
    assert torch.equal(lse.transpose(1, 2)[~hit], clean_lse.transpose(1, 2)[~hit])
    if value != value:  # a NaN reaches every row that sees it
        assert (~o.isfinite()).any(-1)[hit].all(), "a row that sees a NaN key or value stayed finite"


def test_dflash_mask_checks():
    """The DFlash launcher takes DFlash-form masks only: a causal mask (a diagonal), three segment slots,
    element-mask tiles or groups over 64 positions raise ValueError naming ``mask`` before anything runs."""
    from dflash_kernels.ops.attention import causal_block_mask, dflash_block_mask
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import (attention_fwd_gluon_sm90_dflash,
                                                                        check_gluon_dflash_mask)
    from dflash_kernels.ops.attention.mask import BlockSparseMask

    anchors = torch.tensor([[3, 7, 20]])
    good = dflash_block_mask(anchors, 30, 16, window=5)
    check_gluon_dflash_mask(good)
    q = torch.zeros(1, 48, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 78, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mask: .*diagonal"):
        attention_fwd_gluon_sm90_dflash(q, kv, kv, causal_block_mask(48, 78, q_block=16), 0.125)
    fields = {f: getattr(good, f) for f in ("segments", "seg_count", "tiles", "rev_offsets", "rev_full",
                                            "rev_entries", "q_len", "kv_len", "q_block", "kv_tile", "tile_width")}
    three = BlockSparseMask(**{**fields, "segments": torch.cat([good.segments, good.segments[:, :, :1]], 2)})
    with pytest.raises(ValueError, match="mask: .*at most 2 segments"):
        check_gluon_dflash_mask(three)
    tiled = BlockSparseMask(**{**fields, "tiles": torch.ones(1, 16, 1, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="mask: .*element-mask tiles"):
        check_gluon_dflash_mask(tiled)
    with pytest.raises(ValueError, match="mask: .*q_block <= 64"):
        check_gluon_dflash_mask(dflash_block_mask(anchors, 30, 128))
