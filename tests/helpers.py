"""Test helpers shared by the test modules."""

import functools
import os

import torch


def device() -> torch.device:
    """CUDA when present (GPU runs of the suite), else the CPU (interpreter or reference backends)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def on_reference_device(fn):
    """``fn`` (a plain torch reference) run on ``DFLASH_TEST_REFERENCE_DEVICE`` when that is set: tensor
    arguments go there, tensor results come back (differentiably, so gradients reach the callers' leaves).
    ``tests/memcheck.sh`` sets it to ``cpu``: under memcheck every CUDA launch is instrumented, and a
    step-by-step reference's thousands of small launches took most of a candidate's minutes."""
    where = os.environ.get("DFLASH_TEST_REFERENCE_DEVICE")
    if not where:
        return fn
    ref = torch.device(where)

    def move(x, dev):
        if isinstance(x, torch.Tensor):
            return x.to(dev)
        if isinstance(x, (tuple, list)):
            return type(x)(move(y, dev) for y in x)
        return x

    @functools.wraps(fn)
    def run(*args, **kwargs):
        back = next((a.device for a in args if isinstance(a, torch.Tensor)), ref)
        out = fn(*move(args, ref), **{k: move(v, ref) for k, v in kwargs.items()})
        return move(out, back)

    return run


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; NaN anywhere gives inf so that it can never pass."""
    a64, b64 = a.detach().double(), b.detach().double()
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return float("inf")
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    return diff / denom if denom > 0 else diff


def worst_row_err(a: torch.Tensor, b: torch.Tensor, row_dims=(-1,), floor: float = 1e-2) -> float:
    """The largest relative error of one row: max over rows of ||a_r - b_r|| / ||b_r||, in float64.

    A row is the elements along ``row_dims`` (default the last dim: one head's vector of a token);
    rows are everything else. A whole-tensor norm hides a few wrong rows among many right ones; this
    does not. A row's norm is floored at ``floor`` times the mean row norm: rows the math makes nearly
    0 by cancellation (attention's dq of a row that sees one key) keep a rounding residual that is
    large relative to themselves but not to the tensor. NaN anywhere gives inf, so that it can never
    pass."""
    a64, b64 = a.detach().double(), b.detach().double()
    if a64.shape != b64.shape:
        raise ValueError(f"shapes differ: {tuple(a64.shape)} and {tuple(b64.shape)}")
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return float("inf")
    if a64.numel() == 0:
        return 0.0
    dims = tuple(d % a64.dim() for d in row_dims)
    diff = (a64 - b64).norm(dim=dims)
    ref = b64.norm(dim=dims)
    low = max(ref.mean().item() * floor, torch.finfo(torch.float64).tiny)
    return (diff / ref.clamp_min(low)).max().item()


def hopper_shared_memory(module: str, name: str, arg_types: dict, constexprs: dict, configs: list) -> list:
    """Bytes of shared memory the ``@triton.jit`` function ``module.name`` needs when compiled for
    sm_90, one number per ``(num_warps, num_stages, extra constexprs)`` in ``configs``.

    Compiled by ``tools/studies/sm90_resources.py`` (Triton's own toolchain: no GPU needed), in a
    subprocess without TRITON_INTERPRET, since interpreted kernels cannot be compiled.
    ``arg_types``: Triton type strings of runtime parameters ("*bf16", "*fp32", "fp32"); others "i32"."""
    import json
    import os
    import subprocess
    import sys

    code = """
import importlib, json, sys
from tools.studies.sm90_resources import compile_resources
module, name, types, consts, configs = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
print(json.dumps([compile_resources(fn, types, {**consts, **extra}, nw, ns, machine_code=False)["shared"]
                  for nw, ns, extra in configs]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arg = json.dumps([module, name, arg_types, constexprs, configs])
    res = subprocess.run([sys.executable, "-c", code, arg], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


H200_SHARED_MEMORY = 232448  # bytes per block (227 KiB), as Triton reports sm_90's (Hopper's) limit (sm90_resources.py)


def require_triton_kernels(op: str) -> None:
    """Fail (not skip) unless ``op`` runs its Triton kernels here: the interpreter on a CPU, compiled on
    a GPU. Tests of a kernel that quietly ran the reference would prove nothing."""
    import pytest

    from dflash_kernels.runtime import resolve

    backend = resolve(op, device())
    if backend not in ("interpret", "triton"):
        pytest.fail(f"{op} tests need the Triton kernels (interpreter on the CPU), got {backend!r}; "
                    f"run with TRITON_INTERPRET=1")


def worst_row_err_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error of one last-dim row, each row's norm floored at the RMS of all row
    norms (rows near 0 keep rounding residuals large relative to themselves, not to the tensor); NaN
    anywhere gives inf."""
    g = got.detach().double().reshape(-1, got.shape[-1])
    r = ref.detach().double().reshape(-1, ref.shape[-1])
    if torch.isnan(g).any() or torch.isnan(r).any():
        return float("inf")
    rn = r.norm(dim=1)
    floor = rn.square().mean().sqrt().clamp_min(1e-30)
    return ((g - r).norm(dim=1) / torch.maximum(rn, floor)).max().item()


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float, row_tol: float) -> None:
    """Shape, whole-tensor relative error <= ``tol`` and (rank > 1) worst-row error <= ``row_tol``."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    if got.dim() > 1:
        werr = worst_row_err_rms(got, ref)
        assert werr <= row_tol, f"{name}: worst row relative error {werr:.3g} > {row_tol:.3g}"


def check_compiled_matches_eager(f, inputs, tol: float = 1e-6) -> None:
    """``f(*inputs)`` (a scalar) under ``torch.compile(fullgraph=True)`` (a graph break fails) against the eager
    call: the value and the gradient of every input, by relative error, on fresh leaf copies of the inputs."""
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = [t.clone().requires_grad_() for t in inputs]
    exp = [t.clone().requires_grad_() for t in inputs]
    out = compiled(*got)
    out.backward()
    ref = f(*exp)
    ref.backward()
    assert rel_err(out, ref) < tol, "output"
    for i, (g, e) in enumerate(zip(got, exp)):
        assert rel_err(g.grad, e.grad) < tol, f"gradient of input {i}"


def slow_param(*values, id=None, slow=True):
    """``pytest.param(*values, id=id)``, marked ``slow`` when ``slow`` is true: the README's default run
    (``-m "not slow"``) leaves it out, ``python -m pytest tests -m slow`` runs it, CI runs both. A
    parametrization keeps a cheaper case of the same code path unmarked."""
    import pytest

    return pytest.param(*values, id=id, marks=pytest.mark.slow if slow else ())
