"""What the single-process loop (train.py) and the threaded pipeline (pipeline.py) both use: the run's
paths and devices, the drafter built from the config, the learning-rate schedule and the step log line.
"""

import dataclasses
import math
import resource

import torch

from trainer.config import TrainConfig
from trainer.flops import PEAK_BF16_FLOPS, mfu
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.target import Target

__all__ = ["resolve_paths", "resolve_device", "build_drafter", "lr_lambda", "current_lr", "optimizer_summary",
           "peak_mem_gib", "fmt_eta", "step_log_line"]


def resolve_paths(cfg: TrainConfig, log=print) -> TrainConfig:
    """Fill the built-in target's (``cfg.builtin_target``) target / data / prompts where the config leaves
    them empty.

    ``"tiny"``: a random tiny target and its data, built in seconds (:func:`trainer.random_target.ensure_tiny`).
    ``"embedded"``: the embedded default, built first when missing (minutes on a CPU): on the config's device
    when one is named, else on a GPU when there is one (see :func:`trainer.build_default.ensure`).
    """
    if cfg.target and cfg.data:
        return cfg
    if cfg.builtin_target == "tiny":
        from trainer.random_target import ensure_tiny

        paths = ensure_tiny(cfg.cache_dir, log=log)
    else:
        from trainer.build_default import ensure

        paths = ensure(cfg.cache_dir, device=None if cfg.device == "auto" else cfg.device, log=log)
    return dataclasses.replace(cfg, target=cfg.target or paths["target"], data=cfg.data or paths["train"],
                               eval_prompts=cfg.eval_prompts or paths["eval_prompts"])


def resolve_device(cfg: TrainConfig):
    """The single-process loop's ``(device, compute dtype)``: ``auto`` is cuda when available, bf16 there."""
    dev = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return dev, dtype


def build_drafter(cfg: TrainConfig, target: Target, mask_token_id: int) -> DFlashDrafter:
    """A fresh drafter for ``target``, initialised from ``cfg.seed`` (every replica and process alike)."""
    n_sw = min(cfg.num_sliding_layers, cfg.num_layers)
    dcfg = DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=cfg.intermediate_size or target.intermediate_size,
        vocab_size=target.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, block_size=cfg.block_size, mask_token_id=mask_token_id,
        target_layer_ids=list(target.layer_ids), sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention"] * n_sw + ["full_attention"] * (cfg.num_layers - n_sw))
    torch.manual_seed(cfg.seed)
    return DFlashDrafter(dcfg)


def lr_lambda(total: int, warmup_ratio: float, min_ratio: float):
    """Linear warm-up over ``warmup_ratio * total`` steps, then cosine from 1 to ``min_ratio``."""
    warm = max(int(round(warmup_ratio * total)), 1)

    def f(s):
        if s < warm:
            return (s + 1) / warm
        p = min((s - warm) / max(total - warm, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def current_lr(sched) -> float:
    """The first group's learning rate as a float, read without the device: a group whose lr is a device
    tensor (the drafter's step as CUDA graphs) gives the schedule's own value, ``base_lr * lambda(epoch)``
    (what ``LambdaLR`` filled in), not a read-back of the tensor."""
    lr = sched.optimizer.param_groups[0]["lr"]
    if not isinstance(lr, torch.Tensor):
        return lr
    return float(sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch))


def optimizer_summary(sched) -> str:
    """What the optimizer behind ``sched`` trains with, read from it (a resume logs it: the values the run
    really uses, the config's after ``--allow-config-change``): the schedule's peak lr and its lr now, the
    first group's betas, eps and weight decay."""
    g = sched.optimizer.param_groups[0]
    return (f"lr {sched.base_lrs[0]:g} (now {current_lr(sched):.3g}), betas {tuple(g['betas'])}, eps {g['eps']:g}, "
            f"weight decay {g['weight_decay']:g}")


def peak_mem_gib(dev) -> float:
    """Peak memory so far: on a GPU what the caching allocator held (``max_memory_reserved``: the CUDA
    graphs' pools included, whose activations a replay does not allocate, so the allocated peak would
    miss them), the process's max RSS on the CPU."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_reserved(dev) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # ru_maxrss is KiB on Linux


def fmt_eta(sec: float) -> str:
    sec = int(max(sec, 0))
    return f"{sec // 3600}:{sec % 3600 // 60:02d}:{sec % 60:02d}"


def step_log_line(window: list, step: int, total: int, dev, gpus: int = 1) -> str:
    """The interval's log line from its per-step records (``metrics.jsonl`` rows). On a GPU, records that
    carry their model TFLOP (``tflop``, the whole step's) add the interval's MFU against ``gpus`` x 989
    TFLOP/s (``trainer.flops``)."""
    ms = sum(r["ms"] for r in window) / len(window)
    seconds = sum(r["ms"] for r in window) / 1e3
    tok_s = sum(r["tokens"] for r in window) / seconds
    util = ""
    if dev.type == "cuda" and all("tflop" in r for r in window):
        util = f" | MFU {mfu(sum(r['tflop'] for r in window) * 1e12, seconds, gpus * PEAK_BF16_FLOPS):.1%}"
    return (f"step {step}/{total} | loss {sum(r['loss'] for r in window) / len(window):.4f} | "
            f"acc {sum(r['acc'] for r in window) / len(window):.3f} | lr {window[-1]['lr']:.2e} | "
            f"{tok_s:,.0f} tok/s | {ms:.0f} ms/step{util} | peak {peak_mem_gib(dev):.2f} GiB | "
            f"eta {fmt_eta((total - step) * ms / 1e3)}")
