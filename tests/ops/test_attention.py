"""Block-sparse attention against the dense fp32 reference, on the Triton interpreter or a GPU."""

import os
import threading

import pytest
import torch
import torch.nn.functional as F

import dflash_kernels.ops.attention.kernels as attention_kernels
from dflash_kernels.ops.attention import (block_sparse_attention, causal_block_mask, dflash_block_mask,
                                          from_flex_block_mask)
from dflash_kernels.ops.attention.naive import naive_block_sparse_attention, naive_dense_mask
from tests.helpers import device, rel_err, worst_row_err, worst_row_err_rms

# Buffers the launchers allocate are NaN-filled first (DFLASH_KERNELS_POISON, set by conftest), so an
# element a kernel skips fails the comparisons below.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = device()
needs_kernels = pytest.mark.skipif(DEVICE.type == "cpu" and not INTERPRET,
                                   reason="kernels need CUDA or TRITON_INTERPRET=1")


def make_qkv(B, Tq, Tk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Tk, Hkv, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Tk, Hkv, D, generator=g).to(DEVICE, dtype)
    do = torch.randn(B, Tq, Hq, D, generator=g).to(DEVICE, dtype)
    return q, k, v, do


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# The worst single row (one head's D-vector of one token; one key's for dk, dv): looser than the
# whole-tensor bound, since a short row's rounding error does not average out.
ROW_TOL = {torch.float32: 1e-3, torch.bfloat16: 8e-2, torch.float16: 2e-2}


def dflash_dense_mask(anchors, S, bs, window=None, valid=None):
    """The DFlash mask ``[B, N * bs, S + N * bs]`` in plain torch from its definition (block i sees
    context keys ``max(0, anchor - window) <= kv < anchor`` and its own bs keys; invalid blocks nothing):
    built from the anchors alone, never from a BlockSparseMask's segments."""
    B, N = anchors.shape
    a = anchors.long()
    blk = torch.arange(N * bs, device=a.device) // bs  # [Tq]: each query's block
    kv = torch.arange(S + N * bs, device=a.device)  # [Tk]
    anchor = a[:, blk][..., None]  # [B, Tq, 1]
    vis = (kv < S) & (kv < anchor)
    if window is not None:
        vis &= kv >= anchor - window
    vis = vis | ((kv >= S) & (torch.div(kv - S, bs, rounding_mode="floor") == blk[:, None]))[None]
    if valid is not None:
        vis &= valid[:, blk][..., None]
    return vis


def dense_reference(q, k, v, vis, scale=None):
    """fp32 SDPA under the boolean mask ``vis [B, Tq, Tk]``; rows that see no key give 0 and lse -inf."""
    Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    scale = D ** -0.5 if scale is None else scale
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(Hq // Hkv, dim=2).transpose(1, 2)
    m = vis[:, None]
    seen = m.any(-1, keepdim=True)
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=m | ~seen, scale=scale)
    o = torch.where(seen, o, 0.0).transpose(1, 2)
    lse = torch.logsumexp((qf @ kf.transpose(-1, -2) * scale).masked_fill(~m, float("-inf")), -1)
    return o, lse


