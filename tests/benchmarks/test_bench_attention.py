"""benchmarks/bench_attention.py: every implementation in a process of its own, and ours over each of the others
at the same shape."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_attention  # noqa: E402


def test_each_implementation_gets_a_process_of_its_own_in_order(monkeypatch):
    calls = []

    def fake_child(impl, quick, timeout_s):
        calls.append((impl, quick, timeout_s))
        return [{"op": "attention", "impl": impl, "process": impl}]

    monkeypatch.setattr(bench_attention, "_run_child", fake_child)
    rows = bench_attention.run("cuda", True, ["fa4", "flex", "dflash_kernels", "sdpa"], 123)
    assert [c[0] for c in calls] == ["dflash_kernels", "flex", "sdpa", "fa4"]  # ALL_IMPLS order
    assert all(c[1] is True and c[2] == 123 for c in calls)
    assert [r["process"] for r in rows] == ["dflash_kernels", "flex", "sdpa", "fa4"]


def test_without_a_gpu_only_ours_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_attention, "_run_child", lambda impl, q, t: calls.append(impl) or [])
    bench_attention.run("cpu", True)
    assert calls == ["dflash_kernels"]


def test_an_unknown_implementation_is_refused():
    with pytest.raises(SystemExit, match="unknown attention implementation"):
        bench_attention.run("cpu", True, ["dflash_kernels", "fa5"])


def test_ours_over_each_other_implementation_of_the_same_shape():
    rows = [
        {"shape": "A", "impl": "dflash_kernels", "process": "dflash_kernels", "fwd_ms": 2.0, "fwdbwd_ms": 8.0},
        {"shape": "A", "impl": "flex (torch.compile)", "process": "flex", "fwd_ms": 3.0, "fwdbwd_ms": 10.0},
        {"shape": "A", "impl": "fa4", "process": "fa4", "fwd_ms": 1.0},  # no backward: no fwdbwd ratio
        {"shape": "B", "impl": "fa4", "process": "fa4", "fwd_ms": 9.0},  # no ours at this shape
        {"shape": "D", "impl": "dflash_kernels", "process": "dflash_kernels", "fwd_ms": 4.0, "fwdbwd_ms": 12.0},
        {"shape": "D", "impl": "sdpa cudnn_attention", "process": "sdpa", "fwd_ms": 3.0, "fwdbwd_ms": 9.0},
        {"shape": "D", "impl": "sdpa flash_attention", "process": "sdpa", "error": "not built"},
    ]
    bench_attention._ratios(rows)
    a, d = rows[0], rows[4]
    assert a["fwd_speedup_vs_flex"] == pytest.approx(1.5) and a["fwdbwd_speedup_vs_flex"] == pytest.approx(1.25)
    assert a["fwd_speedup_vs_fa4"] == pytest.approx(0.5) and "fwdbwd_speedup_vs_fa4" not in a
    assert d["fwd_speedup_vs_sdpa_cudnn_attention"] == pytest.approx(0.75)
    assert not any(k.endswith("flash_attention") for k in d)
    assert not any("speedup" in k for r in rows[1:4] for k in r)  # only ours carries ratios
    assert not any(k.endswith("vs_dflash_kernels") for r in rows for k in r)


def test_on_a_cpu_ours_runs_in_a_child_and_its_row_comes_back():
    rows = bench_attention.run("cpu", True, ["dflash_kernels"], 300)
    assert len(rows) == 1, rows
    r = rows[0]
    assert r["process"] == "dflash_kernels" and r["impl"].startswith("dflash_kernels") and "error" not in r
    assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
    assert r["shape"] == bench_attention._shape_name(bench_attention.CPU_SHAPE)


def test_a_child_without_a_gpu_says_skipped_for_gpu_only_implementations(capsys):
    if bench_attention.torch.cuda.is_available():
        pytest.skip("on a GPU the child runs")
    bench_attention.child("flex", True)
    assert '"skipped": "needs a CUDA GPU"' in capsys.readouterr().out
