"""benchmarks/make_target.py: the folder it writes trains with trainer.train and the pipeline (tiny, CPU)."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import make_target  # noqa: E402


@pytest.mark.slow
def test_tiny_target_trains_in_both_loops(tmp_path):
    from trainer.config import preset
    from trainer.pipeline import run_pipeline
    from trainer.supervise import RunLog
    from trainer.train import train

    paths = make_target.make("tiny", str(tmp_path / "t"), sequences=6, device="cpu", log=lambda s: None)
    recs = [json.loads(line) for line in open(paths["data"])]
    length = preset("tiny").max_len
    assert len(recs) == 6 and all(len(r["input_ids"]) == length == len(r["loss_mask"]) for r in recs)
    assert all(8 <= i < 512 for r in recs for i in r["input_ids"])
    hist = train(preset("tiny", target=paths["target"], data=paths["data"], steps=2, out_dir=str(tmp_path / "a")),
                 log=lambda s: None)
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in hist)
    log = RunLog()
    log.log = lambda s: None
    stats = {}
    hist = run_pipeline(preset("tiny", target=paths["target"], data=paths["data"], steps=2, target_gpus="cpu",
                               drafter_gpus="cpu:2", out_dir=str(tmp_path / "b")), log=log, stats=stats)
    assert len(hist) == 2 and stats["roles"]["drafter"]["units"] == 4


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="preset: unknown 'huge'"):
        make_target.make("huge", str(tmp_path))
    with pytest.raises(ValueError, match="sequences: expected at least 1, got 0"):
        make_target.make("tiny", str(tmp_path), sequences=0)
    assert make_target.text_config("27b")["num_hidden_layers"] == 64
    assert make_target.text_config("real")["hidden_size"] == 2560