def check_against_reference(q, k, v, do, mask, dtype, memory_budget=1 << 30, dense=None, rms_rows=False):
    """Outputs, lse and all gradients against the fp32 reference on the same (rounded) inputs, by the
    whole-tensor and the worst-row relative error. With ``dense`` (a boolean [B, Tq, Tk] mask built
    independently of ``mask``), the reference is SDPA under it, and the mask must describe it exactly.
    ``rms_rows``: rows' norms floored at the RMS of all rows' (``worst_row_err_rms``), for masks with rows
    whose gradient is near 0 (causal: the first query sees one key, its dq is a rounding residual)."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = block_sparse_attention(q, k, v, mask, return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    if dense is None:
        ro, rlse = naive_block_sparse_attention(qf, kf, vf, mask, return_lse=True, memory_budget=memory_budget)
    else:
        assert torch.equal(naive_dense_mask(mask).expand_as(dense), dense), "the mask differs from its definition"
        ro, rlse = dense_reference(qf, kf, vf, dense)
    rdq, rdk, rdv = torch.autograd.grad(ro, (qf, kf, vf), do.float())
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not x.isnan().any(), f"{name} has NaN"
    assert torch.equal(lse.isinf(), rlse.isinf())
    finite = rlse.isfinite()
    assert rel_err(lse[finite], rlse[finite]) < 1e-5
    tol, row_tol = TOL[dtype], ROW_TOL[dtype]
    for name, x, ref in (("o", o, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        err = rel_err(x, ref)
        assert err < tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
        # Rows the reference makes exactly 0 (no key seen; keys no row sees) must be 0.
        zero = (ref == 0).flatten(-1).all(-1) if name != "dq" else None
        if zero is not None:
            assert (x[zero] == 0).all(), f"{name}: a row that must be 0 is not"
        row_err = worst_row_err_rms if rms_rows else worst_row_err
        row = row_err(x[~zero] if zero is not None else x, ref[~zero] if zero is not None else ref)
        assert row < row_tol, f"{name}: worst row relative error {row:.2e} > {row_tol:.0e}"
    return o, lse, dq, dk, dv


def dflash_rule(anchors, S, block_size, window, valid, b, t, kv):
    """The DFlash mask for one (batch, query, key), written out from the definition."""
    i = t // block_size
    if valid is not None and not bool(valid[b, i]):
        return False
    a = int(anchors[b, i])
    if kv < S:
        return kv < a and (window is None or kv >= a - window)
    return (kv - S) // block_size == i


@pytest.mark.parametrize("window", [None, 3, 9], ids=lambda w: f"window{w}")
def test_dflash_mask_matches_rule(window):
    S, N, bs = 23, 6, 4
    anchors = torch.tensor([[0, 22, 5, 6, 22, 1], [3, 3, 10, 0, 21, 9]])
    valid = torch.tensor([[True] * 6, [True, False, True, True, True, False]])
    mask = dflash_block_mask(anchors, S, bs, window=window, valid=valid, kv_tile=16)
    dense = naive_dense_mask(mask)
    assert torch.equal(dense, dflash_dense_mask(anchors, S, bs, window=window, valid=valid))
    assert dense.shape == (2, N * bs, S + N * bs)
    for b in range(2):
        for t in range(N * bs):
            for kv in range(S + N * bs):
                assert bool(dense[b, t, kv]) == dflash_rule(anchors, S, bs, window, valid, b, t, kv), (b, t, kv)
    assert int(mask.visible_pairs().sum()) == int(dense.sum())


@needs_kernels
def test_anchor_at_context_end_sees_whole_context():
    # Decoding: the block follows the newest context token (anchor == S) and sees all S keys.
    S, N, bs = 21, 3, 4
    anchors = torch.tensor([[S, 7, S]])
    mask = dflash_block_mask(anchors.to(DEVICE), S, bs, kv_tile=16)
    dense = naive_dense_mask(mask)[0]
    assert dense[:bs, :S].all() and dense[2 * bs:, :S].all() and not dense[bs:2 * bs, 7:S].any()
    q, k, v, do = make_qkv(1, N * bs, S + N * bs, 2, 1, 64, torch.float32, seed=3)
    check_against_reference(q, k, v, do, mask, torch.float32)


def test_reverse_index_lists_every_visible_tile():
    S, N, bs, kv_tile = 37, 5, 4, 16
    anchors = torch.tensor([[0, 36, 17, 16, 15]])
    mask = dflash_block_mask(anchors, S, bs, window=20, kv_tile=kv_tile)
    dense = naive_dense_mask(mask)[0]
    off, n_full, ent = mask.rev_offsets.tolist(), mask.rev_full.tolist(), mask.rev_entries.tolist()
    for n in range(len(off) - 1):
        listed = ent[off[n]:off[n + 1]]
        assert len({tuple(e) for e in listed}) == len(listed), n  # a (group, segment) pair once
        groups = sorted({g for g, _ in listed})
        tile = slice(n * kv_tile, (n + 1) * kv_tile)
        want = [g for g in range(N) if dense[g * bs:(g + 1) * bs, tile].any()]
        assert groups == want, n
        full, part = listed[:n_full[n]], listed[n_full[n]:]
        for g, _ in full:  # listed as unmasked: the group sees the whole key tile
            assert dense[g * bs:(g + 1) * bs, tile].all() and (n + 1) * kv_tile <= dense.shape[1], (n, g)
        for part_ in (full, part):  # fixed summation order
            assert [g for g, _ in part_] == sorted(g for g, _ in part_), n
    assert sum(n_full) > 0


@needs_kernels
def test_triton_index_builder_equals_the_torch_reference():
    """The reverse index built by the Triton kernels (used on the GPU and under the interpreter) is
    the plain-torch build's, entry for entry: same offsets, same unmasked counts, same order."""
    from torch.nn.attention.flex_attention import create_block_mask
    from dflash_kernels.ops.attention import mask as mask_module

    g = torch.Generator().manual_seed(5)
    masks = []
    for B, S, N, bs, window in [(2, 45, 3, 16, None), (2, 100, 7, 16, 9), (1, 37, 5, 4, 3)]:
        anchors = torch.randint(0, S + 1, (B, N), generator=g)
        anchors[0, 0], anchors[-1, -1] = 0, S
        valid = torch.rand(B, N, generator=g) > 0.2
        max_len = max(bs, S if window is None else min(window, S))
        masks.append((dflash_block_mask(anchors.to(DEVICE), S, bs, window=window, valid=valid.to(DEVICE),
                                        kv_tile=16), max_len))
    causal = causal_block_mask(77, 90, q_block=16, kv_tile=16, device=DEVICE)
    masks.append((causal, 90))
    flex = from_flex_block_mask(create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < 20), None, None,
                                                  45, 50, device=DEVICE, BLOCK_SIZE=16), kv_tile=16)
    masks.append((flex, flex.tile_width))
    for m, max_len in masks:
        args = (m.segments, m.seg_count, m.q_block, m.q_len, m.kv_len, m.kv_tile, max_len)
        off_ref, full_ref, ent_ref = mask_module._reverse_index(*args)
        off, full, ent = mask_module._reverse_index_triton(*args)
        assert torch.equal(off, off_ref) and torch.equal(full, full_ref)
        n = int(off_ref[-1])
        assert n > 0 and torch.equal(ent[:n], ent_ref[:n])
        assert ent.shape == ent_ref.shape  # the same upper bound: rows past offsets[-1] are never read


