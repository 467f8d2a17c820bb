"""Train a DFlash drafter against a frozen target.

    python -m trainer.train --preset tiny          # a first run: a random tiny target, seconds on a CPU
    python -m trainer.train                        # the embedded default (built on first use: minutes on a CPU)
    python -m trainer.train --target DIR --data train.jsonl --out-dir runs/x
    python -m trainer.train ... --resume           # continue from OUT_DIR/checkpoint.pt
    python -m trainer.train ... --overwrite        # start over in an OUT_DIR that holds an earlier run
    python -m trainer.train ... --target-gpus 0-4 --drafter-gpus 5-7   # the threaded pipeline (pipeline.py)
    python -m trainer.train ... --preflight        # check devices, model, data and kernels, then exit

A flat loop: setup (config, target, data, drafter, optimiser), resume, then per step: batch ->
target features -> drafter -> weighted CE -> AdamW step; one log line per interval, an atomic
checkpoint every ``save_interval`` steps and at the end, and the drafter as an HF-style folder
(``OUT_DIR/drafter``). On a GPU every attention kernel the run's shapes need is compiled before
step 0 and the loop runs under ``dflash_kernels.strict()``: a compile during training is an error.

The run folder (:mod:`trainer.rundir`): a new run refuses an ``OUT_DIR`` holding an earlier run
unless ``--resume`` or ``--overwrite``; a resume refuses a config that differs from the checkpoint's
(named fields) unless ``--allow-config-change``. SIGTERM / SIGINT end the loop after the current step
with a checkpoint and exit status 0 (as the pipeline does); a second signal exits at once.

Run as ``python -m trainer.train``, the first lines open the run log (``OUT_DIR/train.log``,
:mod:`trainer.supervise`) before anything heavy is imported. ``--target-gpus`` / ``--drafter-gpus``
or ``--preflight`` hand over to :func:`trainer.pipeline.cli` (threads, supervision, torchrun).
"""

import sys

if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv[1:]):
    # the run log opens before torch, transformers or the kernels are imported (not for --help: no run)
    from trainer.supervise import open_run_log

    open_run_log(sys.argv[1:])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from trainer.checkpoint import (CHECKPOINT_NAME, CheckpointError, read_checkpoint, restore,  # noqa: E402
                                save_checkpoint)
from trainer.common import (build_drafter, current_lr, lr_lambda, optimizer_summary, resolve_device,  # noqa: E402
                            resolve_paths, step_log_line)
from trainer.compute_weights import make_optimizer  # noqa: E402
from trainer.config import TrainConfig, add_cli_args, from_cli  # noqa: E402
from trainer.data import batch_at, load_jsonl, steps_per_epoch  # noqa: E402
from trainer.flops import step_flops  # noqa: E402
from trainer.loss import expected_accept_length  # noqa: E402
from trainer.rundir import (DRAFTER_DIR, ConfigChanged, RunDirError, check_resume_config,  # noqa: E402
                            open_metrics, prepare_run_dir)
from trainer.step import attention_precompile_specs, forward_loss, target_features  # noqa: E402
from trainer.step_graph import DrafterStep  # noqa: E402
from trainer.supervise import StopRequest, fault_point, get_log, install_signal_handlers  # noqa: E402
from trainer.target import load_target, resolve_mask_token_id  # noqa: E402

__all__ = ["train", "build_drafter", "resolve_paths", "resolve_device", "lr_lambda", "forward_loss", "main",
           "add_run_flags", "build_parser"]


