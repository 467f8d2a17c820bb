"""The GDN forward's fused preparation (``DFLASH_KERNELS_GDN_FWD_PREPARE=fused``: the solve and the w/u products in
one kernel, kernels_fwd_fused.py) against the split path (the solve kernel, then the w/u kernel) and the fp32
recurrence of ``naive.py``.

The fused kernel runs the split path's solve itself and the w/u kernel's products, so under the interpreter
its A, G, t_bad, w and u are the split path's bit for bit (its interpreter config takes the same blocks), and so
are the op's outputs, final states and gradients (the backward reads the forward's A and G). Checked at the
level of the per-chunk prep (``gated_delta_rule._prep``: cheap, every path of the kernel: odd lengths, GQA,
packed sequences, the raw gate with and without dt_bias, beta logits, a row-strided v, non-finite rows, fp32,
bf16 and fp16) and through the public op (forward and every gradient, against the split path and the
reference). Each tuning candidate is forced alone: with blocks other than the split path's, w and u are one
rounding of numpy's sums apart under the interpreter (the kernel's module docstring), bounded here. The suite
NaN-poisons every output buffer (tests/conftest.py), so an element the kernel fails to write fails.

    TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_gdn_fwd_prepare.py
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
from dflash_kernels.ops.gated_delta_rule import gated_delta_rule as gdn_module
from dflash_kernels.ops.gated_delta_rule import kernels_fwd_fused
from dflash_kernels.runtime import alloc, settings
from tests.helpers import device, rel_err, require_triton_kernels, slow_param
from tests.ops.test_gated_delta_rule import _Launches, _compare, _inputs, _run, _same

PREPARE = kernels_fwd_fused.gdn_fwd_prepare_kernel
ENV = "DFLASH_KERNELS_GDN_FWD_PREPARE"
# The forward's prep kernels in the launcher's module: DFLASH_KERNELS_GDN_FWD_PREPARE -> the kernel it launches.
PREP_KERNELS = {"split": "gdn_fwd_solve_kernel", "fused": "gdn_fwd_prepare_kernel"}


@pytest.fixture(autouse=True)
def _require_kernels():
    require_triton_kernels("gdn")


def use_prepare(monkeypatch, mode):
    """Run the forward's prep in ``mode``; returns the list of the modes of the prep kernels launched from then
    on (the forward's only: the backward's recompute takes the forward's A and launches neither)."""
    monkeypatch.setenv(ENV, mode)
    launched = []
    for name, attr in PREP_KERNELS.items():
        monkeypatch.setattr(gdn_module, attr, _Launches(getattr(gdn_module, attr), name, launched))
    return launched


def both(monkeypatch, fn):
    """``fn()`` with the split prep, then with the fused one; checks that each launched its own kernels only."""
    out = {}
    for mode in PREP_KERNELS:
        with monkeypatch.context() as m:
            launched = use_prepare(m, mode)
            out[mode] = fn()
            assert launched and set(launched) == {mode}, (mode, launched)
    return out["split"], out["fused"]


# ------------------------------------------------------------------------------------------- the setting

def test_setting(monkeypatch):
    """Unset or empty: split; the two modes in any case and spacing; another value raises naming both."""
    monkeypatch.delenv(ENV, raising=False)
    assert settings.gdn_fwd_prepare() == "split" and settings.GDN_FWD_PREPARE_MODES == ("split", "fused")
    for text, mode in (("", "split"), ("split", "split"), ("fused", "fused"), (" Fused ", "fused")):
        monkeypatch.setenv(ENV, text)
        assert settings.gdn_fwd_prepare() == mode, text
    monkeypatch.setenv(ENV, "fuse")
    with pytest.raises(ValueError, match=f"{ENV}: expected one of split, fused, got 'fuse'"):
        settings.gdn_fwd_prepare()


def test_bad_value_fails_the_forward(monkeypatch):
    """The forward reads the setting before it launches anything: a bad value raises there, naming it."""
    monkeypatch.setenv(ENV, "both")
    q, k, v, g, beta, _ = _inputs(1, 20, 1, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=f"{ENV}.*'both'"):
        chunk_gated_delta_rule(q, k, v, g, beta)


def test_outputs_are_poisoned_in_this_suite():
    # "An unwritten element fails" (the prep checks below assert every element finite) rests on the poisoning.
    assert alloc.poisoning()


# ------------------------------------------------------------------------------- the prep, bit for bit

def _prep_inputs(B, T, Hk, Hv, K, V, dtype, gate=False, dt_bias=True, beta_mode=0, bounds=None, strided=False,
                 bad=None, seed=0):
    """(k, v, g, beta, layout, gate) as the forward passes them to ``_prep``: unit keys, v a view of a wider
    projection when ``strided`` (row stride > Hv * V), g the raw gate (with A_log, dt_bias) when ``gate``,
    beta logits when ``beta_mode``; ``bad``: (name, batch row, token, value head) set to NaN."""
    gen = torch.Generator().manual_seed(seed)
    dev = device()

    def rand(*shape):
        return torch.randn(*shape, generator=gen)
    k = F.normalize(rand(B, T, Hk, K), dim=-1).to(dev, dtype)
    if strided:
        v = rand(B, T, Hv * V + 24).to(dev, dtype)[..., 8:8 + Hv * V].view(B, T, Hv, V)
        assert gdn_module.row_stride(v) == Hv * V + 24
    else:
        v = rand(B, T, Hv, V).to(dev, dtype)
    g = rand(B, T, Hv) if gate else F.logsigmoid(rand(B, T, Hv)) * 0.5
    beta = rand(B, T, Hv) if beta_mode else torch.rand(B, T, Hv, generator=gen)
    g, beta = g.to(dev), beta.to(dev, dtype)
    if bad is not None:
        name, b, t, h = bad
        x = {"k": k, "v": v, "g": g, "beta": beta}[name]
        x[(b, t, 0, 3) if name == "k" else (b, t, h, 3) if name == "v" else (b, t, h)] = float("nan")
    gates = None
    if gate:
        gates = ((torch.rand(Hv, generator=gen) * 2 - 2.5).to(dev), rand(Hv).to(dev) if dt_bias else None)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=dev)
    layout = gdn_module._varlen_layout(cu, B, T, dev)
    return k, v, g, beta, layout, gates


