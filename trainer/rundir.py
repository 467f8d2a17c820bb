"""The run folder (``OUT_DIR``): what a new run or a resume finds there, and what it keeps.

- A new run into a folder that holds an earlier run (its ``checkpoint.pt``, or a non-empty
  ``metrics.jsonl``) refuses, unless told ``--resume`` (continue it) or ``--overwrite`` (start over:
  the old checkpoint and ``drafter/`` folder are deleted at once, the old ``metrics.jsonl`` is kept as
  ``metrics.replaced-<n>.jsonl``). A resume without a checkpoint refuses too.
- Temporary files of saves that never finished (a process killed mid-save) are deleted at start.
- A resume compares the config saved in the checkpoint with the new one and refuses a change, naming
  the fields, unless told ``--allow-config-change``; the fields in :data:`RESUME_MAY_CHANGE` (where
  and how often things are written, the hardware layout, supervision limits, the run's length) may
  change without it. Either way the run trains with the new config from the saved step on (the optimizer's
  settings and schedule included: ``trainer.checkpoint.restore``).
- ``metrics.jsonl`` on resume keeps the lines up to the checkpoint's step (one trajectory; the later
  steps are trained again) and says how many it dropped; a line cut short by a kill is skipped.
"""

import dataclasses
import glob
import json
import os
import shutil

from trainer.checkpoint import CHECKPOINT_NAME, remove_stale_temporaries
from trainer.config import TrainConfig

__all__ = ["prepare_run_dir", "config_changes", "check_resume_config", "open_metrics", "RunDirError",
           "ConfigChanged", "RESUME_MAY_CHANGE", "METRICS_NAME", "DRAFTER_DIR"]

METRICS_NAME = "metrics.jsonl"
DRAFTER_DIR = "drafter"

# Config fields a resume may change without --allow-config-change. The others decide what is trained
# (target, data, shapes, optimiser, seed, loss): a resume with another value would silently continue a
# different run. ``steps`` / ``epochs`` extend or shorten a run: the learning-rate schedule is
# recomputed for the new total from the saved step on.
RESUME_MAY_CHANGE = frozenset({
    "out_dir", "cache_dir", "log_interval", "save_interval", "steps", "epochs", "device", "target_gpus",
    "drafter_gpus", "queue_depth", "watchdog_s", "watchdog_setup_s", "stop_grace_s", "extra", "target_cuda_graphs",
    "step_cuda_graphs",
})


class RunDirError(RuntimeError):
    """The run folder does not allow what was asked (a new run over an earlier one)."""


class ConfigChanged(ValueError):
    """A resume with a config that differs from the checkpoint's in fields that must not change."""


def _nonempty(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) > 0


def _free_name(out_dir: str) -> str:
    n = 1
    while os.path.exists(os.path.join(out_dir, f"metrics.replaced-{n}.jsonl")):
        n += 1
    return os.path.join(out_dir, f"metrics.replaced-{n}.jsonl")


