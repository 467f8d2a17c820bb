"""The trainer loses nothing: SIGTERM in the single-process loop checkpoints and exits 0, a resume refuses a
changed config, a new run refuses a folder holding an earlier one, killed saves leave nothing that breaks a
resume, a damaged checkpoint is named, and (on a GPU) a resumed run repeats the uninterrupted one."""

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

import dflash_kernels as dk
from trainer.checkpoint import CheckpointError, rng_state, set_rng_state
from trainer.config import preset
from trainer.pipeline import run_pipeline
from trainer.rundir import RESUME_MAY_CHANGE, ConfigChanged, RunDirError, config_changes
from trainer.supervise import RunLog
from trainer.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny(target, data, out, **kw):
    return preset("tiny", target=target, data=data, out_dir=str(out), **kw)


def quiet(s):
    pass


def quiet_log():
    log = RunLog()
    log.log = lambda msg: None
    return log


def steps_in(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def losses_in(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def ckpt_step(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["step"]


# ----------------------------------------------------------------------------- SIGTERM (CPU)
def start_cli(args, fault=None, env_extra=None):
    env = dict(os.environ, DFLASH_KERNELS_BACKEND="attention=reference", PYTHONPATH=ROOT)
    env.pop("DFLASH_TRAINER_FAULT", None)
    if fault:
        env["DFLASH_TRAINER_FAULT"] = fault
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "trainer.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(proc, path, text, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and text in open(path).read():
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"{text!r} not in {path} after {timeout}s")


def sigterm_then_resume(tmp_path, target, data, steps=10, extra=(), env_extra=None, timeout=120):
    """Start the single-process loop, SIGTERM it after step 2, resume it; returns the stopped step."""
    out = tmp_path / "run"
    args = ["--preset", "tiny", "--target", target, "--data", data, "--out-dir", str(out), "--steps", str(steps),
            *extra]
    proc = start_cli(args, fault="drafter0:slow@0", env_extra=env_extra)  # 0.5 s per step
    wait_for(proc, out / "train.log", f"step 2/{steps}", timeout)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, text[-3000:]
    log = (out / "train.log").read_text()
    assert "SIGTERM received" in log
    stopped = ckpt_step(out)
    assert 2 <= stopped < steps
    assert f"stopped by SIGTERM after step {stopped} of {steps}" in log
    assert steps_in(out / "metrics.jsonl") == list(range(1, stopped + 1))
    proc = start_cli(args + ["--resume"], env_extra=env_extra)
    text, _ = proc.communicate(timeout=timeout + 60)
    assert proc.returncode == 0, text[-3000:]
    assert f"resume: from step {stopped}" in text
    assert ckpt_step(out) == steps
    assert steps_in(out / "metrics.jsonl") == list(range(1, steps + 1))
    return stopped


@pytest.mark.slow
def test_sigterm_in_the_single_process_loop_checkpoints_and_resumes(tmp_path, tiny_qwen3_dir, counting_data):
    sigterm_then_resume(tmp_path, tiny_qwen3_dir, counting_data, steps=10)
    # The resumed trajectory is the uninterrupted one (same process kind: a fresh CLI run).
    ref = tmp_path / "ref"
    proc = start_cli(["--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data, "--out-dir", str(ref),
                      "--steps", "10"])
    text, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, text[-3000:]
    assert losses_in(tmp_path / "run" / "metrics.jsonl") == losses_in(ref / "metrics.jsonl")


# ------------------------------------------------------------------------ config on resume
def test_config_changes_lists_the_differing_fields():
    a = preset("tiny").to_dict()
    b = preset("tiny", lr=1e-3, betas=(0.9, 0.95), log_interval=7).to_dict()
    assert config_changes(a, b) == {"log_interval": (1, 7), "lr": (3e-3, 1e-3)}  # tuple vs list: no change
    old = {k: v for k, v in a.items() if k != "loss"}  # a field added since: its default applies
    assert config_changes(old, a) == {}
    assert {"out_dir", "log_interval", "save_interval", "steps"} <= RESUME_MAY_CHANGE
    assert not {"lr", "seed", "target", "data", "max_len", "num_layers"} & RESUME_MAY_CHANGE


def test_resume_refuses_a_changed_config(tmp_path, tiny_qwen3_dir, counting_data):
    out = tmp_path / "run"
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=6), log=quiet, stop_after=2)
    with pytest.raises(ConfigChanged) as e:
        train(tiny(tiny_qwen3_dir, counting_data, out, steps=6, lr=1e-3, seed=5), resume=True, log=quiet)
    msg = str(e.value)
    assert "lr: 0.003 -> 0.001" in msg and "seed: 0 -> 5" in msg and "--allow-config-change" in msg
    assert str(out / "checkpoint.pt") in msg
    assert ckpt_step(out) == 2 and steps_in(out / "metrics.jsonl") == [1, 2]  # nothing touched
    # The pipeline refuses it the same way.
    with pytest.raises(ConfigChanged, match="seed: 0 -> 5"):
        run_pipeline(tiny(tiny_qwen3_dir, counting_data, out, steps=6, seed=5, target_gpus="cpu"), resume=True,
                     log=quiet_log())
    # Fields a resume may change pass (and are logged); the rest with --allow-config-change.
    logged = []
    hist = train(tiny(tiny_qwen3_dir, counting_data, out, steps=4, log_interval=2), resume=True, log=logged.append,
                 stop_after=3)
    assert [r["step"] for r in hist] == [1, 2, 3]
    assert any("may change" in s and "steps: 6 -> 4" in s for s in logged), logged
    logged = []
    hist = train(tiny(tiny_qwen3_dir, counting_data, out, steps=4, lr=1e-3), resume=True, log=logged.append,
                 allow_config_change=True)
    assert [r["step"] for r in hist] == [1, 2, 3, 4]
    assert any("WARNING" in s and "lr: 0.003 -> 0.001" in s for s in logged), logged


