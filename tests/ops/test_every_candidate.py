"""Every tuning candidate of every Triton kernel, forced alone, against the fp32 reference (GPU; the RMSNorm
kernels' candidates also under the CPU interpreter).

The tuner may pick any candidate of a kernel's ``configs`` on some shape, and with tuning off the first
runs; so each one must be right. For each ``TritonKernel`` of each op (found by walking the ops'
``kernels*.py`` modules, ``ByPrecision`` pairs included: ``.default`` for bf16 / fp16, ``.fp32`` for
fp32), each config index and two sizes (a real one and an odd one), the test makes that config the
kernel's only candidate, runs the public op that launches the kernel (forward, and backward through
``torch.autograd.grad`` over every differentiable input) in the dtype the list serves, and compares
every output and gradient with the op's ``naive_*`` reference by relative error and worst-row error.
A candidate that faults or is wrong fails; one that needs more shared memory or registers than this
GPU has is skipped with the reason (with a single config the launcher has nothing else to fall back to,
so it raises ``OutOfResources``). The test also asserts the kernel was launched, so a driver that no
longer reaches its kernel cannot pass. A kernel added later is found automatically and fails
``test_every_kernel_has_a_driver`` until a driver for it is added to ``DRIVERS``.

Run on a GPU:   python -m pytest tests/ops/test_every_candidate.py -q  (the discovery tests also run on a CPU)
On a CPU:       TRITON_INTERPRET=1 python -m pytest tests/ops/test_every_candidate.py -q -k interpret  (the
kernels of ``INTERPRETED``, each candidate as the interpreted config, at the driver's small size ``interpret``)
Tuning mode of the whole GPU suite: ``--tuning on|off|default`` (tests/conftest.py).
"""

import importlib
import pkgutil

import pytest
import torch
from triton.runtime.errors import OutOfResources

import dflash_kernels.ops as ops_pkg
from dflash_kernels.ops.gated_delta_rule.kernels_fwd import ByPrecision
from dflash_kernels.runtime import TritonKernel
from tests.helpers import (check_close, device, on_reference_device, rel_err, require_triton_kernels, slow_param,
                           worst_row_err)


# ------------------------------------------------------------------------------------------ discovery
def _kernel_modules():
    """Every ``dflash_kernels.ops.<op>.kernels*`` module."""
    mods = []
    for op in pkgutil.iter_modules(ops_pkg.__path__):
        if not op.ispkg:
            continue
        pkg = importlib.import_module(f"{ops_pkg.__name__}.{op.name}")
        for m in pkgutil.iter_modules(pkg.__path__):
            if m.name.startswith("kernels"):
                mods.append(importlib.import_module(f"{pkg.__name__}.{m.name}"))
    return mods


def discover_kernels():
    """``{runtime name: TritonKernel}`` of every kernel defined in the ops' kernel modules."""
    found = {}
    for mod in _kernel_modules():
        for value in vars(mod).values():
            members = [value] if isinstance(value, TritonKernel) else (
                [value.default, value.fp32] if isinstance(value, ByPrecision) else [])
            for k in members:
                assert found.get(k.name, k) is k, f"two kernels named {k.name!r}"
                found[k.name] = k
    return found


KERNELS = discover_kernels()
assert KERNELS, "no TritonKernel found in dflash_kernels/ops/*/kernels*.py"

