"""``Target.use_cuda_graphs``: the frozen target's feature forward replayed as CUDA graphs gives the eager
features bit for bit (any ids of the captured shape, another shape, threads on their own streams), and a
trainer run with ``--target-cuda-graphs on`` the same losses; on a CPU "on" is refused by name and the
default, "auto", runs eagerly."""

import threading

import pytest
import torch

from trainer.config import preset
from trainer.target import load_target


def test_refused_on_the_cpu(tiny_qwen35_dir):
    target = load_target(tiny_qwen35_dir, k=2, device="cpu")
    with pytest.raises(ValueError, match="target_cuda_graphs: needs the target on a CUDA device"):
        target.use_cuda_graphs()
    target.use_cuda_graphs(False)  # switching off is always fine
    ids = torch.randint(0, target.vocab_size, (2, 40))
    assert target.features(ids).shape == (2, 40, 2 * target.hidden_size)


def test_train_refuses_the_option_on_the_cpu(tmp_path, tiny_qwen35_dir, counting_data):
    from trainer.train import train

    cfg = preset("tiny", target=tiny_qwen35_dir, data=counting_data, out_dir=str(tmp_path / "run"), steps=1,
                 device="cpu", target_cuda_graphs="on")
    with pytest.raises(ValueError, match="target_cuda_graphs"):
        train(cfg, log=lambda s: None)


def test_the_config_default_is_auto_graphs_on_cuda_only():
    import argparse

    from trainer.config import TrainConfig, add_cli_args, from_cli

    cfg = preset("tiny")
    assert cfg.target_cuda_graphs == "auto"
    assert cfg.target_graphs_on("cuda") and cfg.target_graphs_on(torch.device("cuda", 1))
    assert not cfg.target_graphs_on("cpu") and not cfg.target_graphs_on(torch.device("cpu"))
    on, off = preset("tiny", target_cuda_graphs="on"), preset("tiny", target_cuda_graphs="off")
    assert on.target_graphs_on("cpu") and not off.target_graphs_on("cuda:0")  # "on" on a CPU: Target refuses it
    # True / False, as configs saved before "auto" hold them
    assert preset("tiny", target_cuda_graphs=True).target_cuda_graphs == "on"
    assert TrainConfig.from_dict({**cfg.to_dict(), "target_cuda_graphs": False}).target_cuda_graphs == "off"
    with pytest.raises(ValueError, match="target_cuda_graphs: expected one of .*'maybe'"):
        preset("tiny", target_cuda_graphs="maybe")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert from_cli(parser.parse_args(["--target-cuda-graphs", "off"])).target_cuda_graphs == "off"
    assert from_cli(parser.parse_args([])).target_cuda_graphs == "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graphed_features_are_the_eager_ones(tiny_qwen35_dir, dtype):
    target = load_target(tiny_qwen35_dir, k=2, device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, target.vocab_size, shape, generator=g).cuda() for shape in
               ((2, 96), (2, 96), (1, 130), (2, 96))]
    eager = [target.features(ids) for ids in batches]
    target.use_cuda_graphs()
    graphed = [target.features(ids) for ids in batches]
    assert len(target._graphs) == 2, "one graph per shape"
    for i, (a, b) in enumerate(zip(graphed, eager)):
        assert torch.equal(a, b), i
    assert graphed[0].data_ptr() != graphed[1].data_ptr(), "each call returns its own tensor"
    assert torch.equal(graphed[0], eager[0]), "a later replay does not overwrite an earlier result"


@pytest.mark.gpu
def test_threads_on_their_own_streams(tiny_qwen35_dir):
    target = load_target(tiny_qwen35_dir, k=2, device="cuda", dtype=torch.bfloat16)
    ids = [torch.randint(0, target.vocab_size, (2, 96), generator=torch.Generator().manual_seed(i)).cuda()
           for i in range(4)]
    eager = [target.features(x) for x in ids]
    target.use_cuda_graphs()
    got, errors = {}, []

    def work(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(3):
                    got[i] = target.features(ids[i])
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        assert torch.equal(got[i], eager[i]), i


@pytest.mark.gpu
def test_training_with_graphs_gives_the_same_losses(tmp_path, tiny_qwen35_dir, counting_data):
    import json

    from trainer.train import train

    losses = {}
    for flag in (False, True):
        out = tmp_path / f"run{int(flag)}"
        cfg = preset("tiny", target=tiny_qwen35_dir, data=counting_data, out_dir=str(out), steps=6, device="cuda",
                     target_cuda_graphs="on" if flag else "off")
        train(cfg, log=lambda s: None)
        with open(out / "metrics.jsonl") as f:
            losses[flag] = [json.loads(line)["loss"] for line in f if "loss" in json.loads(line)]
    assert losses[True] and losses[True] == losses[False]
