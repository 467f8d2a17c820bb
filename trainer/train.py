"""Train a DFlash drafter against a frozen target.

    python -m trainer.train                        # the embedded default (built on first use)
    python -m trainer.train --target DIR --data train.jsonl --out-dir runs/x
    python -m trainer.train ... --resume           # continue from OUT_DIR/checkpoint.pt
    python -m trainer.train ... --target-gpus 0-4 --drafter-gpus 5-7   # the threaded pipeline (pipeline.py)
    python -m trainer.train ... --preflight        # check devices, model, data and kernels, then exit

A flat loop: setup (config, target, data, drafter, optimiser), resume, then per step: batch ->
target features -> drafter -> weighted CE -> AdamW step; one log line per interval, an atomic
checkpoint every ``save_interval`` steps and at the end, and the drafter as an HF-style folder
(``OUT_DIR/drafter``). On a GPU every attention kernel the run's shapes need is compiled before
step 0 and the loop runs under ``dflash_kernels.strict()``: a compile during training is an error.

Run as ``python -m trainer.train``, the first lines open the run log (``OUT_DIR/train.log``,
:mod:`trainer.supervise`) before anything heavy is imported. ``--target-gpus`` / ``--drafter-gpus``
or ``--preflight`` hand over to :func:`trainer.pipeline.cli` (threads, supervision, torchrun).
"""

import sys

if __name__ == "__main__":  # the run log opens before torch, transformers or the kernels are imported
    from trainer.supervise import open_run_log

    open_run_log(sys.argv[1:])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from trainer.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint  # noqa: E402
from trainer.config import TrainConfig, add_cli_args, from_cli  # noqa: E402
from trainer.data import batch_at, load_jsonl, steps_per_epoch  # noqa: E402
from trainer.loss import expected_accept_length  # noqa: E402
from trainer.step import attention_precompile_specs, forward_loss  # noqa: E402
from trainer.model import DFlashDrafter, DrafterConfig  # noqa: E402
from trainer.target import Target, load_target, resolve_mask_token_id  # noqa: E402

__all__ = ["train", "build_drafter", "resolve_paths", "lr_lambda", "forward_loss", "main"]


def resolve_paths(cfg: TrainConfig, log=print) -> TrainConfig:
    """Fill the embedded default's target / data / prompts where the config leaves them empty."""
    if cfg.target and cfg.data:
        return cfg
    from trainer.build_default import ensure

    paths = ensure(cfg.cache_dir, log=log)
    import dataclasses
    return dataclasses.replace(cfg, target=cfg.target or paths["target"], data=cfg.data or paths["train"],
                               eval_prompts=cfg.eval_prompts or paths["eval_prompts"])


def resolve_device(cfg: TrainConfig):
    dev = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return dev, dtype


def build_drafter(cfg: TrainConfig, target: Target, mask_token_id: int) -> DFlashDrafter:
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


def _peak_mem_gib(dev) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # ru_maxrss is KiB on Linux


def _fmt_eta(sec: float) -> str:
    sec = int(max(sec, 0))
    return f"{sec // 3600}:{sec % 3600 // 60:02d}:{sec % 60:02d}"


def _precompile(cfg: TrainConfig, drafter: DFlashDrafter, dev, dtype, log):
    rep = dk.precompile(attention_precompile_specs(cfg, drafter.config, dtype), devices=[dev])
    log(f"precompile: {len(rep['keys'])} kernels in {rep['seconds']:.1f}s")


