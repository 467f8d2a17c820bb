"""Every candidate of the backward's local kernels (``gdn_bwd_local``, and ``gdn_bwd_onepass`` in its two modes,
``DFLASH_KERNELS_GDN_BWD_LOCAL=onepass`` / ``group``) forced alone at small head dims (K = 32; V = 16 or 32,
narrower than BV).

On sm_90 (triton 3.6) the kernel at BK = 32 with a V block of 64 (or 16) over a single V iteration
compiles to an out-of-range shared-memory access (compute-sanitizer: kernels_bwd.py, the ``b_kf`` line of
the K-block loop): garbage dk, dg and dbeta when forced alone, an illegal memory access that kills the CUDA
context when the tuner times it (tests/ops/test_gated_delta_rule.py::test_chunk_matches_reference
[T130-bf16-nol2] on a fresh tuning cache). So the kernels run their V loops in blocks of 32 whenever BK is 32.

Each case forces one candidate (on the CPU the interpreter's config, on a GPU the only config with tuning
off), runs the op forward and backward with the suite's NaN-poisoned outputs, and checks every gradient
against the fp32 recurrence of naive.py (relative and worst-row errors, tests/ops/test_gated_delta_rule.py).
Every tensor the kernel gets lies inside a NaN guard region: the guards must stay NaN (no store outside a
tensor) and the inputs unchanged.
"""

import pytest
import torch

from dflash_kernels.ops.gated_delta_rule import gated_delta_rule as gdn_module
from dflash_kernels.ops.gated_delta_rule import kernels_bwd, kernels_fwd
from dflash_kernels.runtime import alloc
from tests.helpers import device, slow_param
from tests.ops.test_gated_delta_rule import _compare, _inputs, _run

GUARD = 1024  # elements before and after each tensor argument
OUTPUTS = ("dq_ptr", "dk_ptr", "dv_ptr", "dbeta_ptr", "dg_ptr", "dA_log_ptr", "ddt_bias_ptr")


class _Guarded:
    """Stands in for a local kernel (``gdn_bwd_local_kernel``, ...) in the launcher's module: launches the real
    kernel on copies of its tensor arguments inside NaN guard regions, checks the guards and the inputs, copies
    the outputs back."""

    def __init__(self, real):
        self.real = real
        self.launches = 0
        self.problems = []

    def of(self, x):
        kernel = self.real.of(x)

        def launch(grid, *args, **constexprs):
            guarded, copies = [], []
            for name, a in zip(kernel.runtime_names, args):
                if not isinstance(a, torch.Tensor) or a.numel() == 0:
                    guarded.append(a)
                    continue
                fill = float("nan") if a.dtype.is_floating_point else -7
                flat = torch.full((a.numel() + 2 * GUARD,), fill, dtype=a.dtype, device=a.device)
                inner = flat[GUARD:GUARD + a.numel()]
                inner.copy_(a.contiguous().view(-1))
                copies.append((name, a, flat, inner))
                guarded.append(inner.view(a.shape))
            kernel(grid, *guarded, **constexprs)
            self.launches += 1
            for name, a, flat, inner in copies:
                edges = torch.cat([flat[:GUARD], flat[-GUARD:]])
                written = ~torch.isnan(edges) if edges.dtype.is_floating_point else edges != -7
                if written.any():
                    self.problems.append(f"{name}: {int(written.sum())} elements written outside the tensor")
                if name in OUTPUTS:
                    a.copy_(inner.view(a.shape))
                elif not torch.equal(inner.view(a.shape).nan_to_num(-1e30), a.nan_to_num(-1e30)):
                    self.problems.append(f"{name}: an input was modified")
        return launch


# DFLASH_KERNELS_GDN_BWD_LOCAL -> the launcher module's attribute of the local kernel it launches
LOCAL = {"twopass": "gdn_bwd_local_kernel", "onepass": "gdn_bwd_onepass_kernel", "group": "gdn_bwd_group_kernel"}


def _candidates():
    """Every candidate of the two-pass kernel by default; of the one-pass kernel's modes the first of each
    precision, the others under ``-m slow``."""
    for mode, attr in LOCAL.items():
        for dtype in (torch.bfloat16, torch.float32):
            kernel = getattr(kernels_bwd, attr).of(torch.empty(0, dtype=dtype))
            tag = "bf16" if dtype == torch.bfloat16 else "fp32"
            for i, config in enumerate(kernel.configs):
                bkb = f"-BKB{config.meta['BKB']}" if "BKB" in config.meta else ""
                prefix = "" if mode == "twopass" else f"{mode}-"
                yield slow_param(mode, dtype, i, id=f"{prefix}{tag}-{i}-BV{config.meta['BV']}{bkb}",
                                 slow=mode != "twopass" and i > 0)