def test_cli_refuses_a_changed_config(tmp_path, tiny_qwen3_dir, counting_data):
    base = ["--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data, "--out-dir", str(tmp_path),
            "--steps", "3"]
    from trainer.train import main

    main(base)
    # A refusal ends the command with its message (exit status 1), no traceback.
    with pytest.raises(SystemExit, match="gamma: 7.0 -> 3.0.*--allow-config-change"):
        main(base + ["--resume", "--gamma", "3"])
    with pytest.raises(SystemExit, match="holds an earlier run.*--resume.*--overwrite"):
        main(base)
    main(base + ["--resume", "--gamma", "3", "--steps", "4", "--allow-config-change"])
    assert ckpt_step(tmp_path) == 4


def test_allow_config_change_trains_with_the_new_optimizer_settings(tmp_path, tiny_qwen3_dir, counting_data,
                                                                    monkeypatch):
    """--allow-config-change applies the new lr, betas, weight decay and schedule from the resumed step on
    (the moments and step counts are the checkpoint's): the steps take them, the log line says them and the
    next checkpoint records them."""
    import trainer.train as train_mod
    from trainer.common import lr_lambda

    out = tmp_path / "run"
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=6), log=quiet, stop_after=2)
    taken = []  # the first group's settings as each step after the resume takes them
    real_call = train_mod.DrafterStep.__call__

    def spy(self, batch, feats):
        g = self.opt.param_groups[0]
        taken.append((float(g["lr"]), tuple(g["betas"]), g["weight_decay"]))
        return real_call(self, batch, feats)

    monkeypatch.setattr(train_mod.DrafterStep, "__call__", spy)
    logged = []
    hist = train(tiny(tiny_qwen3_dir, counting_data, out, steps=6, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.05,
                      warmup_ratio=0.5), resume=True, log=logged.append, allow_config_change=True, stop_after=4)
    f = lr_lambda(6, 0.5, 0.0)  # the new schedule: 3 warm-up steps, then cosine
    assert taken == [(1e-3 * f(2), (0.8, 0.9), 0.05), (1e-3 * f(3), (0.8, 0.9), 0.05)]
    assert [r["lr"] for r in hist[2:]] == [1e-3 * f(3), 1e-3 * f(4)]
    line = [s for s in logged if s.startswith("resume: from step 2")]
    assert len(line) == 1 and "lr 0.001" in line[0] and "betas (0.8, 0.9)" in line[0] and \
        "weight decay 0.05" in line[0], logged
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    g = ck["optimizer"]["param_groups"][0]
    assert (g["lr"], tuple(g["betas"]), g["weight_decay"]) == (1e-3 * f(4), (0.8, 0.9), 0.05)
    assert ck["scheduler"]["base_lrs"] == [1e-3] and ck["scheduler"]["last_epoch"] == 4
    assert (ck["config"]["lr"], tuple(ck["config"]["betas"]), ck["config"]["weight_decay"]) == (1e-3, (0.8, 0.9), 0.05)
    assert {int(s["step"]) for s in ck["optimizer"]["state"].values()} == {4}  # the counts went on from 2