def _precompile(cfg: TrainConfig, drafter, opt, dev, dtype, log):
    """The attention kernels at the run's shapes and, for compute_weights="copies", the optimizer's: the
    warm-up step below runs no optimizer step, and the loop runs in strict mode."""
    specs = list(attention_precompile_specs(cfg, drafter.config, dtype))
    if hasattr(opt, "precompile_specs"):  # trainer.compute_weights.MasterAdamW (dflash_kernels' AdamW)
        specs += opt.precompile_specs(cfg.grad_clip)
    log(f"precompile: the {len(specs)} kernels of this run's shapes on {dev}, compiled and tuned (once per GPU model "
        f"and shape; minutes the first time) or found in the cache ...")
    if dev.type == "cuda":
        rec = dk.precompile_recorded(dev, verbose=False)  # waits for the pass started before the target's load
        if rec["current"]:
            log(f"precompile: {rec['done_before'] + rec['compiled']} recorded kernels compiled in parallel "
                f"processes ({rec['seconds']:.1f}s waited for them here)")
    rep = dk.precompile(specs, devices=[dev])
    log(f"precompile: {len(rep['keys'])} kernels in {rep['seconds']:.1f}s")


def train(cfg: TrainConfig, resume: bool = False, log=print, stop_after: int | None = None,
          stop: StopRequest | None = None, overwrite: bool = False, allow_config_change: bool = False) -> list[dict]:
    """Run (or continue) training; returns the per-step records written to ``metrics.jsonl``.

    Args:
        resume: continue from ``OUT_DIR/checkpoint.pt`` (its config must match, see :mod:`trainer.rundir`).
        stop_after: leave the loop after that global step, with a checkpoint (tests use it to
            simulate an interruption).
        stop: a graceful stop request (SIGTERM / SIGINT set it): honoured after the current step,
            with a checkpoint.
        overwrite: start a new run in an ``OUT_DIR`` that holds an earlier one (else refused).
        allow_config_change: resume although the config differs from the checkpoint's.
    """
    stop = stop if stop is not None else StopRequest()
    # The run folder first: a refusal comes before the embedded default is built.
    resume_from = prepare_run_dir(cfg.out_dir, resume=resume, overwrite=overwrite, log=log)
    cfg = resolve_paths(cfg, log=log)
    dev, dtype = resolve_device(cfg)
    saved = None
    if resume_from is not None:
        saved = read_checkpoint(resume_from)
        check_resume_config(saved["config"], cfg.to_dict(), allow_change=allow_config_change, path=resume_from,
                            log=log)
    log(f"config: {json.dumps(cfg.to_dict(), sort_keys=True)}")
    if dev.type == "cuda":  # the recorded kernels compile in worker processes while the target loads
        dk.precompile_recorded(dev, verbose=False, background=True)
    log(f"target: loading {cfg.target} on {dev} ({dtype}) ...")
    target = load_target(cfg.target, cfg.target_layer_ids, cfg.num_target_layers, device=dev, dtype=dtype,
                         gdn_layers=cfg.target_graphs_on(dev))
    if cfg.target_graphs_on(target.device):
        target.use_cuda_graphs()
    tok = target.tokenizer
    mask_id = resolve_mask_token_id(tok, target.vocab_size, cfg.mask_token_id)
    log(f"target: {cfg.target}: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}, "
        f"layers {target.layer_ids}, mask token {mask_id}")
    log(f"data: reading and tokenizing {cfg.data} ...")
    ds = load_jsonl(cfg.data, tok, cfg.max_len, cfg.block_size, vocab_size=target.vocab_size, log=log,
                    pack=cfg.pack)
    drafter = build_drafter(cfg, target, mask_id).to(dev)
    n_params = sum(p.numel() for p in drafter.parameters())
    total = cfg.steps or cfg.epochs * steps_per_epoch(len(ds), cfg.batch_size)
    opt = make_optimizer(drafter, cfg, dtype, "copies" if cfg.compute_weights_for(dev, dtype) == "copies" else "fused")
    cw = getattr(drafter, "compute_weights", None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup_ratio, cfg.min_lr_ratio))
    ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
    step = 0
    if saved is not None:
        step = restore(saved, model=drafter, optimizer=opt, scheduler=sched, path=resume_from)
        if cw is not None:
            cw.refresh(drafter)
        saved = None  # the CPU copy of every state is not needed any more
        log(f"resume: from step {step} of {resume_from}; optimizer: {optimizer_summary(sched)}")
    log(f"drafter: {n_params / 1e6:.2f}M trainable parameters, {cfg.num_layers} layers; {len(ds)} sequences, "
        f"{total} steps on {dev} ({dtype}); weights: "
        + (f"{cw.dtype} copies written by the optimizer step" if cw is not None else "fp32, cast by autocast"))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    # the drafter's half of each step (after the scheduler exists: it keeps the float base lr)
    dstep = DrafterStep(drafter, target, opt, cfg, dev, dtype, graphs=cfg.step_graphs_on(dev))
    if dstep.graphs:
        log("step: the drafter's forward, backward and optimizer step as CUDA graphs (one per batch shape, "
            "captured at its second step)")
    if dev.type == "cuda":
        _precompile(cfg, drafter, opt, dev, dtype, log)
        # The target's own kernels (Gated DeltaNet, conv of a hybrid) are compiled by one real
        # forward/backward before strict mode; its gradients are dropped and nothing is stepped.
        log("warm-up step: one forward and backward (no update) compiles the target's own kernels ...")
        t0 = time.perf_counter()
        before = len(dk.cache_info())
        batch = batch_at(ds, step, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed, pad_id)
        forward_loss(batch, target, drafter, cfg, dev, dtype)[0].backward()
        opt.zero_grad(set_to_none=True)
        log(f"warm-up step: {len(dk.cache_info()) - before} new kernels in {time.perf_counter() - t0:.1f}s")
    if stop:  # a signal during set-up: nothing trained, nothing to save
        log(f"stopped by {stop.reason} before training started")
        return []
    history, mf = open_metrics(cfg.out_dir, step if resume else None, log)

    def save():
        t0 = time.perf_counter()
        save_checkpoint(ckpt_path, model=drafter, optimizer=opt, scheduler=sched, step=step, config=cfg.to_dict())
        drafter.save_pretrained(os.path.join(cfg.out_dir, DRAFTER_DIR))
        log(f"checkpoint: step {step} -> {ckpt_path} ({time.perf_counter() - t0:.1f}s)")

    def count_flops(batch):  # the step's model TFLOP (trainer.flops), from the host's batch: no synchronization
        return step_flops(target.model, drafter, batch, target.layers_run)["total"] / 1e12

    log(f"training: steps {step + 1} to {total}, a log line every {cfg.log_interval}")
    tty = sys.stderr.isatty()
    drafter.train()
    t_start, window = time.perf_counter(), []
    # A step's record (loss, accuracy, gradient norm) stays on the device until the next log line,
    # checkpoint or the end: reading it back is a host synchronization, once per interval instead of
    # once per step. ``ms`` is then the interval's mean step time.
    pending, t_flush = [], [time.perf_counter()]

    def flush():
        if not pending:
            return
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.perf_counter()
        ms = (now - t_flush[0]) * 1e3 / len(pending)
        t_flush[0] = now
        for rec, loss, st, gnorm in pending:
            rec = {"step": rec["step"], "loss": loss.item(), "acc": st["acc"], "lr": rec["lr"],
                   "grad_norm": float(gnorm), "tokens": rec["tokens"], "epoch": rec["epoch"],
                   "tau_est": expected_accept_length(st["acc_by_pos"]), "ms": ms, "tflop": rec["tflop"]}
            history.append(rec)
            window.append(rec)
            mf.write(json.dumps(rec) + "\n")
        mf.flush()
        pending.clear()

    ctx = dk.strict() if dev.type == "cuda" else contextlib.nullcontext()
    with ctx, mf:
        while step < total:
            batch = batch_at(ds, step, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed, pad_id)
            fault_point("drafter", 0, step)
            loss, st, gnorm = dstep(batch, target_features(target, batch, dev))
            sched.step()
            step += 1
            pending.append(({"step": step, "lr": current_lr(sched), "tokens": int(batch["lengths"].sum()),
                             "epoch": batch["epoch"], "tflop": count_flops(batch)}, loss, st, gnorm))
            if tty:
                done = int(30 * step / total)
                print(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total}", end="", file=sys.stderr, flush=True)
            leave = bool(stop) or step == stop_after
            if step % cfg.log_interval == 0 or step == total or leave:
                flush()
                if tty:
                    print(file=sys.stderr)
                log(step_log_line(window, step, total, dev))
                window = []
            if step % cfg.save_interval == 0 or step == total or leave:
                flush()
                save()
            if leave:
                break
    if stop and step < total:
        log(f"stopped by {stop.reason} after step {step} of {total}; checkpoint at {ckpt_path}; "
            f"continue with --resume")
    else:
        log(f"done: {step} steps in {time.perf_counter() - t_start:.1f}s; drafter at "
            f"{os.path.join(cfg.out_dir, DRAFTER_DIR)}")
    return history


