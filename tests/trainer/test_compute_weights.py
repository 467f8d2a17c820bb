"""trainer.compute_weights: bf16 leaves written by MasterAdamW train as fp32 masters under bf16 autocast do."""

import copy

import pytest
import torch

from trainer.compute_weights import ComputeWeights, MasterAdamW
from trainer.step import clip_and_step


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(48, 96, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(96))  # 1-D: stays fp32, no leaf
        self.b = torch.nn.Linear(96, 8)  # its bias is 1-D too

    def forward(self, x, scale=1.0):
        return self.b(torch.nn.functional.silu(self.a(x)) * self.norm) * scale


def _run(model, opt, cw, steps=6):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(32, 48, generator=g) * (30 if i < 3 else 0.1)  # clipped first, then not
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x, scale=2.0) if cw is None else cw(model, x, scale=2.0)
        y.float().square().mean().backward()
        clip_and_step(opt, model.parameters(), 1.0)
        opt.zero_grad(set_to_none=True)


@pytest.fixture()
def adamw_reference():
    """The step's math in plain torch (the kernel is held to it in tests/ops/test_adamw.py): its bf16
    copies round to nearest as autocast's casts do, where the Triton interpreter's casts truncate."""
    import dflash_kernels as dk
    before = dk.get_backend("adamw")
    dk.set_backend("adamw", "reference")
    yield
    dk.set_backend("adamw", before)


def test_trains_as_autocast_with_fp32_masters(adamw_reference):
    torch.manual_seed(0)
    ref = Toy()
    ours = copy.deepcopy(ref)
    _run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), None)
    cw = ComputeWeights(ours)
    assert set(cw.copies) == {"a.weight", "b.weight"}
    opt = MasterAdamW(ours.parameters(), cw, lr=1e-2, weight_decay=0.1)
    _run(ours, opt, cw)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p - q).abs().max() <= 1e-5 * p.abs().max(), name
    masters = dict(ours.named_parameters())
    for name, leaf in cw.copies.items():  # each leaf is its master rounded, written by the step
        assert torch.equal(leaf.detach(), masters[name].detach().to(torch.bfloat16)), name
    assert all(leaf.grad is None for leaf in cw.copies.values()), "zero_grad hands the leaves' gradients back"


