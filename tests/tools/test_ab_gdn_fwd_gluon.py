"""tools/studies/ab_gdn_fwd_gluon.py, the GDN forward's Triton-against-Gluon study, on the CPU: its modes, refusals
and table, and (``-m slow``) one run of both modes' processes through the interpreter, where the Gluon mode's rows
carry the switch's error (the kernel needs an sm_90 GPU)."""

import pytest
import torch

from tools.studies import ab_gdn_fwd_gluon as study


def test_modes_are_the_librarys():
    from dflash_kernels.runtime import settings

    assert study.MODES == settings.GDN_FWD_MODES and study.ENV == "DFLASH_KERNELS_GDN_FWD"


def test_help_and_unknown_mode(capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["--help"])
    assert e.value.code == 0 and "--check" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown modes.*cuda"):
        study.main(["--modes", "triton,cuda", "--no-record"])


def test_table_speedups_and_errors():
    rows = [dict(impl="triton", label="4x8192", fwd_ms=2.0, fwdbwd_ms=9.0, fwd_device_us=1900.0, check="ok"),
            dict(impl="gluon", label="4x8192", fwd_ms=1.0, fwdbwd_ms=8.0, fwd_device_us=950.0, check="ok"),
            dict(impl="gluon", label="packed4x32768", error="ValueError: DFLASH_KERNELS_GDN_FWD=gluon: ...")]
    table = study._table(rows)
    assert rows[1]["fwd_speedup_vs_triton"] == pytest.approx(2.0) and "2.000x" in table
    assert rows[1]["fwdbwd_speedup_vs_triton"] == pytest.approx(1.125)
    assert "error: ValueError: DFLASH_KERNELS_GDN_FWD=gluon" in table


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for machines without a GPU")
def test_both_modes_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = study.main(["--shapes", "packed3x100", "--check", "--quick", "--no-record"])
    assert [(r["impl"], r["label"]) for r in rows] == [("triton", "packed3x100"), ("gluon", "packed3x100")], rows
    assert rows[0]["check"] == "ok" and rows[0]["fwdbwd_ms"] > 0, rows[0]
    assert "DFLASH_KERNELS_GDN_FWD=gluon: the Gluon forward takes an sm_90 GPU" in rows[1]["error"], rows[1]
