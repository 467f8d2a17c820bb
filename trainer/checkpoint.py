"""Checkpoints: one dict (model, optimizer, scheduler, step, config, RNG states), written atomically.

The file is written to a temporary name in the same folder (``checkpoint.pt.tmp.<pid>``), flushed to
disk, renamed over the old one (``os.replace`` is atomic on POSIX) and the folder itself is flushed,
so a crash at any point leaves either the previous checkpoint or the new one, whole. A save killed
half-way leaves its temporary file behind: :func:`remove_stale_temporaries` deletes those at start.

Reading is always to the CPU (:func:`read_checkpoint`); :func:`restore` then copies the states into
the given model(s), optimizer(s) and scheduler(s), wherever their parameters live, and restores the
RNG states from CPU tensors (``torch.set_rng_state`` and ``torch.cuda.set_rng_state`` take CPU
ByteTensors only).
"""

import copy
import glob
import os
import random

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "restore", "rng_state", "set_rng_state",
           "remove_stale_temporaries", "CheckpointError", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "config", "rng")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read or does not fit the run (the message names the file)."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _cpu_bytes(t) -> torch.Tensor:
    return torch.as_tensor(t).detach().to(device="cpu", dtype=torch.uint8)


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s result; tensors may be on any device (they are moved to the CPU).

    CUDA generators are restored one per device, as many as both the saved state and this machine have.
    """
    torch.set_rng_state(_cpu_bytes(state["torch"]))
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_cpu_bytes(s), i)


def _fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (the directory entry, not only the file's data)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename itself stays atomic
        pass
    finally:
        os.close(fd)


def _host_lr(state: dict) -> dict:
    """An optimizer's or scheduler's state dict with learning rates held as device tensors (the drafter's
    step as CUDA graphs, ``trainer.step_graph``) as floats: the checkpoint reads the same whichever way
    the run stepped (a new dict; the live optimizer keeps its tensors)."""
    def host(v):
        return float(v) if isinstance(v, torch.Tensor) else v

    state = dict(state)
    if "param_groups" in state:
        state["param_groups"] = [{**g, "lr": host(g["lr"])} if "lr" in g else g for g in state["param_groups"]]
    if "_last_lr" in state:
        state["_last_lr"] = [host(v) for v in state["_last_lr"]]
    return state


def save_checkpoint(path: str, *, model, optimizer, scheduler, step: int, config: dict, extra=None) -> None:
    """Write ``{model, optimizer, scheduler, step, config, rng, extra}`` to ``path`` atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    ckpt = {"model": model.state_dict(), "optimizer": _host_lr(optimizer.state_dict()),
            "scheduler": _host_lr(scheduler.state_dict()), "step": step, "config": config, "rng": rng_state(),
            "extra": extra or {}}
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # a failed save (disk full) leaves nothing behind
            os.remove(tmp)
        raise
    _fsync_dir(folder)


def remove_stale_temporaries(path: str, log=None) -> list:
    """Delete ``<path>.tmp.<pid>`` files other than this process's own: saves that never finished."""
    removed = []
    mine = f"{path}.tmp.{os.getpid()}"
    for tmp in sorted(glob.glob(glob.escape(path) + ".tmp.*")):
        if tmp == mine:
            continue
        os.remove(tmp)
        removed.append(tmp)
        if log is not None:
            log(f"checkpoint: removed {tmp}, left by a save that never finished")
    return removed


def read_checkpoint(path: str) -> dict:
    """The checkpoint dict, read to the CPU; :class:`CheckpointError` naming the file if it is unusable."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint: no file at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a damaged archive
        raise CheckpointError(
            f"checkpoint: {path} cannot be read ({os.path.getsize(path)} bytes; truncated or corrupt): "
            f"{type(e).__name__}: {e}. Restore a good copy, or start over with --overwrite") from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint: {path} is not a trainer checkpoint (missing {missing})")
    return ckpt


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def restore(ckpt: dict, *, model, optimizer, scheduler, path: str = "checkpoint") -> int:
    """Load a checkpoint dict into one model / optimizer / scheduler, or into lists of them (replicas),
    and restore the RNG states; returns the checkpoint's step.

    Each of several optimizers gets a private copy of the saved state: ``load_state_dict`` keeps
    tensors that are already on the right device, and replicas sharing AdamW moments would update
    them once per replica.
    """
    models, opts, scheds = _as_list(model), _as_list(optimizer), _as_list(scheduler)
    if not len(models) == len(opts) == len(scheds):
        raise ValueError(f"restore: {len(models)} models, {len(opts)} optimizers, {len(scheds)} schedulers")
    for m, opt, sched in zip(models, opts, scheds):
        try:
            m.load_state_dict(ckpt["model"])
            opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]) if len(opts) > 1 else ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint: {path} does not fit this drafter: {type(e).__name__}: {e}") from e
        sched.load_state_dict(ckpt["scheduler"])
    set_rng_state(ckpt["rng"])
    return int(ckpt["step"])


def load_checkpoint(path: str, *, model, optimizer, scheduler) -> dict:
    """:func:`read_checkpoint` then :func:`restore`; returns the checkpoint dict."""
    ckpt = read_checkpoint(path)
    restore(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, path=path)
    return ckpt
