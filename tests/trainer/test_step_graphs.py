"""``trainer.step_graph.DrafterStep``: the drafter's forward, backward, clip and AdamW step as CUDA graphs
give the eager steps' losses, statistics, gradient norms and weights (the learning-rate schedule
included); the option is refused by name where it cannot run; the eager path is the loop it replaced;
checkpoints hold plain float learning rates either way."""

import json

import pytest
import torch

import dflash_kernels as dk
from trainer.common import build_drafter, current_lr, lr_lambda
from trainer.config import TrainConfig, preset
from trainer.step import clip_and_step, forward_loss, target_features
from trainer.step_graph import DrafterStep
from trainer.target import load_target


def _setup(tiny_qwen35_dir, dev, dtype=torch.float32, seed=0):
    from trainer.data import Dataset, batch_at

    cfg = preset("tiny", device=str(dev), lr=3e-3, warmup_ratio=0.5)
    target = load_target(tiny_qwen35_dir, k=cfg.num_target_layers, device=dev, dtype=dtype)
    torch.manual_seed(seed)
    drafter = build_drafter(cfg, target, target.vocab_size - 1).to(dev)
    g = torch.Generator().manual_seed(1)
    seqs = []
    for n in (60, 64, 41, 64, 50, 33, 64, 57):  # right-padded to max_len: one batch shape
        ids = torch.randint(1, target.vocab_size, (n,), generator=g)
        lm = torch.ones(n, dtype=torch.bool)
        lm[:4] = False
        seqs.append((ids, lm))
    dataset = Dataset(seqs, stats=None)
    batches = [batch_at(dataset, i, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed)
               for i in range(6)]
    return cfg, target, drafter, batches


def _optimizer(drafter, cfg, steps, kind="fused", dtype=torch.float32):
    if kind == "copies":  # MasterAdamW over bf16 compute copies (trainer.compute_weights)
        from trainer.compute_weights import make_optimizer

        opt = make_optimizer(drafter, cfg, dtype, "copies")
    else:
        fused = next(drafter.parameters()).is_cuda
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, cfg.warmup_ratio, cfg.min_lr_ratio))


def test_the_eager_step_is_the_loop_it_replaced(tiny_qwen35_dir):
    """graphs=False: forward_loss -> backward -> clip_and_step -> zero_grad, bit for bit, no gradients left."""
    dev = torch.device("cpu")
    results = []
    for use_step in (False, True):
        cfg, target, drafter, batches = _setup(tiny_qwen35_dir, dev)
        opt, sched = _optimizer(drafter, cfg, len(batches))
        step = DrafterStep(drafter, target, opt, cfg, dev, torch.float32)
        losses = []
        for b in batches[:3]:
            if use_step:
                loss, stats, gnorm = step(b, target_features(target, b, dev))
                assert all(p.grad is None for p in drafter.parameters())
            else:
                loss, stats = forward_loss(b, target, drafter, cfg, dev, torch.float32)
                loss.backward()
                gnorm = clip_and_step(opt, drafter.parameters(), cfg.grad_clip)
                opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append((loss.item(), stats["acc"], float(gnorm)))
        results.append((losses, [p.detach().clone() for p in drafter.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_refused_where_it_cannot_run(tiny_qwen35_dir, tmp_path, counting_data):
    cfg, target, drafter, _ = _setup(tiny_qwen35_dir, torch.device("cpu"))
    opt, _ = _optimizer(drafter, cfg, 4)
    with pytest.raises(ValueError, match="step_cuda_graphs: needs the drafter on a CUDA device, it is on cpu"):
        DrafterStep(drafter, target, opt, cfg, "cpu", torch.float32, graphs=True)
    from trainer.train import train

    run = preset("tiny", target=tiny_qwen35_dir, data=counting_data, out_dir=str(tmp_path / "run"), steps=1,
                 device="cpu", step_cuda_graphs="on")
    with pytest.raises(ValueError, match="step_cuda_graphs"):
        train(run, log=lambda s: None)


def test_the_config_option():
    import argparse

    from trainer.config import add_cli_args, from_cli

    cfg = preset("tiny")
    assert cfg.step_cuda_graphs == "auto"
    assert cfg.step_graphs_on("cuda:0") and cfg.step_graphs_on(torch.device("cuda", 1))
    assert not cfg.step_graphs_on("cpu") and not preset("tiny", step_cuda_graphs="off").step_graphs_on("cuda")
    assert preset("tiny", step_cuda_graphs="auto", compute_weights="copies").step_graphs_on("cuda")
    assert preset("tiny", step_cuda_graphs="on").step_graphs_on("cpu")  # DrafterStep refuses it by name
    assert preset("tiny", step_cuda_graphs=True).step_cuda_graphs == "on"
    assert TrainConfig.from_dict({**cfg.to_dict(), "step_cuda_graphs": False}).step_cuda_graphs == "off"
    with pytest.raises(ValueError, match="step_cuda_graphs: expected one of .*'sometimes'"):
        preset("tiny", step_cuda_graphs="sometimes")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert from_cli(parser.parse_args(["--step-cuda-graphs", "off"])).step_cuda_graphs == "off"
    assert from_cli(parser.parse_args([])).step_cuda_graphs == "auto"


def test_checkpoints_hold_float_learning_rates(tmp_path):
    """A device-tensor lr (what DrafterStep sets) is saved as a float; the live optimizer keeps its tensor;
    current_lr reads the schedule, not the tensor."""
    from trainer.checkpoint import read_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.5, 0.0))
    opt.param_groups[0]["lr"] = torch.tensor(1e-2)  # as DrafterStep does (on the drafter's device)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert current_lr(sched) == pytest.approx(1e-2 * lr_lambda(10, 0.5, 0.0)(1))
    assert current_lr(sched) == pytest.approx(float(opt.param_groups[0]["lr"]))
    path = str(tmp_path / "ck.pt")
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=1, config={})
    ck = read_checkpoint(path)
    assert type(ck["optimizer"]["param_groups"][0]["lr"]) is float
    assert all(type(v) is float for v in ck["scheduler"]["_last_lr"])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.parametrize("kind", ["torch", "master"])
