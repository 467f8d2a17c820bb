"""A CPU machine that has causal-conv1d and fla installed (as a fresh GPU machine's CPU side does):
transformers binds a Qwen3.5's conv and Gated DeltaNet to those packages at import time, and they take
CUDA tensors only. Stand-ins that raise on CPU tensors as the real ones do are put on the path; the
embedded default's build, the trainer's preflight and a short training run must never reach them."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFUSAL = "Expected x.is_cuda() to be true"  # causal-conv1d's message for a CPU tensor

CAUSAL_CONV1D = f'''
"""Stand-in for causal-conv1d: CUDA tensors only, as the real extension."""
__version__ = "1.5.2"


def _cuda_only(x):
    if not x.is_cuda:
        raise RuntimeError("{REFUSAL}, but got false. (stand-in causal_conv1d)")
    raise RuntimeError("stand-in causal_conv1d: no kernels here")


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    _cuda_only(x)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    _cuda_only(x)
'''

FLA_GDN = '''
"""Stand-in for fla.ops.gated_delta_rule: Triton kernels, CUDA tensors only."""


def _cuda_only(q):
    if not q.is_cuda:
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?) (stand-in fla)")
    raise RuntimeError("stand-in fla: no kernels here")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, **kwargs):
    _cuda_only(q)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                     **kwargs):
    _cuda_only(q)
'''


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text).lstrip())


@pytest.fixture(scope="module")
def peers_path(tmp_path_factory):
    """A folder holding the stand-ins and their distribution metadata (version checks find them)."""
    root = str(tmp_path_factory.mktemp("cuda_only_peers"))
    _write(os.path.join(root, "causal_conv1d", "__init__.py"), CAUSAL_CONV1D)
    _write(os.path.join(root, "causal_conv1d-1.5.2.dist-info", "METADATA"),
           "Metadata-Version: 2.1\nName: causal_conv1d\nVersion: 1.5.2\n")
    _write(os.path.join(root, "fla", "__init__.py"), '__version__ = "0.4.0"\n')
    _write(os.path.join(root, "fla", "ops", "__init__.py"), "")
    _write(os.path.join(root, "fla", "ops", "gated_delta_rule", "__init__.py"), FLA_GDN)
    _write(os.path.join(root, "flash_linear_attention-0.4.0.dist-info", "METADATA"),
           "Metadata-Version: 2.1\nName: flash-linear-attention\nVersion: 0.4.0\n")
    _write(os.path.join(root, "flash_linear_attention-0.4.0.dist-info", "top_level.txt"), "fla\n")
    return root


def run(args, peers_path, timeout=600, gpu=False):
    # A machine without the Triton interpreter: dflash_kernels' CPU ops are their torch references.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DFLASH_TRAINER_FAULT")}
    env.update(PYTHONPATH=os.pathsep.join([peers_path, ROOT]))
    if not gpu:  # the CPU side of a GPU machine: no device visible
        env.update(DFLASH_KERNELS_BACKEND="attention=reference", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_stand_ins_catch_a_cpu_forward(peers_path):
    """Control: without routing, transformers up to 5.24 sends a CPU Qwen3.5 forward to the stand-ins, which
    refuse (so the tests below would fail if the trainer let the target reach them); from 5.25 transformers
    first asks whether the installed kernels support the inputs' device and runs its own torch code on CPU
    inputs, saying so. Either way a CPU forward never runs the CUDA-only peers."""
    code = textwrap.dedent("""
        import torch, trainer
        from trainer.build_default import target_config
        from transformers import Qwen3_5ForCausalLM
        m = Qwen3_5ForCausalLM(target_config(64, hidden=64, layers=4))
        m(input_ids=torch.zeros(1, 8, dtype=torch.long))
    """)
    proc = run(["-c", code], peers_path)
    refused = proc.returncode != 0 and REFUSAL in proc.stderr
    fell_back = proc.returncode == 0 and all(
        f"`{fn}` is falling back to its reference PyTorch implementation" in proc.stderr
        for fn in ("causal_conv1d_fn", "chunk_gated_delta_rule"))
    assert refused or fell_back, proc.stderr[-3000:]


@pytest.mark.slow
def test_build_preflight_and_training_on_the_cpu(peers_path, tmp_path):
    cache = str(tmp_path / "cache")
    proc = run(["-m", "trainer.build_default", "--cache-dir", cache, "--steps", "2", "--train-records", "8",
                "--eval-prompts", "2", "--gen-len", "24"], peers_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "target on the CPU: Gated DeltaNet and conv on transformers' torch code" in proc.stdout
    embedded = tmp_path / "cache" / "embedded"
    assert (embedded / "target" / "config.json").exists() and (embedded / "build.json").exists()
    with open(embedded / "train.jsonl") as f:
        assert len(f.readlines()) == 8

    # The trainer on that default (the tiny preset's shapes; it would use its own random tiny target otherwise):
    # its preflight, then a short single-process run.
    common = ["--preset", "tiny", "--builtin-target", "embedded", "--cache-dir", cache]
    proc = run(["-m", "trainer.train", "--preflight", "--target-gpus", "cpu", "--out-dir", str(tmp_path / "pre"),
                *common], peers_path)
    assert proc.returncode == 0 and "preflight: OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run(["-m", "trainer.train", "--steps", "2", "--out-dir", str(tmp_path / "run"), *common], peers_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout and (tmp_path / "run" / "checkpoint.pt").exists()


def test_the_tiny_preset_on_the_cpu(peers_path, tmp_path):
    """A first run (``--preset tiny``: its random tiny target, built in seconds) on the CPU of a machine with
    the CUDA-only packages installed."""
    proc = run(["-m", "trainer.train", "--preset", "tiny", "--steps", "1", "--cache-dir", str(tmp_path / "cache"),
                "--out-dir", str(tmp_path / "run")], peers_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tiny target: building a random tiny target" in proc.stdout and "step 1/1" in proc.stdout
    assert not (tmp_path / "cache" / "embedded").exists()


@pytest.mark.gpu
def test_fresh_gpu_machine_builds_on_the_gpu_and_runs_the_pipeline_preflight(peers_path, tmp_path):
    """With a GPU, ``python -m trainer.build_default`` (no --device) builds there on dflash_kernels' ops, and
    ``python -m trainer.train --target-gpus 0,0 --drafter-gpus 0,0,0 --preflight`` on that default passes.
    The stand-ins refuse CUDA tensors too, so neither may reach them."""
    cache = str(tmp_path / "cache")
    proc = run(["-m", "trainer.build_default", "--cache-dir", cache, "--steps", "5", "--train-records", "32",
                "--eval-prompts", "4", "--gen-len", "48"], peers_path, gpu=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "target on cuda: Gated DeltaNet and conv on dflash_kernels" in proc.stdout
    proc = run(["-m", "trainer.train", "--preflight", "--target-gpus", "0,0", "--drafter-gpus", "0,0,0",
                "--cache-dir", cache, "--out-dir", str(tmp_path / "pre")], peers_path, gpu=True)
    assert proc.returncode == 0 and "preflight: OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
