"""The warp-specialized Gluon attention forward (kernels_gluon_sm90.py) against a plain fp32 PyTorch reference:
o and lse, dense and causal, GQA ratios 1 and 4, D = 64 and 128, lengths that are not multiples of the tiles.

Gluon kernels run only on the GPU they are written for (no interpreter path): these tests need a CUDA device
of compute capability 9.x and skip elsewhere, the interpreter included. The launcher is called directly; the
op's dispatch does not choose this kernel. Output buffers are NaN-filled before the launch
(DFLASH_KERNELS_POISON), so an element the kernel does not write fails.
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
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

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
    torch.cuda.synchronize()
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32 and lse.shape == (B, H, Lq)
    assert not o.isnan().any() and not lse.isnan().any(), "an output element was not written (NaN)"
    ro, rlse = reference(q, k, v, causal, scale)
    assert torch.equal(lse.isinf(), rlse.isinf())
    finite = rlse.isfinite()
    err = rel_err(lse[finite], rlse[finite])
    assert err < 1e-5, f"lse: relative error {err:.2e} > 1e-5"
    err = rel_err(o, ro)
    assert err < TOL[dtype], f"o: relative error {err:.2e} > {TOL[dtype]:.0e}"
    row = worst_row_err(o, ro)
    assert row < ROW_TOL[dtype], f"o: worst row relative error {row:.2e} > {ROW_TOL[dtype]:.0e}"


def test_no_keys():
    """Lk = 0: every row sees nothing, o is 0 and lse -inf (the portable forward's convention)."""
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90

    q, k, v = _inputs(1, 70, 0, 2, 2, 64, torch.bfloat16)
    o, lse = attention_fwd_gluon_sm90(q, k, v, True, 0.125)
    assert (o == 0).all() and (lse == float("-inf")).all()
