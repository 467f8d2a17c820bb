"""The training loop on a tiny random Qwen3 target: loss goes down, resume repeats the trajectory,
checkpoints and the HF-style drafter folder are written."""

import json
import os
import re

import pytest
import torch

from trainer.config import preset
from trainer.model import DFlashDrafter
from trainer.train import train


def tiny_cfg(target, data, out, **kw):
    return preset("tiny", target=target, data=data, out_dir=str(out), **kw)


def test_tiny_run_loss_decreases(tmp_path, tiny_qwen3_dir, counting_data):
    hist = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path, steps=16, warmup_ratio=0.1), log=lambda s: None)
    losses = [r["loss"] for r in hist]
    assert len(losses) == 16 and all(map(lambda x: x == x, losses))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.7 * first, losses
    assert hist[-1]["acc"] > hist[0]["acc"]
    # The drafter folder carries the DFlash fields and loads back to the same weights.
    with open(tmp_path / "drafter" / "config.json") as f:
        meta = json.load(f)
    assert meta["block_size"] == 16 and meta["target_layer_ids"] == [1, 3] and meta["mask_token_id"] == 3
    d = DFlashDrafter.from_pretrained(str(tmp_path / "drafter"))
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 16 and set(ck) >= {"model", "optimizer", "scheduler", "config", "rng"}
    assert all(torch.equal(v, ck["model"][k]) for k, v in d.state_dict().items())
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_resume_repeats_the_uninterrupted_trajectory(tmp_path, tiny_qwen3_dir, counting_data):
    quiet = lambda s: None  # noqa: E731
    full = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path / "a", steps=6), log=quiet)
    part = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", steps=6), log=quiet, stop_after=3)
    assert len(part) == 3
    torch.manual_seed(123)  # the resumed run must not depend on the process's RNG state at start
    resumed = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", steps=6), resume=True, log=quiet)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full]
    with open(tmp_path / "b" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 7))


def test_cli_log_line(tmp_path, tiny_qwen3_dir, counting_data, capsys):
    from trainer.train import main

    main(["--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data, "--out-dir", str(tmp_path),
          "--steps", "2", "--log-interval", "2", "--num-anchors", "3", "--target-layer-ids", "2,4"])
    out = capsys.readouterr().out
    line = [s for s in out.splitlines() if s.startswith("step 2/2")]
    assert line, out
    for field in ("loss", "acc", "tok/s", "ms/step", "peak", "GiB", "eta"):
        assert field in line[0]
    assert "data: " in out and "kept 16 of 16 records" in out
    assert json_load(tmp_path / "drafter" / "config.json")["target_layer_ids"] == [2, 4]


def test_each_step_records_its_model_flops(tmp_path, tiny_qwen3_dir, counting_data):
    """metrics rows carry the step's model TFLOP (trainer.flops on that step's batch, the target counted up
    to its deepest feature layer), which the GPU log line turns into MFU."""
    from trainer.common import build_drafter
    from trainer.data import batch_at, load_jsonl
    from trainer.flops import step_flops
    from trainer.target import load_target, resolve_mask_token_id

    cfg = tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path, steps=3, target_layer_ids=[1, 2])
    hist = train(cfg, log=lambda s: None)
    target = load_target(tiny_qwen3_dir, cfg.target_layer_ids)
    assert target.layers_run == 3 < target.num_layers  # the tiny target has layers above the deepest feature
    ds = load_jsonl(counting_data, target.tokenizer, cfg.max_len, cfg.block_size, vocab_size=target.vocab_size,
                    log=lambda s: None)
    drafter = build_drafter(cfg, target, resolve_mask_token_id(target.tokenizer, target.vocab_size, None))
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    for i, rec in enumerate(hist):
        batch = batch_at(ds, i, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed, pad)
        parts = step_flops(target.model, drafter, batch, target.layers_run)
        assert rec["tflop"] == pytest.approx(parts["total"] / 1e12, rel=1e-12)
        assert parts["target_fwd"] < step_flops(target.model, drafter, batch)["target_fwd"]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["tflop"] for line in f] == [r["tflop"] for r in hist]


def test_the_log_line_shows_mfu_on_a_gpu(monkeypatch):
    import trainer.common as common

    monkeypatch.setattr(common, "peak_mem_gib", lambda dev: 1.0)
    window = [{"loss": 1.0, "acc": 0.5, "lr": 1e-4, "tokens": 1000, "ms": 100.0, "tflop": 989 * 0.1 * 0.25},
              {"loss": 1.0, "acc": 0.5, "lr": 1e-4, "tokens": 1000, "ms": 300.0, "tflop": 989 * 0.3 * 0.75}]
    line = common.step_log_line(window, 2, 10, torch.device("cuda"))
    assert "| MFU 62.5% |" in line, line  # (24.725 + 222.525) TFLOP over 0.4 s against 989 TFLOP/s
    assert "| MFU 31.2% |" in common.step_log_line(window, 2, 10, torch.device("cuda"), gpus=2)  # the pipeline's
    assert "MFU" not in common.step_log_line(window, 2, 10, torch.device("cpu"))  # the peak is a GPU's
    untimed = [{k: v for k, v in window[0].items() if k != "tflop"}]  # records without a count
    assert "MFU" not in common.step_log_line(untimed, 1, 10, torch.device("cuda"))


