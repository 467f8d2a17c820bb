"""The built-in targets a run without --target trains on, and what a run says before its first step.

``--preset tiny`` trains on a random tiny target built in seconds (trainer.random_target), never on the
embedded default, whose build takes minutes on a CPU; that build, and every long phase of the trainer's
set-up, logs a line before it starts, and the build's long stages log progress with an ETA.
"""

import json
import os
import types

import pytest
import torch

import dflash_kernels as dk
import trainer.build_default as build_default
from trainer.config import preset
from trainer.train import train


@pytest.fixture
def reference_hybrid_ops():
    """The tiny target's Gated DeltaNet and conv on their torch references (the trainer's wiring is under
    test here, not the kernels; under TRITON_INTERPRET=1 "auto" would interpret them)."""
    before = {op: dk.get_backend(op) for op in ("gdn", "conv1d")}
    for op in before:
        dk.set_backend(op, "reference")
    yield
    for op, name in before.items():
        dk.set_backend(op, name)


def no_embedded_build(*args, **kwargs):
    raise AssertionError("the embedded default was built")


def index_of(lines, prefix):
    return next(i for i, s in enumerate(lines) if s.startswith(prefix))


def test_the_tiny_preset_trains_on_a_tiny_target_built_in_seconds(tmp_path, monkeypatch, reference_hybrid_ops):
    monkeypatch.setattr(build_default, "build", no_embedded_build)
    cache = str(tmp_path / "cache")
    logged = []
    hist = train(preset("tiny", cache_dir=cache, out_dir=str(tmp_path / "run"), steps=2), log=logged.append)
    assert [r["step"] for r in hist] == [1, 2] and all(r["loss"] == r["loss"] for r in hist)
    root = os.path.join(cache, "tiny")
    config = json.loads(open(tmp_path / "run" / "drafter" / "config.json").read())
    assert config["vocab_size"] == 512 and config["hidden_size"] == 64  # the tiny Qwen3.5 hybrid's sizes
    with open(os.path.join(root, "build.json")) as f:
        assert json.load(f)["seconds"] < 60
    assert any(s.startswith("tiny target: building a random tiny target") for s in logged), logged
    # trainer.eval finds the tiny target the drafter was trained on
    from trainer.eval import main as eval_main

    res = eval_main(["--drafter", str(tmp_path / "run" / "drafter"), "--builtin-target", "tiny", "--cache-dir", cache,
                     "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu"])
    assert res["target"] == os.path.join(root, "target") and res["trained"]["prompts"] == 1
    # a second run finds it
    logged.clear()
    train(preset("tiny", cache_dir=cache, out_dir=str(tmp_path / "run2"), steps=1), log=logged.append)
    assert f"tiny target: {root}" in logged and not any("building" in s for s in logged), logged


def test_the_tiny_target_folder(tmp_path):
    from transformers import Qwen3_5TextConfig

    from trainer.random_target import TEXT_CONFIGS, ensure_tiny
    from trainer.target import load_target

    paths = ensure_tiny(str(tmp_path), log=lambda s: None)
    target = load_target(paths["target"], k=2)
    text = Qwen3_5TextConfig(**TEXT_CONFIGS["tiny"])
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (text.num_hidden_layers,
                                                                          text.hidden_size, text.vocab_size)
    assert len(target.tokenizer) <= target.vocab_size and target.tokenizer.mask_token_id is not None
    with open(paths["train"]) as f:
        records = [json.loads(line) for line in f]
    assert len(records) >= 64 and {len(r["input_ids"]) for r in records} == {preset("tiny").max_len}
    assert all(0 <= t < target.vocab_size for r in records for t in r["input_ids"])
    assert len(set(records[0]["input_ids"])) > 8  # text, not one token repeated
    with open(paths["eval_prompts"]) as f:
        assert sum(1 for _ in f) > 0
    mtime = os.path.getmtime(paths["build"])
    assert ensure_tiny(str(tmp_path), log=lambda s: None) == paths and os.path.getmtime(paths["build"]) == mtime


def test_builtin_target_is_checked():
    with pytest.raises(ValueError, match="builtin_target: expected one of .*'huge'"):
        preset("tiny", builtin_target="huge")
    assert preset("embedded").builtin_target == "embedded" and preset("tiny").builtin_target == "tiny"