# Names the discovery must find (a kernel renamed or no longer found by the walk fails the test below).
KNOWN = {
    "block_sparse_attn_fwd", "block_sparse_attn_bwd_dq", "block_sparse_attn_bwd_dkdv", "block_sparse_attn_bwd_pre",
    "block_sparse_attn_fwd_gluon_sm90", "block_sparse_attn_fwd_gluon_sm90_dflash",
    "block_sparse_attn_bwd_gluon_sm90_dq", "block_sparse_attn_bwd_gluon_sm90_dkdv",
    "block_sparse_attn_bwd_gluon_sm90_causal_dq", "block_sparse_attn_bwd_gluon_sm90_causal_dkdv", "mask_rev_count",
    "mask_rev_fill",
    "causal_conv1d_fwd", "causal_conv1d_bwd", "causal_conv1d_update",
    "gdn_fwd_solve", "gdn_fwd_wu", "gdn_fwd_state", "gdn_fwd_state_output", "gdn_bwd_state", "gdn_bwd_local",
    "gdn_fwd_solve_fp32", "gdn_fwd_wu_fp32", "gdn_fwd_state_fp32", "gdn_fwd_state_output_fp32",
    "gdn_bwd_state_fp32", "gdn_bwd_local_fp32", "gdn_l2norm_fwd", "gdn_l2norm_bwd", "gdn_recurrent",
    "gdn_fwd_output", "gdn_fwd_output_fp32", "gdn_fwd_wu_narrow", "gdn_fwd_wu_narrow_fp32", "gdn_bwd_onepass",
    "gdn_bwd_onepass_fp32", "gdn_bwd_onepass_group", "gdn_bwd_onepass_group_fp32", "gdn_fwd_prepare",
    "gdn_fwd_prepare_fp32", "gdn_fwd_gluon_sm90",
    "linear_ce_rows", "adamw",
    "rms_norm_fwd_narrow", "rms_norm_fwd_wide", "rms_norm_bwd_narrow", "rms_norm_bwd_wide",
    "rope", "swiglu_fwd", "swiglu_bwd",
}


def _dtype_of(name):
    return torch.float32 if name.endswith("_fp32") else torch.bfloat16


def _check(name, got, ref, tol, row_tol, row_dims=(-1,)):
    """``got`` against the fp32 ``ref``: whole-tensor and worst-row relative error."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    if got.dim() > 1 and got.numel():
        row = worst_row_err(got, ref, row_dims=row_dims)
        assert row <= row_tol, f"{name}: worst row relative error {row:.3g} > {row_tol:.3g}"


def _grads(out, leaves, go):
    return torch.autograd.grad(out, leaves, go)


# -------------------------------------------------------------------------------------------- drivers
# Each driver runs the public op at one size ("real" or "odd") in ``dtype`` and checks it; the op's own
# test module gives the inputs and the tolerances.

def _attention_dflash(size, dtype, backend, Hq=None):
    import dflash_kernels as dk
    from dflash_kernels.ops.attention import dflash_block_mask
    from tests.ops.test_attention import check_against_reference, dflash_dense_mask, make_qkv

    B, S, N, Hq_, Hkv, window = (1, 2048, 128, 8, 2, None) if size == "real" else (1, 1001, 37, 6, 2, 333)
    Hq = Hq or Hq_
    g = torch.Generator().manual_seed(0)
    anchors = torch.randint(0, S, (B, N), generator=g)
    anchors[0, 0], anchors[0, -1] = 0, S - 1
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, -2] = False
    anchors, valid = anchors.cuda(), valid.cuda()
    dk.set_backend("attention", backend)
    try:
        mask = dflash_block_mask(anchors, S, 16, window=window, valid=valid)  # launches the mask kernels
        dense = dflash_dense_mask(anchors, S, 16, window=window, valid=valid)
        q, k, v, do = make_qkv(B, N * 16, S + N * 16, Hq, Hkv, 128, dtype)
        check_against_reference(q, k, v, do, mask, dtype, dense=dense)
    finally:
        dk.set_backend("attention", "auto")


def _attention(size, dtype):
    """The portable kernels (backend ``portable``: on an sm_90 GPU backend ``triton`` runs the Hopper forward)."""
    _attention_dflash(size, dtype, "portable")


def _attention_gluon_dflash(size, dtype):
    """The Hopper DFlash forward and backward through the op (GQA 4: their 64-row groups)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    _attention_dflash(size, dtype, "triton", Hq=8)


def _attention_gluon_causal(size, dtype):
    """The Hopper dense forward and its sibling backward through the op, for a causal_block_mask (Tq != Tk at
    the odd size)."""
    from dflash_kernels.ops.attention import causal_block_mask
    from tests.ops.test_attention import check_against_reference, make_qkv

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    B, Tq, Tk, Hq, Hkv = (2, 2048, 2048, 8, 2) if size == "real" else (1, 1001, 1117, 6, 3)
    mask = causal_block_mask(Tq, Tk, q_block=64, device="cuda")
    q, k, v, do = make_qkv(B, Tq, Tk, Hq, Hkv, 128, dtype)
    check_against_reference(q, k, v, do, mask, dtype, rms_rows=True)  # the first rows' dq is ~0 (one key)


