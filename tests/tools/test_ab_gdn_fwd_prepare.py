"""tools/studies/ab_gdn_fwd_prepare.py, the GDN forward's split-against-fused prep study, on the CPU: its refusals,
its table, and (``-m slow``) one run of both modes' processes through the interpreter with ``--check``."""

import json
import os

import pytest
import torch

from tools.studies import ab_gdn_fwd_prepare as study


def test_modes_are_the_librarys():
    from dflash_kernels.runtime import settings

    assert study.MODES == settings.GDN_FWD_PREPARE_MODES and study.ENV == "DFLASH_KERNELS_GDN_FWD_PREPARE"
    assert set(study.PREP_KERNELS) == set(study.MODES)


def test_help_and_unknown_mode(capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["--help"])
    assert e.value.code == 0 and "--check" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown modes.*fast"):
        study.main(["--modes", "split,fast", "--no-record"])


def test_table_speedups_and_errors():
    rows = [dict(impl="split", label="1x8192", fwd_ms=1.0, fwdbwd_ms=4.0, prep_us=300.0, check="ok"),
            dict(impl="fused", label="1x8192", fwd_ms=0.8, fwdbwd_ms=3.2, prep_us=200.0, check="ok",
                 not_bitwise=["w"]),
            dict(impl="fused", label="4x8192", error="OutOfMemoryError: ...")]
    table = study._table(rows)
    assert rows[1]["fwd_speedup_vs_split"] == pytest.approx(1.25) and "1.250x" in table
    assert rows[1]["fwdbwd_speedup_vs_split"] == pytest.approx(1.25)
    assert "not bit for bit: w" in table and "error: OutOfMemoryError" in table


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for machines without a GPU")
def test_both_modes_run_and_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "rows.jsonl"
    rows = study.main(["--shapes", "packed3x100", "--check", "--quick", "--no-record", "--out", str(out)])
    assert [(r["impl"], r["label"]) for r in rows] == [("split", "packed3x100"), ("fused", "packed3x100")], rows
    assert all(r["check"] == "ok" and r["not_bitwise"] == [] and r["fwdbwd_ms"] > 0 for r in rows), rows
    assert [json.loads(line)["impl"] for line in out.read_text().splitlines()] == ["split", "fused"]
    assert os.environ.get(study.ENV) is None  # the modes were set in the child processes only
