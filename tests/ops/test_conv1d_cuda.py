"""The CUDA-extension path of causal_conv1d (dflash_kernels._C) and its build/dispatch plumbing.

GPU tests (marked ``gpu``) force backend ``cuda`` and run the conv test matrix of test_conv1d.py
against the fp32 reference, with the Triton launchers replaced by ones that fail, so a silent fall
back to Triton cannot pass. CPU tests cover what needs no GPU: the clear error when the extension is
absent, ``dflash_kernels.backends()``, the routing between the two implementations and the conv's
use of the runtime's timed choice (the choice itself is tested in tests/runtime), setup.py's build
plan, and csrc/check_compile.sh.
"""

import importlib.util
import os
import shutil
import subprocess

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.ops.conv1d import conv1d as conv_mod
from dflash_kernels.ops.conv1d import cuda as conv_cuda
from dflash_kernels.ops.conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update
from dflash_kernels.runtime import backends, tuning
from tests.helpers import device
from tests.ops import test_conv1d as base

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_ext = pytest.mark.skipif(not conv_cuda.available(), reason="dflash_kernels._C is not built")


# ------------------------------------------------------------------------------------ GPU: kernels
@pytest.fixture
def cuda_backend(monkeypatch):
    """Backend ``cuda`` for conv1d, and Triton launchers that fail if anything reaches them."""
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton conv launcher ran while backend 'cuda' was forced")
    for name in ("_triton_fwd", "_triton_bwd", "_triton_update"):
        monkeypatch.setattr(conv_mod, name, no_triton)
    dk.set_backend("conv1d", "cuda")
    assert backends.resolve("conv1d", device()) == "cuda"
    yield
    dk.set_backend("conv1d", "auto")


def _check_all(B, D, T, W, dtype, activation="silu", bias=True, channel_last=False, init=False, seq=False,
               final=False, weight_dtype=None):
    x, weight, b, seq_idx, init_states = base._inputs(B, D, T, W, dtype, bias=bias, channel_last=channel_last,
                                                      init=init, seq=seq)
    if weight_dtype is not None:
        weight = weight.to(weight_dtype)
        b = b.to(weight_dtype) if b is not None else None
    outs_k, outs_r, kern, ref = base._run_both(x, weight, b, seq_idx, init_states, activation, final=final)
    base._check("y", outs_k[0], outs_r[0], dtype)
    if final:
        base._check("final_states", outs_k[1], outs_r[1], dtype)
    names = ["dx", "dweight"] + (["dbias"] if bias else []) + (["dinitial_states"] if init else [])
    for name, k, r in zip(names, kern, ref):
        # Tolerance of x's dtype for every gradient: an fp32 weight's gradient still comes from bf16 dy.
        base._check(name, k.grad, r.grad.to(k.dtype), dtype)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,D,T,W,activation,bias", base.CASES, ids=lambda c: str(c))
