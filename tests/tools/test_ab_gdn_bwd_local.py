"""tools/studies/ab_gdn_bwd_local.py, the GDN backward local-kernel modes study, on the CPU: its refusals, its
table, and (``-m slow``) one run of two modes' processes through the interpreter with ``--check``."""

import json
import os

import pytest
import torch

from tools.studies import ab_gdn_bwd_local as study


def test_modes_are_the_librarys():
    from dflash_kernels.runtime import settings

    assert study.MODES == settings.GDN_BWD_LOCAL_MODES and study.ENV == "DFLASH_KERNELS_GDN_BWD_LOCAL"


def test_unknown_mode_is_refused():
    with pytest.raises(SystemExit, match="unknown modes.*fast"):
        study.main(["--modes", "twopass,fast", "--no-record"])


def test_table_speedups_and_errors():
    rows = [dict(impl="twopass", label="1x8192", fwdbwd_ms=2.0, local_us=900.0, check="ok"),
            dict(impl="group", label="1x8192", fwdbwd_ms=1.6, local_us=700.0, check="ok"),
            dict(impl="onepass", label="1x8192", error="OutOfMemoryError: ...")]
    table = study._table(rows)
    assert rows[1]["speedup_vs_twopass"] == pytest.approx(1.25) and "1.250x" in table
    assert "error: OutOfMemoryError" in table


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for machines without a GPU")
def test_two_modes_run_and_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "rows.jsonl"
    rows = study.main(["--modes", "twopass,group", "--shapes", "2x70", "--check", "--quick", "--no-record",
                       "--out", str(out)])
    assert [(r["impl"], r["label"]) for r in rows] == [("twopass", "2x70"), ("group", "2x70")], rows
    assert all(r["check"] == "ok" and r["fwdbwd_ms"] > 0 for r in rows), rows
    assert [json.loads(line)["impl"] for line in out.read_text().splitlines()] == ["twopass", "group"]
    assert os.environ.get(study.ENV) is None  # the modes were set in the child processes only
