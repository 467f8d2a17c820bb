"""benchmarks/roles.py: the projection's arithmetic, the CPU tiny run end to end, and the GPU presets'
refusal on a CPU."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import roles  # noqa: E402

# The subprocesses see no GPU, so the CPU path runs on any machine.
CPU_ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def _roles(*args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "roles.py"), *args],
                          capture_output=True, text=True, env=CPU_ENV, cwd=ROOT, timeout=timeout)


def test_projection_arithmetic():
    p = roles.project(1000.0, 3000.0)
    assert p["layout"]["n_target"] == 5 and p["layout"]["n_drafter"] == 3
    assert p["layout"]["tok_s"] == 5000.0 and p["layout"]["bound"] == "target"  # min(5000, 9000)
    assert [s["tok_s"] for s in p["splits"]] == [1000, 2000, 3000, 4000, 5000, 6000, 3000]  # n_t = 1..7
    assert (p["best"]["n_target"], p["best"]["n_drafter"], p["best"]["tok_s"]) == (6, 2, 6000.0)
    assert p["shared"]["tok_s"] == pytest.approx(8 / (1 / 1000 + 1 / 3000))  # 6000
    # E scales every projection; a drafter-bound 5 + 3 and a tie broken towards fewer target GPUs.
    q = roles.project(10_000.0, 9_000.0, efficiency=0.8)
    assert q["layout"]["tok_s"] == pytest.approx(0.8 * 27_000) and q["layout"]["bound"] == "drafter"
    assert (q["best"]["n_target"], q["best"]["tok_s"]) == (4, pytest.approx(0.8 * 36_000))
    assert q["shared"]["tok_s"] == pytest.approx(0.8 * 8 / (1 / 10_000 + 1 / 9_000))
    assert roles.project(1.0, 1.0)["best"]["n_target"] == 4
    with pytest.raises(ValueError, match="positive"):
        roles.project(0.0, 1.0)


@pytest.mark.slow
def test_cpu_tiny_run_prints_the_roles_and_the_projection(tmp_path):
    out_json = tmp_path / "row.json"
    proc = _roles("--preset", "tiny", "--steps", "1", "--no-record", "--efficiency", "0.9", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "No CUDA device: the tiny preset on the CPU" in out and "not recorded" in out
    row = json.loads(out_json.read_text())
    assert row["op"] == "roles" and row["preset"] == "tiny" and row["efficiency_measured"] is True
    t, d, p = row["target"], row["drafter"], row["projection"]
    assert t["tokens_per_batch"] == d["tokens_per_batch"] == 128  # 2 x 64 tokens: the same micro-batches
    assert t["tok_s"] > 0 and d["tok_s"] > 0 and d["loss_step1"] > 0
    assert t["tok_s"] == pytest.approx(t["tokens_per_batch"] / (t["ms"] / 1e3))
    assert p == roles.project(t["tok_s"], d["tok_s"], 0.9)
    assert p["layout"]["tok_s"] == pytest.approx(0.9 * min(5 * t["tok_s"], 3 * d["tok_s"]))
    # the printed tables: one line per role, the three projections and every split
    lines = out.splitlines()
    table = {ln.split("|")[0].strip(): [c.strip() for c in ln.split("|")] for ln in lines if "|" in ln}
    assert float(table["target (T)"][3].replace(",", "")) == pytest.approx(t["tok_s"], abs=0.5)
    assert float(table["drafter (D)"][3].replace(",", "")) == pytest.approx(d["tok_s"], abs=0.5)
    assert table["5 + 3 (layout)"][1] == "E * min(5T, 3D)"
    assert float(table["5 + 3 (layout)"][2].replace(",", "")) == pytest.approx(p["layout"]["tok_s"], abs=0.5)
    best = f"best split {p['best']['n_target']} + {p['best']['n_drafter']}"
    assert float(table[best][2].replace(",", "")) == pytest.approx(p["best"]["tok_s"], abs=0.5)
    assert "E = 0.90 (measured (--efficiency))" in out and "short (" in out
    assert "every split n_t + n_d: 1+7" in out


def test_gpu_presets_refuse_a_cpu():
    proc = _roles("--preset", "27b", "--no-record", timeout=120)
    assert proc.returncode != 0
    assert "the `27b` preset needs a CUDA GPU" in proc.stderr and "--preset tiny" in proc.stderr


def test_efficiency_outside_0_1_is_refused():
    with pytest.raises(SystemExit):
        roles.parse_args(["--efficiency", "1.5"])
    assert roles.parse_args(["--efficiency", "0.85"]).efficiency == 0.85
