"""The state scan's K-split form (``_gdn_fwd_states_kernel`` with KSPLIT: the state as two K halves, U's rows
decayed instead of k's) forced one candidate at a time, through the public op, against the fp32 recurrence
of ``naive.py``.

The states kernel (``gdn_fwd_state``) runs in the split forward (``DFLASH_KERNELS_GDN_FWD_SPLIT=1``, or the
library's pick for few sequences and heads on a GPU: the
output kernel reads the h and v_new it stored), in a split training forward that keeps them for the
backward (``DFLASH_KERNELS_GDN_SAVE_STATES=1``), and in the backward's recompute of the states (every
backward whose forward did not keep them). The KSPLIT configs (``GDN_FWD_STATE_KSPLIT_CONFIGS``) are
among the bf16 candidates. Each case forces one of them (under
the interpreter through ``interpret_config``, on a GPU through ``configs``), or a KSPLIT config for fp32
inputs (not a candidate of the fp32 list: the form must stay general), and checks the output, final state
and every gradient by relative error (whole tensor and worst row) at odd sizes: T not a multiple of the
chunk, V below the V block, K not a power of two (masked K rows in the halves of a padded block), K = 16
(the fallback to the one-tile scan), Hk != Hv, an initial state, V-first states, packed sequences with a
NaN. The suite NaN-poisons every output buffer (tests/conftest.py), so an element the kernel fails to
write fails.

    TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_gdn_scan_variants.py
"""

import pytest
import torch

from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
from dflash_kernels.ops.gated_delta_rule import gated_delta_rule as gdn_module
from dflash_kernels.ops.gated_delta_rule import kernels_fwd
from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from dflash_kernels.runtime import Config
from tests.helpers import device, on_reference_device, rel_err, slow_param, worst_row_err
from tests.ops.test_gated_delta_rule import _require_kernels  # noqa: F401 - the suite's autouse check
from tests.ops.test_gated_delta_rule import _compare, _inputs, _tol

STATES = kernels_fwd.gdn_fwd_scan_states_kernel
BF16_KSPLIT = list(enumerate(kernels_fwd.GDN_FWD_STATE_KSPLIT_CONFIGS))
FP32_KSPLIT = Config(BV=32, num_warps=4, num_stages=1, KSPLIT=True)
CANDIDATES = ([pytest.param(STATES.default, c, id=f"bf16[{i}]-BV{c.meta['BV']}") for i, c in BF16_KSPLIT]
              + [pytest.param(STATES.fp32, FP32_KSPLIT, id="fp32")])


def _dtype(kernel):
    return torch.float32 if kernel is STATES.fp32 else torch.bfloat16


def test_ksplit_candidates():
    """The bf16 list keeps its one-tile configs, the first (what an untuned run launches) first, and holds
    every KSPLIT config; the fp32 list holds none (4-warp single-stage configs only)."""
    configs = [repr(c) for c in STATES.default.configs]
    before = [Config(BV=64, num_warps=4), Config(BV=32, num_warps=4), Config(BV=64, num_warps=8),
              Config(BV=16, num_warps=4), Config(BV=32, num_warps=8), Config(BV=16, num_warps=8)]
    assert configs[0] == repr(before[0]) and all(repr(c) in configs for c in before)
    assert all(repr(c) in configs for c in kernels_fwd.GDN_FWD_STATE_KSPLIT_CONFIGS) and len(BF16_KSPLIT) >= 1
    assert not any(c.meta.get("KSPLIT") for c in STATES.fp32.configs)


# (id, B, T, Hk, Hv, K, V, l2norm, initial state, final state)
SHAPES = [
    ("T130-gqa-K64-V32-h0", 1, 130, 1, 2, 64, 32, True, True, True),
    ("B2-T70-K48-V16", 2, 70, 2, 2, 48, 16, True, False, True),
    ("T65-K16-V16-h0", 1, 65, 1, 2, 16, 16, False, True, True),
]
MODES = ["split", "split-save", "recompute"]


def _in_default_run(candidate, shape, mode):
    """The default run takes each candidate in one mode (the modes in turn) on one of the first two shapes
    (in turn), and the first candidate at K = 16 in every mode; -m slow the other combinations."""
    return (shape == candidate % 2 and mode == candidate % 3) or (candidate == 0 and shape == 2)


# bf16 candidates: every shape and mode; the fp32 config (slow under the interpreter): the first shape.
REFERENCE_CASES = [slow_param(*c.values, *s[1:], m, id=f"{c.id}-{s[0]}-{m}", slow=not _in_default_run(i, j, k))
                   for i, c in enumerate(CANDIDATES)
                   for j, s in enumerate(SHAPES if c.values[0] is STATES.default else SHAPES[:1])
                   for k, m in enumerate(MODES)]