def _prep(inputs, fused, beta_mode=0):
    k, v, g, beta, layout, gates = inputs
    with torch.no_grad():
        return gdn_module._prep(k, v, g, beta, layout, gate=gates, beta_mode=beta_mode, fused=fused)


PREP_NAMES = ("A", "gcum", "w", "u", "t_bad")

# (id, B, T, Hk, Hv, K, V, dtype, options): options of _prep_inputs
PREP_CASES = [
    ("T1-fp32", 1, 1, 1, 1, 32, 32, torch.float32, {}),
    ("B2-T63-bf16-gqa2", 2, 63, 1, 2, 32, 16, torch.bfloat16, {}),
    ("T65-fp32-K48-V24", 1, 65, 1, 2, 48, 24, torch.float32, {}),
    ("T130-bf16-gqa3-gate-sigmoid", 1, 130, 1, 3, 16, 32, torch.bfloat16, dict(gate=True, beta_mode=1)),
    ("T130-fp16-gate-nobias-negeig", 1, 130, 2, 2, 16, 16, torch.float16,
     dict(gate=True, dt_bias=False, beta_mode=2)),
    ("varlen-bf16-gate-sigmoid", 1, 160, 1, 2, 16, 16, torch.bfloat16,
     dict(gate=True, beta_mode=1, bounds=[0, 30, 94, 94, 160])),
    ("T70-fp32-strided-v", 2, 70, 1, 2, 16, 16, torch.float32, dict(strided=True)),
    ("T130-fp32-nan-v", 1, 130, 1, 2, 16, 16, torch.float32, dict(bad=("v", 0, 100, 1))),
    ("varlen-bf16-nan-k-gate", 1, 160, 1, 2, 16, 16, torch.bfloat16,
     dict(gate=True, beta_mode=1, bounds=[0, 30, 94, 160], bad=("k", 0, 120, 0))),
    ("T130-fp32-nan-g", 1, 130, 1, 2, 16, 16, torch.float32, dict(bad=("g", 0, 70, 0))),
    ("T130-bf16-nan-beta", 1, 130, 1, 2, 16, 16, torch.bfloat16, dict(bad=("beta", 0, 64, 1))),
]


