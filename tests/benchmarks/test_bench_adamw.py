"""benchmarks/bench_adamw.py: every implementation's step against the fp32 reference on the tiny drafter's
parameter list (CPU, the Triton interpreter for ours), the harness end to end, and the `real` case's
refusal without a GPU."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_adamw  # noqa: E402

CPU_ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_the_real_case_is_the_real_drafter():
    shapes = bench_adamw.param_shapes("real")
    assert len(shapes) == 58 and sum(torch.Size(s).numel() for s in shapes) == 517_766_400


@pytest.mark.parametrize("impl", bench_adamw.IMPLS)
def test_each_implementation_matches_the_reference(impl):
    row = bench_adamw.measure(impl, "tiny")
    assert row["rel_err"] < 1e-6, row  # parameters and moments after one step, fp32 math in every one
    if impl == "ours" and row["device"] == "cuda":  # the kernel's cast rounds to nearest even, as torch's
        assert row["copy_rel_err"] == 0.0, row
    elif impl == "ours":  # the Triton interpreter's bf16 cast truncates: within one bf16 ulp
        assert row["copy_rel_err"] <= 2.0 ** -7, row
    assert row["ms"] > 0 and row["tensors"] == len(bench_adamw.param_shapes("tiny"))


@pytest.mark.slow
def test_harness_end_to_end_and_refusal():
    run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_adamw.py"), *a],  # noqa: E731
                                    capture_output=True, text=True, env=CPU_ENV, cwd=ROOT, timeout=600)
    out = run("--case", "tiny", "--impls", "torch_fused,ours")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [s for s in out.stdout.splitlines() if s.startswith(("torch_fused ", "ours "))]
    assert len(lines) == 2 and all("|" in s and "error" not in s for s in lines), out.stdout
    refused = run()  # the real case without a GPU
    assert refused.returncode == 0 and "no CUDA device" in refused.stdout and "ROW" not in refused.stdout
