"""No silent failures, end to end: `python -m trainer.train` with the pipeline as a subprocess on the tiny
target; exit status, elapsed time and the run log's contents are checked."""

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli_args(target, data, out, *extra, steps=8, drafters="cpu:2", targets="cpu:2"):
    return ["--preset", "tiny", "--target", target, "--data", data, "--out-dir", str(out), "--steps", str(steps),
            "--target-gpus", targets, "--drafter-gpus", drafters, *extra]


def start(args, fault=None):
    env = dict(os.environ, DFLASH_KERNELS_BACKEND="attention=reference", PYTHONPATH=ROOT)
    env.pop("DFLASH_TRAINER_FAULT", None)
    if fault:
        env["DFLASH_TRAINER_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "trainer.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=120):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, time.time()


def read_log(out):
    with open(os.path.join(out, "train.log")) as f:
        return f.read()


def stamp(log, pattern):
    """Wall-clock time (seconds since the epoch) of the first log line matching ``pattern``."""
    m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \[[^\]]*\] " + pattern, log, re.M)
    assert m, f"no log line matches {pattern!r}:\n{log[-3000:]}"
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


STAGES = ["config", "device init", "model load", "data", "drafter", "precompile"]


@pytest.mark.parametrize("fault,worker", [("drafter1:raise@3", "drafter1"), ("target0:raise@2", "target0")])
def test_worker_exception_stops_everything(tmp_path, tiny_qwen3_dir, counting_data, fault, worker):
    rc, out, t_end = finish(start(cli_args(tiny_qwen3_dir, counting_data, tmp_path), fault=fault))
    log = read_log(tmp_path)
    assert rc == 1, out
    # The log opened before torch was imported and every stage logged its start and end.
    first = log.splitlines()[0]
    assert "run log opened" in first and "torch imported: False" in first
    for s in STAGES:
        assert f"stage {s}: start" in log and f"stage {s}: end" in log, s
    # The failing thread's traceback, every other worker stopped, and a prompt exit.
    assert f"worker {worker}: FAILED: InjectedFault" in log
    assert "Traceback (most recent call last)" in log and "in fault_point" in log
    others = {"target0", "target1", "drafter0", "drafter1"} - {worker}
    for w in others:
        assert re.search(rf"worker {w}: (stopped after {worker} failed|end)", log), w
    assert "exit status 1" in log
    assert t_end - stamp(log, "fault injected") < 30


def test_hang_is_caught_by_the_watchdog(tmp_path, tiny_qwen3_dir, counting_data):
    wd = 3
    rc, out, t_end = finish(start(cli_args(tiny_qwen3_dir, counting_data, tmp_path, "--watchdog-s", str(wd),
                                           drafters="cpu:2", targets="cpu"), fault="drafter0:hang@2"))
    log = read_log(tmp_path)
    assert rc == 3, out
    assert "watchdog: no progress" in log and "thread stacks (watchdog)" in log
    # The hung thread's stack is in the dump, down to the call that blocks.
    dump = log[log.index("thread stacks (watchdog)"):]
    hung = dump[dump.index("--- thread drafter0"):]
    hung = hung[:hung.index("--- thread", 5)] if "--- thread" in hung[5:] else hung
    assert "_hang_forever" in hung and "_drafter_worker" in hung
    assert "--- thread drafter1" in dump and "barrier.wait()" in dump
    fired = stamp(log, "watchdog: no progress")
    assert wd <= fired - stamp(log, "fault injected") < wd + 5
    assert t_end - fired < 10


def test_sigterm_writes_a_checkpoint_that_resumes(tmp_path, tiny_qwen3_dir, counting_data):
    args = cli_args(tiny_qwen3_dir, counting_data, tmp_path, steps=10, drafters="cpu:2", targets="cpu")
    proc = start(args, fault="drafter0:slow@0")  # 0.5 s per step: time to send the signal mid-run
    logfile = tmp_path / "train.log"
    deadline = time.time() + 90
    while time.time() < deadline:
        if logfile.exists() and "step 2/10" in logfile.read_text():
            break
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc, out, _ = finish(proc)
    log = read_log(tmp_path)
    assert rc == 0, out
    assert "SIGTERM received" in log
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"]
    assert 2 <= step < 10
    assert f"stopped by SIGTERM after step {step} of 10" in log
    assert f"checkpoint: step {step}" in log
    rc, out, _ = finish(start(args + ["--resume"]))
    assert rc == 0, out
    log = read_log(tmp_path)
    assert f"resume: from step {step}" in log
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 10
    import json
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 11))


def test_preflight_reports_and_exits(tmp_path, tiny_qwen35_dir, counting_data):
    rc, out, _ = finish(start(cli_args(tiny_qwen35_dir, counting_data, tmp_path, "--preflight", drafters="cpu",
                                       targets="cpu")))
    assert rc == 0, out
    for what in ("devices: targets ['cpu'], drafters ['cpu']", "model: ", "4 layers", "data: ", "kept 16 of 16",
                 "kernels: backends", "trial step: loss", "preflight: OK"):
        assert what in out, what
    assert not os.path.exists(tmp_path / "checkpoint.pt")  # it trained nothing


def test_setup_failure_is_logged_with_its_stage(tmp_path, counting_data):
    rc, out, _ = finish(start(cli_args(str(tmp_path / "no_such_model"), counting_data, tmp_path / "run",
                                       drafters="cpu", targets="cpu")))
    assert rc == 1, out
    log = read_log(tmp_path / "run")
    assert "stage model load: FAILED" in log and "is not a folder" in log and "Traceback" in log
    assert "exit status 1" in log