DFLASH_CASES = [
    # B, S, N, bs, Hq, Hkv, window, dtype
    pytest.param(2, 37, 5, 4, 4, 1, None, torch.float32, id="fp32-G4-S37"),
    pytest.param(2, 37, 5, 4, 4, 1, None, torch.bfloat16, id="bf16-G4-S37"),
    pytest.param(1, 45, 3, 16, 2, 2, None, torch.bfloat16, id="bf16-G1-bs16-S45"),
    pytest.param(2, 50, 4, 8, 4, 1, 13, torch.float32, id="fp32-G4-window13"),
    pytest.param(1, 29, 4, 4, 8, 2, 5, torch.float16, id="fp16-G4-Hkv2-window5"),
]


@needs_kernels
@pytest.mark.parametrize("B,S,N,bs,Hq,Hkv,window,dtype", DFLASH_CASES)
def test_dflash_attention(B, S, N, bs, Hq, Hkv, window, dtype):
    g = torch.Generator().manual_seed(S)
    anchors = torch.randint(0, S, (B, N), generator=g)
    anchors[0, 0], anchors[0, -1] = 0, S - 1  # the extremes, and adjacent blocks below
    if N > 2:
        anchors[0, 1] = anchors[0, 2] - 1 if anchors[0, 2] > 0 else 1
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[-1, 1] = False  # a padding block: sees nothing
    mask = dflash_block_mask(anchors.to(DEVICE), S, bs, window=window, valid=valid.to(DEVICE), kv_tile=16)
    q, k, v, do = make_qkv(B, N * bs, S + N * bs, Hq, Hkv, 64, dtype, seed=S)
    dense = dflash_dense_mask(anchors.to(DEVICE), S, bs, window=window, valid=valid.to(DEVICE))
    o, lse, dq, dk, dv = check_against_reference(q, k, v, do, mask, dtype, dense=dense)
    pad = slice(bs, 2 * bs)
    assert (o[-1, pad] == 0).all() and (dq[-1, pad] == 0).all()
    assert torch.isneginf(lse[-1, :, pad]).all()