def _attention_fwd_sm90(size, dtype):
    """The Hopper forward through its launcher (the op's dispatch does not choose it), o and lse."""
    from tests.ops.test_attention_sm90 import _check, _dflash_mask, _inputs

    if size != "interpret" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the sm_90 forward needs compute capability >= 9.0")
    B, S, N, Hq, Hkv, window = {"real": (1, 2048, 128, 8, 2, None), "odd": (1, 1001, 37, 6, 2, 333),
                                "interpret": (1, 301, 5, 8, 2, 133)}[size]
    mask = _dflash_mask(B, S, N, window)
    _check(*_inputs(B, N * 16, S + N * 16, Hq, Hkv, 128, dtype), mask, dtype)


def _conv1d(size, dtype):
    from tests.ops.test_conv1d import _inputs, _run_both, _tol

    B, D, T = (1, 2560, 4096) if size == "real" else (2, 1000, 3001)
    tol = _tol(dtype)
    for channel_last in (False, True):
        x, weight, b, seq, init = _inputs(B, D, T, 4, dtype, channel_last=channel_last, init=True, seq=True)
        outs_k, outs_r, kern, ref = _run_both(x, weight, b, seq, init, "silu", final=True)
        # Rows: one channel over time ([B, D, T] tensors); rounding of a short row does not average out.
        pairs = [("y", outs_k[0], outs_r[0]), ("final_states", outs_k[1], outs_r[1])]
        pairs += [(n, k_.grad, r.grad.to(dtype)) for n, k_, r in
                  zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref)]
        for name, got, want in pairs:
            assert got.dtype == dtype, name
            if name == "dinitial_states":
                # Rows of W-1 = 3 taps, each a short sum that can cancel to near 0 (the first sequence
                # of a packed row may be a token or two long): the row norm is floored at the RMS of
                # all rows' norms (tests/helpers.worst_row_err_rms), as for the fused ops.
                check_close(f"{name} (channel_last={channel_last})", got, want.float(), tol, 4 * tol)
            else:
                _check(f"{name} (channel_last={channel_last})", got, want.float(), tol, 4 * tol)


def _conv1d_update(size, dtype):
    import dflash_kernels as dk
    from dflash_kernels.ops.conv1d.naive import naive_causal_conv1d_update
    from tests.ops.test_conv1d import _tol

    B, D, L, S = (64, 2560, 1, 3) if size == "real" else (3, 1001, 5, 6)
    x = torch.randn(B, D, L, device="cuda", dtype=dtype)
    state = torch.randn(B, D, S, device="cuda", dtype=dtype)
    weight = torch.randn(D, 4, device="cuda", dtype=dtype) / 4
    bias = torch.randn(D, device="cuda", dtype=dtype)
    state_ref = state.clone()
    y = dk.causal_conv1d_update(x, state, weight, bias, "silu")
    y_ref = naive_causal_conv1d_update(x, state_ref, weight, bias, "silu")
    _check("y", y.float(), y_ref.float(), _tol(dtype), 4 * _tol(dtype))
    assert torch.equal(state, state_ref), "conv_state after the update"


def _gdn_forward(split: str, local: str = "twopass", prepare: str = "split", fwd: str = "triton"):
    """The chunked op, forward and backward, with the forward forced fused (``"0"``: its scan writes the
    output) or split (``"1"``: the state scan, then the output kernel), whatever the library would pick
    for the shape (it splits for few sequences and heads on a GPU), the backward's local kernel
    ``local`` (``DFLASH_KERNELS_GDN_BWD_LOCAL``), the forward's prep ``prepare``
    (``DFLASH_KERNELS_GDN_FWD_PREPARE``: the solve and w/u kernels, or the fused kernel doing both) and its
    kernels after the solve ``fwd`` (``DFLASH_KERNELS_GDN_FWD``: ``gluon`` needs an sm_90 GPU)."""
    def driver(size, dtype):
        import os
        from unittest import mock

        from tests.ops.test_gated_delta_rule import _compare, _inputs

        if fwd == "gluon" and torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the Gluon GDN forward needs an sm_90 GPU")
        shape = (1, 1024, 4, 8, 128, 128) if size == "real" else (2, 333, 2, 6, 128, 128)
        env = {"DFLASH_KERNELS_GDN_FWD_SPLIT": split, "DFLASH_KERNELS_GDN_BWD_LOCAL": local,
               "DFLASH_KERNELS_GDN_FWD_PREPARE": prepare, "DFLASH_KERNELS_GDN_FWD": fwd}
        with mock.patch.dict(os.environ, env):
            _compare(_inputs(*shape, dtype, h0=True), dict(use_qk_l2norm_in_kernel=True), True, dtype)
    return driver


