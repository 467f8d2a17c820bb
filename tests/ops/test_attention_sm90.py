"""The Hopper forward of block-sparse attention (kernels_sm90.py), through its launcher, against the fp32
reference and the portable forward: o and lse, on the Triton interpreter (tensor descriptors included) or a
GPU of compute capability 9.0 or newer.

The launcher is called directly: the op's dispatch does not choose this kernel. Output buffers are
NaN-filled first (DFLASH_KERNELS_POISON, set by conftest), so an element the kernel does not write fails.
"""

import os

import pytest
import torch
import triton

from dflash_kernels.ops.attention import causal_block_mask, dflash_block_mask, from_flex_block_mask
from dflash_kernels.ops.attention.attention import attention_fwd
from dflash_kernels.ops.attention.kernels_sm90 import attention_fwd_sm90
from dflash_kernels.ops.attention.naive import masked_block_sparse_attention, naive_dense_mask
from tests.helpers import device, rel_err, worst_row_err

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = device()
pytestmark = pytest.mark.skipif(
    not INTERPRET and not (DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9),
    reason="the sm_90 forward needs TRITON_INTERPRET=1 or a GPU of compute capability >= 9.0")

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
ROW_TOL = {torch.float32: 1e-3, torch.bfloat16: 8e-2}


def _inputs(B, Tq, Tk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Tk, Hkv, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Tk, Hkv, D, generator=g).to(DEVICE, dtype)
    return q, k, v


def _launch(launcher, q, k, v, mask, scale):
    return launcher(q, k, v, mask.segments, mask.seg_count, mask.tiles, mask.q_block, mask.tile_width, scale)


def _check(q, k, v, mask, dtype):
    """o and lse against the fp32 reference (relative and worst-row error; rows that see nothing exactly
    0 and -inf) and against the portable forward (same arithmetic: close to rounding)."""
    scale = q.shape[-1] ** -0.5
    o, lse = _launch(attention_fwd_sm90, q, k, v, mask, scale)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert not o.isnan().any() and not lse.isnan().any(), "an output element was not written (NaN)"
    ro, rlse = masked_block_sparse_attention(q.float(), k.float(), v.float(), mask, scale=scale, return_lse=True)
    assert torch.equal(lse.isinf(), rlse.isinf()), "rows seeing no key must have lse -inf, others finite"
    finite = rlse.isfinite()
    assert rel_err(lse[finite], rlse[finite]) < 1e-5
    err = rel_err(o, ro)
    assert err < TOL[dtype], f"o: relative error {err:.2e} > {TOL[dtype]:.0e}"
    zero = (ro == 0).flatten(-1).all(-1)
    assert (o[zero] == 0).all(), "a row that sees no key is not 0"
    row = worst_row_err(o[~zero], ro[~zero])
    assert row < ROW_TOL[dtype], f"o: worst row relative error {row:.2e} > {ROW_TOL[dtype]:.0e}"
    po, plse = _launch(attention_fwd, q, k, v, mask, scale)
    assert rel_err(o, po) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(lse.isinf(), plse.isinf()) and rel_err(lse[finite], plse[finite]) < 1e-6
    return o, lse


def _dflash_mask(B, S, N, window, seed=0, bs=16):
    """Sorted anchors (as a trainer samples them) with the extremes 0 (no context) and S (all of it), and
    one invalid (padding) block."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(0, S + 1, (B, N), generator=g), dim=1).values
    anchors[0, 0], anchors[-1, -1] = 0, S
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[-1, N // 2] = False
    return dflash_block_mask(anchors.to(DEVICE), S, bs, window=window, valid=valid.to(DEVICE))


# (B, S, N, Hq, Hkv): GQA ratios 1 and 4, odd context lengths.
SHAPES = {"gqa1": (2, 77, 3, 2, 2), "gqa4": (1, 101, 4, 8, 2)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 21], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_dflash_mask(shape, D, window, dtype):
    B, S, N, Hq, Hkv = SHAPES[shape]
    mask = _dflash_mask(B, S, N, window)
    _check(*_inputs(B, N * 16, S + N * 16, Hq, Hkv, D, dtype), mask, dtype)


@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1)], ids=["gqa1", "gqa4"])
def test_causal_mask(Hq, Hkv, D):
    """Diagonal tiles under the element mask, odd lengths (the last group partial), Tk > Tq: queries past
    the keys see all of them."""
    mask = causal_block_mask(45, 39, q_block=16, kv_tile=16, device=DEVICE)
    _check(*_inputs(1, 45, 39, Hq, Hkv, D, torch.bfloat16), mask, torch.bfloat16)


def test_flex_mask_with_element_tiles():
    """A sliding causal flex mask: partial blocks carry element tiles (HAS_TILES), every tile masked."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < 20), None, None, 45, 50,
                                   device=DEVICE, BLOCK_SIZE=16)
    mask = from_flex_block_mask(block_mask, kv_tile=16)
    assert mask.tiles.shape[0] > 0
    _check(*_inputs(1, 45, 50, 4, 2, 64, torch.float32), mask, torch.float32)