def test_restore_keeps_the_optimizer_settings_it_was_built_with(tmp_path):
    """restore() loads the moments, the step counts and the position in the schedule; lr, betas, eps, weight
    decay and the schedule's base lr stay those the optimizer and scheduler were built with (this run's
    config), the lr set as the new schedule has it at the saved step. The pipeline restores the same way."""
    from trainer.checkpoint import read_checkpoint, restore, save_checkpoint
    from trainer.common import lr_lambda

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.2, 0.0))
    for _ in range(3):
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3, config={})
    other = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    f = lr_lambda(20, 0.5, 0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, f)
    assert restore(read_checkpoint(path), model=other, optimizer=opt2, scheduler=sched2, path=path) == 3
    g = opt2.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3 * f(3), (0.8, 0.9), 1e-6, 0.1)
    assert sched2.base_lrs == [1e-3] and sched2.last_epoch == 3 and sched2.get_last_lr() == [1e-3 * f(3)]
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"]) and int(opt2.state[q]["step"]) == 3
    sched2.step()
    assert g["lr"] == 1e-3 * f(4)


# ------------------------------------------------------------------ a new run over an old one
def test_new_run_refuses_a_folder_with_an_earlier_run(tmp_path, tiny_qwen3_dir, counting_data):
    out = tmp_path / "run"
    first = train(tiny(tiny_qwen3_dir, counting_data, out, steps=3), log=quiet)
    before = (out / "metrics.jsonl").read_text()
    for run in (lambda **kw: train(tiny(tiny_qwen3_dir, counting_data, out, steps=3), log=quiet, **kw),
                lambda **kw: run_pipeline(tiny(tiny_qwen3_dir, counting_data, out, steps=3, target_gpus="cpu"),
                                          log=quiet_log(), **kw)):
        with pytest.raises(RunDirError) as e:
            run()
        assert str(out) in str(e.value) and "--resume" in str(e.value) and "--overwrite" in str(e.value)
        assert (out / "metrics.jsonl").read_text() == before and ckpt_step(out) == 3
    with pytest.raises(ValueError, match="choose one"):
        train(tiny(tiny_qwen3_dir, counting_data, out, steps=3), resume=True, overwrite=True, log=quiet)
    # --overwrite: a new run; the old records are kept aside, never wiped.
    logged = []
    second = train(tiny(tiny_qwen3_dir, counting_data, out, steps=2, seed=1), log=logged.append, overwrite=True)
    assert (out / "metrics.replaced-1.jsonl").read_text() == before
    assert steps_in(out / "metrics.jsonl") == [1, 2] and ckpt_step(out) == 2
    assert [r["loss"] for r in second] != [r["loss"] for r in first[:2]]
    assert any("metrics.replaced-1.jsonl" in s for s in logged) and any("deleted" in s for s in logged)
    run_pipeline(tiny(tiny_qwen3_dir, counting_data, out, steps=2, target_gpus="cpu"), log=quiet_log(), overwrite=True)
    assert (out / "metrics.replaced-2.jsonl").exists() and steps_in(out / "metrics.jsonl") == [1, 2]


def test_records_without_a_checkpoint_are_not_wiped(tmp_path, tiny_qwen3_dir, counting_data):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(RunDirError, match="metrics.jsonl"):
        train(tiny(tiny_qwen3_dir, counting_data, out, steps=2), log=quiet)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    (out / "metrics.jsonl").write_text("")  # an empty file holds nothing to lose
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=2), log=quiet)
    assert steps_in(out / "metrics.jsonl") == [1, 2]


