"""benchmarks/bench_common.run_rows: an implementation's process, its rows, and how a failed one is reported."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

from bench_common import run_rows  # noqa: E402


def _py(code):
    return [sys.executable, "-c", code]


def test_rows_come_back_tagged_with_their_process(capsys):
    rows = run_rows(_py('print("warming up"); print(\'ROW {"op": "x", "ms": 1.5}\')'), "x", "impl_a", 60)
    assert rows == [{"op": "x", "ms": 1.5, "process": "impl_a"}]
    assert "[impl_a] warming up" in capsys.readouterr().out


def test_a_process_that_fails_adds_an_error_row_with_its_last_output():
    rows = run_rows(_py('print(\'ROW {"op": "x"}\'); print("boom"); raise SystemExit(3)'), "x", "impl_b", 60)
    assert rows[0] == {"op": "x", "process": "impl_b"}
    assert rows[1]["impl"] == "impl_b" and "exited with 3" in rows[1]["error"] and "boom" in rows[1]["error"]


def test_a_process_past_its_limit_is_killed_and_said_so():
    rows = run_rows(_py('import time; print("started", flush=True); time.sleep(60)'), "x", "impl_c", 1.0)
    assert len(rows) == 1 and "killed at the 1 s limit" in rows[0]["error"] and "started" in rows[0]["error"]
