"""The pipeline's two roles measured apart on one GPU and projected to eight: ``python benchmarks/roles.py``.

The multi-GPU pipeline (``trainer/pipeline.py``) splits a training step in two roles, each on GPUs of
its own: target workers compute the frozen target's features of a micro-batch, drafter workers
(data-parallel replicas) train on them. This script times each role alone, with the trainer's own
functions, on one GPU:

- target: ``trainer.data.batch_at`` (pinned on a GPU) then ``trainer.step.target_features`` (no grad,
  as the target worker runs it: ``Target.features``), per micro-batch; ``T`` = target tokens per second;
- drafter: on the features of the same micro-batches (kept from the target role: computed once, not
  timed again), ``trainer.step.drafter_loss`` (the target's frozen embedding and LM head through
  ``trainer.pipeline.Heads``; the fused LM head + cross-entropy) then backward into one flat fp32
  gradient buffer, clip, fused AdamW and the LR schedule, as the drafter worker runs them; ``D`` = target
  tokens per second (the trainer's definition of tokens/s). Before this role the target's decoder
  layers are dropped: a drafter GPU holds only the embedding and the LM head, and so does this
  role's peak memory. Not counted: the hand-off copy between GPUs and the gradient mean across
  replicas (the pipeline's ``_reduce``), which the pipeline efficiency E stands for.

Both roles use the kernels of ``tok_s`` group (a) (``dflash_kernels`` for the drafter's attention, the
target's Gated DeltaNet and conv, the fused loss; bf16 compute, fp32 drafter weights under autocast),
warm-up micro-batches first (compiling and tuning), then the timed ones under
``dflash_kernels.strict()``, the device synchronised at both ends of each timed region.

Projection to ``G`` = 8 GPUs with pipeline efficiency ``E`` (default 1.0: an upper bound, no pipeline
loss; ``--efficiency`` passes a measured one): ``n_t`` target GPUs and ``n_d`` drafter GPUs deliver
``E * min(n_t * T, n_d * D)`` tokens/s; the 5 + 3 layout is ``E * min(5T, 3D)``, the best split the
``n_t + n_d = 8`` that maximises it, and both roles time-sharing every GPU (the ideal, no split to
choose) ``E * G / (1/T + 1/D)``. The goal is 30,000 tokens/s on 8 H200s.

Presets (the run shape of ``tok_s``'s ``real`` preset: 1 sequence x 3072 tokens, 512 anchors of 16,
drafter of 5 layers, 32 x 128 query heads, 8 kv heads, the target's intermediate size):
- ``27b`` (the default on a GPU): a random-weight Qwen3.5-27B-like target (64 layers, 3 Gated DeltaNet :
  1 attention, hidden 5120, vocab 248320, 54 GB of bf16 weights built on the GPU); GPU only; 2 warm-up
  + 3 timed micro-batches per role;
- ``real``: ``tok_s``'s random Qwen3.5-4B-like target; GPU only;
- ``tiny`` (the only one on a CPU, through Triton's interpreter): seconds; says nothing about speed.

GPU runs append one row (op ``roles``) to ``benchmarks/results/tok_s.jsonl`` unless ``--no-record``.
"""

import argparse
import gc
import importlib
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tok_s.py sits next to this file
import tok_s  # noqa: E402

