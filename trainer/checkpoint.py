"""Checkpoints: one dict (model, optimizer, scheduler, step, config, RNG states), written atomically.

The file is written to a temporary name in the same folder (``checkpoint.pt.tmp.<pid>``), flushed to
disk, renamed over the old one (``os.replace`` is atomic on POSIX) and the folder itself is flushed,
so a crash at any point leaves either the previous checkpoint or the new one, whole. A save killed
half-way leaves its temporary file behind: :func:`remove_stale_temporaries` deletes those at start.

Reading is always to the CPU (:func:`read_checkpoint`); :func:`restore` then copies the states into
the given model(s), optimizer(s) and scheduler(s), wherever their parameters live, and restores the
RNG states from CPU tensors (``torch.set_rng_state`` and ``torch.cuda.set_rng_state`` take CPU
ByteTensors only). The optimizer's settings (lr, betas, eps, weight decay, how it steps) and the schedule
stay the resuming run's own; a checkpoint holds no device-specific optimizer state (float learning rates,
no ``capturable``, step counts on the CPU), so a GPU run's checkpoint resumes on the CPU and the other way.
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


def _portable(state: dict) -> dict:
    """An optimizer's or scheduler's state dict as any device reads it back: learning rates held as device
    tensors (the drafter's step as CUDA graphs, ``trainer.step_graph``) as floats, ``capturable`` off, and
    the step counts as float32 CPU scalars (the capturable step keeps them on the device). A new dict: the
    live optimizer keeps its tensors and settings. Which of these a resumed run uses is its own affair
    (:func:`restore`): a checkpoint of a step-graph run resumes on the CPU, a CPU run's into step graphs."""
    def host(v):
        return float(v) if isinstance(v, torch.Tensor) else v

    state = dict(state)
    if "param_groups" in state:
        state["param_groups"] = [{**g, **({"lr": host(g["lr"])} if "lr" in g else {}),
                                  **({"capturable": False} if "capturable" in g else {})}
                                 for g in state["param_groups"]]
    if "state" in state:
        state["state"] = {k: ({**v, "step": torch.as_tensor(v["step"]).detach().to("cpu", torch.float32).reshape(())}
                              if isinstance(v, dict) and "step" in v else v) for k, v in state["state"].items()}
    if "_last_lr" in state:
        state["_last_lr"] = [host(v) for v in state["_last_lr"]]
    return state


def save_checkpoint(path: str, *, model, optimizer, scheduler, step: int, config: dict, extra=None) -> None:
    """Write ``{model, optimizer, scheduler, step, config, rng, extra}`` to ``path`` atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    ckpt = {"model": model.state_dict(), "optimizer": _portable(optimizer.state_dict()),
            "scheduler": _portable(scheduler.state_dict()), "step": step, "config": config, "rng": rng_state(),
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


def _settings(opt) -> list:
    """Each group's settings (everything but its parameters): lr, betas, eps, weight decay, and how it steps
    (``fused``, ``foreach``, ``capturable``) as this run built it."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _place_step_counts(opt) -> None:
    """Each parameter's step count where its group's settings want it: on the parameter's device as float32
    for torch's fused or capturable AdamW and MasterAdamW's capturable mode, else on the CPU (a checkpoint
    holds them on the CPU; ``load_state_dict`` placed them by the saved groups' settings, not this run's)."""
    for g in opt.param_groups:
        on_device = bool(g.get("fused")) or bool(g.get("capturable"))
        for p in g["params"]:
            st = opt.state.get(p)
            if st and isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].to(p.device if on_device else "cpu", torch.float32)


def restore(ckpt: dict, *, model, optimizer, scheduler, path: str = "checkpoint") -> int:
    """Load a checkpoint dict into one model / optimizer / scheduler, or into lists of them (replicas),
    and restore the RNG states; returns the checkpoint's step.

    The checkpoint supplies the weights, the optimizer's moments and step counts, and the position in the
    schedule (``last_epoch``). The optimizer's settings (lr, betas, eps, weight decay, fused / capturable) and
    the schedule (its base lr and lambda) stay those the optimizer and scheduler were built with, i.e. this
    run's config: a resume with ``--allow-config-change`` (or a longer ``steps``) trains with the new values
    from the saved step on, and the group's lr is the new schedule's at that step. With an unchanged config
    the values are the saved ones, bit for bit.

    Each of several optimizers gets a private copy of the saved state: ``load_state_dict`` keeps
    tensors that are already on the right device, and replicas sharing AdamW moments would update
    them once per replica.
    """
    models, opts, scheds = _as_list(model), _as_list(optimizer), _as_list(scheduler)
    if not len(models) == len(opts) == len(scheds):
        raise ValueError(f"restore: {len(models)} models, {len(opts)} optimizers, {len(scheds)} schedulers")
    for m, opt, sched in zip(models, opts, scheds):
        settings, base_lrs = _settings(opt), list(sched.base_lrs)
        try:
            m.load_state_dict(ckpt["model"])
            opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]) if len(opts) > 1 else ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint: {path} does not fit this drafter: {type(e).__name__}: {e}") from e
        sched.load_state_dict(ckpt["scheduler"])
        for g, own in zip(opt.param_groups, settings):
            g.update(own)
        _place_step_counts(opt)
        sched.base_lrs = base_lrs
        if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):  # the lr LambdaLR.step would have set
            lrs = [b * f(sched.last_epoch) for b, f in zip(sched.base_lrs, sched.lr_lambdas)]
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
            sched._last_lr = lrs
    set_rng_state(ckpt["rng"])
    return int(ckpt["step"])


def load_checkpoint(path: str, *, model, optimizer, scheduler) -> dict:
    """:func:`read_checkpoint` then :func:`restore`; returns the checkpoint dict."""
    ckpt = read_checkpoint(path)
    restore(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, path=path)
    return ckpt