_gdn_chunk, _gdn_split = _gdn_forward("0"), _gdn_forward("1")


def _gdn_narrow(size, dtype):
    """The chunked op, forward and backward, at V <= 32 (the w/u kernel's narrow form, kernels_fwd.py)."""
    from tests.ops.test_gated_delta_rule import _compare, _inputs

    shape = (1, 200, 1, 4, 64, 32) if size == "real" else (2, 133, 2, 4, 128, 16)
    _compare(_inputs(*shape, dtype, h0=True), dict(use_qk_l2norm_in_kernel=True), True, dtype)


_gdn_onepass, _gdn_group = _gdn_forward("0", "onepass"), _gdn_forward("0", "group")
_gdn_prepare = _gdn_forward("0", prepare="fused")
_gdn_gluon = _gdn_forward("0", fwd="gluon")


def _gdn_recurrent(size, dtype):
    from dflash_kernels.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from tests.ops.test_gated_delta_rule import _inputs

    # The decode step (forward only: the recurrent op has no backward): one token of many sequences,
    # then a short odd-length prefix with GQA.
    B, T, Hk, Hv = (64, 1, 16, 32) if size == "real" else (3, 7, 2, 6)
    q, k, v, g, beta, h0 = _inputs(B, T, Hk, Hv, 128, 128, dtype, h0=True)
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    ro, rht = on_reference_device(naive_recurrent_gated_delta_rule)(q, k, v, g, beta, **kwargs)
    assert o.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # as test_fused_recurrent
    _check("o", o, ro.to(dtype), tol, 4 * tol)
    _check("final_state", ht, rht, tol, 4 * tol)


def _adamw(size, dtype):
    from dflash_kernels.ops.adamw import fused_adamw_, naive_adamw_

    shapes = [(9728, 2560), (2560,)] if size == "real" else [(1001, 37), (3,)]
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    ms = [torch.randn(s, device="cuda", generator=g) * 0.01 for s in shapes]
    vs = [torch.rand(s, device="cuda", generator=g) * 1e-4 for s in shapes]
    gs = [torch.randn(s, device="cuda", generator=g).to(torch.bfloat16) for s in shapes]
    copies = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    ref = [[t.clone() for t in lst] for lst in (ps, ms, vs)]
    scale = torch.tensor([2.0], device="cuda")
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7)
    fused_adamw_(ps, gs, ms, vs, grad_scale=scale, compute_copies=copies, **kw)
    naive_adamw_(*ref[:1], [x.float() / 2.0 for x in gs], *ref[1:], **kw)
    for name, got, want in (("param", ps, ref[0]), ("exp_avg", ms, ref[1]), ("exp_avg_sq", vs, ref[2])):
        for a, b in zip(got, want):
            err = rel_err(a, b)
            assert err < 1e-6, f"{name}: relative error {err:.3g}"
    for c, p in zip(copies, ps):
        assert torch.equal(c, p.to(torch.bfloat16)), "compute copy"


def _linear_cross_entropy(size, dtype):
    from tests.ops.test_linear_cross_entropy import _check_all, _inputs, _run

    n, h, v = (4096, 2048, 32768) if size == "real" else (1001, 1000, 10007)
    hidden, weight, bias, labels, w = _inputs(n, h, v, dtype)
    for reduction in ("mean", "none"):
        out, ref, go, gr, _ = _run(hidden, weight, bias, labels, w, reduction=reduction)
        _check_all(out, ref, go, gr, dtype, ["dhidden", "dweight", "dbias"])
        # tests.helpers' worst row too (the op test's own row measure floors at the rms row norm)
        row_tol = {torch.float32: 1e-4, torch.bfloat16: 8e-2, torch.float16: 1.5e-2}[dtype]
        for name, g_, r in zip(["dhidden", "dweight"], go, gr):
            row = worst_row_err(g_, r.to(g_.dtype))
            assert row <= row_tol, f"{name}: worst row relative error {row:.3g} > {row_tol:.3g}"