def test_resume_without_a_checkpoint_is_a_one_line_refusal(tmp_path, tiny_qwen3_dir, counting_data):
    """--resume into a folder without a checkpoint: a RunDirError naming the path; the command ends with
    that line (exit status 1), as the other run-folder refusals do, not with a traceback."""
    from trainer.train import main

    out = tmp_path / "empty"
    with pytest.raises(RunDirError, match=f"--resume: no checkpoint at {out / 'checkpoint.pt'}"):
        train(tiny(tiny_qwen3_dir, counting_data, out, steps=2), resume=True, log=quiet)
    with pytest.raises(RunDirError, match="--resume: no checkpoint"):
        run_pipeline(tiny(tiny_qwen3_dir, counting_data, out, steps=2, target_gpus="cpu"), resume=True,
                     log=quiet_log())
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data, "--out-dir", str(out),
              "--resume"])
    assert str(e.value).startswith("trainer.train: --resume: no checkpoint at ") and "\n" not in str(e.value)
    proc = start_cli(["--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data, "--out-dir",
                      str(out), "--resume"])
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in text and "--resume: no checkpoint at" in text, text


def test_overwrite_deletes_the_earlier_drafter_folder_at_once(tmp_path, tiny_qwen3_dir, counting_data,
                                                              monkeypatch):
    """--overwrite removes the earlier run's drafter folder before anything else happens (and says so): a
    run that fails before its first save leaves no earlier drafter beside its own files."""
    import trainer.train as train_mod

    out = tmp_path / "run"
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=2), log=quiet)
    assert (out / "drafter" / "model.safetensors").exists()
    logged = []

    def fails_at_load(*a, **kw):
        raise RuntimeError("the target failed to load")

    monkeypatch.setattr(train_mod, "load_target", fails_at_load)
    with pytest.raises(RuntimeError, match="failed to load"):
        train(tiny(tiny_qwen3_dir, counting_data, out, steps=2, seed=1), log=logged.append, overwrite=True)
    assert not (out / "drafter").exists() and not (out / "checkpoint.pt").exists()
    assert any("--overwrite" in s and "drafter" in s and str(out / "drafter") in s for s in logged), logged


# ----------------------------------------------------------------------------- killed saves
def test_leftovers_of_killed_saves_are_removed_and_a_cut_metrics_line_is_skipped(tmp_path, tiny_qwen3_dir,
                                                                                 counting_data):
    out = tmp_path / "run"
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=5), log=quiet, stop_after=2)
    leftovers = [out / "checkpoint.pt.tmp.999999", out / "drafter" / "model.safetensors.tmp",
                 out / "metrics.jsonl.tmp"]
    for p in leftovers:
        p.write_bytes(b"half a save")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # the process died mid-line
    logged = []
    hist = train(tiny(tiny_qwen3_dir, counting_data, out, steps=5), resume=True, log=logged.append)
    assert not [p for p in leftovers if p.exists()]
    assert sum("never finished" in s for s in logged) == 2, logged
    assert any("skipped 1 unreadable line" in s for s in logged), logged
    assert [r["step"] for r in hist] == [1, 2, 3, 4, 5] and steps_in(out / "metrics.jsonl") == [1, 2, 3, 4, 5]