@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,opts", [pytest.param(*c[1:], id=c[0]) for c in PREP_CASES])
def test_prep_matches_split(monkeypatch, B, T, Hk, Hv, K, V, dtype, opts):
    """A, G, w, u and t_bad of the fused kernel are the split path's bit for bit, and every element is written
    and finite (the rows from a non-finite row on included: A's are the identity's, w's and u's 0)."""
    beta_mode = opts.get("beta_mode", 0)
    inputs = _prep_inputs(B, T, Hk, Hv, K, V, dtype, **opts)
    split, fused = both(monkeypatch, lambda: _prep(inputs, settings.gdn_fwd_prepare() == "fused", beta_mode))
    for name, a, b in zip(PREP_NAMES, split, fused):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(b.float()).all(), f"{name}: a non-finite (unwritten?) element"
        assert _same(b, a), f"{name}: differs from the split path's (relative error {rel_err(b, a):.3g})"
    t_bad = fused[4]
    if "bad" in opts:  # exactly the poisoned chunk, in the poisoned head (every value head of a poisoned key head)
        assert (t_bad < 64).sum() == (Hv // Hk if opts["bad"][0] == "k" else 1), t_bad
    else:
        assert (t_bad == 64).all(), t_bad


# ------------------------------------------------------------------------------------ through the op

# (id, B, T, Hk, Hv, K, V, dtype, l2norm, initial state, final state)
OP_CASES = [
    ("T1-fp32-h0", 1, 1, 1, 1, 16, 16, torch.float32, False, True, True),
    ("T63-fp32-gqa-l2-h0", 2, 63, 1, 2, 16, 32, torch.float32, True, True, True),
    ("T65-bf16-gqa3-nol2", 1, 65, 1, 3, 32, 16, torch.bfloat16, False, False, True),
    ("T130-bf16-l2-h0", 1, 130, 2, 2, 16, 16, torch.bfloat16, True, True, True),
    ("T130-fp32-K48-nostate", 1, 130, 1, 2, 48, 16, torch.float32, False, False, False),
]


@pytest.mark.parametrize("B,T,Hk,Hv,K,V,dtype,l2,h0,final", [
    slow_param(*c[1:], id=c[0], slow=c[0] == "T130-fp32-K48-nostate") for c in OP_CASES])
def test_op_matches_split_and_reference(monkeypatch, B, T, Hk, Hv, K, V, dtype, l2, h0, final):
    """Output, final state and every gradient (the backward reads the forward's A and G) with the fused prep:
    the split path's, and against the reference."""
    tensors = _inputs(B, T, Hk, Hv, K, V, dtype, h0=h0, normalized=not l2)
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(B, Hv, K, V, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=l2)
    split, fused = both(monkeypatch, lambda: _run(chunk_gated_delta_rule, tensors, kwargs, final, do, dht))
    assert _same(fused[0], split[0]) and _same(fused[1], split[1])
    assert set(fused[2]) == set(split[2])
    for name, grad in split[2].items():
        assert _same(fused[2][name], grad), name
    with monkeypatch.context() as m:
        launched = use_prepare(m, "fused")
        _compare(tensors, kwargs, final, dtype)
        assert set(launched) == {"fused"}, launched


@pytest.mark.parametrize("save", [False, slow_param(True)], ids=["split-forward", "split-forward-save"])
def test_op_split_forward_matches(monkeypatch, save):
    """The fused prep before the split forward (``DFLASH_KERNELS_GDN_FWD_SPLIT=1``: the state scan, then the output
    kernel) and, with ``save``, the states kept for the backward: the split prep's results."""
    monkeypatch.setenv("DFLASH_KERNELS_GDN_FWD_SPLIT", "1")
    if save:
        monkeypatch.setenv("DFLASH_KERNELS_GDN_SAVE_STATES", "1")
    tensors = _inputs(1, 70, 1, 2, 16, 16, torch.float32, h0=True)
    do = torch.randn(*tensors[2].shape, device=device())
    dht = torch.randn(1, 2, 16, 16, device=device())
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    split, fused = both(monkeypatch, lambda: _run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht))
    assert _same(fused[0], split[0]) and _same(fused[1], split[1])
    for name, grad in split[2].items():
        assert _same(fused[2][name], grad), name