ROOT = tok_s.ROOT
RESULTS = tok_s.RESULTS
GPUS = 8
LAYOUT = (5, 3)  # target GPUs + drafter GPUs of the full training run's layout
GOAL = 30_000.0  # tokens/s on 8 H200s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring for what each role times and the projection.")
    p.add_argument("--preset", choices=["27b", "real", "tiny"], default=None,
                   help="default: 27b on a GPU, tiny on a CPU")
    p.add_argument("--steps", type=int, default=None, help="timed micro-batches per role (default: 3 on a GPU, 1 on a CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed micro-batches first (default: 2 on a GPU, 1 on a CPU)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="pipeline efficiency E in (0, 1], measured on 2 GPUs; default 1.0, an upper bound")
    p.add_argument("--no-record", action="store_true", help="do not append the row to benchmarks/results/tok_s.jsonl")
    p.add_argument("--json", default="", help="also write the row to this JSON file")
    args = p.parse_args(argv)
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        p.error(f"--efficiency: must be in (0, 1], got {args.efficiency}")
    for name in ("steps", "warmup"):
        v = getattr(args, name)
        if v is not None and v < (1 if name == "steps" else 0):
            p.error(f"--{name}: got {v}")
    args.batch_size = None  # the tok_s setups read it: the preset's own batch size
    return args


# ------------------------------------------------------------------------------------------ presets
TEXT_27B = dict(  # Qwen3.5-27B's published text sizes (Qwen3_5TextConfig keywords)
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False, pad_token_id=0)


def setup_27b(args, dev, dtype, log):
    """Qwen3.5-27B's published text sizes with random weights (speed does not depend on them), at the
    run shape of tok_s's ``real`` preset."""
    from transformers import Qwen3_5TextConfig

    from trainer.config import preset

    text = Qwen3_5TextConfig(**TEXT_27B)
    cfg = preset("default", device=str(dev), batch_size=args.batch_size or 1)  # as tok_s.setup_real
    target = tok_s._random_qwen35_target(text, cfg, dev, dtype, elementwise=dev.type == "cuda")  # as load_target
    ds = tok_s._synthetic_dataset(text.vocab_size, 16, cfg.max_len)
    return tok_s.Setup("27b", cfg, target, ds, "random Qwen3.5-27B-like target (64 layers, 3 GDN : 1 attention, "
                       "hidden 5120, vocab 248320)")


SETUPS = {"27b": setup_27b, "real": tok_s.setup_real, "tiny": tok_s.setup_tiny}


# ----------------------------------------------------------------------------------- projection
def project(T: float, D: float, efficiency: float = 1.0, gpus: int = GPUS, layout=LAYOUT) -> dict:
    """Pipeline tokens/s on ``gpus`` GPUs from the per-GPU role throughputs ``T`` (target) and ``D``
    (drafter): ``E * min(n_t T, n_d D)`` for ``n_t`` target and ``n_d`` drafter GPUs.

    Returns ``layout`` (its tokens/s and the role that bounds it), ``splits`` (every ``n_t + n_d =
    gpus``), ``best`` (the split with the most tokens/s; the fewer target GPUs on a tie) and ``shared``
    (both roles on every GPU, time-shared: ``E * gpus / (1/T + 1/D)``).
    """
    if T <= 0 or D <= 0:
        raise ValueError(f"T, D: per-GPU throughputs must be positive, got T={T}, D={D}")
    E = efficiency

    def rate(nt, nd):
        return E * min(nt * T, nd * D)

    nt, nd = layout
    splits = [{"n_target": n, "n_drafter": gpus - n, "tok_s": rate(n, gpus - n)} for n in range(1, gpus)]
    best = max(splits, key=lambda s: s["tok_s"])
    return {"efficiency": E, "gpus": gpus,
            "layout": {"n_target": nt, "n_drafter": nd, "tok_s": rate(nt, nd),
                       "bound": "target" if nt * T < nd * D else "drafter" if nd * D < nt * T else "both"},
            "splits": splits, "best": best, "shared": {"tok_s": E * gpus / (1 / T + 1 / D)}}


# ------------------------------------------------------------------------------------------ roles
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _run(one, n_warm: int, n_timed: int, dev, log) -> tuple:
    """``one(i)`` (returns micro-batch i's tokens) for the warm-up micro-batches, then for the timed
    ones under ``dflash_kernels.strict()`` between two device synchronisations.

    A kernel compiled in the timed region (a shape the warm-up did not meet) raises there, as it would
    stop the pipeline, which trains under strict mode: it is reported, the timed micro-batches run
    once untimed, and they are timed again. Returns (the first micro-batch's seconds, timed tokens,
    timed seconds, the strict-mode miss or None)."""
    import dflash_kernels as dk

    first_s, miss = float("nan"), None
    for i in range(n_warm):
        t0 = time.perf_counter()
        one(i)
        if i == 0:
            _sync(dev)
            first_s = time.perf_counter() - t0
    timed = range(n_warm, n_warm + n_timed)
    for attempt in (0, 1):
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            with dk.strict():
                t0 = time.perf_counter()
                tokens = sum(one(i) for i in timed)
                _sync(dev)
                return first_s, tokens, time.perf_counter() - t0, miss
        except dk.KernelCacheMiss as e:
            if attempt:
                raise
            miss = str(e)[:300]
            log(f"  a kernel compiled after the warm-up ({miss}); the timed micro-batches run once untimed, "
                f"then are timed again")
            for i in timed:
                one(i)


def _peak_gib(dev):
    return torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else float("nan")


def _resident_gib(dev):
    return torch.cuda.memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else float("nan")


def measure_target(setup, n_warm: int, n_timed: int, dev, log) -> tuple:
    """The target worker's loop: build the micro-batch, pin it, compute its features. Returns the row
    and ``[(batch, features)]`` of every micro-batch (warm-up ones first) for the drafter role."""
    from trainer.data import batch_at
    from trainer.step import target_features

    cfg, target = setup.cfg, setup.target
    out = {}

    def one(i):
        batch = batch_at(setup.dataset, i, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed)
        if dev.type == "cuda":
            batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
        out[i] = (batch, target_features(target, batch, dev))
        return int(batch["lengths"].sum())

    resident = _resident_gib(dev)
    first_s, tokens, elapsed, miss = _run(one, n_warm, n_timed, dev, log)
    row = {"ms": elapsed / n_timed * 1e3, "tokens_per_batch": tokens // n_timed, "tok_s": tokens / elapsed,
           "peak_GiB": _peak_gib(dev), "resident_GiB": resident, "first_s": first_s, "strict_miss": miss}
    log(f"  target: {row['ms']:.1f} ms per micro-batch, {row['tok_s']:,.0f} tokens/s, peak {row['peak_GiB']:.2f} GiB "
        f"(weights {resident:.2f} GiB)")
    return row, [out[i] for i in range(n_warm + n_timed)]


def drop_target_layers(setup, items, dev, log):
    """Keep only the target's embedding and LM head (what a drafter GPU holds: ``trainer.pipeline.Heads``)."""
    from trainer.pipeline import Heads

    model = setup.target.model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    heads = Heads(embed, head)
    setup.target.model = None
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        kept = {p.data_ptr(): p.numel() * p.element_size() for m in (embed, head) for p in m.parameters()}
        expect = (sum(kept.values()) + sum(f.numel() * f.element_size() for _, f in items)) / 2 ** 30
        now = _resident_gib(dev)
        log(f"  dropped the target's decoder layers: {now:.2f} GiB resident (embedding and LM head and the kept "
            f"features: {expect:.2f} GiB)" + ("; WARNING: more than those: the drafter role's peak includes it"
                                              if now > expect + 1.0 else ""))
    return heads


def measure_drafter(setup, heads, items, n_warm: int, n_timed: int, dev, dtype, log) -> dict:
    """The drafter worker's step on precomputed features: loss, backward into the flat gradient
    buffer, clip, AdamW, schedule (one replica: no gradient reduction)."""
    from trainer.common import build_drafter, lr_lambda
    from trainer.step import clip_and_step, drafter_loss

    cfg, target = setup.cfg, setup.target
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.vocab_size - 1  # no tokenizer
    with torch.device(dev):  # built in place: a 27B-sized drafter is GBs of fp32 weights
        drafter = build_drafter(cfg, target, mask_id)
    drafter.train()
    params = list(drafter.parameters())
    n_params = sum(p.numel() for p in params)
    flat = torch.zeros(n_params, device=dev, dtype=torch.float32)  # as the pipeline: grads are views of one buffer
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                            fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(n_warm + n_timed, cfg.warmup_ratio, cfg.min_lr_ratio))
    losses = []

    def one(i):
        batch, feats = items[i]
        loss, _ = drafter_loss(batch, feats, heads, drafter, cfg, dev, dtype)
        loss.backward()
        clip_and_step(opt, params, cfg.grad_clip)
        sched.step()
        opt.zero_grad(set_to_none=False)  # keep the views into the flat buffer
        if i == 0:
            losses.append(loss.item())
        return int(batch["lengths"].sum())

    first_s, tokens, elapsed, miss = _run(one, n_warm, n_timed, dev, log)
    loss1 = losses[0]
    row = {"ms": elapsed / n_timed * 1e3, "tokens_per_batch": tokens // n_timed, "tok_s": tokens / elapsed,
           "peak_GiB": _peak_gib(dev), "first_s": first_s, "loss_step1": loss1, "params_M": n_params / 1e6,
           "grad_GiB": n_params * 4 / 2 ** 30, "strict_miss": miss}
    log(f"  drafter: {row['ms']:.1f} ms per micro-batch, {row['tok_s']:,.0f} tokens/s, peak {row['peak_GiB']:.2f} GiB, "
        f"{row['params_M']:.1f}M parameters, first loss {loss1:.4f}")
    return row


