"""fused_adamw_ against torch.optim.AdamW and the fp32 reference: fp32 and bf16 gradients, the device-side
gradient scale, the compute copies, odd sizes, bad input."""

import copy

import pytest
import torch

from dflash_kernels.ops.adamw import fused_adamw_, naive_adamw_
from tests.helpers import device, rel_err, require_triton_kernels

SHAPES = [(37, 129), (5000,), (3, 7, 11), (1,), (8, 256)]  # odd sizes (a tail block), and one of only full blocks


@pytest.fixture(autouse=True)
def _require_kernels():
    require_triton_kernels("adamw")


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(device()) for s in SHAPES]
    return ps, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 0.1).to(dtype).to(device()) for s in SHAPES]


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
def test_matches_torch_adamw_over_steps(gdtype):
    """Five steps with weight decay: parameters and moments as torch.optim.AdamW's given the same
    gradients (upcast where ours reads bf16), to fp32 rounding (torch's single-tensor path uses lerp)."""
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ps, ms, vs = _state()
    ref = [p.clone().requires_grad_() for p in ps]
    opt = torch.optim.AdamW(ref, foreach=False, **hp)
    for step in range(1, 6):
        grads = _grads(step, gdtype)
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        fused_adamw_(ps, grads, ms, vs, lr=hp["lr"], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
    for p, r, m, v in zip(ps, ref, ms, vs):
        st = opt.state[r]
        assert rel_err(p, r.detach()) < 1e-6
        assert rel_err(m, st["exp_avg"]) < 1e-6 and rel_err(v, st["exp_avg_sq"]) < 1e-6


def test_grad_scale_and_compute_copies():
    """A device-side scale divides every gradient (as a clip's 1 / coef would); each compute copy is the
    updated parameter rounded to bf16, exactly; the reference agrees."""
    ps, ms, vs = _state(1)
    ps2, ms2, vs2 = (copy.deepcopy(x) for x in (ps, ms, vs))
    copies = [torch.empty(p.shape, dtype=torch.bfloat16, device=device()) for p in ps]
    copies[2] = None  # a parameter without a compute copy (e.g. a norm weight kept fp32)
    scale = torch.tensor([3.0], device=device())
    for step in (1, 2):
        grads = _grads(step, torch.bfloat16)
        fused_adamw_(ps, grads, ms, vs, lr=1e-3, step=step, weight_decay=0.01, grad_scale=scale,
                     compute_copies=copies)
        naive_adamw_(ps2, [g.float() / 3.0 for g in grads], ms2, vs2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.01, step=step)
    for p, p2, c in zip(ps, ps2, copies):
        assert rel_err(p, p2) < 1e-6
        if c is not None:
            if c.is_cuda:  # the kernel's cast rounds to nearest even, as torch's
                assert torch.equal(c, p.to(torch.bfloat16))
            else:  # the Triton interpreter's fp32 -> bf16 cast truncates: within one bf16 ulp
                assert bool(((c.float() - p).abs() <= p.abs() * 2.0 ** -7).all())


def test_learning_rate_and_step_on_the_device():
    """lr a one-element tensor and step one tensor per parameter (what a CUDA graph records): the host path's
    numbers, the bias corrections from each parameter's own count; the reference reads them back."""
    ps, ms, vs = _state(2)
    ps2, ms2, vs2 = (copy.deepcopy(x) for x in (ps, ms, vs))
    ps3, ms3, vs3 = (copy.deepcopy(x) for x in (ps, ms, vs))
    lr = torch.tensor([0.0], device=device())
    steps = [torch.zeros((), device=device()) for _ in ps]
    for step, lr_now in ((1, 1e-2), (2, 5e-3), (3, 2e-3)):
        grads = _grads(step, torch.bfloat16)
        lr.fill_(lr_now)
        torch._foreach_add_(steps, 1)
        fused_adamw_(ps, grads, ms, vs, lr=lr, step=steps, weight_decay=0.1, beta2=0.95)
        fused_adamw_(ps2, grads, ms2, vs2, lr=lr_now, step=step, weight_decay=0.1, beta2=0.95)
        naive_adamw_(ps3, grads, ms3, vs3, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=steps)
    for a, b, c in zip(ps, ps2, ps3):
        assert rel_err(a, b) < 1e-6 and rel_err(a, c) < 1e-6
    for a, b in zip(ms + vs, ms2 + vs2):
        assert torch.equal(a, b)
    # one shared step tensor; counts that differ per parameter use each its own
    for t, n in zip(steps, [1] + [4] * (len(steps) - 1)):
        t.fill_(n)
    one, many = copy.deepcopy(ps), copy.deepcopy(ps)
    g = _grads(9, torch.float32)
    fused_adamw_(one, g, copy.deepcopy(ms), copy.deepcopy(vs), lr=1e-2, step=torch.tensor(4.0, device=device()))
    fused_adamw_(many, g, copy.deepcopy(ms), copy.deepcopy(vs), lr=1e-2, step=steps)  # 1, 4, 4, ...
    ref = copy.deepcopy(ps)
    naive_adamw_(ref[:1], g[:1], copy.deepcopy(ms[:1]), copy.deepcopy(vs[:1]), lr=1e-2, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.0, step=1)
    assert rel_err(many[0], ref[0]) < 1e-6 and rel_err(many[0], one[0]) > 1e-4
    for a, b in zip(one[1:], many[1:]):
        assert rel_err(a, b) < 1e-7


@pytest.fixture
def tuning_forced(monkeypatch, tmp_path):
    """The adamw kernel's next launch is tuned: a fresh tuning file, no packaged results, an empty cache for
    the kernel. Under the interpreter (which never tunes) the runtime's own tuning path is run all the same:
    the kernel counts as compiled, each candidate's launcher is the interpreter's, and ``do_bench`` launches its
    trial a few times instead of timing it. Yields the list of configs the tuner tried."""
    import contextlib
    import types

    import triton

    from dflash_kernels.ops.adamw.kernels import adamw_kernel as k
    from dflash_kernels.runtime.kernel import TritonKernel

    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "0")
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    tried = []
    if k.interpreted:
        interp = types.SimpleNamespace(interpreted=True, fn=k.fn, constexpr_names=k.constexpr_names)

        def build(config, meta, args, dev):
            tried.append(config)
            return TritonKernel._build_launcher(interp, config, meta, args, dev)

        def bench(fn, warmup=None, rep=None, return_mode=None):
            for _ in range(3):
                fn()
            return float(len(tried))  # the first candidate "fastest"

        monkeypatch.setattr(k, "interpreted", False)
        monkeypatch.setattr(k, "_build_launcher", build)
        monkeypatch.setattr(triton.testing, "do_bench", bench)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    k.reset()
    yield k
    k.reset()  # later tests get the kernel's usual entries


