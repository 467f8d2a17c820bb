"""Shared test settings: fixed seeds, a private tuning cache, the ``gpu`` marker, the tuning mode.

``--tuning {off,on,default}`` sets the GPU suite's tuning: ``on`` times every kernel's candidates
(``DFLASH_KERNELS_TUNE=1``: the configs the tuner picks for the tests' shapes run), ``off`` takes each
kernel's first config untimed (``DFLASH_KERNELS_TUNE=0``; the conv's CUDA-vs-Triton choice takes
Triton), ``default`` leaves the environment as it is. The runtime reads the variable at every compile,
so setting it before the tests run takes effect. ``tests/ops/test_every_candidate.py`` forces every
candidate of every kernel in turn.

    python -m pytest tests --tuning on
"""

import os
import tempfile

import pytest
import torch

# Tuning results of test runs go to a throw-away folder, never the user's cache, and every output
# buffer the launchers allocate is NaN-filled first, so an element a kernel fails to write fails a test.
os.environ.setdefault("DFLASH_KERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="dflash_kernels_test_cache_"))
os.environ.setdefault("DFLASH_KERNELS_POISON", "1")
# The tests time their own tuning: the results shipped with the package (runtime/tuned/) are not read
# unless a test turns them on.
os.environ.setdefault("DFLASH_KERNELS_PACKAGED_TUNING", "0")


_TUNING = {"on": "1", "off": "0"}


def pytest_addoption(parser):
    parser.addoption("--tuning", choices=("off", "on", "default"), default="default",
                     help="GPU kernels: time every candidate (on), take each kernel's first config (off), or "
                          "leave DFLASH_KERNELS_TUNE as it is (default)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (real sizes); skipped elsewhere")
    mode = config.getoption("--tuning")
    if mode in _TUNING:
        os.environ["DFLASH_KERNELS_TUNE"] = _TUNING[mode]


def pytest_report_header(config):
    return (f"dflash_kernels tuning: --tuning {config.getoption('--tuning')} "
            f"(DFLASH_KERNELS_TUNE={os.environ.get('DFLASH_KERNELS_TUNE', 'unset')})")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def force(monkeypatch):
    """``force(kernel, config)``: ``config`` as the kernel's only candidate (and its interpreter config), tuning
    off; returns a function listing the configs the kernel actually ran. The kernels' caches are reset before and
    after."""
    forced = []

    def apply(kernel, config):
        monkeypatch.setenv("DFLASH_KERNELS_TUNE", "0")
        monkeypatch.setattr(kernel, "configs", [config])
        monkeypatch.setattr(kernel, "interpret_config", config)
        kernel.reset()
        forced.append(kernel)
        return lambda: [v["config"] for v in kernel.cache_info().values()]
    yield apply
    for kernel in forced:
        kernel.reset()
