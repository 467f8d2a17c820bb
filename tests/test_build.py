"""The build: how setup.py and csrc/check_compile.sh find nvcc (fake CUDA trees, no GPU needed)."""

import importlib.util
import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_module():
    spec = importlib.util.spec_from_file_location("dflash_setup_build", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # guarded by __main__: setup() does not run
    return module


def _fake_cuda(root, name):
    """A CUDA tree ``root/name/bin/nvcc`` whose nvcc is an executable stub."""
    nvcc = root / name / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho fake nvcc\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return str(nvcc)


def test_find_nvcc_prefers_cuda_home(tmp_path):
    home = _fake_cuda(tmp_path, "home")
    on_path = _fake_cuda(tmp_path, "path")
    env = {"CUDA_HOME": str(tmp_path / "home"), "PATH": os.path.dirname(on_path)}
    assert _setup_module().find_nvcc(env) == home


def test_find_nvcc_cuda_path_then_path(tmp_path):
    module = _setup_module()
    cuda_path = _fake_cuda(tmp_path, "cp")
    on_path = _fake_cuda(tmp_path, "path")
    assert module.find_nvcc({"CUDA_PATH": str(tmp_path / "cp"), "PATH": os.path.dirname(on_path)}) == cuda_path
    # A CUDA_HOME without nvcc is passed over, as torch's cpp_extension does.
    assert module.find_nvcc({"CUDA_HOME": str(tmp_path / "missing"), "PATH": os.path.dirname(on_path)}) == on_path


def test_find_nvcc_falls_back_to_usr_local_cuda(tmp_path):
    module = _setup_module()
    default = "/usr/local/cuda/bin/nvcc"
    empty = {"PATH": str(tmp_path)}
    assert module.find_nvcc(empty, exists=lambda p: p == default) == default
    assert module.find_nvcc(empty, exists=lambda p: False) is None


def test_build_plan_names_the_missing_nvcc(tmp_path):
    module = _setup_module()
    plan = module.cuda_build_plan({}, "13.0", module.find_nvcc({"PATH": str(tmp_path)}, exists=lambda p: False))
    assert plan["build"] is False and "nvcc was not found" in plan["reason"]


def test_check_compile_finds_nvcc_like_setup(tmp_path):
    script = os.path.join(ROOT, "csrc", "check_compile.sh")
    home = _fake_cuda(tmp_path, "home")
    env = {"PATH": "/usr/bin:/bin", "CUDA_HOME": str(tmp_path / "home")}
    found = subprocess.run(["bash", script, "--find-nvcc"], capture_output=True, text=True, env=env)
    assert found.returncode == 0 and found.stdout.strip() == home


@pytest.mark.skipif(os.path.exists("/usr/local/cuda/bin/nvcc"), reason="this machine has /usr/local/cuda/bin/nvcc")
def test_check_compile_without_nvcc_says_so():
    script = os.path.join(ROOT, "csrc", "check_compile.sh")
    none = subprocess.run(["bash", script, "--find-nvcc"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    assert none.returncode == 1 and "nvcc not found" in none.stderr