def json_load(path):
    with open(path) as f:
        return json.load(f)


def test_packed_run_trains_and_logs_the_packing(tmp_path, tiny_qwen3_dir, counting_data):
    """``--pack`` in the single-process loop: records share rows, every step's loss is finite, and
    the loss goes down as in the padded run."""
    logged = []
    hist = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path, steps=12, warmup_ratio=0.1, max_len=128,
                          pack=True), log=logged.append)
    assert any("packed into" in s for s in logged), logged
    losses = [r["loss"] for r in hist]
    assert len(losses) == 12 and all(x == x and x < float("inf") for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


@pytest.mark.parametrize("loss", ["fused", "chunked"])
def test_loss_paths_train_the_same_trajectory(tmp_path, tiny_qwen3_dir, counting_data, loss):
    """--loss fused (the library's linear_cross_entropy, the default) and --loss chunked (torch in row
    chunks) give the same losses, accuracies and weights as the whole-logits loss, up to fp32 rounding."""
    quiet = lambda s: None  # noqa: E731
    ref = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path / "a", steps=4, loss="logits"), log=quiet)
    got = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", steps=4, loss=loss), log=quiet)
    for r, g in zip(ref, got, strict=True):
        assert abs(r["loss"] - g["loss"]) <= 1e-5 * abs(r["loss"]) and r["acc"] == g["acc"], (r, g)
    wa = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    for k, v in wa.items():
        assert (wb[k] - v).abs().max() <= 1e-4 * v.abs().max().clamp_min(1e-6), k


def test_configs_saved_with_chunked_loss_still_load():
    from trainer.config import TrainConfig

    old = preset("tiny").to_dict()
    old.pop("loss")
    assert TrainConfig.from_dict({**old, "chunked_loss": True}).loss == "chunked"
    assert TrainConfig.from_dict({**old, "chunked_loss": False}).loss == "logits"
    with pytest.raises(ValueError, match="loss"):
        preset("tiny", loss="fast")


@pytest.mark.parametrize("betas,match", [((0.9, 1.0), r"betas\[1\]: expected a number in \[0, 1\), got 1.0"),
                                         ((1, 0.95), r"betas\[0\]: expected a number in \[0, 1\), got 1"),
                                         ((0.9, 0.95, 0.99), r"betas: expected two numbers, got \(0.9, 0.95, 0.99\)")],
                         ids=["beta2_one", "beta1_one", "three"])
def test_betas_outside_0_1_are_refused_when_the_config_is_made(betas, match, capsys):
    """A config, a saved config and the --betas flag refuse beta >= 1 (as torch's AdamW) by the field's name,
    before anything is loaded: the command ends with argparse's usage error (exit status 2)."""
    from trainer.config import TrainConfig
    from trainer.train import main

    with pytest.raises(ValueError, match=match):
        preset("tiny", betas=betas)
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict({**preset("tiny").to_dict(), "betas": list(betas)})
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--betas", ",".join(map(str, betas))])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


@pytest.mark.slow
def test_fused_elementwise_ops_train_the_same_trajectory(tmp_path, tiny_qwen3_dir, counting_data, monkeypatch):
    """The drafter's fused RMSNorm / RoPE / SwiGLU (the default on a GPU) against its plain torch chains (the
    path before them): the same losses, accuracies and weights over a run, up to fp32 rounding."""
    import trainer.model as model_mod

    quiet = lambda s: None  # noqa: E731
    calls = []
    real = model_mod.fused_swiglu
    monkeypatch.setattr(model_mod, "fused_swiglu", lambda *a: calls.append(1) or real(*a))
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(model_mod, "FUSED_OPS", fused)
        runs[fused] = train(tiny_cfg(tiny_qwen3_dir, counting_data, tmp_path / str(fused), steps=6), log=quiet)
    assert calls, "the fused run called no fused op"
    for r, g in zip(runs[False], runs[True], strict=True):
        assert abs(r["loss"] - g["loss"]) <= 1e-4 * abs(r["loss"]) and abs(r["acc"] - g["acc"]) <= 1e-3, (r, g)
    wa = torch.load(tmp_path / "False" / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "True" / "checkpoint.pt", weights_only=False)["model"]
    for k, v in wa.items():
        assert (wb[k] - v).abs().max() <= 1e-3 * v.abs().max().clamp_min(1e-6), k