# (id, B, T, Hk, Hv, K, V): K = 32 (BK = 32), V narrower than BV = 64 and BKB = 64; T not a multiple of 64
SHAPES = [("K32-V16", 1, 130, 2, 4, 32, 16), ("K32-V32", 1, 130, 2, 4, 32, 32)]


def _force(monkeypatch, dtype, index, mode="twopass"):
    kernel = getattr(kernels_bwd, LOCAL[mode]).of(torch.empty(0, dtype=dtype))
    config = kernel.configs[index]
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "0")
    monkeypatch.setenv("DFLASH_KERNELS_GDN_BWD_LOCAL", mode)
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "interpret_config", config)  # the interpreter launches this one
    kernel.reset()
    guarded = _Guarded(getattr(kernels_bwd, LOCAL[mode]))
    monkeypatch.setattr(gdn_module, LOCAL[mode], guarded)
    return kernel, config, guarded


def _grads(shape, dtype):
    torch.manual_seed(0)
    B, T, Hk, Hv, K, V = shape
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, normalized=True)
    do = torch.randn(B, T, Hv, V, device=device())
    return tensors, _run(gdn_module.chunk_gated_delta_rule, tensors, {}, False, do, None)[2]


@pytest.mark.parametrize("B,T,Hk,Hv,K,V", [slow_param(*s[1:], id=s[0], slow=s[0] != "K32-V16") for s in SHAPES])
@pytest.mark.parametrize("mode,dtype,index", list(_candidates()))
def test_every_local_candidate_small_dims(monkeypatch, mode, dtype, index, B, T, Hk, Hv, K, V):
    assert alloc.poisoning(), "the suite NaN-fills the launchers' outputs (tests/conftest.py)"
    kernel, config, guarded = _force(monkeypatch, dtype, index, mode)
    try:
        torch.manual_seed(0)
        tensors = _inputs(B, T, Hk, Hv, K, V, dtype, normalized=True)
        _compare(tensors, {}, False, dtype)  # every gradient against the fp32 reference
        if device().type == "cuda":
            torch.cuda.synchronize()
        used = [e["config"] for e in kernel.cache_info().values()]
        assert used and all(c == config.as_dict() for c in used), f"ran {used}, not {config}"
        assert guarded.launches > 0, f"the backward did not launch {LOCAL[mode]}"
        assert not guarded.problems, guarded.problems
    finally:
        kernel.reset()


@pytest.mark.skipif(device().type != "cpu", reason="bit equality of two configs: the interpreter's")
@pytest.mark.parametrize("V", [16, 32])
def test_bk32_runs_v_blocks_of_32(monkeypatch, V):
    """At BK = 32 the BV=64 candidate runs the V loops in blocks of 32: the same gradients, bit for bit, as
    BV=32 (same BKB), under the interpreter (one program order)."""
    kernel = kernels_bwd.gdn_bwd_local_kernel.default
    index = {c.meta["BV"]: i for i, c in enumerate(kernel.configs) if c.meta["BKB"] == 32}
    shape = (1, 130, 2, 4, 32, V)
    results = []
    for bv in (32, 64):
        with monkeypatch.context() as m:
            k, _, _ = _force(m, torch.bfloat16, index[bv])
            try:
                results.append(_grads(shape, torch.bfloat16)[1])
            finally:
                k.reset()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


@pytest.mark.parametrize("K,V", [(64, 32), (128, 16)])
def test_narrow_v_forward_with_every_wu_candidate_timed(monkeypatch, K, V):
    """V <= 32 with tuning on (on a GPU the tuner times every w/u candidate on a fresh key): the forward takes the
    w/u kernel's narrow form (kernels_fwd.py: the 32-column candidate faulted there on sm_90), and the op's
    output, final state and every gradient match the fp32 recurrence."""
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    narrow = kernels_fwd.gdn_fwd_wu_narrow_kernel.default
    wide = kernels_fwd.gdn_fwd_wu_kernel.default
    narrow.reset()
    wide.reset()
    try:
        torch.manual_seed(0)
        tensors = _inputs(1, 200, 1, 4, K, V, torch.bfloat16, h0=True)
        _compare(tensors, dict(use_qk_l2norm_in_kernel=True), True, torch.bfloat16)
        if device().type == "cuda":
            torch.cuda.synchronize()  # a fault surfaces here, in this test
        assert narrow.cache_info(), "the forward did not launch the narrow w/u kernel"
        assert not wide.cache_info(), "the forward launched the wide w/u kernel at V <= 32"
    finally:
        narrow.reset()
        wide.reset()
