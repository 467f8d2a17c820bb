"""Shared test settings: fixed seeds, a private tuning cache, the ``gpu`` marker."""

import os
import tempfile

import pytest
import torch

# Tuning results of test runs go to a throw-away folder, never the user's cache, and every output
# buffer the launchers allocate is NaN-filled first, so an element a kernel fails to write fails a test.
os.environ.setdefault("DFLASH_KERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="dflash_kernels_test_cache_"))
os.environ.setdefault("DFLASH_KERNELS_POISON", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (real sizes); skipped elsewhere")


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