@pytest.mark.parametrize("meta", ["cu_seqlens", "chunk_indices"])
def test_op_varlen_gate_sigmoid(monkeypatch, meta):
    """Packed sequences (short, one chunk, empty, off the boundary), the raw gate with A_log and dt_bias, beta
    logits, V-first states; the layout from cu_seqlens or from fla's chunk_indices: every output and gradient
    (A_log's and dt_bias' included) the split path's, and against the reference."""
    from tests.ops.test_gdn_fla_keywords import _compare as fla_compare
    from tests.ops.test_gdn_fla_keywords import _inputs as fla_inputs
    from tests.ops.test_gdn_fla_keywords import _run as fla_run
    from tests.ops.test_gdn_fla_keywords import prepare_chunk_indices

    bounds = [0, 30, 94, 94, 160]
    cu = torch.tensor(bounds, dtype=torch.long, device=device())
    kwargs = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu)
    if meta == "chunk_indices":
        kwargs["chunk_indices"] = prepare_chunk_indices(cu)
    tensors = fla_inputs(1, bounds[-1], 1, 2, 16, 16, torch.bfloat16, h0=True, N=len(bounds) - 1,
                         state_v_first=True)
    do = torch.randn(1, bounds[-1], 2, 16, device=device())
    dht = torch.randn(len(bounds) - 1, 2, 16, 16, device=device())
    split, fused = both(monkeypatch, lambda: fla_run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht))
    assert _same(fused[0], split[0]) and _same(fused[1], split[1])
    assert set(fused[2]) == set(split[2]) >= {"A_log", "dt_bias"}
    for name, grad in split[2].items():
        assert _same(fused[2][name], grad), name
    with monkeypatch.context() as m:
        use_prepare(m, "fused")
        fla_compare(tensors, kwargs, True, torch.bfloat16)


# One value head per poisoned token: rows 20, 40, 60 of the second chunk (the solve's 16-row blocks 1, 2, 3) and
# row 5 of the partial third chunk (block 0), as tests/ops/test_nonfinite.py.
BAD_TOKENS = (64 + 20, 64 + 40, 64 + 60, 128 + 5)


# The interpreter computes with numpy, which warns about the NaN arithmetic these cases cause on purpose.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("name", ["k", "v", "g", "beta"])
@pytest.mark.parametrize("dtype", [torch.float32, slow_param(torch.bfloat16)], ids=["fp32", "bf16"])
def test_op_nonfinite_rows(monkeypatch, name, dtype):
    """Forward, 150 tokens, head h NaN at token BAD_TOKENS[h] (k: the key head of every value head, each its own
    head here): the fused prep's outputs are the split path's, NaN in the same places; before the bad token they
    are those of a clean run, from it on NaN."""
    H = len(BAD_TOKENS)
    q, k, v, g, beta, _ = _inputs(1, 150, H, H, 16, 16, dtype)
    clean = (q, k, v, g, beta)
    x = {"k": k.clone(), "v": v.clone(), "g": g.clone(), "beta": beta.clone()}
    for h, t in enumerate(BAD_TOKENS):
        x[name][(0, t, h, 3) if x[name].dim() == 4 else (0, t, h)] = float("nan")
    bad = (q, x["k"], x["v"], x["g"], x["beta"])

    def forward(inputs):
        with torch.no_grad():
            return chunk_gated_delta_rule(*inputs, output_final_state=True)
    split, fused = both(monkeypatch, lambda: forward(bad))
    assert _same(fused[0], split[0]) and _same(fused[1], split[1])
    with monkeypatch.context() as m:
        use_prepare(m, "fused")
        o_clean = forward(clean)[0]
    o = fused[0]
    for h, t in enumerate(BAD_TOKENS):
        assert torch.equal(o[0, :t, h], o_clean[0, :t, h]), f"head {h}: an output before token {t} changed"
        assert (~o[0, t:, h].isfinite()).any(-1).all(), f"head {h}: an output from token {t} on stayed finite"
        assert torch.equal(o[0, :t, h], split[0][0, :t, h]), f"head {h}: differs from the split path before {t}"
        assert not fused[1][0, h].isfinite().all(), f"head {h}: the final state stayed finite"