def prepare_run_dir(out_dir: str, *, resume: bool, overwrite: bool = False, log=print, modify: bool = True):
    """Make ``out_dir`` ready for this run; returns the checkpoint path to resume from, or None.

    ``modify=False`` (the non-main ranks of a multi-process run) checks without deleting or moving files.
    Raises :class:`RunDirError` for a new run over an earlier one without ``overwrite``, and for a resume
    without a checkpoint.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite: choose one (continue the run in OUT_DIR, or start over)")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, CHECKPOINT_NAME)
    metrics = os.path.join(out_dir, METRICS_NAME)
    if modify:
        remove_stale_temporaries(ckpt, log)
        if os.path.exists(metrics + ".tmp"):  # a rewrite of metrics.jsonl cut short; the file itself is whole
            os.remove(metrics + ".tmp")
        for tmp in sorted(glob.glob(os.path.join(glob.escape(os.path.join(out_dir, DRAFTER_DIR)), "*.tmp"))):
            os.remove(tmp)
            log(f"run folder: removed {tmp}, left by a save that never finished")
    if resume:
        if not os.path.exists(ckpt):
            raise RunDirError(f"--resume: no checkpoint at {ckpt}: nothing to continue; start a new run (without "
                              f"--resume), or name the folder of the run to continue with --out-dir")
        return ckpt
    found = [p for p in (ckpt, metrics) if (os.path.exists(p) if p == ckpt else _nonempty(p))]
    if found and not overwrite:
        names = ", ".join(os.path.basename(p) for p in found)
        raise RunDirError(f"out_dir: {out_dir} holds an earlier run ({names}): pass --resume to continue it, or "
                          f"--overwrite to start a new run there (its checkpoint and drafter folder are deleted, its "
                          f"metrics.jsonl kept as metrics.replaced-<n>.jsonl), or choose another --out-dir")
    if overwrite and modify:
        if _nonempty(metrics):
            dest = _free_name(out_dir)
            os.replace(metrics, dest)
            log(f"--overwrite: the earlier run's {METRICS_NAME} is kept as {dest}")
        if os.path.exists(ckpt):
            os.remove(ckpt)
            log(f"--overwrite: deleted the earlier run's checkpoint {ckpt}")
        # the drafter folder is the checkpoint's weights again: gone with it, not left beside the new run's
        # files until its first save
        drafter = os.path.join(out_dir, DRAFTER_DIR)
        if os.path.lexists(drafter):
            if os.path.isdir(drafter) and not os.path.islink(drafter):
                shutil.rmtree(drafter)
            else:  # a link (never what it points to) or a file
                os.remove(drafter)
            log(f"--overwrite: deleted the earlier run's drafter folder {drafter}")
    return None


def _norm(v):
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    return v


_MISSING = "<not set>"


def config_changes(saved: dict, new: dict) -> dict:
    """``{field: (saved value, new value)}`` for every field that differs (tuples and lists compare equal;
    a field missing on one side counts as its default)."""
    defaults = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}
    out = {}
    for k in sorted(set(saved) | set(new)):
        a = saved.get(k, defaults.get(k, _MISSING))
        b = new.get(k, defaults.get(k, _MISSING))
        if _norm(a) != _norm(b):
            out[k] = (a, b)
    return out


def _describe(changes: dict) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def check_resume_config(saved: dict, new: dict, *, allow_change: bool = False, path: str = CHECKPOINT_NAME,
                        log=print) -> dict:
    """Refuse (:class:`ConfigChanged`) a resume whose config differs from the saved one outside
    :data:`RESUME_MAY_CHANGE`, unless ``allow_change``; log every difference. Returns them all."""
    changes = config_changes(saved, new)
    free = {k: v for k, v in changes.items() if k in RESUME_MAY_CHANGE}
    fixed = {k: v for k, v in changes.items() if k not in RESUME_MAY_CHANGE}
    if free:
        log(f"resume: config changed where a resume may change it: {_describe(free)}")
    if fixed and not allow_change:
        raise ConfigChanged(
            f"resume: the config differs from the one saved in {path}: {_describe(fixed)}. Resume with the saved "
            f"values, or pass --allow-config-change to continue with the new ones. (Fields a resume may change "
            f"without it: {', '.join(sorted(RESUME_MAY_CHANGE))}.)")
    if fixed:
        log(f"resume: WARNING: continuing with a changed config (--allow-config-change; the new values, the "
            f"optimizer's and the schedule's included, apply from the saved step on): {_describe(fixed)}")
    return changes


def open_metrics(out_dir: str, resume_step=None, log=print):
    """``(history, file)``: the earlier records to keep and ``metrics.jsonl`` opened for appending.

    ``resume_step``: keep the records up to that step (a resume); None: a new run, which refuses to
    replace a non-empty file (:func:`prepare_run_dir` moved an overwritten run's file aside already).
    """
    path = os.path.join(out_dir, METRICS_NAME)
    history = []
    if resume_step is None:
        if _nonempty(path):
            raise RunDirError(f"out_dir: {path} holds an earlier run's records; pass --resume or --overwrite")
    elif os.path.exists(path):
        with open(path) as f:
            lines = f.read().splitlines()
        bad, later = 0, 0
        for line in lines:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # cut short by a kill mid-write
                bad += 1
                continue
            if r.get("step", 0) <= resume_step:
                history.append(r)
            else:
                later += 1
        if bad:
            log(f"resume: {path}: skipped {bad} unreadable line(s) (a write cut short)")
        if later:
            log(f"resume: {path}: dropped {later} record(s) after step {resume_step} (the checkpoint is at step "
                f"{resume_step}; those steps are trained again)")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in history)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return history, open(path, "a")