def _rms_norm_forms(kernel, flag):
    """The forms of ``kernel`` in its compile cache: ``(HAS_GATE, flag)`` of each key."""
    forms = set()
    for key in kernel.cache_info():
        constexprs = dict(key[2])
        forms.add((constexprs.get("HAS_GATE", False), constexprs.get(flag, False)))
    return forms


def _rms_norm(narrow):
    """Every form the RMSNorm kernels of one width run, forward and backward: the plain norm, the gated norm
    (HAS_GATE) and the fused residual add (HAS_RES; its backward with ``h`` read on, HAS_DRES, and with ``y``
    alone read). Sizes ``real`` and ``odd`` on a GPU, ``interpret`` (small) under the CPU interpreter."""
    def run(size, dtype):
        from dflash_kernels.ops.rms_norm import naive_rms_norm, rms_norm
        from dflash_kernels.ops.rms_norm import kernels as rk
        from tests.ops.test_fused_add_rms_norm import _compare as compare_fused_add
        from tests.ops.test_rms_norm import TOL, _compare_gated

        dev = device()
        if narrow:
            shape = {"real": (8192 * 8, 128), "odd": (3 * 4099, 8, 256), "interpret": (3, 101, 67)}[size]
            fwd, bwd = rk.rms_norm_fwd_narrow, rk.rms_norm_bwd_narrow
        else:
            shape = {"real": (8192, 2560), "odd": (3001, 1000), "interpret": (37, 600)}[size]
            fwd, bwd = rk.rms_norm_fwd_wide, rk.rms_norm_bwd_wide
        fwd.reset()  # only the forms this run launches count below
        bwd.reset()
        x = (torch.randn(shape, device=dev) * 2).to(dtype)
        w = (torch.randn(shape[-1], device=dev) * 0.2 + 1.0).to(dtype)
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
        y, yr = rms_norm(xo, wo, 1e-6), naive_rms_norm(xr, wr, 1e-6)
        go = torch.randn(y.shape, device=dev).to(dtype)
        dx, dw = _grads(y, (xo, wo), go)
        dxr, dwr = _grads(yr, (xr, wr), go.float())
        tol, row_tol = TOL[dtype]
        assert y.dtype == dx.dtype == dw.dtype == dtype
        _check("y", y, yr.to(dtype), tol, row_tol)
        _check("dx", dx, dxr, tol, row_tol)
        _check("dweight", dw, dwr, 2 * tol, 2 * row_tol)  # one row: a reduction over every row of x
        g = (torch.randn(shape, device=dev) * 2).to(dtype)
        _compare_gated(x, g, w, 1e-6, 0.0, dtype, round_normed=True)  # the GDN output norm's form
        residual = torch.randn(shape, device=dev).to(dtype)
        compare_fused_add(x, residual, w, 1e-6, 1.0)  # h goes on down the residual stream
        compare_fused_add(x, residual, w, 1e-6, 0.0, read=("y",))  # the last layer: y alone is read
        plain, gated, fused_add = (False, False), (True, False), (False, True)
        assert {plain, gated, fused_add} <= _rms_norm_forms(fwd, "HAS_RES"), "a forward form did not run"
        assert {plain, gated, fused_add} <= _rms_norm_forms(bwd, "HAS_DRES"), "a backward form did not run"
    return run