def add_run_flags(p) -> None:
    """The flags that say how this invocation treats OUT_DIR (not part of the saved config); ``p`` is a parser
    or an argument group."""
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint.pt (default: off)")
    p.add_argument("--overwrite", action="store_true", help="start a new run in an OUT_DIR that holds an earlier "
                   "one: its checkpoint and drafter folder are deleted at once, its metrics.jsonl kept as "
                   "metrics.replaced-<n>.jsonl (default: off)")
    p.add_argument("--allow-config-change", action="store_true", help="resume although the config differs from "
                   "the checkpoint's in fields that decide what is trained: the new values (the optimizer's and the "
                   "schedule's included) apply from the saved step on, and the differences are logged (default: off)")


def _single_process(cfg: TrainConfig, args) -> None:
    """The flat loop under SIGTERM / SIGINT handling: the first signal ends it after the current step
    with a checkpoint (exit status 0), a second exits at once (:mod:`trainer.supervise`)."""
    stop = StopRequest()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    install_signal_handlers(get_log(), stop)
    try:
        train(cfg, resume=args.resume, log=lambda s: print(s, flush=True), stop=stop, overwrite=args.overwrite,
              allow_config_change=args.allow_config_change)
    except (RunDirError, ConfigChanged, CheckpointError) as e:  # a refusal: its message says what to do
        raise SystemExit(f"trainer.train: {e}") from e
    finally:
        for s, h in previous.items():  # called in-process (tests): leave the caller's handlers as they were
            signal.signal(s, h)