@needs_kernels
@pytest.mark.parametrize("q_block,Hq,Hkv", [(16, 2, 1), (32, 1, 1)], ids=["qblock16-G2", "qblock32-G1"])
def test_causal_attention_matches_sdpa_causal(q_block, Hq, Hkv):
    Tq = 45
    mask = causal_block_mask(Tq, q_block=q_block, kv_tile=16, device=DEVICE)
    q, k, v, do = make_qkv(1, Tq, Tq, Hq, Hkv, 64, torch.float32, seed=1)
    o = block_sparse_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(Hq // Hkv, 2).transpose(1, 2),
                                         v.repeat_interleave(Hq // Hkv, 2).transpose(1, 2), is_causal=True)
    assert rel_err(o, ref.transpose(1, 2)) < 1e-5
    check_against_reference(q, k, v, do, mask, torch.float32)


@pytest.mark.parametrize("B,S,N,bs,Hq,Hkv,window,dtype", DFLASH_CASES)
def test_reference_backend_matches_the_dense_reference(B, S, N, bs, Hq, Hkv, window, dtype):
    """The ``reference`` backend (its own backward, written so masked keys never multiply) gives the dense
    autograd reference's outputs, lse and gradients, padding blocks included."""
    from dflash_kernels import set_backend
    g = torch.Generator().manual_seed(S)
    anchors = torch.randint(0, S, (B, N), generator=g)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[-1, 1] = False
    mask = dflash_block_mask(anchors.to(DEVICE), S, bs, window=window, valid=valid.to(DEVICE), kv_tile=16)
    q, k, v, do = make_qkv(B, N * bs, S + N * bs, Hq, Hkv, 64, torch.float32, seed=S)
    set_backend("attention", "reference")
    try:
        check_against_reference(q, k, v, do, mask, torch.float32)
    finally:
        set_backend("attention", "auto")


@needs_kernels
def test_from_flex_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 20)

    Tq, Tk = 45, 50
    block_mask = create_block_mask(sliding_causal, None, None, Tq, Tk, device=DEVICE, BLOCK_SIZE=16)
    mask = from_flex_block_mask(block_mask, kv_tile=16)
    t = torch.arange(Tq, device=DEVICE)[:, None]
    kv = torch.arange(Tk, device=DEVICE)[None, :]
    assert torch.equal(naive_dense_mask(mask)[0], sliding_causal(0, 0, t, kv))
    q, k, v, do = make_qkv(2, Tq, Tk, 2, 1, 64, torch.float32, seed=2)
    check_against_reference(q, k, v, do, mask, torch.float32)


@pytest.mark.skipif(not INTERPRET, reason="on the GPU the tuner picks the configs")
def test_one_group_per_program(monkeypatch):
    """The tests above run the stacked configs (two query groups / two index entries per step); here
    the plain ones, on a window mask with a padding block."""
    from dflash_kernels.runtime import Config
    kernels = (attention_kernels.attention_fwd_kernel, attention_kernels.attention_bwd_dq_kernel,
               attention_kernels.attention_bwd_dkdv_kernel)
    for kern, cfg in zip(kernels, (Config(BN=16, GPB=1), Config(BN=16, GPB=1), Config(EPI=1, SPLIT=1, QM=0))):
        monkeypatch.setattr(kern, "interpret_config", cfg)
        kern.reset()
    try:
        anchors = torch.tensor([[0, 30, 31, 12, 20]])
        valid = torch.tensor([[True, True, True, False, True]])
        mask = dflash_block_mask(anchors, 33, 4, window=17, valid=valid, kv_tile=16)
        q, k, v, do = make_qkv(1, 20, 53, 4, 1, 64, torch.float32, seed=4)
        check_against_reference(q, k, v, do, mask, torch.float32)
    finally:
        for kern in kernels:
            kern.reset()


@pytest.mark.skipif(not INTERPRET, reason="on the GPU the tuner picks the configs")
@pytest.mark.parametrize("qm", [0, 1], ids=["keys_m", "rows_m"])
@pytest.mark.parametrize("epi", [1, 2])
def test_dkdv_on_half_key_tiles(monkeypatch, epi, qm):
    """SPLIT=2: each dk/dv program covers half of an index tile and walks that tile's entries (a
    partial last tile and a half past the end of the keys included); with the keys (QM=0) or the
    row tile (QM=1, transposed accumulators) on the matmuls' M side."""
    from dflash_kernels.runtime import Config
    kern = attention_kernels.attention_bwd_dkdv_kernel
    monkeypatch.setattr(kern, "interpret_config", Config(EPI=epi, SPLIT=2, QM=qm))
    kern.reset()
    try:
        anchors = torch.tensor([[0, 30, 31, 12, 20], [33, 7, 16, 17, 2]])
        valid = torch.tensor([[True, True, True, False, True], [True] * 5])
        for window in (None, 17):
            mask = dflash_block_mask(anchors, 33, 4, window=window, valid=valid, kv_tile=32)
            q, k, v, do = make_qkv(2, 20, 53, 4, 1, 64, torch.float32, seed=6)
            check_against_reference(q, k, v, do, mask, torch.float32)
    finally:
        kern.reset()


@needs_kernels
def test_backward_is_deterministic():
    anchors = torch.tensor([[5, 30, 31, 2]], device=DEVICE)
    mask = dflash_block_mask(anchors, 33, 4, kv_tile=16)
    q, k, v, do = make_qkv(1, 16, 49, 4, 1, 64, torch.bfloat16, seed=3)
    grads = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = block_sparse_attention(qq, kk, vv, mask)
        grads.append(torch.autograd.grad(o, (qq, kk, vv), do))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_bad_inputs():
    anchors = torch.tensor([[0, 5]])
    with pytest.raises(TypeError, match="anchors"):
        dflash_block_mask(anchors.float(), 8)
    with pytest.raises(ValueError, match="anchors"):
        dflash_block_mask(anchors[0], 8)
    with pytest.raises(ValueError, match=r"anchors\[0, 1\] = 9"):
        dflash_block_mask(torch.tensor([[0, 9]]), 8)
    with pytest.raises(ValueError, match="anchors"):
        dflash_block_mask(torch.tensor([[-1, 2]]), 8)
    dflash_block_mask(torch.tensor([[-1, 2]]), 8, valid=torch.tensor([[False, True]]))  # ignored when invalid
    with pytest.raises(ValueError, match="valid"):
        dflash_block_mask(anchors, 8, valid=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="valid"):
        dflash_block_mask(anchors, 8, valid=torch.ones(1, 2))
    with pytest.raises(ValueError, match="window"):
        dflash_block_mask(anchors, 8, window=0)
    with pytest.raises(TypeError, match="context_len"):
        dflash_block_mask(anchors, 8.0)

    mask = dflash_block_mask(anchors, 8, 4)
    q, k, v = torch.zeros(1, 8, 4, 64), torch.zeros(1, 16, 2, 64), torch.zeros(1, 16, 2, 64)
    with pytest.raises(ValueError, match="head dim"):
        block_sparse_attention(q[..., :32], k[..., :32], v[..., :32], mask)
    with pytest.raises(ValueError, match="Hkv"):
        block_sparse_attention(q, k[:, :, :1].expand(1, 16, 3, 64), v[:, :, :1].expand(1, 16, 3, 64), mask)
    with pytest.raises(ValueError, match="mask"):
        block_sparse_attention(q[:, :4], k, v, mask)
    with pytest.raises(TypeError, match="mask"):
        block_sparse_attention(q, k, v, torch.ones(8, 16, dtype=torch.bool))
    with pytest.raises(TypeError, match="k, v"):
        block_sparse_attention(q, k.half(), v, mask)
    with pytest.raises(ValueError, match="memory_budget"):
        naive_block_sparse_attention(q, k, v, mask, memory_budget=1000)


@pytest.mark.parametrize("case", [
    dict(B=1, S=3072, N=512, Hq=8, Hkv=2, window=None),
    dict(B=1, S=4096, N=512, Hq=8, Hkv=2, window=2048),
], ids=["S3072", "S4096-window2048"])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.gpu
def test_dflash_attention_gpu_sizes(case, dtype):
    B, S, N, Hq, Hkv = case["B"], case["S"], case["N"], case["Hq"], case["Hkv"]
    g = torch.Generator().manual_seed(0)
    anchors = torch.randint(0, S, (B, N), generator=g)
    anchors[0, 0], anchors[0, 1], anchors[0, 2], anchors[0, -1] = 0, 100, 101, S - 1
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, -2] = False
    mask = dflash_block_mask(anchors.cuda(), S, 16, window=case["window"], valid=valid.cuda())
    dense = dflash_dense_mask(anchors.cuda(), S, 16, window=case["window"], valid=valid.cuda())
    q, k, v, do = make_qkv(B, N * 16, S + N * 16, Hq, Hkv, 128, dtype)
    check_against_reference(q, k, v, do, mask, dtype, dense=dense)


