"""The threaded pipeline on CPU workers: same trajectory as the single-process loop with one worker each,
bit-identical replicas with several, every micro-batch exactly once, exact resume."""

import json
from collections import Counter

import pytest
import torch

from trainer.config import preset
from trainer.data import batch_at, load_jsonl
from trainer.pipeline import micro_index, parse_devices, run_pipeline
from trainer.supervise import RunLog, StopRequest
from trainer.train import train


def quiet_log():
    log = RunLog()
    log.log = lambda msg: None
    return log


def cfg_for(target, data, out, **kw):
    return preset("tiny", target=target, data=data, out_dir=str(out), **kw)


def test_parse_devices():
    cuda = lambda *i: [torch.device("cuda", k) for k in i]  # noqa: E731
    assert parse_devices("0-4") == cuda(0, 1, 2, 3, 4)
    assert parse_devices("5-7") == cuda(5, 6, 7)
    assert parse_devices("0") == cuda(0)
    assert parse_devices("0,2, 3") == cuda(0, 2, 3)
    assert parse_devices("0,0") == cuda(0, 0)
    assert parse_devices("cuda:1") == cuda(1)
    assert parse_devices("cpu") == [torch.device("cpu")]
    assert parse_devices("cpu:3") == [torch.device("cpu")] * 3
    for bad in ("", "gpu", "3-1", "cpu:0", "0-", "a,b"):
        with pytest.raises(ValueError, match="target_gpus"):
            parse_devices(bad, "target_gpus")


@pytest.mark.parametrize("world,replicas", [(1, 1), (1, 3), (2, 3), (3, 2)])
def test_micro_index_covers_each_batch_once(world, replicas):
    steps = 5
    got = [micro_index(s, r, world, d, replicas) for s in range(steps) for r in range(world) for d in range(replicas)]
    assert sorted(got) == list(range(steps * world * replicas))


def test_one_worker_each_matches_the_single_process_loop(tmp_path, tiny_qwen3_dir, counting_data):
    ref = train(cfg_for(tiny_qwen3_dir, counting_data, tmp_path / "ref", steps=5), log=lambda s: None)
    got = run_pipeline(cfg_for(tiny_qwen3_dir, counting_data, tmp_path / "pipe", steps=5, target_gpus="cpu",
                               drafter_gpus="cpu"), log=quiet_log())
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    a = torch.load(tmp_path / "ref" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "pipe" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_replicas_stay_identical_and_each_batch_is_used_once(tmp_path, tiny_qwen3_dir, counting_data, tiny_tokenizer):
    steps, D = 6, 3
    cfg = cfg_for(tiny_qwen3_dir, counting_data, tmp_path, steps=steps, target_gpus="cpu:2", drafter_gpus=f"cpu:{D}",
                  lr=1e-2, warmup_ratio=0.0)
    record, replicas, init = [], [], {}
    import trainer.pipeline as pl

    real_setup = pl._setup

    def spy_setup(*a, **k):
        R = real_setup(*a, **k)
        replicas.extend(R.replicas)
        init.update({k: v.clone() for k, v in R.replicas[0].state_dict().items()})
        return R

    pl._setup = spy_setup
    try:
        hist = run_pipeline(cfg, log=quiet_log(), record=record)
    finally:
        pl._setup = real_setup
    assert len(hist) == steps and len(replicas) == D
    # Bit-identical replicas although each trained on its own micro-batches.
    for m in replicas[1:]:
        for (name, p0), p in zip(replicas[0].named_parameters(), m.parameters()):
            assert torch.equal(p0, p), name
    # The weights moved (replicas that never step would be equal too), and the checkpoint holds them.
    final = replicas[0].state_dict()
    assert all(not torch.equal(init[k], v) for k, v in final.items() if k.endswith("proj.weight"))
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(ckpt[k], v) for k, v in final.items())
    # Every micro-batch 0 .. steps * D - 1 exactly once, each at its step and replica, with its data.
    assert Counter(r["micro"] for r in record) == Counter(range(steps * D))
    ds = load_jsonl(counting_data, None, cfg.max_len, cfg.block_size, log=None)
    for r in record:
        assert r["micro"] == micro_index(r["step"], 0, 1, r["replica"], D)
        b = batch_at(ds, r["micro"], cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed,
                     tiny_tokenizer.pad_token_id)
        assert int(b["input_ids"].sum()) == r["ids_sum"]
    assert hist[-1]["tokens"] == D * cfg.batch_size * 60  # tokens of all replicas are counted
    # Each step's model TFLOP is that of all its micro-batches (trainer.flops, the target's layers run).
    from trainer.flops import step_flops
    from trainer.target import load_target

    target = load_target(tiny_qwen3_dir, cfg.target_layer_ids, cfg.num_target_layers)
    for row in hist:
        micro = [batch_at(ds, micro_index(row["step"] - 1, 0, 1, d, D), cfg.batch_size, cfg.max_len,
                          cfg.num_anchors, cfg.block_size, cfg.seed, tiny_tokenizer.pad_token_id) for d in range(D)]
        expect = sum(step_flops(target.model, replicas[0], b, target.layers_run)["total"] for b in micro) / 1e12
        assert row["tflop"] == pytest.approx(expect, rel=1e-6)
    losses = [r["loss"] for r in hist]
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_resume_repeats_the_uninterrupted_trajectory(tmp_path, tiny_qwen3_dir, counting_data):
    kw = dict(steps=6, target_gpus="cpu", drafter_gpus="cpu:2")
    full = run_pipeline(cfg_for(tiny_qwen3_dir, counting_data, tmp_path / "a", **kw), log=quiet_log())
    part = run_pipeline(cfg_for(tiny_qwen3_dir, counting_data, tmp_path / "b", **kw), log=quiet_log(), stop_after=2)
    assert [r["step"] for r in part] == [1, 2]
    resumed = run_pipeline(cfg_for(tiny_qwen3_dir, counting_data, tmp_path / "b", **kw), resume=True, log=quiet_log())
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    with open(tmp_path / "b" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 7))