def test_forward_backward(cuda_backend, B, D, T, W, activation, bias, dtype):
    _check_all(B, D, T, W, dtype, activation=activation, bias=bias)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("W", [2, 3, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [1, 2, 45, 2049, 5000, 8200], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("channel_last", [False, True], ids=["cf", "cl"])
def test_initial_and_final_states(cuda_backend, channel_last, T, W, dtype):
    # T = 2049 and 5000 cross the channel-first tiles (2048 bf16 times) and the warp edges inside them;
    # 5000 and 8200 (multiples of 8) take the fast forward, 8200 its four-tiles-per-block form with a
    # last group of one partial tile, and the separate row-edges kernel (initial and final states).
    _check_all(2, 12, T, W, dtype, init=True, final=True, channel_last=channel_last)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channel_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("T", [70, 3001], ids=lambda t: f"T{t}")
def test_seq_idx(cuda_backend, T, channel_last, dtype):
    _check_all(2, 40, T, 4, dtype, init=True, seq=True, final=True, channel_last=channel_last)


@pytest.mark.gpu
@needs_ext
def test_seq_idx_isolates_sequences(cuda_backend):
    base.test_seq_idx_isolates_sequences()


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [24, 20, 1000], ids=lambda d: f"D{d}")
def test_channel_last(cuda_backend, D, dtype):
    # D = 20 is not a multiple of the 16-byte vector: the element-wise edge path.
    x, weight, b, _, init = base._inputs(2, D, 333, 4, dtype, channel_last=True, init=True)
    outs_k, outs_r, kern, ref = base._run_both(x, weight, b, None, init, "silu", final=True)
    assert outs_k[0].stride(1) == 1, "output keeps the channel-last layout"
    base._check("y", outs_k[0], outs_r[0], dtype)
    base._check("final_states", outs_k[1], outs_r[1], dtype)
    for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], kern, ref):
        base._check(name, k.grad, r.grad.to(dtype), dtype)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_weight_with_half_input(cuda_backend, dtype):
    _check_all(2, 64, 300, 4, dtype, init=True, final=True, weight_dtype=torch.float32)


@pytest.mark.gpu
@needs_ext
def test_odd_strides(cuda_backend):
    # Rows that are not 16-byte aligned (T = 37) and a slice with a larger row stride.
    base_x = torch.randn(2, 8, 80, device=device(), dtype=torch.bfloat16)
    weight = torch.randn(8, 4, device=device(), dtype=torch.bfloat16)
    for x in (base_x[:, :, :37], base_x[:, :, 3:40], base_x[:, :, ::2]):
        ref = naive_causal_conv1d(x.float(), weight.float(), activation="silu").to(x.dtype)
        base._check("y", dk.causal_conv1d(x, weight, activation="silu"), ref, torch.bfloat16)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [37, 4099, 8192], ids=lambda t: f"T{t}")
def test_vector_path_row_tails(cuda_backend, T, dtype):
    # Rows of a wider buffer: 16-byte aligned row starts (the vectorized channel-first kernels) whose
    # length is not a multiple of the vector (T = 37, 4099): the word at the end of each row is partial.
    # Forward, every gradient and the states, against the fp32 reference.
    Tpad = (T + 15) // 16 * 16 + 16
    base_x = torch.randn(2, 24, Tpad, device=device(), dtype=dtype)
    weight = (torch.randn(24, 4, device=device(), dtype=dtype) / 4).requires_grad_()
    bias = torch.randn(24, device=device(), dtype=dtype).requires_grad_()
    init = torch.randn(2, 24, 3, device=device(), dtype=dtype).requires_grad_()
    leaf = base_x.clone().requires_grad_()
    y, fin = dk.causal_conv1d(leaf[:, :, :T], weight, bias, activation="silu", initial_states=init,
                              return_final_states=True)
    refs = [t.detach().float().requires_grad_() for t in (base_x, weight, bias, init)]
    y_r, fin_r = naive_causal_conv1d(refs[0][:, :, :T], refs[1], refs[2], activation="silu", initial_states=refs[3],
                                   return_final_states=True)
    dy, dfin = torch.randn_like(y), torch.randn_like(fin)
    torch.autograd.backward((y, fin), (dy, dfin))
    torch.autograd.backward((y_r, fin_r), (dy.float(), dfin.float()))
    base._check("y", y, y_r.to(dtype), dtype)
    base._check("final_states", fin, fin_r.to(dtype), dtype)
    for name, k, r in zip(["dx", "dweight", "dbias", "dinitial_states"], (leaf, weight, bias, init), refs):
        base._check(name, k.grad, r.grad.to(dtype), dtype)