def train(cfg: TrainConfig, resume: bool = False, log=print, stop_after: int | None = None) -> list[dict]:
    """Run (or continue) training; returns the per-step records written to ``metrics.jsonl``.

    ``stop_after``: leave the loop after that global step, with a checkpoint (tests use it to
    simulate an interruption).
    """
    cfg = resolve_paths(cfg, log=log)
    dev, dtype = resolve_device(cfg)
    os.makedirs(cfg.out_dir, exist_ok=True)
    log(f"config: {json.dumps(cfg.to_dict(), sort_keys=True)}")
    target = load_target(cfg.target, cfg.target_layer_ids, cfg.num_target_layers, device=dev, dtype=dtype)
    tok = target.tokenizer
    mask_id = resolve_mask_token_id(tok, target.vocab_size, cfg.mask_token_id)
    log(f"target: {cfg.target}: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}, "
        f"layers {target.layer_ids}, mask token {mask_id}")
    ds = load_jsonl(cfg.data, tok, cfg.max_len, cfg.block_size, vocab_size=target.vocab_size, log=log,
                    pack=cfg.pack)
    drafter = build_drafter(cfg, target, mask_id).to(dev)
    n_params = sum(p.numel() for p in drafter.parameters())
    total = cfg.steps or cfg.epochs * steps_per_epoch(len(ds), cfg.batch_size)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                            foreach=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup_ratio, cfg.min_lr_ratio))
    ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    step = 0
    if resume:
        if not os.path.exists(ckpt_path):
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        step = load_checkpoint(ckpt_path, model=drafter, optimizer=opt, scheduler=sched, map_location=dev)["step"]
        log(f"resume: from step {step} of {ckpt_path}")
    history = []
    if os.path.exists(metrics_path):  # keep the lines up to the checkpoint, so the file is one trajectory
        with open(metrics_path) as f:
            history = [r for r in map(json.loads, f) if resume and r["step"] <= step]
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in history)
    log(f"drafter: {n_params / 1e6:.2f}M trainable parameters, {cfg.num_layers} layers; {len(ds)} sequences, "
        f"{total} steps on {dev} ({dtype})")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    if dev.type == "cuda":
        _precompile(cfg, drafter, dev, dtype, log)
        # The target's own kernels (Gated DeltaNet, conv of a hybrid) are compiled by one real
        # forward/backward before strict mode; its gradients are dropped and nothing is stepped.
        t0 = time.perf_counter()
        before = len(dk.cache_info())
        batch = batch_at(ds, step, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed, pad_id)
        forward_loss(batch, target, drafter, cfg, dev, dtype)[0].backward()
        opt.zero_grad(set_to_none=True)
        log(f"warm-up step: {len(dk.cache_info()) - before} new kernels in {time.perf_counter() - t0:.1f}s")

    def save():
        save_checkpoint(ckpt_path, model=drafter, optimizer=opt, scheduler=sched, step=step, config=cfg.to_dict())
        drafter.save_pretrained(os.path.join(cfg.out_dir, "drafter"))

    tty = sys.stderr.isatty()
    drafter.train()
    t_start, window = time.perf_counter(), []
    ctx = dk.strict() if dev.type == "cuda" else contextlib.nullcontext()
    with ctx, open(metrics_path, "a") as mf:
        while step < total:
            t0 = time.perf_counter()
            batch = batch_at(ds, step, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed, pad_id)
            loss, st = forward_loss(batch, target, drafter, cfg, dev, dtype)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            rec = {"step": step, "loss": loss.item(), "acc": st["acc"], "lr": sched.get_last_lr()[0],
                   "grad_norm": float(gnorm), "tokens": int(batch["lengths"].sum()), "epoch": batch["epoch"],
                   "tau_est": expected_accept_length(st["acc_by_pos"])}
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            rec["ms"] = (time.perf_counter() - t0) * 1e3
            history.append(rec)
            window.append(rec)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            if tty:
                done = int(30 * step / total)
                print(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total} loss {rec['loss']:.3f}", end="",
                      file=sys.stderr, flush=True)
            if step % cfg.log_interval == 0 or step == total:
                ms = sum(r["ms"] for r in window) / len(window)
                tok_s = sum(r["tokens"] for r in window) / (sum(r["ms"] for r in window) / 1e3)
                if tty:
                    print(file=sys.stderr)
                log(f"step {step}/{total} | loss {sum(r['loss'] for r in window) / len(window):.4f} | "
                    f"acc {sum(r['acc'] for r in window) / len(window):.3f} | lr {rec['lr']:.2e} | "
                    f"{tok_s:,.0f} tok/s | {ms:.0f} ms/step | peak {_peak_mem_gib(dev):.2f} GiB | "
                    f"eta {_fmt_eta((total - step) * ms / 1e3)}")
                window = []
            if step % cfg.save_interval == 0 or step == total or step == stop_after:
                save()
            if step == stop_after:
                break
    log(f"done: {step} steps in {time.perf_counter() - t_start:.1f}s; drafter at {os.path.join(cfg.out_dir, 'drafter')}")
    return history


def main(argv=None):
    p = argparse.ArgumentParser(description="Train a DFlash drafter (see trainer/train.py).")
    add_cli_args(p)
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint.pt")
    p.add_argument("--preflight", action="store_true", help="check devices, model, data and kernels, print what "
                   "was found and exit (0: all passed)")
    p.add_argument("--log-file", default=None, help="the run log (default OUT_DIR/train.log, "
                   "train.rank<R>.log under torchrun)")
    args = p.parse_args(argv)
    cfg = from_cli(args)
    if args.preflight or cfg.target_gpus or cfg.drafter_gpus:
        from trainer.pipeline import cli

        return cli(cfg, resume=args.resume, preflight_only=args.preflight, log_file=args.log_file)
    train(cfg, resume=args.resume, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
