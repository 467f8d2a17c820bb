"""Two pipeline processes under torchrun over gloo (CPU): gradients all-reduced across processes, so both
end with bit-identical drafters, and the loss goes down."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_processes_over_gloo(tmp_path, tiny_qwen3_dir, counting_data):
    steps, D, P, B = 12, 2, 2, 2
    env = dict(os.environ, DFLASH_KERNELS_BACKEND="attention=reference", PYTHONPATH=ROOT)
    env.pop("DFLASH_TRAINER_FAULT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(P),
           "-m", "trainer.train", "--preset", "tiny", "--target", tiny_qwen3_dir, "--data", counting_data,
           "--out-dir", str(tmp_path), "--steps", str(steps), "--batch-size", str(B), "--target-gpus", "cpu",
           "--drafter-gpus", f"cpu:{D}", "--log-interval", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = []
    for r in range(P):
        with open(tmp_path / f"train.rank{r}.log") as f:
            log = f.read()
        assert f"distributed: rank {r} of {P} ready" in log
        assert "identical: True" in log
        digests += re.findall(rf"parameter digest ([0-9a-f]+) \(rank {r}\)", log)
    assert len(digests) == P and len(set(digests)) == 1, digests
    with open(tmp_path / "metrics.jsonl") as f:
        hist = [json.loads(line) for line in f]
    assert [r["step"] for r in hist] == list(range(1, steps + 1))
    # Every step counts the tokens of all P * D micro-batches (60-token sequences): stats are reduced too.
    assert all(r["tokens"] == P * D * B * 60 for r in hist)
    losses = [r["loss"] for r in hist]
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