@pytest.mark.gpu
@needs_ext
def test_backward_is_deterministic(cuda_backend):
    x, weight, b, seq, init = base._inputs(2, 256, 4099, 4, torch.bfloat16, init=True, seq=True)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, b, init)]
        y = dk.causal_conv1d(leaves[0], leaves[1], leaves[2], "silu", seq, leaves[3])
        y.float().square().sum().backward()
        grads.append([t.grad for t in leaves])
    for g1, g2 in zip(*grads):
        assert torch.equal(g1, g2)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S,W", [(1, 3, 4), (5, 3, 4), (2, 6, 4), (1, 1, 2), (3, 2, 3)], ids=lambda v: str(v))
def test_update(cuda_backend, L, S, W, dtype):
    B, D = 2, 20
    dev = device()
    x = torch.randn(B, D, L, device=dev, dtype=dtype)
    state = torch.randn(B, D, S, device=dev, dtype=dtype)
    weight = torch.randn(D, W, device=dev, dtype=dtype)
    bias = torch.randn(D, device=dev, dtype=dtype)
    state_ref = state.clone()
    y = dk.causal_conv1d_update(x, state, weight, bias, "silu")
    y_ref = naive_causal_conv1d_update(x, state_ref, weight, bias, "silu")
    base._check("y", y, y_ref, dtype)
    assert torch.equal(state, state_ref), "conv_state after the update"


@pytest.mark.gpu
@needs_ext
def test_update_matches_full_conv(cuda_backend):
    base.test_update_matches_full_conv()


@pytest.mark.gpu
@needs_ext
def test_torch_compile_no_graph_break(cuda_backend):
    base.test_torch_compile_no_graph_break()


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint(cuda_backend, reentrant):
    base.test_checkpoint(reentrant)


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,D,T", [(1, 2560, 4096), (2, 1000, 3001)], ids=lambda v: str(v))
def test_gpu_real_sizes(cuda_backend, B, D, T, dtype):
    for channel_last in (False, True):
        _check_all(B, D, T, 4, dtype, init=True, seq=True, final=True, channel_last=channel_last)


@pytest.mark.gpu
@needs_ext
def test_auto_measures_and_persists(monkeypatch, tmp_path):
    # "auto" on CUDA with the extension built: the first call of a bucket times both paths and
    # persists the winner; the result equals the reference either way.
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DFLASH_KERNELS_TUNE", raising=False)  # the choice is timed only with tuning on
    conv_mod._impl_choice.reset()
    dk.set_backend("conv1d", "auto")
    x, weight, b, _, _ = base._inputs(2, 512, 1000, 4, torch.bfloat16)
    y = dk.causal_conv1d(x, weight, b, "silu")
    ref = naive_causal_conv1d(x.float(), weight.float(), b.float(), "silu").to(x.dtype)
    base._check("y", y, ref, torch.bfloat16)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    entries = [k for k in tuning.store()._load(tuning.store().path(dev)) if k.startswith("conv1d_impl|")]
    assert entries, "no persisted CUDA-vs-Triton choice"


# --------------------------------------------------------------------------------- CPU: plumbing
@pytest.mark.skipif(conv_cuda.available(), reason="the extension is built here")
def test_forced_cuda_without_extension_is_a_clear_error(monkeypatch):
    x, weight = torch.randn(1, 8, 16), torch.randn(8, 4)
    # set_backend refuses at once, the setting unchanged
    with pytest.raises(dk.BackendUnavailable, match="'cuda' is not built"):
        dk.set_backend("conv1d", "cuda")
    assert dk.get_backend("conv1d") == "auto"
    # chosen through the environment: each call says so
    monkeypatch.setenv("DFLASH_KERNELS_BACKEND", "conv1d=cuda")
    with pytest.raises(dk.BackendUnavailable, match="'cuda' is not built"):
        dk.causal_conv1d(x, weight, activation="silu")
    with pytest.raises(dk.BackendUnavailable, match="'cuda' is not built"):
        dk.causal_conv1d_update(x[:, :, 0], torch.zeros(1, 8, 3), weight)
    # The launchers themselves name the missing module and how to build it.
    with pytest.raises(dk.BackendUnavailable, match=r"dflash_kernels\._C.*no-build-isolation"):
        conv_cuda.cuda_causal_conv1d_fwd(x, weight, None, None, None, True, False)
    # The library's launchers obey a forced "cuda" too: no silent Triton run.
    for call in (lambda: conv_mod.causal_conv1d_fwd(x, weight, None, None, None, True, False),
                 lambda: conv_mod.causal_conv1d_update_fwd(x, torch.zeros(1, 8, 3), weight, None, False)):
        with pytest.raises(dk.BackendUnavailable, match=r"dflash_kernels\._C"):
            call()