def _rope(size, dtype):
    from dflash_kernels.ops.rope import apply_rope, naive_apply_rope
    from tests.ops.test_rope import TOL, cos_sin

    (B, T, H, D), R = ((1, 4096, 32, 128), 128) if size == "real" else ((2, 1001, 6, 256), 64)
    x = torch.randn(B, T, H, D, device="cuda").to(dtype)
    cos, sin = cos_sin(B, T, R, theta=1e6, dev=torch.device("cuda"))
    cos, sin = cos[:, :, None], sin[:, :, None]
    xo, xr = x.clone().requires_grad_(), x.float().requires_grad_()
    y, yr = apply_rope(xo, cos, sin), naive_apply_rope(xr, cos, sin)
    go = torch.randn(y.shape, device="cuda").to(dtype)
    (dx,), (dxr,) = _grads(y, (xo,), go), _grads(yr, (xr,), go.float())
    tol, row_tol = TOL[dtype]
    assert y.dtype == dx.dtype == dtype
    _check("y", y, yr.to(dtype), tol, row_tol)
    _check("dx", dx, dxr, tol, row_tol)


def _swiglu(size, dtype):
    from dflash_kernels.ops.swiglu import naive_swiglu, swiglu
    from tests.ops.test_swiglu import TOL

    shape = (4096, 9216) if size == "real" else (3001, 9217)
    gate = (torch.randn(shape, device="cuda") * 3).to(dtype)
    up = torch.randn(shape, device="cuda").to(dtype)
    go_, uo = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gr, ur = gate.float().requires_grad_(), up.float().requires_grad_()
    y, yr = swiglu(go_, uo), naive_swiglu(gr, ur)
    dy = torch.randn(y.shape, device="cuda").to(dtype)
    dg, du = _grads(y, (go_, uo), dy)
    dgr, dur = _grads(yr, (gr, ur), dy.float())
    tol, row_tol = TOL[dtype]
    assert y.dtype == dg.dtype == du.dtype == dtype
    _check("y", y, yr.to(dtype), tol, row_tol)
    _check("dgate", dg, dgr, tol, row_tol)
    _check("dup", du, dur, tol, row_tol)


_GDN_CHUNK = ["gdn_fwd_solve", "gdn_fwd_wu", "gdn_fwd_state", "gdn_fwd_state_output", "gdn_bwd_state",
              "gdn_bwd_local"]
# runtime name -> the driver that launches that kernel
DRIVERS = {
    **{n: _attention for n in ("block_sparse_attn_fwd", "block_sparse_attn_bwd_dq", "block_sparse_attn_bwd_dkdv",
                               "block_sparse_attn_bwd_pre", "mask_rev_count", "mask_rev_fill")},
    "block_sparse_attn_fwd_sm90": _attention_fwd_sm90,
    **{f"block_sparse_attn_{n}_gluon_sm90{s}": _attention_gluon_dflash
       for n, s in (("fwd", "_dflash"), ("bwd", "_dq"), ("bwd", "_dkdv"))},
    **{n: _attention_gluon_causal for n in ("block_sparse_attn_fwd_gluon_sm90",
                                             "block_sparse_attn_bwd_gluon_sm90_causal_dq",
                                             "block_sparse_attn_bwd_gluon_sm90_causal_dkdv")},
    "causal_conv1d_fwd": _conv1d, "causal_conv1d_bwd": _conv1d, "causal_conv1d_update": _conv1d_update,
    **{n: _gdn_chunk for n in _GDN_CHUNK + [n + "_fp32" for n in _GDN_CHUNK]
       + ["gdn_l2norm_fwd", "gdn_l2norm_bwd"]},
    "gdn_fwd_wu_narrow": _gdn_narrow, "gdn_fwd_wu_narrow_fp32": _gdn_narrow,
    "gdn_recurrent": _gdn_recurrent, "gdn_fwd_output": _gdn_split, "gdn_fwd_output_fp32": _gdn_split,
    "gdn_bwd_onepass": _gdn_onepass, "gdn_bwd_onepass_fp32": _gdn_onepass,
    "gdn_bwd_onepass_group": _gdn_group, "gdn_bwd_onepass_group_fp32": _gdn_group,
    "gdn_fwd_prepare": _gdn_prepare, "gdn_fwd_prepare_fp32": _gdn_prepare, "gdn_fwd_gluon_sm90": _gdn_gluon,
    "linear_ce_rows": _linear_cross_entropy, "adamw": _adamw,
    "rms_norm_fwd_narrow": _rms_norm(True), "rms_norm_bwd_narrow": _rms_norm(True),
    "rms_norm_fwd_wide": _rms_norm(False), "rms_norm_bwd_wide": _rms_norm(False),
    "rope": _rope, "swiglu_fwd": _swiglu, "swiglu_bwd": _swiglu,
}