@pytest.mark.gpu
def test_threads_with_checkpoint_gpu():
    """Three threads, fresh shapes, fwd+bwd under non-reentrant checkpoint: same results as one thread."""
    from torch.utils.checkpoint import checkpoint

    def run(S, N, seed):
        g = torch.Generator().manual_seed(seed)
        anchors = torch.randint(0, S, (2, N), generator=g).cuda()
        mask = dflash_block_mask(anchors, S, 16)
        q, k, v, do = make_qkv(2, N * 16, S + N * 16, 8, 2, 128, torch.bfloat16, seed=seed)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o = checkpoint(block_sparse_attention, q, k, v, mask, use_reentrant=False)
        o.backward(do)
        torch.cuda.synchronize()
        return [x.clone() for x in (o, q.grad, k.grad, v.grad)]

    shapes = [(1000 + 37 * i, 40 + i, i) for i in range(3)]
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = run(*shapes[i])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for i in range(3):
        for a, b in zip(results[i], run(*shapes[i])):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------- the Hopper forwards' dispatch
def test_forward_choice_by_mask_form_dtype_and_gpu():
    """``choose_forward``: the Hopper forwards for the masks, dtypes, head dims and GPUs they take, the portable
    one for everything else (the rule, checked on the CPU; the GPU tests below check what runs)."""
    import dataclasses

    from dflash_kernels.ops.attention.attention import choose_forward

    anchors = torch.tensor([[3, 9, 20]])
    dflash = dflash_block_mask(anchors, 24, 16)
    causal = causal_block_mask(40, q_block=64)
    bf16 = torch.bfloat16
    assert choose_forward(9, bf16, 128, 4, dflash) == "gluon_sm90_dflash"
    assert choose_forward(9, torch.float16, 64, 8, dflash) == "gluon_sm90_dflash"
    assert choose_forward(9, bf16, 128, 4, causal) == "gluon_sm90_causal"
    assert choose_forward(9, bf16, 128, 1, causal) == "gluon_sm90_causal"
    assert choose_forward(9, torch.float16, 64, 1, causal) == "gluon_sm90_causal"
    portable = [
        (8, bf16, 128, 4, dflash),  # not Hopper
        (10, bf16, 128, 4, dflash),
        (None, bf16, 128, 4, dflash),  # not a CUDA input under backend triton
        (9, torch.float32, 128, 4, dflash),
        (9, bf16, 256, 4, dflash),
        (9, bf16, 128, 2, dflash),  # 16 x 2 rows: half a warpgroup
        (9, bf16, 128, 4, dflash_block_mask(anchors, 24, 8)),  # 8-token blocks: 32 rows
        (9, bf16, 128, 4, dataclasses.replace(dflash, form="general")),
        (9, bf16, 256, 4, causal),
    ]
    for args in portable:
        assert choose_forward(*args) == "portable", args[:4]
    t, kv = torch.arange(40)[:, None], torch.arange(50)[None, :]
    flex = from_flex_block_mask(_flex_block_mask(lambda b, h, q, k: k <= q, 40, 50))
    assert flex.form == "general" and choose_forward(9, bf16, 128, 4, flex) == "portable"
    assert dflash.to("cpu").form == "dflash" and torch.equal(naive_dense_mask(flex)[0], kv <= t)