def test_backends_lists_cuda_only_when_built(monkeypatch):
    assert backends._ops["conv1d"]["extra"].get("cuda") is conv_cuda.available, "conv1d registers backend 'cuda'"
    available = dk.backends()["conv1d"]["available"]
    assert ("cuda" in available) == conv_cuda.available()
    monkeypatch.setitem(backends._ops["conv1d"]["extra"], "cuda", lambda: True)
    assert "cuda" in dk.backends()["conv1d"]["available"]
    monkeypatch.setitem(backends._ops["conv1d"]["extra"], "cuda", lambda: False)
    assert "cuda" not in dk.backends()["conv1d"]["available"]


def test_launchers_route_by_backend(monkeypatch):
    calls = []

    def triton_fn(*args):
        calls.append("triton")

    def cuda_fn(*args):
        calls.append("cuda")
    x = torch.randn(1, 4, 8)
    args = (x, torch.randn(4, 4), None, None, None, False, False)
    monkeypatch.setitem(backends._ops["conv1d"]["extra"], "cuda", lambda: True)  # set_backend("cuda") accepted
    try:
        for backend in ("cuda", "interpret", "auto"):  # "auto" with a CPU input: never timed
            dk.set_backend("conv1d", backend)
            conv_mod._run("fwd", triton_fn, cuda_fn, args)
    finally:
        dk.set_backend("conv1d", "auto")
    assert calls == ["cuda", "triton", "triton"]
    # "auto" with the extension present and a CUDA input runs the timed choice of its bucket.
    class FakeCudaX:
        shape, dtype, device = (1, 4, 8), torch.bfloat16, torch.device("cuda", 0)

        def stride(self, dim):
            return (32, 8, 1)[dim]
    seen = []

    def choose(key, device, candidates):
        seen.append((key, list(candidates)))
        return choice
    monkeypatch.setattr(conv_cuda, "_C", object())
    monkeypatch.setattr(conv_mod._impl_choice, "choose", choose)
    monkeypatch.setattr(conv_mod.settings, "interpreting", lambda: False)
    conv_mod._impl_choice.reset()
    calls.clear()
    for choice in ("cuda", "triton"):
        conv_mod._run("fwd", triton_fn, cuda_fn, (FakeCudaX(),) + args[1:])
    assert calls == ["cuda", "triton"]
    assert seen[0] == (("fwd", "torch.bfloat16", 4, False, False, False, 8, 4), ["cuda", "triton"])


def test_conv_choice_default_name_and_strict_mode(monkeypatch, tmp_path):
    """The conv's CUDA-vs-Triton choice (a runtime Choice, tested in tests/runtime): its persisted
    name carries the CUDA sources' hash (an edited extension is timed again), strict mode names it,
    and untimed (DFLASH_KERNELS_TUNE=0) it runs Triton."""
    choice = conv_mod._impl_choice
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DFLASH_KERNELS_TUNE", raising=False)  # strict mode raises only where it would time
    choice.reset()
    cpu = torch.device("cpu")
    assert choice.persist_name(("fwd", 1)) == f"conv1d_impl|{conv_cuda.source_hash()}|('fwd', 1)"

    def no_timing(fn):
        raise AssertionError("timed although it must not be")
    candidates = {"cuda": lambda: "cuda", "triton": lambda: "triton"}
    with dk.strict():
        with pytest.raises(dk.KernelCacheMiss, match=r"conv1d CUDA-vs-Triton choice .* not measured yet"):
            choice.choose(("fwd", "strict"), cpu, candidates, timer=no_timing)
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "0")
    assert choice.choose(("fwd", "untimed"), cpu, candidates, timer=no_timing) == "triton"
    choice.reset()


