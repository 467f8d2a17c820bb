"""Per-thread CUDA state: which device a launch runs on, its current stream, the GPU model.

Every launch runs on the device of its input tensors and on that device's current stream of the
calling thread, whatever device the thread last selected: a worker thread that never called
``torch.cuda.set_device`` still launches on the right GPU.
"""

import contextlib
import functools
import re

import torch

__all__ = ["device_index", "gpu_model", "on_device", "current_stream", "sm_count"]

try:  # the raw-stream getter Triton itself uses: no Python Stream object per call
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - very old torch
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def device_index(device: torch.device) -> int:
    """-1 for the CPU, the CUDA ordinal otherwise (``cuda`` without an index means the current one)."""
    if device.type == "cpu":
        return -1
    if device.index is not None:
        return device.index
    return torch.cuda.current_device()


def current_stream(index: int) -> int:
    return _raw_stream(index)


@contextlib.contextmanager
def on_device(index: int):
    """Make ``index`` the current CUDA device for the block, then restore the caller's."""
    if index < 0:
        yield
        return
    previous = torch.cuda.current_device()
    if previous == index:
        yield
        return
    torch.cuda.set_device(index)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


@functools.lru_cache(maxsize=None)
def gpu_model(index: int) -> str:
    """A file-name-safe GPU model name, e.g. ``NVIDIA_H200``; ``cpu`` for the interpreter."""
    if index < 0:
        return "cpu"
    name = torch.cuda.get_device_name(index)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The number of streaming multiprocessors of CUDA device ``index`` (0 for the CPU)."""
    if index < 0:
        return 0
    return torch.cuda.get_device_properties(index).multi_processor_count
