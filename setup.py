"""dflash_kernels: Triton attention / linear-attention kernels with a thread-safe runtime.

Install:  pip install -e ".[test]"     (the CPU machine: Triton interpreter and reference backends)
Peers:    pip install -e ".[peers]"    (CUDA machines only: flash-linear-attention, causal-conv1d)
CUDA:     python -m pip install -e . --no-build-isolation   (with a CUDA build of torch and nvcc: also builds
          the extension dflash_kernels._C from csrc/; the isolated build environment has no torch)

Build variables:
- ``DFLASH_KERNELS_SKIP_CUDA_BUILD=1``: never build the extension (pure-Triton package).
- ``DFLASH_KERNELS_FORCE_CUDA_BUILD=1``: fail instead of skipping when the extension cannot be built.
- ``DFLASH_KERNELS_CUDA_ARCHS="80;90"``: targets (default 80;90; ``90a`` style suffixes allowed).
"""

import glob
import hashlib
import os
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
DEFAULT_ARCHS = "80;90"


def _flag(env, name):
    return env.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def parse_archs(spec):
    """``"80;90"`` / ``"8.0 9.0"`` / ``"90a"`` -> nvcc ``-gencode`` flags, plus PTX of the highest target
    so a newer GPU can still JIT the kernels."""
    archs = []
    for item in spec.replace(",", ";").replace(" ", ";").split(";"):
        item = item.strip().lower().replace(".", "").removeprefix("sm_")
        if not item:
            continue
        digits = item.rstrip("af")
        if not digits.isdigit() or len(digits) < 2:
            raise ValueError(f"DFLASH_KERNELS_CUDA_ARCHS: cannot read {item!r} in {spec!r}; use e.g. '80;90'")
        if item not in archs:
            archs.append(item)
    if not archs:
        raise ValueError(f"DFLASH_KERNELS_CUDA_ARCHS: no architecture in {spec!r}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return archs, flags


def find_nvcc(env, exists=os.path.exists):
    """The nvcc torch's ``cpp_extension`` would use: ``$CUDA_HOME`` (or ``$CUDA_PATH``), then ``nvcc``
    on ``PATH``, then ``/usr/local/cuda``; None when there is none."""
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH")):
        if home and exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    if on_path:
        return on_path
    default = os.path.join("/usr/local/cuda", "bin", "nvcc")
    return default if exists(default) else None


def cuda_build_plan(env, torch_cuda, nvcc):
    """Whether to build ``dflash_kernels._C``: ``{"build", "reason", "archs", "gencode"}``.

    env: the environment (a mapping); torch_cuda: ``torch.version.cuda`` (None for a CPU torch, or
    when torch is not importable); nvcc: the nvcc path or None. Raises ``RuntimeError`` when the build
    is forced but impossible.
    """
    plan = {"build": False, "reason": "", "archs": [], "gencode": []}
    if _flag(env, "DFLASH_KERNELS_SKIP_CUDA_BUILD"):
        plan["reason"] = "DFLASH_KERNELS_SKIP_CUDA_BUILD is set"
    elif torch_cuda is None:
        plan["reason"] = ("torch in the build environment is not a CUDA build (or not importable: "
                          "use pip's --no-build-isolation to build against the installed torch)")
    elif nvcc is None:
        plan["reason"] = "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    else:
        plan["archs"], plan["gencode"] = parse_archs(env.get("DFLASH_KERNELS_CUDA_ARCHS") or DEFAULT_ARCHS)
        plan["build"] = True
        plan["reason"] = f"torch CUDA {torch_cuda}, nvcc {nvcc}, targets {';'.join(plan['archs'])}"
    if not plan["build"] and _flag(env, "DFLASH_KERNELS_FORCE_CUDA_BUILD"):
        raise RuntimeError(f"DFLASH_KERNELS_FORCE_CUDA_BUILD is set but the CUDA extension cannot be built: "
                           f"{plan['reason']}")
    return plan


def csrc_hash(root):
    """Hash of every file under csrc/: the CUDA-vs-Triton choice persisted per bucket is keyed by it."""
    h = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(root, CSRC, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _torch_cuda():
    try:
        import torch
    except Exception:
        return None
    return torch.version.cuda


def extension_kwargs(env):
    plan = cuda_build_plan(env, _torch_cuda(), find_nvcc(env))
    if not plan["build"]:
        print(f"dflash_kernels: building the pure-Triton package without the CUDA extension ({plan['reason']})",
              file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    print(f"dflash_kernels: building the CUDA extension dflash_kernels._C ({plan['reason']})", file=sys.stderr)
    sources = [os.path.join(CSRC, "binding.cpp")] + sorted(
        os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, CSRC, "**", "*.cu"), recursive=True))
    define = f'-DDFLASH_CSRC_HASH="{csrc_hash(HERE)}"'
    ext = CUDAExtension(
        "dflash_kernels._C", sources=sources, include_dirs=[os.path.join(HERE, CSRC)],
        extra_compile_args={"cxx": ["-O3", define], "nvcc": ["-O3", "-lineinfo", *plan["gencode"]]},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


if __name__ == "__main__":
    setup(
        name="dflash_kernels",
        version="0.1.0",
        description=("Block-sparse attention, Gated DeltaNet, causal conv1d, fused LM-head cross-entropy and fused "
                     "norm/RoPE/SwiGLU kernels with a thread-safe runtime"),
        packages=find_packages(include=["dflash_kernels", "dflash_kernels.*"]),
        # tuning results shipped per GPU model; compiled kernels per GPU architecture, Triton and driver version
        package_data={"dflash_kernels.runtime": ["tuned/*.json", "compiled/*.tar.xz"]},
        python_requires=">=3.10",
        install_requires=["torch>=2.5", "triton>=3.4"],
        extras_require={
            # transformers: its torch Gated DeltaNet is a test oracle, and the integration is tested;
            # pytest-xdist: the README's test command runs the tests in parallel (-n auto).
            "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", "transformers>=5"],
            # The trainer and benchmarks/tok_s.py: HF models, tokenizers, safetensors.
            "train": ["transformers>=5"],
            "peers": ["flash-linear-attention>=0.6", "causal-conv1d>=1.5", "liger-kernel>=0.8",
                      "cut-cross-entropy>=25.1"],
        },
        **extension_kwargs(os.environ),
    )