# ------------------------------------------------------------------------------ CPU: setup.py
def _setup_module():
    spec = importlib.util.spec_from_file_location("dflash_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # guarded by __main__: setup() does not run
    return module


def test_setup_import_does_not_run_setup():
    module = _setup_module()
    assert callable(module.cuda_build_plan)


@pytest.mark.parametrize("env,torch_cuda,nvcc,build,reason", [
    ({}, "13.0", "/usr/local/cuda/bin/nvcc", True, "targets 80;90"),
    ({"DFLASH_KERNELS_SKIP_CUDA_BUILD": "1"}, "13.0", "/usr/local/cuda/bin/nvcc", False, "SKIP_CUDA_BUILD"),
    ({}, None, "/usr/local/cuda/bin/nvcc", False, "not a CUDA build"),
    ({}, "13.0", None, False, "nvcc was not found"),
    ({"DFLASH_KERNELS_CUDA_ARCHS": "90"}, "13.0", "/x/nvcc", True, "targets 90"),
], ids=["cuda", "skip", "cpu-torch", "no-nvcc", "archs"])
def test_cuda_build_plan(env, torch_cuda, nvcc, build, reason):
    plan = _setup_module().cuda_build_plan(env, torch_cuda, nvcc)
    assert plan["build"] is build
    assert reason in plan["reason"]
    if build:
        assert all(f.startswith("-gencode=arch=compute_") for f in plan["gencode"])


def test_cuda_archs_parse():
    module = _setup_module()
    archs, flags = module.parse_archs("80;90")
    assert archs == ["80", "90"]
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                     "-gencode=arch=compute_90,code=compute_90"]
    assert module.parse_archs("8.0 9.0a")[0] == ["80", "90a"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in module.parse_archs("sm_90a")[1]
    with pytest.raises(ValueError, match="DFLASH_KERNELS_CUDA_ARCHS"):
        module.parse_archs("hopper")


def test_force_build_fails_loudly():
    module = _setup_module()
    with pytest.raises(RuntimeError, match="FORCE_CUDA_BUILD"):
        module.cuda_build_plan({"DFLASH_KERNELS_FORCE_CUDA_BUILD": "1"}, None, None)


def test_cpu_torch_builds_pure_triton_package(capsys):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    module = _setup_module()
    assert module.extension_kwargs({"PATH": os.environ.get("PATH", "")}) == {}
    assert "pure-Triton package" in capsys.readouterr().err


# ------------------------------------------------------------------ CPU: csrc/check_compile.sh
_nvcc = shutil.which("nvcc") or (shutil.which("nvcc", path=os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                                        "bin")))


@pytest.mark.skipif(_nvcc is None, reason="nvcc not installed")
def test_check_compile_script_fails_on_a_broken_source(tmp_path):
    # The script compiles every .cu beside it: a copy next to a tiny good and a tiny broken source.
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    shutil.copy(os.path.join(ROOT, "csrc", "check_compile.sh"), csrc / "check_compile.sh")
    (csrc / "good.cu").write_text("__global__ void k(float* p) { p[threadIdx.x] = 1.f; }\n")
    env = {**os.environ, "NVCC": _nvcc}
    ok = subprocess.run(["bash", str(csrc / "check_compile.sh")], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (csrc / "bad.cu").write_text("__global__ void k2(float* p) { p[threadIdx.x] = 1.f }\n")
    bad = subprocess.run(["bash", str(csrc / "check_compile.sh")], capture_output=True, text=True, env=env)
    assert bad.returncode != 0
    assert "bad.cu" in bad.stdout + bad.stderr