def test_save_flushes_the_file_then_the_folder(tmp_path, monkeypatch):
    from trainer.checkpoint import save_checkpoint

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        return real_fsync(fd)

    def replace(a, b):
        events.append("replace")
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(str(tmp_path / "checkpoint.pt"), model=m, optimizer=opt, scheduler=sched, step=1, config={})
    assert events == ["fsync file", "replace", "fsync dir"]
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that dies half-way through writing (disk full, a kill) leaves the previous checkpoint whole and
    readable, and no temporary file."""
    import trainer.checkpoint as ckmod

    path = str(tmp_path / "checkpoint.pt")
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckmod.save_checkpoint(path, model=m, optimizer=opt, scheduler=sched, step=1, config={"n": 1})
    before = open(path, "rb").read()
    real_save = torch.save

    def dies_midway(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        f.truncate(f.tell() // 2)  # half the bytes reached the file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_midway)
    with torch.no_grad():
        m.weight.add_(1.0)
    with pytest.raises(OSError, match="No space left"):
        ckmod.save_checkpoint(path, model=m, optimizer=opt, scheduler=sched, step=2, config={"n": 2})
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["checkpoint.pt"]
    assert ckmod.read_checkpoint(path)["step"] == 1


def as_a_step_graph_run_wrote_it(path, groups):
    """Rewrite a CPU run's checkpoint as a GPU run with the step as CUDA graphs (trainer.step_graph) wrote it
    before checkpoints were made portable: the groups capturable with ``groups``' keys (torch's fused AdamW, or
    MasterAdamW's few), the step counts float32 tensors (the device's, read back to the CPU)."""
    ck = torch.load(path, weights_only=False)
    ck["optimizer"]["param_groups"] = [{**{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")},
                                        **groups} for g in ck["optimizer"]["param_groups"]]
    for st in ck["optimizer"]["state"].values():
        st["step"] = torch.as_tensor(st["step"], dtype=torch.float32)
    torch.save(ck, path)


@pytest.mark.parametrize("groups", [
    dict(capturable=True, fused=True, foreach=None, amsgrad=False, maximize=False, differentiable=False),
    dict(capturable=True)], ids=["torch_fused_adamw", "master_adamw"])
def test_a_step_graph_checkpoint_resumes_on_the_cpu(tmp_path, tiny_qwen3_dir, counting_data, groups):
    """A checkpoint of a GPU run that stepped as CUDA graphs (capturable groups) resumes on the CPU with the
    uninterrupted run's losses: the resumed optimizer steps as this run built it, not as the GPU run did."""
    full = train(tiny(tiny_qwen3_dir, counting_data, tmp_path / "a", steps=5), log=quiet)
    out = tmp_path / "b"
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=5), log=quiet, stop_after=2)
    as_a_step_graph_run_wrote_it(out / "checkpoint.pt", groups)
    resumed = train(tiny(tiny_qwen3_dir, counting_data, out, steps=5), resume=True, log=quiet)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    g = torch.load(out / "checkpoint.pt", weights_only=False)["optimizer"]["param_groups"][0]
    assert g["capturable"] is False and g.get("fused") in (None, False)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_a_checkpoint"])
def test_a_damaged_checkpoint_is_named(tmp_path, tiny_qwen3_dir, counting_data, damage):
    out = tmp_path / "run"
    train(tiny(tiny_qwen3_dir, counting_data, out, steps=4), log=quiet, stop_after=2)
    path = out / "checkpoint.pt"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\0" * 1000)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    for resume in (lambda: train(tiny(tiny_qwen3_dir, counting_data, out, steps=4), resume=True, log=quiet),
                   lambda: run_pipeline(tiny(tiny_qwen3_dir, counting_data, out, steps=4, target_gpus="cpu"),
                                        resume=True, log=quiet_log())):
        with pytest.raises(CheckpointError) as e:
            resume()
        assert str(path) in str(e.value)
        assert ("not a trainer checkpoint" if damage == "not_a_checkpoint" else "truncated or corrupt") in str(e.value)