SIZES = ("real", "odd")
CASES = [pytest.param(name, i, size, id=f"{name}[{i}]-{size}")
         for name, k in sorted(KERNELS.items()) for i in range(len(k.configs)) for size in SIZES]


# ---------------------------------------------------------------------------------------------- tests
def test_discovery_finds_every_known_kernel():
    missing = KNOWN - set(KERNELS)
    assert not missing, f"kernels not found by walking dflash_kernels/ops/*/kernels*.py: {sorted(missing)}"


def test_every_kernel_has_a_driver():
    missing = set(KERNELS) - set(DRIVERS)
    assert not missing, f"kernels without a driver in DRIVERS (add one): {sorted(missing)}"


def _out_of_resources(e):
    while e is not None:
        if isinstance(e, OutOfResources):
            return e
        e = e.__cause__ or e.__context__
    return None


def _run_alone(monkeypatch, name, index, size):
    """Run ``DRIVERS[name]`` at ``size`` with config ``index`` as kernel ``name``'s only candidate (and, under
    the interpreter, as its interpreted config); check that the driver launched it with that config."""
    kernel = KERNELS[name]
    driver = DRIVERS.get(name)
    if driver is None:
        pytest.fail(f"{name}: no driver in DRIVERS")
    config = kernel.configs[index]
    # Untimed: the conv's CUDA-vs-Triton choice takes Triton (its default), so the Triton kernel runs.
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "0")
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "interpret_config", config)
    kernel.reset()
    try:
        try:
            driver(size, _dtype_of(name))
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # a fault surfaces here, in this test
        except Exception as e:
            oor = _out_of_resources(e)
            if oor is None:
                raise
            pytest.skip(f"{name} {config} does not fit this GPU ({torch.cuda.get_device_name()}): {oor}")
        used = [v["config"] for v in kernel.cache_info().values()]
        assert used, f"{name}: the driver did not launch the kernel"
        assert all(c == config.as_dict() for c in used), f"{name}: ran {used}, not {config}"
    finally:
        kernel.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("name,index,size", CASES)
def test_candidate(monkeypatch, name, index, size):
    """Config ``index`` of kernel ``name`` as its only candidate: outputs and gradients at ``size``."""
    _run_alone(monkeypatch, name, index, size)


# Kernels whose drivers also run under the CPU interpreter (size "interpret": small, odd). The default run
# takes each kernel's first config (what an untuned run launches); -m slow the others.
INTERPRETED = sorted(n for n in KERNELS if n.startswith("rms_norm_")) + ["block_sparse_attn_fwd_sm90"]
INTERPRETED_CASES = [slow_param(name, i, id=f"{name}[{i}]-interpret", slow=i > 0)
                     for name in INTERPRETED for i in range(len(KERNELS[name].configs))]


@pytest.mark.parametrize("name,index", INTERPRETED_CASES)
def test_candidate_interpreted(monkeypatch, name, index):
    """Config ``index`` of kernel ``name`` through the Triton interpreter on the CPU: every form its driver
    runs, against the reference (the block shapes and masks of each candidate, without a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU test_candidate runs every candidate compiled")
    require_triton_kernels("rms_norm")
    _run_alone(monkeypatch, name, index, "interpret")


def test_memcheck_families_cover_every_kernel():
    """``tests/memcheck.sh``'s default families (pytest -k expressions of names joined by ``or``) reach every
    kernel found here: a kernel added later is not silently left out of the memcheck run."""
    import os
    import re

    script = open(os.path.join(os.path.dirname(__file__), "..", "memcheck.sh")).read()
    families = re.search(r"declare -A FAMILIES=\((.*?)\)\n", script, re.S).group(1)
    words = [w.strip() for expr in re.findall(r'\]="([^"]*)"', families) for w in expr.split(" or ")]
    assert words and all(re.fullmatch(r"\w+", w) for w in words), words
    missing = [name for name in KERNELS if not any(w in name for w in words)]
    assert not missing, f"kernels in no memcheck family: {missing}"
