"""benchmarks/plot.py groups result rows by op and GPU and keeps only the newest run of each."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import plot  # noqa: E402


def test_latest_run_per_op_and_gpu(tmp_path):
    rows = [
        {"op": "copy", "impl": "torch", "gpu": "H200", "date": "2"},
        {"op": "conv", "impl": "a", "shape": "s", "fwd_ms": 1.0, "gpu": "H200", "date": "1"},
        {"op": "conv", "impl": "a", "shape": "s", "fwd_ms": 2.0, "gpu": "H200", "date": "2"},
        {"op": "conv", "impl": "peer", "shape": "s", "error": "boom", "gpu": "H200", "date": "2"},
        {"op": "conv", "impl": "a", "shape": "s", "fwd_ms": 3.0, "gpu": "A100", "date": "1"},
        {"op": "overhead", "impl": "x", "us_per_call": 1.0, "gpu": "H200", "date": "2"},
    ]
    path = tmp_path / "ops.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runs = plot.load_latest_runs(str(path))
    assert set(runs) == {("conv", "H200"), ("conv", "A100")}
    assert [r.get("fwd_ms") for r in runs[("conv", "H200")]] == [2.0, None]
    assert runs[("conv", "H200")][1]["error"] == "boom"
    assert [r["fwd_ms"] for r in runs[("conv", "A100")]] == [3.0]


def test_a_session_spans_processes_and_keeps_the_newest_row_per_key(tmp_path):
    """A GPU session runs each peer in its own process (each with its own stamp): rows within
    SESSION_S of the newest belong to the chart; an older session's rows do not."""
    rows = [
        {"op": "conv", "impl": "a", "shape": "s", "fwd_ms": 9.0, "gpu": "H200", "date": "2026-11-29T10:00:00+00:00"},
        {"op": "conv", "impl": "a", "shape": "s", "fwd_ms": 1.0, "gpu": "H200", "date": "2026-11-29T13:15:00+00:00"},
        {"op": "conv", "impl": "a", "shape": "s", "fwd_ms": 1.5, "backend": "cuda", "gpu": "H200",
         "date": "2026-11-29T13:15:00+00:00"},
        {"op": "conv", "impl": "peer", "shape": "s", "fwd_ms": 2.0, "gpu": "H200", "date": "2026-11-29T13:16:00+00:00"},
    ]
    path = tmp_path / "ops.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = plot.load_latest_runs(str(path))[("conv", "H200")]
    assert [(r["impl"], r.get("backend"), r["fwd_ms"]) for r in got] == [("a", None, 1.0), ("a", "cuda", 1.5),
                                                                          ("peer", None, 2.0)]