# ----------------------------------------------------------------------------- every candidate, forced

def _dtype(kernel):
    return torch.float32 if kernel is PREPARE.fp32 else torch.bfloat16


CANDIDATES = ([(PREPARE.default, i, c) for i, c in enumerate(PREPARE.default.configs)]
              + [(PREPARE.fp32, i, c) for i, c in enumerate(PREPARE.fp32.configs)])
CANDIDATE_IDS = [f"{'fp32' if k is PREPARE.fp32 else 'bf16'}[{i}]-BV{c.meta['BV']}-BKB{c.meta['BKB']}-"
                 f"w{c.num_warps}" for k, i, c in CANDIDATES]


def _one_rounding_apart(got, ref, dtype):
    """Each element within one rounding of ``dtype`` of ``ref``'s (a sum in another order, then rounded)."""
    eps = torch.finfo(dtype).eps
    got, ref = got.double(), ref.double()
    scale = ref.abs().amax().clamp_min(1e-30)
    return bool(((got - ref).abs() <= eps * ref.abs() + 64 * torch.finfo(torch.float32).eps * scale).all())


@pytest.mark.parametrize("kernel,index,config", [pytest.param(*c, id=n) for c, n in zip(CANDIDATES, CANDIDATE_IDS)])
def test_candidate_prep(monkeypatch, force, kernel, index, config):
    """Each candidate forced alone at K = V = 64 (two column blocks of 32, one of 64, a block of 128 masked): A,
    G and t_bad the split path's bit for bit; w and u (blocks other than the split path's interpreted ones) one
    rounding apart (the module docstring), bit for bit where the blocks match; every element written."""
    dtype = _dtype(kernel)
    inputs = _prep_inputs(1, 130, 1, 2, 64, 64, dtype, gate=True, beta_mode=1, bad=("v", 0, 100, 1))
    with monkeypatch.context() as m:
        use_prepare(m, "split")
        split = _prep(inputs, False, 1)
    ran = force(kernel, config)
    with monkeypatch.context() as m:
        launched = use_prepare(m, "fused")
        fused = _prep(inputs, True, 1)
        assert launched == ["fused"], launched
    assert ran() and all(c == config.as_dict() for c in ran()), ran()
    for name, a, b in zip(PREP_NAMES, split, fused):
        assert torch.isfinite(b.float()).all(), f"{name}: a non-finite (unwritten?) element"
        if name in ("w", "u") and device().type == "cpu":
            same_blocks = (config.meta["BKB"] >= 64) if name == "w" else config.meta["BV"] == 16
            ok = _same(b, a) if same_blocks else _one_rounding_apart(b, a, dtype)
        else:
            ok = _same(b, a)
        assert ok, f"{name}: relative error to the split path {rel_err(b, a):.3g}"


@pytest.mark.parametrize("kernel,index,config", [
    slow_param(*c, id=n, slow=c[1] > 0) for c, n in zip(CANDIDATES, CANDIDATE_IDS)])
def test_candidate_op(force, monkeypatch, kernel, index, config):
    """Each candidate forced alone through the op (GQA, l2norm, an initial state, K = V = 64, T = 70): output,
    final state and every gradient against the reference. The first of each list by default, -m slow the rest."""
    dtype = _dtype(kernel)
    ran = force(kernel, config)
    launched = use_prepare(monkeypatch, "fused")
    _compare(_inputs(1, 70, 1, 2, 64, 64, dtype, h0=True, normalized=False), dict(use_qk_l2norm_in_kernel=True), True,
             dtype)
    assert set(launched) == {"fused"} and ran() and all(c == config.as_dict() for c in ran()), ran()