def test_checkpoints_hold_no_device_specific_optimizer_state(tmp_path, kind):
    """The optimizer of a step-graph run (capturable groups, a device-tensor lr, the step counts tensors on the
    device) is saved as an eager run's: not capturable, float lrs, step counts float32 CPU scalars; the live
    optimizer keeps its own."""
    from trainer.checkpoint import read_checkpoint, save_checkpoint
    from trainer.compute_weights import MasterAdamW

    model = torch.nn.Linear(3, 2)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if kind == "torch" else
           MasterAdamW(model.parameters(), None, lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.5, 0.0))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    for g in opt.param_groups:  # what DrafterStep sets (its tensors on the drafter's device)
        g["capturable"] = True
        g["lr"] = torch.tensor(float(g["lr"]), dtype=getattr(opt, "lr_dtype", torch.float32))
    for st in opt.state.values():
        st["step"] = torch.as_tensor(st["step"], dtype=torch.float32)
    path = str(tmp_path / "ck.pt")
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=1, config={})
    ck = read_checkpoint(path)
    assert [g["capturable"] for g in ck["optimizer"]["param_groups"]] == [False]
    assert type(ck["optimizer"]["param_groups"][0]["lr"]) is float
    for st in ck["optimizer"]["state"].values():
        step = st["step"]
        assert step.device.type == "cpu" and step.dtype == torch.float32 and step.shape == () and float(step) == 1
    assert opt.param_groups[0]["capturable"] is True and isinstance(opt.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, "fused"), (torch.float32, "fused"),
                                        (torch.bfloat16, "copies")], ids=["bf16", "fp32", "bf16-copies"])
def test_graphed_steps_are_the_eager_ones(tiny_qwen35_dir, dtype, kind):
    """Six steps with a changing learning rate, eager against graphs (eager, captured, four replays); with
    torch's fused AdamW, and with MasterAdamW over bf16 compute copies (its capturable mode under graphs,
    host step counts eagerly)."""
    dev = torch.device("cuda")
    before = dk.get_backend("attention")
    dk.set_backend("attention", "auto")  # the library's kernels, as a GPU run has them
    try:
        runs = []
        for graphs in (False, True):
            cfg, target, drafter, batches = _setup(tiny_qwen35_dir, dev, dtype)
            opt, sched = _optimizer(drafter, cfg, len(batches), kind, dtype)
            assert kind != "copies" or hasattr(drafter, "compute_weights")
            step = DrafterStep(drafter, target, opt, cfg, dev, dtype, graphs=graphs)
            out, prev = [], [p.detach().clone() for p in drafter.parameters()]
            for b in batches:
                loss, stats, gnorm = step(b, target_features(target, b, dev))
                sched.step()
                now = [p.detach().clone() for p in drafter.parameters()]
                moved = max((a - c).abs().max().item() for a, c in zip(now, prev))
                assert moved > 0, "the step updated the weights"
                prev = now
                out.append((loss, stats, gnorm, current_lr(sched)))
            assert step.info() == {"graphs": graphs, "captured": int(graphs)}
            runs.append((out, prev))
    finally:
        dk.set_backend("attention", before)
    (eager, w_eager), (graphed, w_graphed) = runs
    # the outputs of earlier replays were not overwritten by later ones
    assert len({r[0].data_ptr() for r in graphed}) == len(graphed)
    for i, (e, g) in enumerate(zip(eager, graphed)):
        assert e[3] == g[3], i
        assert torch.allclose(e[0], g[0], rtol=1e-5, atol=1e-6), (i, e[0].item(), g[0].item())
        assert torch.allclose(e[2], g[2], rtol=1e-4, atol=1e-6), (i, e[2].item(), g[2].item())
        assert e[1]["tokens"] == g[1]["tokens"] and e[1]["acc"] == pytest.approx(g[1]["acc"], abs=1e-6)
    worst = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(w_graphed, w_eager))
    assert worst < 1e-4, worst


@pytest.mark.gpu
@pytest.mark.parametrize("compute_weights", ["autocast", "copies"])
def test_training_with_step_graphs_gives_the_same_losses(tmp_path, tiny_qwen35_dir, counting_data, compute_weights):
    """trainer.train with and without the step's graphs. Each run starts from an empty kernel cache, as a
    fresh process does: its loop runs in strict mode, so a kernel its set-up did not precompile fails it
    (MasterAdamW's, before the trainer precompiled it: the warm-up step runs no optimizer step)."""
    from trainer.train import train

    losses = {}
    for flag in ("off", "on"):
        dk.reset_cache()
        out = tmp_path / f"run-{flag}"
        cfg = preset("tiny", target=tiny_qwen35_dir, data=counting_data, out_dir=str(out), steps=6, device="cuda",
                     step_cuda_graphs=flag, save_interval=3, compute_weights=compute_weights)
        train(cfg, log=lambda s: None)
        with open(out / "metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        losses[flag] = [(r["loss"], r["lr"]) for r in recs if "loss" in r]
    assert len(losses["on"]) == 6
    for (a, lr_a), (b, lr_b) in zip(losses["off"], losses["on"]):
        assert lr_a == lr_b and a == pytest.approx(b, rel=1e-4)