# ------------------------------------------------------------------------------- RNG states
def test_rng_states_restore_from_tensors_on_any_device():
    state = rng_state()
    want = (torch.rand(3), torch.randint(0, 1000, (3,)))
    # A checkpoint loaded with map_location=<device> holds the CPU generator state on that device (and
    # as another dtype after some conversions): it is moved back to a CPU ByteTensor.
    state["torch"] = state["torch"].to(torch.int16)
    set_rng_state(state)
    got = (torch.rand(3), torch.randint(0, 1000, (3,)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


# ------------------------------------------------------------------------------------- GPU
def _gpu_cfg(target, data, out, **kw):
    return tiny(target, data, out, device="cuda", **kw)


@pytest.fixture
def real_attention_kernels():
    """The GPU tests train on the library's own attention kernels (the trainer tests default to reference)."""
    was = dk.get_backend("attention")
    dk.set_backend("attention", "auto")
    yield
    dk.set_backend("attention", was)


def assert_same_trajectory(resumed, full, repeat):
    """Bit for bit when the uninterrupted run repeats itself bit for bit (deterministic kernels), else close."""
    if repeat == full:
        assert resumed == full
    else:
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full), rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_gpu_resume_repeats_the_uninterrupted_run(tmp_path, tiny_qwen3_dir, counting_data, real_attention_kernels):
    """The single-process loop on the GPU: stop after 3 steps, resume (the checkpoint's CPU RNG state
    must come back as a CPU tensor), same losses as an uninterrupted run."""
    full = [r["loss"] for r in train(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "a", steps=6), log=quiet)]
    repeat = [r["loss"] for r in train(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "a2", steps=6), log=quiet)]
    part = train(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", steps=6), log=quiet, stop_after=3)
    assert len(part) == 3
    torch.manual_seed(123)
    torch.cuda.manual_seed_all(123)  # the resumed run must not depend on the process's RNG state at start
    resumed = train(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", steps=6), resume=True, log=quiet)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert_same_trajectory([r["loss"] for r in resumed], full, repeat)
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ck["rng"]["torch"].device.type == "cpu" and len(ck["rng"]["cuda"]) == torch.cuda.device_count()


@pytest.mark.gpu
def test_gpu_step_graph_checkpoints_move_between_the_cpu_and_the_gpu(tmp_path, tiny_qwen3_dir, counting_data,
                                                                      real_attention_kernels):
    """A step-graph run's checkpoint resumes on the CPU, and a CPU run's into a step-graph run on the GPU, each
    continuing with the losses of an uninterrupted run on the device it resumes on (up to the two devices'
    fp32 rounding, which the first steps differ by)."""
    def cfg(out, dev):
        graphs = dict(step_cuda_graphs="on") if dev == "cuda" else {}
        return tiny(tiny_qwen3_dir, counting_data, out, steps=6, device=dev, dtype="float32", **graphs)

    def losses(hist):
        return [r["loss"] for r in hist]

    full = {dev: losses(train(cfg(tmp_path / f"full-{dev}", dev), log=quiet)) for dev in ("cpu", "cuda")}
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        out = tmp_path / f"{first}-then-{then}"
        train(cfg(out, first), log=quiet, stop_after=3)
        groups = torch.load(out / "checkpoint.pt", weights_only=False)["optimizer"]["param_groups"]
        assert all(g["capturable"] is False and type(g["lr"]) is float for g in groups)
        resumed = losses(train(cfg(out, then), resume=True, log=quiet))
        assert len(resumed) == 6
        torch.testing.assert_close(torch.tensor(resumed[3:]), torch.tensor(full[then][3:]), rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_gpu_pipeline_resume_repeats_the_uninterrupted_run(tmp_path, tiny_qwen3_dir, counting_data,
                                                           real_attention_kernels):
    kw = dict(steps=6, target_gpus="0", drafter_gpus="0,0")
    full = [r["loss"] for r in run_pipeline(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "a", **kw),
                                            log=quiet_log())]
    repeat = [r["loss"] for r in run_pipeline(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "a2", **kw),
                                              log=quiet_log())]
    run_pipeline(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", **kw), log=quiet_log(), stop_after=2)
    resumed = run_pipeline(_gpu_cfg(tiny_qwen3_dir, counting_data, tmp_path / "b", **kw), resume=True,
                           log=quiet_log())
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert_same_trajectory([r["loss"] for r in resumed], full, repeat)


@pytest.mark.gpu
def test_gpu_sigterm_then_resume(tmp_path, tiny_qwen3_dir, counting_data):
    """``python -m trainer.train`` on the GPU (the library's kernels): SIGTERM after step 2 -> exit 0 with a
    checkpoint; ``--resume`` continues to the end with the losses of an uninterrupted run."""
    gpu = {"DFLASH_KERNELS_BACKEND": ""}
    # Kernel compilation comes before step 1: a longer wait for step 2.
    sigterm_then_resume(tmp_path, tiny_qwen3_dir, counting_data, steps=10, extra=("--device", "cuda"),
                        env_extra=gpu, timeout=480)
    runs = []
    for name in ("ref", "ref2"):
        proc = start_cli(["--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data, "--out-dir",
                          str(tmp_path / name), "--steps", "10", "--device", "cuda"], env_extra=gpu)
        text, _ = proc.communicate(timeout=480)
        assert proc.returncode == 0, text[-3000:]
        runs.append(losses_in(tmp_path / name / "metrics.jsonl"))
    assert_same_trajectory(losses_in(tmp_path / "run" / "metrics.jsonl"), runs[0], runs[1])