def test_a_missing_embedded_default_says_it_is_built_first(tmp_path, monkeypatch):
    """Before the minutes-long build starts, the run says what it is doing, where, and how to avoid it."""
    from trainer.common import resolve_paths

    calls, logged = [], []

    def fake_build(root, steps, device=None, log=print, **sizes):
        calls.append(len(logged))
        with open(os.path.join(root, "build.json"), "w") as f:
            f.write("{}")
    monkeypatch.setattr(build_default, "build", fake_build)
    cfg = preset("embedded", cache_dir=str(tmp_path), device="cpu")
    resolve_paths(cfg, log=logged.append)
    assert calls == [1] and logged[0].startswith("build_default: the embedded default target is not built yet: "
                                                 f"building it into {tmp_path / 'embedded'} on cpu"), logged
    assert "--preset tiny" in logged[0]
    resolve_paths(cfg, log=logged.append)
    assert calls == [1] and logged[-1] == f"embedded default target: {tmp_path / 'embedded'}"


@pytest.mark.slow
def test_the_embedded_build_shows_its_stages_and_progress(tmp_path, monkeypatch, reference_hybrid_ops):
    """A shrunk build (12 source files, 3 target steps, 4 responses of 4 tokens): a line before each stage,
    and progress with an ETA in the long ones. (An earlier test's target may have routed the hybrid layers of
    transformers' Qwen3.5 module to dflash_kernels, process-wide: the build then runs their references.)"""
    files = build_default.stdlib_files()[:12]
    monkeypatch.setattr(build_default, "stdlib_files", lambda: files)
    logged = []
    root = tmp_path / "embedded"
    root.mkdir()
    build_default.build(str(root), steps=3, vocab_size=300, seq_len=32, batch=8, n_train=4, n_eval=2, prompt_len=8,
                        gen_len=4, device="cpu", log=logged.append, progress_s=0.0)
    stages = [index_of(logged, f"build_default: [{i}/4]") for i in (1, 2, 3, 4)]
    assert stages == sorted(stages), logged
    steps = [s for s in logged if s.startswith("build_default: target step ")]
    assert [s.split()[3] for s in steps] == ["1/3", "2/3", "3/3"], logged
    assert all("ETA" in s and "loss" in s for s in steps), steps
    assert stages[1] < index_of(logged, "build_default: target step 1/3") < stages[2]
    regen = [s for s in logged if s.startswith("build_default: regenerated batch 1/1")]
    assert regen and "ETA 0:00" in regen[0] and "(4/4 responses)" in regen[0], logged
    assert os.path.exists(root / "build.json")


def test_progress_lines_are_throttled():
    logged = []
    progress = build_default.Progress(logged.append, "step", 100, every_s=3600.0)
    for i in range(1, 101):
        progress(i)
    assert [s.split()[2] for s in logged] == ["1/100", "100/100"]  # the first and the last only


def test_the_trainer_says_what_it_does_before_training(tmp_path, tiny_qwen3_dir, counting_data):
    logged = []
    train(preset("tiny", target=tiny_qwen3_dir, data=counting_data, out_dir=str(tmp_path), steps=1),
          log=logged.append)
    order = [index_of(logged, p) for p in (f"target: loading {tiny_qwen3_dir} on cpu", f"target: {tiny_qwen3_dir}:",
                                           f"data: reading and tokenizing {counting_data}", "drafter:",
                                           "training: steps 1 to 1", "step 1/1")]
    assert order == sorted(order), logged


def test_precompile_says_it_compiles_before_it_does(monkeypatch):
    import trainer.train as train_mod

    logged = []
    monkeypatch.setattr(train_mod.dk, "precompile",
                        lambda specs, devices: logged.append("compiling") or {"keys": ["k"] * len(specs),
                                                                              "seconds": 1.5})
    monkeypatch.setattr(train_mod.dk, "precompile_recorded", lambda dev, verbose: logged.append("recorded") or {
        "current": 40, "done_before": 40, "compiled": 0, "seconds": 0.25})
    config = types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"], num_heads=2, num_kv_heads=1,
                                   head_dim=64, block_size=16, sliding_window=24)
    train_mod._precompile(preset("tiny"), types.SimpleNamespace(config=config), object(), torch.device("cuda"),
                          torch.bfloat16, logged.append)
    assert logged[0].startswith("precompile: the 2 kernels of this run's shapes on cuda, compiled and tuned")
    assert logged[1:] == ["recorded", "precompile: 40 recorded kernels compiled in parallel processes (0.2s waited "
                          "for them here)", "compiling", "precompile: 2 kernels in 1.5s"]