def test_tuning_restores_what_the_step_updates(tuning_forced):
    """The kernel updates the parameter, the moments and the compute copy in place, and the tuner launches every
    candidate many times on the real tensors: it must put them back, so that the call that tuned is still
    exactly one step (parameters, moments and the bf16 copy as the reference's one step)."""
    k = tuning_forced
    dev = device()
    g = torch.Generator().manual_seed(7)
    ps = [torch.randn(37, 129, generator=g).to(dev), torch.randn(5000, generator=g).to(dev)]
    gs = [torch.randn(37, 129, generator=g).to(dev, torch.bfloat16), torch.randn(5000, generator=g).to(dev)]
    ms = [torch.randn(p.shape, generator=g).mul(0.1).to(dev) for p in ps]  # a later step: moments not zero
    vs = [torch.rand(p.shape, generator=g).mul(0.01).to(dev) for p in ps]
    cs = [torch.full((37, 129), float("nan"), device=dev, dtype=torch.bfloat16), None]
    ref = [copy.deepcopy(x) for x in (ps, ms, vs)]
    scale = torch.full((1,), 2.0, device=dev)
    fused_adamw_(ps, gs, ms, vs, lr=1e-2, step=3, weight_decay=0.1, grad_scale=scale, compute_copies=cs)
    naive_adamw_(*ref[:1], [x.float() / 2 for x in gs], *ref[1:], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.1, step=3)
    info = k.cache_info()
    assert info and {e["tuned_from"] for e in info.values()} == {"timed"}, info  # the tuner ran
    for got, want in zip(ps + ms + vs, ref[0] + ref[1] + ref[2]):
        assert rel_err(got, want) < 1e-6
    assert bool(((cs[0].float() - ps[0]).abs() <= ps[0].abs() * 2.0 ** -7).all())  # within a bf16 ulp


def _real_step(device_hparams, dev):
    """One step as the trainer's copies path takes it: a 2-D weight with a bf16 gradient and compute copy, a
    1-D one with an fp32 gradient and none, the clip's scale, lr / step on the host or the device."""
    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(37, 5, generator=g).to(dev), torch.randn(129, generator=g).to(dev)]
    gs = [torch.randn(37, 5, generator=g).to(dev, torch.bfloat16), torch.randn(129, generator=g).to(dev)]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    cs = [torch.full((37, 5), float("nan"), device=dev, dtype=torch.bfloat16), None]  # poisoned
    if device_hparams:
        lr, step = torch.full((1,), 1e-2, device=dev), [torch.ones((), device=dev) for _ in ps]
    else:
        lr, step = 1e-2, 1
    ref = [p.clone() for p in ps]
    fused_adamw_(ps, gs, ms, vs, lr=lr, step=step, grad_scale=torch.full((1,), 2.0, device=dev),
                 compute_copies=cs)
    naive_adamw_(ref, [x.float() / 2 for x in gs], [torch.zeros_like(p) for p in ref],
                 [torch.zeros_like(p) for p in ref], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 step=1)
    return ps, cs, ref