def test_stop_request_ends_at_a_step_with_a_checkpoint(tmp_path, tiny_qwen3_dir, counting_data):
    cfg = cfg_for(tiny_qwen3_dir, counting_data, tmp_path, steps=6, target_gpus="cpu", drafter_gpus="cpu:2",
                  save_interval=100)
    stop = StopRequest()

    class StopAtStep2(list):  # the replicas record each micro-batch before the gradient barrier
        def append(self, r):
            super().append(r)
            if r["step"] == 2:
                stop.request("test")

    hist = run_pipeline(cfg, log=quiet_log(), stop=stop, record=StopAtStep2())
    assert [r["step"] for r in hist] == [1, 2, 3]  # step index 2 is the third step: it completes
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 3
    # A stop asked for during set-up ends the run before any step, without touching the checkpoint.
    assert run_pipeline(cfg, resume=True, log=quiet_log(), stop=stop) == []
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 3


def test_packed_rows(tmp_path, tiny_qwen3_dir, counting_data):
    import trainer.data as data

    if not hasattr(data, "packed_target_features"):
        pytest.skip("sequence packing (trainer/data.py) not present")
    record = []
    cfg = cfg_for(tiny_qwen3_dir, counting_data, tmp_path, steps=3, target_gpus="cpu", drafter_gpus="cpu:2",
                  max_len=128, pack=True)
    hist = run_pipeline(cfg, log=quiet_log(), record=record)
    assert len(hist) == 3 and all(r["loss"] == r["loss"] for r in hist)
    assert Counter(r["micro"] for r in record) == Counter(range(6))


def test_per_process_device_lists(monkeypatch):
    from trainer.pipeline import local_part

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_part("0-2;4-6", "target_gpus") == "4-6"
    assert local_part("0-4", "target_gpus") == "0-4"
    with pytest.raises(ValueError, match="drafter_gpus"):
        local_part("3;5;7", "drafter_gpus")


def test_utilisation_stats(tmp_path, tiny_qwen3_dir, counting_data):
    """Each worker's device time and blocked time, per device and per role, logged and in pipeline_stats.json."""
    steps, T, D = 4, 2, 3
    cfg = cfg_for(tiny_qwen3_dir, counting_data, tmp_path, steps=steps, target_gpus=f"cpu:{T}", drafter_gpus=f"cpu:{D}")
    lines, stats = [], {}
    log = RunLog()
    log.log = lines.append
    run_pipeline(cfg, log=log, stats=stats)
    assert stats["roles"]["target"]["units"] == stats["roles"]["drafter"]["units"] == steps * D  # every micro-batch
    assert stats["roles"]["target"]["workers"] == T and stats["roles"]["drafter"]["workers"] == D
    for role in ("target", "drafter"):
        assert stats["roles"][role]["device_ms_per_unit"] > 0 and stats["roles"][role]["blocked_ms_per_unit"] >= 0
    # CPU workers are threads on a few cores: their busy fractions may overlap, each is within the wall time
    row = stats["devices"]["cpu"]
    assert 0 < row["target_busy"] <= T + 1e-6 and 0 < row["drafter_busy"] <= D + 1e-6
    assert sum(stats["roles"][r]["device_ms_per_unit"] * stats["roles"][r]["units"] for r in ("target", "drafter")) \
        <= stats["wall_s"] * 1e3 * (T + D)
    assert any(s.startswith("pipeline: ") and "drafter busy" in s for s in lines), lines
    saved = json.loads((tmp_path / "pipeline_stats.json").read_text())
    assert saved["roles"] == stats["roles"] and saved["steps"] == steps


def test_meter_folds_old_spans():
    from trainer.pipeline import Meter, pipeline_stats

    m = Meter("target", 0, torch.device("cpu"))
    for _ in range(40):
        a = m.mark()
        b = a + 0.001  # a 1 ms span (host marks are perf_counter seconds)
        m.span(a, b)
        m.done()
    assert len(m._open) <= Meter._KEEP
    st = pipeline_stats([m], wall_s=0.08, devices=[torch.device("cpu")])
    assert st["roles"]["target"]["device_ms_per_unit"] == pytest.approx(1.0)
    assert st["devices"]["cpu"]["target_busy"] == pytest.approx(0.5)
