"""Shared test settings: fixed seeds, a private tuning cache, the ``gpu`` marker."""

import os
import tempfile

import numpy as np
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


def _interpreter_compat():
    """Work around two Triton 3.6 interpreter bugs seen with numpy >= 2.4 (CPU test runs only).

    1. Scalars are 1-element arrays and ``tensor.__index__`` calls ``int()`` on them, which numpy
       deprecates (1.25) and then refuses: ``range(runtime_value)`` loops fail. 2. ``tl.dot`` on bf16 multiplies the raw
    uint16 bit patterns. Exact fixes: ``.item()``, and widening bf16 to fp32 (products of bf16 values
    are exact in fp32, so the result equals a bf16 dot with fp32 accumulation).
    """
    import triton.runtime.interpreter as interp

    if getattr(interp, "_dflash_compat", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def _patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interp._patch_lang_tensor = _patched
    create_dot = interp.InterpreterBuilder.create_dot

    def _widen(x):
        if x.dtype == interp.tl.bfloat16:
            return interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), interp.tl.float32)
        return x

    def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)
    interp.InterpreterBuilder.create_dot = _dot
    interp._dflash_compat = True



if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_compat()
