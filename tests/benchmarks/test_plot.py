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


def test_step_breakdown_orders_categories_and_fills_missing_ones():
    rows = [{"preset": "real", "group": "(a)", "profile_ms": {"gemm": 80.0, "copies/casts": 20.0, "odd": 1.0}},
            {"preset": "real", "group": "(b)", "profile_ms": {"loss": 15.0, "gemm": 85.0}}]
    labels, per_cat = plot.step_breakdown(rows)
    assert labels == ["real\n(a)", "real\n(b)"]
    assert list(per_cat) == ["gemm", "loss", "copies/casts", "odd"]  # CATEGORY_ORDER, then the rest
    assert per_cat["gemm"] == [80.0, 85.0] and per_cat["loss"] == [0.0, 15.0] and per_cat["odd"] == [1.0, 0.0]
    rows[0]["ms_step"], rows[1]["ms_step"] = 110.0, 90.0  # (a): 101 ms on the device, (b): 100 (more than the step)
    assert plot.step_breakdown(rows)[1][plot.IDLE] == [9.0, 0.0]


def test_tok_s_chart_renders_mfu_and_the_breakdown(tmp_path):
    pytest = __import__("pytest")
    pytest.importorskip("matplotlib")
    rows = [{"gpu": "H200", "date": "2026-12-01T11:23:24+00:00", "preset": "real", "group": g, "tok_s": t,
             "mfu": m, "profile_ms": {"gemm": 80.0, "attention": a}} for g, t, m, a in
            (("(a)", 15913.0, 0.374, 16.5), ("(b)", 13544.0, 0.318, 18.0))]
    path = tmp_path / "tok_s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = plot.plot_tok_s(str(path), str(tmp_path))
    assert [os.path.basename(p) for p in out] == ["tok_s-H200.png"] and os.path.getsize(out[0]) > 10_000


def test_rows_found_invalid_are_not_charted(tmp_path):
    """A row tagged ``defect`` (or ``variant``) stays in the file and out of the chart (no matplotlib needed)."""
    row = {"gpu": "H200", "date": "2026-12-03T16:35:04+00:00", "preset": "real", "tok_s": 1.0, "mfu": 0.5}
    rows = [dict(row, group="(m)", defect="wrong weights"), dict(row, gpu="H100", group="(e)", variant="x"),
            dict(row, group="(a)")]
    path = tmp_path / "tok_s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert {g: [r["group"] for r in rs] for g, rs in plot.charted_tok_s_rows(str(path)).items()} == {"H200": ["(a)"]}


def test_step_breakdown_fills_in_b_and_b_plus_from_an_older_run():
    """The newest run's profiled rows first; (b) and the fastest (b+) stack from the newest older run that
    profiled them (labelled with its date); other older groups are left out."""
    import plot
    old = "2026-12-01T21:46:01+00:00"
    new = "2026-12-01T22:38:59+00:00"
    prof = {"gemm": 80.0}
    everything = [
        dict(preset="real", group="(a) dflash_kernels", date=old, ms_step=150.0, profile_ms=prof),
        dict(preset="real", group="(b) peers", date=old, ms_step=247.0, profile_ms=prof),
        dict(preset="real", group="(b+) liger-ew", date=old, ms_step=240.0, profile_ms=prof, b_plus_best=True),
        dict(preset="real", group="(b+) cce", date=old, ms_step=269.0, profile_ms=prof),
        dict(preset="real", group="(a) dflash_kernels", date=new, ms_step=142.6, profile_ms=prof),
        dict(preset="real", group="(b) peers", date=new, ms_step=247.0),  # no profile
    ]
    newest = everything[-2:]
    rows = plot._newest_profiles(everything, newest)
    labels, _ = plot.step_breakdown(rows)
    assert labels == ["real\n(a) dflash_kernels", "real\n(b) peers\n(2026-12-01 21:46)",
                      "real\n(b+) liger-ew\n(2026-12-01 21:46)"]
    assert rows[0]["date"] == new


def test_tok_s_bars_fill_in_the_peers_from_an_older_run():
    """A comparison run without the peers ((a) against a variant) keeps (b) and the fastest (b+) on the tokens/s
    chart from the newest older run, marked with their date; an older (a) and other stacks are not shown."""
    import plot
    old, new = "2026-12-03T16:59:43+00:00", "2026-12-03T20:02:08+00:00"
    everything = [
        dict(preset="real", group="(a) dflash_kernels", date=old, tok_s=22386.0),
        dict(preset="real", group="(b) peers", date=old, tok_s=14630.0),
        dict(preset="real", group="(b+) liger-ew", date=old, tok_s=17101.0, b_plus_best=True),
        dict(preset="real", group="(b+) cce", date=old, tok_s=15000.0),
        dict(preset="embedded", group="(b) peers", date=old, tok_s=137015.0),  # a preset the new run did not run
        dict(preset="real", group="(a) dflash_kernels", date=new, tok_s=22829.0),
        dict(preset="real", group="(m) copies", date=new, tok_s=23333.0),
    ]
    rows = plot._with_older_peers(everything, everything[-2:])
    assert [(r["group"], r.get("label_date")) for r in rows] == [
        ("(a) dflash_kernels", None), ("(m) copies", None), ("(b) peers", "2026-12-03 16:59"),
        ("(b+) liger-ew", "2026-12-03 16:59")]
