"""Checkpoints: one dict (model, optimizer, scheduler, step, config, RNG states), written atomically.

The file is written to a temporary name in the same folder, flushed to disk, then renamed over the
old one (``os.replace`` is atomic on POSIX), so a crash mid-write leaves the previous checkpoint intact.
"""

import os
import random

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str, *, model, optimizer, scheduler, step: int, config: dict, extra=None) -> None:
    """Write ``{model, optimizer, scheduler, step, config, rng, extra}`` to ``path`` atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": step, "config": config, "rng": rng_state(), "extra": extra or {}}
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str, *, model, optimizer, scheduler, map_location="cpu") -> dict:
    """Restore the states saved by :func:`save_checkpoint` in place; returns the checkpoint dict."""
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    set_rng_state(ckpt["rng"])
    return ckpt