def test_state_dict_round_trip_and_refresh():
    torch.manual_seed(0)
    model = Toy()
    cw = ComputeWeights(model)
    opt = MasterAdamW(model.parameters(), cw, lr=1e-2)
    _run(model, opt, cw, steps=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert all(v.dtype == torch.float32 for v in saved_model.values()), "checkpoints keep the fp32 masters"
    other = Toy()
    other.load_state_dict(saved_model)
    cw2 = ComputeWeights(other)
    opt2 = MasterAdamW(other.parameters(), cw2, lr=1e-2)
    opt2.load_state_dict(saved_opt)
    cw2.refresh(other)
    cw.refresh(model)  # the same leaves both ways (the Triton interpreter's casts truncate; torch's round)
    _run(model, opt, cw, steps=2)
    _run(other, opt2, cw2, steps=2)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_capturable_mode_takes_the_same_steps():
    """capturable=True (the step counts device tensors, lr a tensor filled in place, as under
    trainer.step_graph's graphs) gives the host-count path's weights and moments; a restored state keeps
    its counts where the group wants them."""
    torch.manual_seed(0)
    model = Toy()
    other = copy.deepcopy(model)
    cw, cw2 = ComputeWeights(model), ComputeWeights(other)
    opt = MasterAdamW(model.parameters(), cw, lr=1e-2, weight_decay=0.1)
    opt2 = MasterAdamW(other.parameters(), cw2, lr=1e-2, weight_decay=0.1, capturable=True)
    opt2.param_groups[0]["lr"] = torch.tensor(1e-2, dtype=MasterAdamW.lr_dtype)  # as DrafterStep makes it
    _run(model, opt, cw)
    _run(other, opt2, cw2)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name  # fp64 lr: the same fp32 hyperparameters, the same steps bit for bit
    for p, q in zip(model.parameters(), other.parameters()):
        a, b = opt.state[p], opt2.state[q]
        assert float(a["step"]) == float(b["step"]) == 6.0
        assert (a["exp_avg"] - b["exp_avg"]).abs().max() <= 1e-6 * a["exp_avg"].abs().max()
    state = copy.deepcopy(opt2.state_dict())
    opt3 = MasterAdamW(copy.deepcopy(other).parameters(), None, lr=1e-2)
    opt3.load_state_dict(state)  # the saved group was capturable: its counts stay tensors of the parameters' device
    assert opt3.param_groups[0]["capturable"] and all(st["step"].dim() == 0 for st in opt3.state.values())


@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clip", "no_clip"])
@pytest.mark.parametrize("capturable", [False, True], ids=["host_counts", "capturable"])
def test_precompile_specs_cover_the_step(capturable, max_norm):
    """trainer.train precompiles MasterAdamW's kernels from precompile_specs before its strict loop (the warm-up
    step runs no optimizer step): after the cache is emptied and only those specs compiled, step_with_clip
    runs in strict mode; without them it is refused."""
    import dflash_kernels as dk
    from dflash_kernels.runtime.errors import KernelCacheMiss

    from tests.helpers import device, require_triton_kernels

    require_triton_kernels("adamw")  # the CPU without the interpreter runs torch's math: nothing to compile
    dev = device()
    torch.manual_seed(0)
    model = Toy().to(dev)
    cw = ComputeWeights(model)
    opt = MasterAdamW(model.parameters(), cw, lr=1e-2, capturable=capturable)
    if capturable:
        opt.param_groups[0]["lr"] = torch.tensor(1e-2, device=dev)
    specs = opt.precompile_specs(max_norm)
    (op, shape, dtype), = specs
    assert op == "adamw" and dtype == torch.float32
    assert shape["grad_scale"] == (max_norm > 0) and shape["device_hparams"] == capturable
    assert sorted((t["numel"], t["copy_dtype"]) for t in shape["tensors"]) == [
        (8, None), (96, None), (768, torch.bfloat16), (4608, torch.bfloat16)]  # b.bias, norm, b.weight, a.weight

    def one_step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = cw(model, torch.randn(32, 48, device=dev), scale=2.0)
        y.float().square().mean().backward()
        norm = opt.step_with_clip(max_norm)
        opt.zero_grad(set_to_none=True)
        return norm

    dk.reset_cache()
    with dk.strict(), pytest.raises(KernelCacheMiss, match="adamw"):
        one_step()
    opt.state.clear()  # the refused step's counts (it raised before any update)
    dk.precompile(specs, devices=[dev], verbose=False)
    before = [p.detach().clone() for p in model.parameters()]
    with dk.strict():
        norm = one_step()
    assert torch.isfinite(norm) and float(norm) > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_auto_is_copies_for_the_single_process_loop_on_a_gpu_in_16_bits():
    from trainer.config import preset

    cfg = preset("tiny")
    assert cfg.compute_weights == "auto"
    assert cfg.compute_weights_for("cuda:0", torch.bfloat16) == "copies"
    assert cfg.compute_weights_for(torch.device("cuda", 1), torch.float16) == "copies"
    assert cfg.compute_weights_for("cuda", torch.float32) == "autocast"  # nothing to copy
    assert cfg.compute_weights_for("cpu", torch.bfloat16) == "autocast"
    assert cfg.compute_weights_for("cuda", torch.bfloat16, pipeline=True) == "autocast"
    for explicit in ("autocast", "copies"):
        c = preset("tiny", compute_weights=explicit)
        assert c.compute_weights_for("cpu", torch.float32) == c.compute_weights_for("cuda", torch.bfloat16) == explicit
    with pytest.raises(ValueError, match="compute_weights: expected one of .*'sometimes'"):
        preset("tiny", compute_weights="sometimes")


def test_the_pipeline_refuses_explicit_copies_by_name():
    from trainer.config import preset
    from trainer.pipeline import run_pipeline

    with pytest.raises(ValueError, match="compute_weights: 'copies' is supported by the single-process loop only"):
        run_pipeline(preset("tiny", compute_weights="copies", target_gpus="cpu"))


@pytest.mark.parametrize("bad", ["lr"])
def test_bad_hyperparameters_name_the_argument(bad):
    model = Toy()
    opt = MasterAdamW(model.parameters(), ComputeWeights(model), lr=float("nan"))
    with pytest.raises(ValueError, match="lr: expected a finite number"):
        _run(model, opt, None, steps=1)


@pytest.mark.parametrize("betas,match", [((0.9, 1.0), r"betas\[1\]: expected a number in \[0, 1\), got 1.0"),
                                         ((1.0, 0.999), r"betas\[0\]: expected a number in \[0, 1\), got 1.0"),
                                         ((-0.1, 0.999), r"betas\[0\]: expected a number in \[0, 1\), got -0.1"),
                                         ((0.9,), r"betas: expected two numbers, got \(0.9,\)")],
                         ids=["beta2_one", "beta1_one", "beta1_negative", "one_beta"])
def test_betas_outside_0_1_are_refused_at_construction(betas, match):
    """As torch's AdamW: beta2 = 1 would make every parameter NaN, beta1 = 1 divide by a zero bias correction."""
    model = Toy()
    with pytest.raises(ValueError, match=match):
        MasterAdamW(model.parameters(), ComputeWeights(model), lr=1e-3, betas=betas)


def test_the_drafter_trains_the_same_with_copies(tmp_path, tiny_qwen3_dir, counting_data, adamw_reference):
    """trainer.train at the tiny preset in bf16 on the CPU: compute_weights="copies" (the drafter's forward
    through functional_call with the bf16 leaves, MasterAdamW) against "autocast": the same losses and
    accuracies, weights equal to bf16-forward rounding."""
    from trainer.config import preset
    from trainer.train import train

    quiet = lambda s: None  # noqa: E731
    def cfg(out, cw):
        return preset("tiny", target=tiny_qwen3_dir, data=counting_data, out_dir=str(out), steps=4, dtype="bfloat16",
                      compute_weights=cw)
    ref = train(cfg(tmp_path / "a", "autocast"), log=quiet)
    lines = []
    got = train(cfg(tmp_path / "b", "copies"), log=lines.append)
    assert any("(torch.bfloat16)" in line for line in lines), lines  # the run was in bf16
    used = []
    import trainer.compute_weights as cwm
    real_step = cwm.MasterAdamW.step

    def counting(self, *a, **k):
        used.append(1)
        return real_step(self, *a, **k)
    cwm.MasterAdamW.step = counting
    try:
        train(cfg(tmp_path / "c", "copies"), log=quiet)
    finally:
        cwm.MasterAdamW.step = real_step
    assert len(used) == 4, "MasterAdamW took the steps"
    # The first step's loss is bit-identical (the same bf16 weights and inputs). After updates the fp32
    # masters differ by the two AdamW implementations' roundings (torch's op order against the library
    # kernel's), which can flip single bf16 weights by one ulp (2^-8 relative): with transformers 5.24 the
    # fourth loss differed by 1.03e-4 relative (steps 1-3: 0.0). The bound is a tenth of one bf16 ulp.
    assert ref[0]["loss"] == got[0]["loss"], (ref[0], got[0])
    for r, g in zip(ref, got, strict=True):
        assert abs(r["loss"] - g["loss"]) <= 3.9e-4 * abs(r["loss"]) and r["acc"] == g["acc"], (r, g)
    wa = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    for k, v in wa.items():
        assert wb[k].dtype == v.dtype == torch.float32, k
        assert (wb[k] - v).abs().max() <= 1e-3 * v.abs().max().clamp_min(1e-6), k
