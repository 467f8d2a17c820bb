"""tools/studies/bench_gemm_shapes.py: the GEMM logger sees every matrix product of a step (the library's custom
ops' products included), attributes each to its source line, and its FLOP arithmetic; the script end to end
on the tiny preset (CPU, the Triton interpreter)."""

import os
import subprocess
import sys

import pytest
import torch

from tools.studies import bench_gemm_shapes as bgs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU_ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_flops_of_each_product():
    assert bgs.gemm_flops("mm", [(3, 5), (5, 7)]) == 2 * 3 * 5 * 7
    assert bgs.gemm_flops("addmm", [(7,), (3, 5), (5, 7)]) == 2 * 3 * 5 * 7
    assert bgs.gemm_flops("bmm", [(2, 3, 5), (2, 5, 7)]) == 2 * 2 * 3 * 5 * 7


def test_logger_counts_products_and_their_sources():
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)
    logger = bgs.GemmLogger()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), logger:
        y = torch.nn.functional.linear(x, w)
        torch.autograd.grad(y.sum(), (x, w))
    calls = dict(logger.calls)
    assert sum(calls.values()) == 3, calls  # the forward and the two gradients
    fwd = [k for k in calls if not k[-1].startswith("MmBackward")]
    bwd = [k for k in calls if k[-1].startswith("MmBackward")]
    assert len(fwd) == 1 and len(bwd) == 2, calls
    here = os.path.basename(__file__)
    assert all(here in k[-1] for k in calls), calls  # the backward's products charged to the forward's line
    assert fwd[0][2] == (((4, 6), (6, 1), "float32"), ((6, 5), (1, 6), "float32"))


def test_fresh_operands_keep_broadcast_strides():
    t = bgs._fresh(((3, 4), (0, 1), "float32"), torch.device("cpu"))
    assert t.shape == (3, 4) and t.stride() == (0, 1) and torch.isfinite(t).all()
    assert torch.equal(t[0], t[2])


@pytest.mark.slow
def test_script_end_to_end_tiny():
    out = subprocess.run([sys.executable, "-m", "tools.studies.bench_gemm_shapes", "--preset", "tiny",
                          "--lm-head-chunks", "64", "--top", "100"],
                         capture_output=True, text=True, env=CPU_ENV, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "GEMM calls per step" in text
    # the drafter's projections, the target's layers and the fused LM-head loss's two products inside its custom op
    for src in ("trainer/model.py", "modeling_qwen3_5.py", "linear_cross_entropy.py"):
        assert src in text, (src, text[-3000:])
    assert "MmBackward0 <- trainer/model.py" in text
    lines = [s for s in text.splitlines() if s.strip().startswith("64 ")]
    assert len(lines) == 1, text[-1500:]