@pytest.mark.parametrize("kernel,config,B,T,Hk,Hv,K,V,l2,h0,final,mode", REFERENCE_CASES)
def test_ksplit_matches_reference(monkeypatch, force, kernel, config, mode, B, T, Hk, Hv, K, V, l2, h0, final):
    """Output, final state and gradients with the forced config, against the reference: ``split`` (the state
    scan and the output kernel; the backward recomputes the states with the same config), ``split-save``
    (the backward reads the forward's h and v_new), ``recompute`` (the fused forward; only the backward's
    recompute runs the states kernel)."""
    dtype = _dtype(kernel)
    monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "1" if mode.startswith("split") else "0")
    if mode == "split-save":
        monkeypatch.setenv("DFLASH_KERNELS_GDN_SAVE_STATES", "1")

        def no_recompute(*args, **kwargs):
            raise AssertionError("the backward recomputed the states the forward was to keep")
        monkeypatch.setattr(gdn_module, "_wy_and_states", no_recompute)
    ran = force(kernel, config)
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, normalized=not l2)
    _compare(tensors, dict(use_qk_l2norm_in_kernel=l2), final, dtype)
    assert ran() and all(c == config.as_dict() for c in ran()), ran()


@pytest.mark.parametrize("kernel,config", CANDIDATES)
def test_ksplit_v_first_varlen_nonfinite(monkeypatch, force, kernel, config):
    """The split forward with V-first initial / final states on packed sequences (shorter than a chunk, empty,
    off the boundary), a NaN in one sequence's v: outputs NaN from the bad token on in its sequence and
    value head only, the final states of the other sequences and heads finite and right, and the whole
    against the fused forward's."""
    dtype = _dtype(kernel)
    bounds = [0, 30, 94, 94, 160]
    cu = torch.tensor(bounds, dtype=torch.long, device=device())
    N, Hv, K, V = len(bounds) - 1, 2, 32, 16
    q, k, v, g, beta, _ = _inputs(1, bounds[-1], 1, Hv, K, V, dtype)
    h0 = torch.randn(N, Hv, V, K, device=device())
    v = v.clone()
    v[0, 110, 1, 3] = float("nan")  # sequence 3 (rows 94..159), value head 1, chunk-local row 16
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
              state_v_first=True)
    with torch.no_grad():
        o_ref, ht_ref = on_reference_device(naive_recurrent_gated_delta_rule)(q, k, v, g, beta, **kw)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "0")
        o_fused, ht_fused = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "1")
        ran = force(kernel, config)
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert ran() and all(c == config.as_dict() for c in ran()), ran()
    assert torch.isnan(o[0, 110:, 1]).all() and not torch.isnan(o[0, :110]).any()
    assert not torch.isnan(o[0, :, 0]).any()
    assert torch.isnan(ht[3, 1]).all() and not torch.isnan(ht[:3]).any() and not torch.isnan(ht[3, 0]).any()
    tol = _tol(dtype)
    good_o = torch.ones_like(o, dtype=torch.bool)
    good_o[0, 110:, 1] = False
    for name, got, ref in (("o", o[good_o], o_ref[good_o]), ("o vs fused", o[good_o], o_fused[good_o]),
                           ("ht", ht[:3], ht_ref[:3]), ("ht head 0", ht[3, 0], ht_ref[3, 0]),
                           ("ht vs fused", ht[:3], ht_fused[:3])):
        err = rel_err(got.float(), ref.float())
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    row = worst_row_err(o[0, :, 0].float(), o_ref[0, :, 0].float(), floor=0.1)
    assert row <= 4 * tol, f"o (head 0): worst row relative error {row:.3g}"


@pytest.mark.parametrize("kernel,config", CANDIDATES)
def test_ksplit_stored_states_match_one_tile(force, kernel, config):
    """h (each chunk's start state), v_new (U) and the final state, as the backward's recompute stores them,
    against the one-tile scan's (the same config without KSPLIT): the same quantities, one rounding of the
    decay apart (the one-tile scan rounds k's decayed rows, KSPLIT U's)."""
    dtype = _dtype(kernel)
    B, T, Hk, Hv, K, V = 1, 150, 1, 2, 48, 32
    q, k, v, g, beta, h0 = _inputs(B, T, Hk, Hv, K, V, dtype, h0=True)
    layout = gdn_module._layout(B, T, None, None, None)

    def states():
        with torch.no_grad():
            A, gcum = gdn_module._prep(k, v, g, beta, layout)[:2]
            return gdn_module._wy_and_states(q, k, v, g, beta, h0, layout, A=A, gcum=gcum)[3:]
    one_tile = {n: x for n, x in config.meta.items() if n != "KSPLIT"}
    force(kernel, Config(num_warps=config.num_warps, num_stages=config.num_stages, **one_tile))
    ref = states()
    ran = force(kernel, config)
    got = states()
    assert ran() and all(c == config.as_dict() for c in ran()), ran()
    tol = 1e-5 if dtype == torch.float32 and device().type == "cpu" else (5e-3 if dtype == torch.float32 else 1e-2)
    for name, a, b in zip(("h", "v_new", "final_state"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = rel_err(a.float(), b.float())
        assert err <= tol, f"{name}: relative error to the one-tile scan {err:.3g} > {tol:.3g}"