def build_parser() -> argparse.ArgumentParser:
    """``python -m trainer.train``'s flags: ``--preset``, one per config field in its group, and the run's own."""
    p = argparse.ArgumentParser(prog="python -m trainer.train", usage="%(prog)s [--preset NAME] [options]",
                                description="Train a DFlash drafter against a frozen target (see trainer/train.py). "
                                "Without --target it trains on a built-in one: with --preset tiny a random tiny "
                                "target (built in seconds: a first run on a CPU), else the embedded default (built "
                                "once on first use: minutes on a CPU).")
    groups = add_cli_args(p)
    add_run_flags(groups["run folder"])
    groups["run folder"].add_argument("--log-file", default=None, metavar="PATH", help="the run log (default: "
                                      "OUT_DIR/train.log, train.rank<R>.log under torchrun)")
    groups["runtime"].add_argument("--preflight", action="store_true", help="check devices, model, data and "
                                   "kernels, print what was found and exit (0: all passed) (default: off)")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    try:
        cfg = from_cli(args)
    except ValueError as e:  # a field's value the config refuses (it names the field): a usage error
        p.error(str(e))
    if args.preflight or cfg.target_gpus or cfg.drafter_gpus:
        from trainer.pipeline import cli

        return cli(cfg, resume=args.resume, preflight_only=args.preflight, log_file=args.log_file,
                   overwrite=args.overwrite, allow_config_change=args.allow_config_change)
    _single_process(cfg, args)


if __name__ == "__main__":
    main()