def _confined(mask, q, k, v, bad_keys, value):
    """A NaN / Inf in keys ``bad_keys`` (in k, then in v): rows that see none of them keep exactly the clean
    o and lse; the others are non-finite exactly where the reference that contains non-finite values is."""
    scale = q.shape[-1] ** -0.5
    co, clse = _launch(attention_fwd_sm90, q, k, v, mask, scale)
    assert co.isfinite().all()
    vis = naive_dense_mask(mask).expand(q.shape[0], -1, -1)
    bad = torch.zeros(vis.shape[2], dtype=torch.bool, device=vis.device)
    bad[list(bad_keys)] = True
    row_bad = (vis & bad).any(-1)  # [B, Tq]
    assert row_bad.any() and (~row_bad).any()
    for where in ("k", "v"):
        k2, v2 = k.clone(), v.clone()
        (k2 if where == "k" else v2)[:, list(bad_keys), 0, 5] = value
        o, lse = _launch(attention_fwd_sm90, q, k2, v2, mask, scale)
        assert torch.equal(o[~row_bad], co[~row_bad]), f"{where}: a row that sees no poisoned key changed"
        assert torch.equal(lse.transpose(1, 2)[~row_bad], clse.transpose(1, 2)[~row_bad])
        if where == "v" or value != value:  # an infinite key may score -inf: a finite row then
            assert (~o.isfinite()).flatten(2).any(-1)[row_bad].all(), f"{where}: a row that sees it stayed finite"
        ro = masked_block_sparse_attention(q.float(), k2.float(), v2.float(), mask, scale=scale)
        assert torch.equal(o.isfinite(), ro.isfinite()), f"{where}: non-finite elements differ from the reference"


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_own_block_key_stays_in_its_block(value):
    """Block 1's own keys hold a NaN / Inf: block 0's masked own-block tile reads them (past its segment's
    end) and must stay exactly clean, as must every other block."""
    S, N = 40, 3
    mask = dflash_block_mask(torch.tensor([[5, 20, 40]], device=DEVICE), S, 16)
    q, k, v = _inputs(1, N * 16, S + N * 16, 4, 1, 64, torch.float32)
    _confined(mask, q, k, v, bad_keys=(S + 16 + 2,), value=value)


def test_nonfinite_context_key_reaches_only_later_anchors():
    """Context key 70 (in the unmasked body of later blocks' loops, in the masked tail of others) holds a
    NaN: blocks whose anchor is at most 70 (and the window-cut block) stay clean."""
    S, N = 150, 4
    mask = dflash_block_mask(torch.tensor([[10, 70, 71, 150]], device=DEVICE), S, 16, window=90)
    q, k, v = _inputs(1, N * 16, S + N * 16, 4, 1, 64, torch.float32)
    _confined(mask, q, k, v, bad_keys=(70,), value=float("nan"))


# Every candidate config, alone (GPU and interpreter): tests/ops/test_every_candidate.py, through its driver.


def test_scratch_allocator_is_installed_in_the_launching_context_only_when_none_is():
    """The in-kernel descriptors need Triton's global-scratch allocator in the launching thread's context:
    installed when none is, a user's own kept. Run in fresh contexts, so the test leaves none behind."""
    import contextvars

    from triton.runtime import _allocation

    from dflash_kernels.ops.attention import kernels_sm90

    def fresh():
        assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
        kernels_sm90._ensure_scratch_allocator()
        return _allocation._allocator.get()

    def users():
        def own(size, alignment, stream):
            raise AssertionError("not called here")
        triton.set_allocator(own)
        kernels_sm90._ensure_scratch_allocator()
        return _allocation._allocator.get() is own

    assert contextvars.Context().run(fresh) is kernels_sm90._scratch
    assert contextvars.Context().run(users)