def _flex_block_mask(mask_mod, Tq, Tk):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, None, None, Tq, Tk, device="cpu", BLOCK_SIZE=16)


def _hopper():
    return DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forwards run on sm_90 GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("form", ["dflash", "dflash-window-batch1mask", "causal"])
def test_hopper_forward_runs_and_matches_reference(form, D, dtype):
    """On an sm_90 GPU backend ``triton`` runs the Gluon forward for DFlash and causal masks, and each one's Gluon
    backward sibling (their kernels are launched: they show in the kernel cache), with outputs,
    lse and every gradient against the fp32 reference, and o against backend ``portable`` on the same inputs."""
    from dflash_kernels import set_backend
    from dflash_kernels.ops.attention import kernels_gluon_sm90, kernels_gluon_sm90_dflash
    from dflash_kernels.ops.attention.attention import forward_path
    from dflash_kernels.ops.attention.kernels_gluon_sm90_causal_bwd import attention_bwd_gluon_causal_dkdv_kernel
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import attention_bwd_gluon_dkdv_kernel

    g = torch.Generator().manual_seed(D)
    if form == "causal":
        B, Tq, Tk, Hq, Hkv = 2, 333, 401, 6, 2
        mask, dense = causal_block_mask(Tq, Tk, q_block=64, device=DEVICE), None
        kernel = kernels_gluon_sm90.attention_fwd_gluon_kernel
    else:
        B, S, N, Hq, Hkv = 2, 555, 37, 8, 2
        window = 200 if "window" in form else None
        MB = 1 if "batch1" in form else B
        anchors = torch.sort(torch.randint(0, S + 1, (MB, N), generator=g), dim=1).values
        anchors[0, 0], anchors[-1, -1] = 0, S
        valid = torch.ones(MB, N, dtype=torch.bool)
        valid[-1, 3] = False
        anchors, valid = anchors.to(DEVICE), valid.to(DEVICE)
        mask = dflash_block_mask(anchors, S, 16, window=window, valid=valid)
        dense = dflash_dense_mask(anchors, S, 16, window=window, valid=valid).expand(B, -1, -1)
        Tq, Tk = N * 16, S + N * 16
        kernel = kernels_gluon_sm90_dflash.attention_fwd_gluon_dflash_kernel
    q, k, v, do = make_qkv(B, Tq, Tk, Hq, Hkv, D, dtype, seed=D)
    causal = form == "causal"
    bwd_kernel = attention_bwd_gluon_causal_dkdv_kernel if causal else attention_bwd_gluon_dkdv_kernel
    kernel.reset()
    bwd_kernel.reset()
    o, lse, dq, dk, dv = check_against_reference(q, k, v, do, mask, dtype, dense=dense, rms_rows=causal)
    gluon_fwd = forward_path(q, k, v, mask) != "portable"
    assert gluon_fwd, forward_path(q, k, v, mask)
    assert bool(kernel.cache_info()) == gluon_fwd, "the Gluon forward ran where it should not, or did not run"
    assert bwd_kernel.cache_info(), "the Gluon backward did not run after the Gluon forward"
    set_backend("attention", "portable")
    try:
        kernel.reset()
        po, plse = block_sparse_attention(q, k, v, mask, return_lse=True)
        assert not kernel.cache_info(), "backend 'portable' ran the Gluon forward"
    finally:
        set_backend("attention", "auto")
    assert rel_err(o, po) < TOL[dtype] and torch.equal(lse.isinf(), plse.isinf())


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forwards run on sm_90 GPUs")
@pytest.mark.parametrize("D", [128, 64])
def test_op_runs_the_gluon_causal_backward(D):
    """After the Gluon causal forward the op runs its sibling, the Gluon causal backward
    (kernels_gluon_sm90_causal_bwd.py): its two kernels' caches fill, the portable dk / dv kernel's stays empty;
    under backend ``portable`` the reverse."""
    from dflash_kernels import set_backend
    from dflash_kernels.ops.attention.attention import forward_path
    from dflash_kernels.ops.attention.kernels import attention_bwd_dkdv_kernel
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_kernel
    from dflash_kernels.ops.attention.kernels_gluon_sm90_causal_bwd import (attention_bwd_gluon_causal_dkdv_kernel,
                                                                            attention_bwd_gluon_causal_dq_kernel)

    mask = causal_block_mask(333, 401, q_block=64, device=DEVICE)
    q, k, v, do = make_qkv(2, 333, 401, 8, 2, D, torch.bfloat16, seed=D)
    assert forward_path(q, k, v, mask) == "gluon_sm90_causal"
    gluon = (attention_bwd_gluon_causal_dq_kernel, attention_bwd_gluon_causal_dkdv_kernel)
    for backend in ("auto", "portable"):
        for kernel in (attention_fwd_gluon_kernel, attention_bwd_dkdv_kernel, *gluon):
            kernel.reset()
        set_backend("attention", backend)
        try:
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            torch.autograd.grad(block_sparse_attention(qg, kg, vg, mask), (qg, kg, vg), do)
            torch.cuda.synchronize()
        finally:
            set_backend("attention", "auto")
        hopper = backend == "auto"
        assert bool(attention_fwd_gluon_kernel.cache_info()) == hopper, f"backend {backend}: the Gluon forward"
        assert all(bool(kernel.cache_info()) == hopper for kernel in gluon), f"backend {backend}: the Gluon backward"
        assert bool(attention_bwd_dkdv_kernel.cache_info()) != hopper, f"backend {backend}: the portable backward"