def role_flops(setup, batch) -> dict:
    """``trainer.flops.step_flops`` of one micro-batch, split by role (the drafter built on the meta
    device: only its sizes are read)."""
    from trainer.common import build_drafter
    from trainer.flops import step_flops

    cfg = setup.cfg
    with torch.device("meta"):
        drafter = build_drafter(cfg, setup.target, setup.target.vocab_size - 1)
    parts = step_flops(setup.target.model, drafter, batch, setup.target.layers_run)
    return {"target": parts["target_fwd"], "drafter": parts["total"] - parts["target_fwd"]}


# -------------------------------------------------------------------------------------- output
def _fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _table(header, body) -> list:
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + body]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return lines


def _goal(v) -> str:
    return f"meets ({v / GOAL:.2f}x)" if v >= GOAL else f"short ({v / GOAL:.2f}x)"


def format_report(row) -> str:
    t, d, p = row["target"], row["drafter"], row["projection"]
    E = p["efficiency"]
    lines = _table(["role", "ms/micro-batch", "tokens/micro-batch", "tokens/s per GPU", "TFLOP/micro-batch", "MFU",
                    "peak GiB", "1st micro-batch s"],
                   [[name, _fmt(r["ms"], ".1f"), str(r["tokens_per_batch"]), _fmt(r["tok_s"], ",.0f"),
                     _fmt(r.get("TFLOP"), ".2f"), _fmt(r.get("mfu"), ".1%"), _fmt(r["peak_GiB"], ".2f"),
                     _fmt(r["first_s"], ".1f")] for name, r in (("target (T)", t), ("drafter (D)", d))])
    lay, best, shared = p["layout"], p["best"], p["shared"]
    label = "measured (--efficiency)" if row["efficiency_measured"] else "upper bound: no pipeline loss counted"
    lines += ["", f"projection to {p['gpus']} GPUs: T = {t['tok_s']:,.0f}, D = {d['tok_s']:,.0f} tokens/s per GPU, "
              f"pipeline efficiency E = {E:.2f} ({label}); goal {GOAL:,.0f} tokens/s"]
    body = [[f"{lay['n_target']} + {lay['n_drafter']} (layout)", f"E * min({lay['n_target']}T, {lay['n_drafter']}D)",
             _fmt(lay["tok_s"], ",.0f"), lay["bound"], _goal(lay["tok_s"])],
            [f"best split {best['n_target']} + {best['n_drafter']}",
             f"E * min({best['n_target']}T, {best['n_drafter']}D)", _fmt(best["tok_s"], ",.0f"),
             "target" if best["n_target"] * t["tok_s"] < best["n_drafter"] * d["tok_s"] else "drafter",
             _goal(best["tok_s"])],
            [f"time-shared, both roles on all {p['gpus']}", f"E * {p['gpus']} / (1/T + 1/D)",
             _fmt(shared["tok_s"], ",.0f"), "-", _goal(shared["tok_s"])]]
    lines += _table(["layout", "formula", "tokens/s", "bound by", f"goal {GOAL:,.0f}"], body)
    lines.append("every split n_t + n_d: " + ", ".join(f"{s['n_target']}+{s['n_drafter']} {s['tok_s']:,.0f}"
                                                       for s in p["splits"]))
    nt, nd = lay["n_target"], lay["n_drafter"]
    lines.append(f"the goal at {nt} + {nd} and this E needs T >= {GOAL / (nt * E):,.0f} and D >= {GOAL / (nd * E):,.0f} "
                 f"tokens/s per GPU")
    for name, r in (("target", t), ("drafter", d)):
        if r.get("strict_miss"):
            lines.append(f"{name}: a kernel compiled after the warm-up (timed again after one more pass): "
                         f"{r['strict_miss']}")
    lines.append(f"not in D: the gradient mean across drafter replicas ({d['grad_GiB']:.2f} GiB of fp32 gradient per "
                 f"replica, summed on the first drafter GPU and copied back) nor the feature hand-off: both are in E")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        # the library's Triton kernels through the interpreter: set before dflash_kernels is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import warnings
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    name = args.preset or ("27b" if cuda else "tiny")
    if not cuda and name != "tiny":
        raise SystemExit(f"roles: the `{name}` preset needs a CUDA GPU (a {'27B' if name == '27b' else '4B'}-parameter "
                         f"target at 3072 tokens, 512 anchors); on a CPU run `--preset tiny`.")
    sys.path.insert(0, ROOT)
    import dflash_kernels as dk
    importlib.import_module("trainer")  # sets the offline switches before transformers is imported

    t_start = time.perf_counter()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n_timed = args.steps or (3 if cuda else 1)
    n_warm = args.warmup if args.warmup is not None else (2 if cuda else 1)
    log = lambda s: print(s, flush=True)  # noqa: E731
    info = tok_s.env_info()
    log(f"roles | dflash_kernels {dk.__version__} | {info['gpu']} | torch {info['torch']} | triton {info['triton']}")
    if not cuda:
        log("No CUDA device: the tiny preset on the CPU (the Triton kernels through the interpreter). These numbers "
            "only show the job runs; they say nothing about GPU speed and are not recorded.")
    elif name == "27b":
        log("expected on an H200 (an estimate, not a measurement): about 1.5 minutes in all: imports and the model "
            "build ~25 s, the first micro-batch of each role ~20-30 s (compiling and tuning), then ~0.3 s per "
            "micro-batch and role (152 TFLOP target forward, 126 TFLOP drafter step at 30-50% MFU)")
    plan = tok_s.group_plan("a", dev)
    for op, backend in plan["backends"].items():
        dk.set_backend(op, backend)
    t0 = time.perf_counter()
    setup = SETUPS[name](args, dev, dtype, log)
    build_s = time.perf_counter() - t0
    c = setup.cfg
    log(f"\n== preset {name}: {setup.note}; built in {build_s:.1f}s; micro-batch {c.batch_size} x {c.max_len} tokens, "
        f"{c.num_anchors} anchors of {c.block_size}; drafter {c.num_layers} layers, {c.num_heads} x {c.head_dim} heads "
        f"({c.num_kv_heads} kv), intermediate {c.intermediate_size or setup.target.intermediate_size}, target layers "
        f"{setup.target.layer_ids}; {dtype}; {n_warm} warm-up + {n_timed} timed micro-batches per role; "
        f"backends {tok_s._describe(plan, dev)}")
    row = {"preset": name, "note": setup.note, "batch_size": c.batch_size, "max_len": c.max_len,
           "num_anchors": c.num_anchors, "block_size": c.block_size, "drafter_layers": c.num_layers,
           "backends": tok_s._describe(plan, dev), "loss_path": c.loss, "adamw": "fused" if cuda else "default (CPU)",
           "warmup": n_warm, "steps": n_timed, "build_s": build_s}
    try:
        trow, items = measure_target(setup, n_warm, n_timed, dev, log)
        flops = role_flops(setup, items[-1][0])
        heads = drop_target_layers(setup, items, dev, log)
        drow = measure_drafter(setup, heads, items, n_warm, n_timed, dev, dtype, log)
    finally:
        for op in tok_s.OPS:
            dk.set_backend(op, "auto")
    from trainer.flops import mfu

    for r, key in ((trow, "target"), (drow, "drafter")):
        r["TFLOP"] = flops[key] / 1e12
        r["mfu"] = mfu(flops[key], r["ms"] / 1e3) if cuda else float("nan")
    E = args.efficiency if args.efficiency is not None else 1.0
    row.update(target=trow, drafter=drow, efficiency_measured=args.efficiency is not None,
               projection=project(trow["tok_s"], drow["tok_s"], E), goal_tok_s=GOAL)
    row["wall_s"] = time.perf_counter() - t_start
    log("\n" + format_report(row))
    log(f"\nwall time {row['wall_s']:.0f}s (model build {build_s:.0f}s)")
    if cuda and not args.no_record:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "a") as f:
            f.write(json.dumps({**info, "op": "roles", **row}) + "\n")
        log(f"appended the row to {RESULTS}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "op": "roles", **row}, f, indent=1)
    return row


if __name__ == "__main__":
    main()