@pytest.mark.parametrize("device_hparams", [False, True], ids=["host_lr", "device_lr"])
def test_precompile_then_strict(device_hparams):
    """``precompile("adamw", ...)`` compiles on scratch tensors exactly the kernels a real step launches (the
    trainer precompiles its MasterAdamW step this way before its strict loop): without it the step is
    refused in strict mode, after it the step runs and matches the reference."""
    import dflash_kernels as dk
    from dflash_kernels.runtime.errors import KernelCacheMiss

    dev = device()
    dk.reset_cache()
    with dk.strict(), pytest.raises(KernelCacheMiss, match="adamw"):
        _real_step(device_hparams, dev)
    spec = dict(tensors=[dict(numel=185, grad_dtype="bfloat16", copy_dtype=torch.bfloat16), dict(numel=129)],
                grad_scale=True, device_hparams=device_hparams)
    report = dk.precompile([("adamw", spec, torch.float32)], devices=[dev], verbose=False)
    assert {k[0] for k in report["keys"]} == {"adamw"} and len(report["keys"]) == 2, report["keys"]
    with dk.strict():
        ps, cs, ref = _real_step(device_hparams, dev)
    for p, r in zip(ps, ref):
        assert rel_err(p, r) < 1e-6
    assert rel_err(cs[0].float(), ref[0]) < 1e-2


def test_device_hparams_rows_are_16_byte_aligned():
    """Each parameter's row of the device hyperparameters starts 16-byte aligned: the kernel's key holds its
    pointers' alignment, so with 12-byte rows it depended on the parameter's index in the list, and a
    precompile (scratch tensors, one per size) missed the real step's keys (a strict-mode failure on the GPU)."""
    from dflash_kernels.ops.adamw.adamw import device_hparams
    hp = device_hparams(7, torch.tensor([1e-3], device=device()), [torch.ones((), device=device())] * 7, 0.9, 0.99,
                        0.1, device())
    assert hp.shape == (7, 4) and all(hp[i].data_ptr() % 16 == 0 for i in range(7))
    assert torch.allclose(hp[0, :3], torch.tensor([1 - 1e-4, 1e-3 / 0.1, 0.01 ** 0.5], device=device()))


@pytest.mark.parametrize("spec,match", [
    (dict(), r"shape\['tensors'\]: expected a non-empty list"),
    (dict(tensors=[dict(numel=0)]), r"shape\['tensors'\]\[0\]\['numel'\]: expected an int >= 1, got 0"),
    (dict(tensors=[dict(numel=8, grad_dtype="bf16")]), r"\['grad_dtype'\]: expected a torch dtype or its name, got 'bf16'"),
])
def test_precompile_bad_spec(spec, match):
    import dflash_kernels as dk
    with pytest.raises(ValueError, match=match):
        dk.precompile([("adamw", spec, torch.float32)], devices=[device()], verbose=False)


BAD = [
    (lambda a: dict(a, params=[a["params"][0].double()]), TypeError, r"params\[0\]: dtype torch.float64"),
    (lambda a: dict(a, grads=[a["grads"][0][:-1]]), ValueError, r"grads\[0\]: shape"),
    (lambda a: dict(a, grads=[a["grads"][0].long()]), TypeError, r"grads\[0\]: dtype torch.int64"),
    (lambda a: dict(a, exp_avgs=[]), ValueError, "exp_avgs: expected 1 tensors"),
    (lambda a: dict(a, lr=float("nan")), ValueError, "lr: expected a finite number"),
    (lambda a: dict(a, beta1=1.5), ValueError, "beta1: expected a finite number in"),
    # torch's AdamW refuses beta >= 1 too: beta1 = 1 divides by a zero bias correction, beta2 = 1 makes every
    # parameter NaN
    (lambda a: dict(a, beta1=1.0), ValueError, r"beta1: expected a finite number in \[0, 1\), got 1.0"),
    (lambda a: dict(a, beta2=1.0), ValueError, r"beta2: expected a finite number in \[0, 1\), got 1.0"),
    (lambda a: dict(a, beta2=-0.5), ValueError, r"beta2: expected a finite number in \[0, 1\), got -0.5"),
    (lambda a: dict(a, step=0), ValueError, "step: expected an int >= 1"),
    (lambda a: dict(a, grad_scale=torch.ones(2)), ValueError, "grad_scale: expected a one-element"),
    (lambda a: dict(a, lr=torch.ones(2)), ValueError, r"lr: expected a number or a one-element float tensor, got "
                                                      r"torch.float32 \(2,\)"),
    (lambda a: dict(a, step=torch.ones((), dtype=torch.int64)), ValueError, "step: expected a number or a one-element"),
    (lambda a: dict(a, step=[torch.ones(()), torch.ones(())]), ValueError, "step: expected 1 tensors"),
    (lambda a: dict(a, params=[a["params"][0].t()]), ValueError, r"params\[0\]: must be contiguous"),
]


@pytest.mark.parametrize("change,exc,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(change, exc, match):
    p = torch.randn(4, 6)
    a = change(dict(params=[p], grads=[torch.randn(4, 6)], exp_avgs=[torch.zeros(4, 6)],
                    exp_avg_sqs=[torch.zeros(4, 6)], lr=1e-3, beta1=0.9, beta2=0.999, step=1, grad_scale=None))
    with pytest.raises(exc, match=match):
        fused_adamw_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], lr=a["lr"], beta1=a["beta1"],
                     beta2=a["beta2"], step=a["step"], grad_scale=a["grad_scale"])