def test_candidates():
    """The bf16 list: 4 warps first, w's column blocks no wider than 128 (its dots' tiles), 2 warps only with
    w in blocks (a whole-K w tile spills there); fp32: 4 warps, one stage (ByPrecision)."""
    bf16, fp32 = PREPARE.default.configs, PREPARE.fp32.configs
    assert bf16[0].num_warps == 4 and all(c.num_warps in (2, 4) for c in bf16)
    assert all(c.meta["BKB"] < 128 for c in bf16 if c.num_warps == 2)
    assert all(c.num_warps == 4 and c.num_stages == 1 for c in fp32)
    assert PREPARE.default.interpret_config.meta["BKB"] >= 256 and PREPARE.default.interpret_config.meta["BV"] == 16


# --------------------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen-gate-sigmoid"])
def test_gpu_matches_split(monkeypatch, varlen):
    """At a Qwen-sized head (K = V = 128, GQA 3), bf16: the fused prep's outputs and gradients against the split
    path's (the same operations; tuned blocks may differ) and the reference's."""
    from tests.ops.test_gdn_fla_keywords import _compare as fla_compare
    from tests.ops.test_gdn_fla_keywords import _inputs as fla_inputs
    from tests.ops.test_gdn_fla_keywords import _run as fla_run

    bounds = [0, 1, 700, 764, 2000, 2003] if varlen else None
    T = bounds[-1] if varlen else 333
    N = len(bounds) - 1 if varlen else 2
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    if varlen:
        kwargs.update(cu_seqlens=torch.tensor(bounds, dtype=torch.long, device=device()), use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
    tensors = fla_inputs(1 if varlen else 2, T, 2, 6, 128, 128, torch.bfloat16, h0=True, N=N, dt_bias=varlen)
    if not varlen:
        tensors[3] = F.logsigmoid(tensors[3].float()).to(torch.bfloat16)
        tensors[4] = tensors[4].float().sigmoid().to(torch.bfloat16)
        tensors[5] = tensors[6] = None
    do = torch.randn(tensors[2].shape, device=device())
    dht = torch.randn(N, 6, 128, 128, device=device())
    split, fused = both(monkeypatch, lambda: fla_run(chunk_gated_delta_rule, tensors, kwargs, True, do, dht))
    assert _same(fused[0], split[0]) and _same(fused[1], split[1])
    for name, grad in split[2].items():
        assert _same(fused[2][name], grad), name
    with monkeypatch.context() as m:
        use_prepare(m, "fused")
        fla_compare(tensors, kwargs, True, torch.bfloat16)


@pytest.mark.parametrize("kernel,index,config", [
    slow_param(*c, id=n, slow=c[1] > 0) for c, n in zip(CANDIDATES, CANDIDATE_IDS)])
def test_fits_hopper_shared_memory(kernel, index, config):
    """Each candidate compiles for sm_90 (Triton's toolchain: no GPU needed) within its shared memory, with the
    raw gate and beta logits (the kernel's largest form). The first of each list by default, -m slow the rest;
    ``python -m tools.studies.sm90_resources gdn_prepare`` reports their registers and spills."""
    from tests.helpers import H200_SHARED_MEMORY, hopper_shared_memory

    consts = dict(HK=16, HV=48, K=128, V=128, BT=64, BK=128, IS_VARLEN=False, GATE=True, HAS_DT_BIAS=True,
                  BETA_MODE=1)
    dt = "*fp32" if kernel is PREPARE.fp32 else "*bf16"
    types = {p: dt for p in ("k_ptr", "v_ptr", "beta_ptr", "w_ptr", "u_ptr")}
    types.update({p: "*fp32" for p in ("g_ptr", "A_log_ptr", "dt_bias_ptr", "gcum_ptr", "A_ptr")})
    types.update({p: "*i32" for p in ("t_bad_ptr", "cu_seqlens_ptr", "chunk_indices_ptr")})
    (smem,) = hopper_shared_memory("dflash_kernels.ops.gated_delta_rule.kernels_fwd_fused", "_gdn_fwd_prepare_kernel",
                                   types, consts, [(config.num_warps, config.num_stages, dict(config.meta))])
    assert 0 < smem <= H200_SHARED_MEMORY, (config, smem)
