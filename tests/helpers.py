"""Test helpers shared by the test modules."""

import torch


def device() -> torch.device:
    """CUDA when present (GPU runs of the suite), else the CPU (interpreter or reference backends)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; NaN anywhere gives inf so that it can never pass."""
    a64, b64 = a.detach().double(), b.detach().double()
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return float("inf")
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    return diff / denom if denom > 0 else diff