def test_gluon_backward_takes_every_forward_case_with_aligned_tensors():
    """After the Gluon DFlash forward the Gluon backward runs for every dtype and head dim that forward takes
    (bf16 / fp16, D 64 / 128); only a tensor at a base address off the 16-byte grid TMA needs (here the upstream
    gradient, a view one element into its storage) sends the backward to the portable kernels."""
    import dflash_kernels.ops.attention.attention as att

    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            q, k, v, do = (torch.zeros(2, 32, 4, D, dtype=dtype) for _ in range(4))
            o = torch.zeros_like(q)
            assert att._gluon_backward(q, k, v, o, do)
            shifted = torch.zeros(do.numel() + 1, dtype=dtype)[1:].view_as(do)
            assert shifted.data_ptr() % 16 != 0
            assert not att._gluon_backward(q, k, v, o, shifted)


@needs_kernels
def test_backward_after_the_gluon_forward_hands_the_mask_to_its_backward(monkeypatch):
    """The custom op's backward under path ``gluon_sm90_dflash`` gives the Gluon backward the mask it was
    called with (rebuilt from the saved tensors: fields, sizes, form) and returns its gradients; with the
    Gluon launcher replaced by the portable backward on that mask, the gradients equal the portable path's.
    (The Gluon kernels themselves run only on an sm_90 GPU: the tests above.)"""
    import dflash_kernels.ops.attention.attention as att

    anchors = torch.tensor([[5, 19, 30, 2]]).to(DEVICE)
    mask = dflash_block_mask(anchors, 33, 16, window=20, kv_tile=16)
    q, k, v, do = make_qkv(1, 64, 33 + 64, 4, 1, 64, torch.float32, seed=3)
    o, lse = block_sparse_attention(q, k, v, mask, return_lse=True)
    fields = (mask.segments, mask.seg_count, mask.tiles, mask.rev_offsets, mask.rev_full, mask.rev_entries)
    seen = []

    def fake_gluon_backward(do_, q_, k_, v_, o_, lse_, m, scale, check_mask):
        seen.append(m)
        assert m.form == "dflash" and not check_mask and (m.q_len, m.kv_len, m.q_block, m.kv_tile) == (64, 97, 16, 16)
        assert all(a is b for a, b in zip(fields, (m.segments, m.seg_count, m.tiles, m.rev_offsets, m.rev_full,
                                                   m.rev_entries)))
        return att.attention_bwd(do_, q_, k_, v_, o_, lse_, *fields, m.q_block, m.kv_tile, m.tile_width, scale)

    monkeypatch.setattr(att, "_gluon_backward", lambda *a: True)
    monkeypatch.setattr(att, "attention_bwd_gluon_sm90_dflash", fake_gluon_backward)
    args = (do, q, k, v, o, lse, *fields, 16, 16, 1, 0.125)
    got = att._bwd_op(*args, att.GLUON_DFLASH)
    assert len(seen) == 1
    want = att._bwd_op(*args, att.PORTABLE)
    assert len(seen) == 1 and all(torch.equal(a, b) for a, b in zip(got, want))
