"""Drafter-training throughput, the project's main job: ``python benchmarks/tok_s.py``.

The same DFlash training step as ``trainer.train`` (batch -> frozen target features -> drafter ->
weighted CE -> backward -> clip -> AdamW) is timed with several sets of backends, one row each:

- (a) ``dflash_kernels``: everything the library offers, with the trainer's defaults: its kernels for the
  drafter's block-sparse attention, the target's Gated DeltaNet and short conv, the fused LM head +
  cross-entropy (``linear_cross_entropy``) as the loss, its fused ``rms_norm`` / ``apply_rope`` /
  ``swiglu`` in the drafter and the target (on a GPU; on a CPU the plain torch chains, where the ops
  would run the interpreter), and ``compute_weights="auto"``: on a GPU in bf16 the drafter runs on bf16
  weight copies that the library's fused AdamW writes in its step (elsewhere fp32 weights under autocast
  and torch's fused AdamW). On a GPU the target's feature forward is replayed as CUDA graphs with its GDN
  layers routed by ``use_dflash_kernels(..., gdn_layers=True)`` (q and k reach the delta rule at their own
  head count, and the kernels compute the decay and beta from the raw gate and logits), and the drafter's
  forward, backward, clip and AdamW step run as CUDA graphs (``TrainConfig.target_cuda_graphs`` /
  ``step_cuda_graphs="auto"``: trainer code, which every group shares). On a CPU the Triton kernels run
  through Triton's interpreter;
- (b) ``peers`` (``benchmarks/peers.py``): the drafter's attention as ``torch.compile(flex_attention)``
  with a BlockMask rebuilt every step (anchors change every step) by ``torch.compile(create_block_mask)``
  (``--flex-mask eager`` builds it eagerly), the target's GDN on fla and its conv on causal-conv1d where
  those are importable (CUDA only); the loss over the whole logits (``F.linear`` + fp32
  ``F.cross_entropy``) and torch's default (foreach) AdamW;
- (c) ``reference``: ``dflash_kernels.set_backend(op, "reference")`` for every op, plain torch.

Comparison rows, each (a) or (b) with one thing changed (``--groups a,e`` etc.; not in the default): (e) the
plain torch norm / RoPE / SwiGLU chains; (k) ``compute_weights="autocast"``; (m) ``"copies"`` explicitly
(on a CPU (a) follows "auto", i.e. autocast); (n) and (bn) the target's forward eager; (r) without the
GDN layer route; (w) and (bw) the drafter's step eager; (s) the split GDN forward forced
(``DFLASH_KERNELS_GDN_FWD_SPLIT=1`` for the row: the state scan, then the output over all chunks at once)
and (f) the fused one (``=0``), the two sides of the library's own choice, which splits for few sequences
and heads (the ``real`` target's B=1, Hv=32).

(b+) is the strongest stack a user could assemble without the library (``--groups b,b+``; GPU only): (b)
plus each peer piece alone, one row each: Liger Kernel's fused linear cross-entropy (``b+liger``) or Cut
Cross-Entropy's (``b+cce``) as the loss (``reduction="none"``, the DFlash position weights applied
outside), and Liger's RMSNorm / RoPE / SwiGLU in the drafter and its RMSNorm / SwiGLU MLP in the target
(``b+liger-ew``); then the pieces that made (b) faster, together, as one more row unless already measured
(``--plus`` picks the variants run alone). The fastest of these rows, (b) included, is (b+) (the
combination is not always faster than its parts) and carries ``b_plus_best``; the table's notes name it.

On a GPU every row runs in a Python process of its own (``--isolate``): the script runs itself with
``--child-group`` per row and collects the rows, so no row inherits another's allocator state, compiled
kernels, autotuner state or patched modules; each builds the target again from the same seed, so every
row starts from the same model, drafter and batch.

Each row's columns are explained under the table (tokens/s is the trainer's definition: target tokens of
the batch per second of training step; the model FLOPs are ``trainer/flops.py``'s analytic count).
``--profile N`` adds each group's device time per category (gemm, attention, gdn, conv, loss, optimizer,
copies/casts, norm/rope/activation, other; JSON field ``profile_ms``) and ``device_idle_ms``: the step's
wall time less that device time, what the GPU waits for the host per step. On a GPU every row also splits
its timed steps with CUDA events (``span_ms``, no synchronization in the steps): ``target`` (the step's
start to its target features), ``drafter`` (to the drafter's step done) and ``between`` (one step's end to
the next one's start, the scheduler's lr write included), each the mean device-side ms per step.
``--verbose`` prints each row's full record as it finishes (the ``--json`` rows hold it too).

Before the clock starts, each timed batch's forward and backward run once without an update (the shape
pass; ``--shape-pass off`` skips it): a batch whose shapes the warm-up steps did not cover would otherwise
put first-time compilation (torch.compile's recompiles in (b)) and tuning (the library's, once per shape
bucket and GPU model) into the timed steps.

Presets:
- ``embedded``: the embedded default (``python -m trainer.build_default``; built first when
  missing unless ``--no-build``) with the ``embedded`` trainer preset;
- ``real``: a random-weight Qwen3.5-4B-like target (32 layers, 3 Gated DeltaNet : 1 attention,
  hidden 2560, vocab 248320) with the published drafter shape (5 layers, 32 x 128 heads) at max_len
  3072 and 512 anchors; GPU only;
- ``tiny``: a random tiny Qwen3.5 hybrid (``trainer.random_target``) and the ``tiny`` trainer preset;
  seconds on a CPU.

Without ``--preset``: ``embedded`` and ``real`` on a GPU, ``tiny`` on a CPU (and it says so). GPU rows
are appended to ``benchmarks/results/tok_s.jsonl`` with the GPU, torch / triton versions, date and
command.
"""

import argparse
import bisect
import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peers.py sits next to this file
sys.path.insert(1, ROOT)  # the trainer, wherever the script is run from
from peers import PLUS_LOSSES, FlexDrafterAttention, liger_elementwise, peer_backends, peer_head_loss  # noqa: E402
# The presets' random targets (no dflash_kernels import here: main sets TRITON_INTERPRET first on a CPU).
from trainer.random_target import TEXT_CONFIGS  # noqa: E402,F401 - also make_target.py's and bench_adamw.py's
from trainer.random_target import random_qwen35_target as _random_qwen35_target  # noqa: E402
from trainer.random_target import synthetic_dataset as _synthetic_dataset  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "tok_s.jsonl")
OPS = ("attention", "gdn", "conv1d", "linear_cross_entropy")
GROUPS = ("a", "b", "b+", "bn", "bw", "c", "e", "f", "k", "m", "n", "r", "s", "w")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python benchmarks/tok_s.py", usage="%(prog)s [--preset NAME] [--groups LIST] [options]",
        description="Drafter-training throughput (tokens/s) of one DFlash training step: the library's kernels "
        "(a), its peers (b), plain torch (c), one row each; the other groups change one thing of (a) or (b).",
        epilog="Groups, presets and columns: docs/benchmarks.md (and this file's docstring).")
    run = p.add_argument_group("what runs")
    run.add_argument("--preset", action="append", choices=["embedded", "real", "tiny"], metavar="NAME",
                     help="tiny, real or embedded; repeatable (default: tiny on a CPU, embedded and real on a GPU)")
    run.add_argument("--device", default="auto", metavar="DEV", help="auto (cuda if available), cuda or cpu")
    ab_rows = ",".join(g for g in GROUPS if g not in ("a", "b", "c"))
    run.add_argument("--groups", default="a,b,c", metavar="LIST", help="rows: a (dflash_kernels), b (peers), "
                     f"c (reference) (default: a,b,c); also {ab_rows}")
    run.add_argument("--plus", default="", metavar="LIST", help="(b+) variants run alone (default: "
                     "liger,cce,liger-ew)")
    run.add_argument("--batch-size", type=int, default=None, metavar="N", help="sequences per step "
                     "(default: the preset's)")
    run.add_argument("--no-build", action="store_true", help="skip the embedded preset if it is not built yet")
    timing = p.add_argument_group("timing")
    timing.add_argument("--steps", type=int, default=None, metavar="N", help="timed steps per row (default: 10 on "
                        "a GPU, 2 on a CPU)")
    timing.add_argument("--warmup", type=int, default=None, metavar="N", help="untimed steps first (default: 2 on "
                        "a GPU, 1 on a CPU)")
    timing.add_argument("--reference-steps", type=int, default=3, metavar="N", help="timed steps of the slow (c) "
                        "rows at most (default: 3)")
    timing.add_argument("--shape-pass", choices=["on", "off"], default="on", metavar="on|off",
                        help="run timed batches once before the clock (default: on)")
    timing.add_argument("--flex-mask", choices=["compiled", "eager"], default="compiled", metavar="MODE",
                        help="(b)'s BlockMask build: compiled (default) or eager")
    timing.add_argument("--target-graphs", choices=["auto", "on", "off"], default="auto", metavar="MODE",
                        help="target forward as CUDA graphs: auto (GPU), on, off")
    timing.add_argument("--step-graphs", choices=["auto", "on", "off"], default=None, metavar="MODE",
                        help="drafter step as CUDA graphs (default: the trainer's)")
    timing.add_argument("--isolate", choices=["auto", "on", "off"], default="auto", metavar="MODE",
                        help="a process per row (default: auto = on a GPU)")
    out = p.add_argument_group("output")
    out.add_argument("--verbose", action="store_true", help="print each row's full record as it finishes")
    out.add_argument("--json", default="", metavar="PATH", help="also write the rows to this JSON file")
    out.add_argument("--no-record", action="store_true", help="do not append GPU rows to "
                     "results/tok_s.jsonl")
    out.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps per row: device "
                     "time (GPU)")
    out.add_argument("--profile-top", type=int, default=15, metavar="N", help="kernels listed per profiled row "
                     "(default: 15)")
    out.add_argument("--profile-sources", type=float, default=0.0, metavar="MS",
                     help="with --profile: name the callers of copies/idle >= MS ms/step")
    out.add_argument("--trace", default="", metavar="DIR", help="write each profiled row's Chrome trace into DIR")
    p.add_argument("--child-group", default="", help=argparse.SUPPRESS)  # one group, for --isolate's parent
    args = p.parse_args(argv)
    if args.child_group and (not args.preset or len(args.preset) != 1):
        p.error("--child-group needs exactly one --preset")
    parse_plus(args.plus)
    return args


# ------------------------------------------------------------------------------------------ presets
@dataclasses.dataclass
class Setup:
    name: str
    cfg: object  # trainer.config.TrainConfig
    target: object  # trainer.target.Target
    dataset: object  # trainer.data.Dataset
    note: str


def setup_tiny(args, dev, dtype, log):
    from transformers import Qwen3_5TextConfig

    from trainer.config import preset

    cfg = preset("tiny", device=str(dev), batch_size=args.batch_size or 2)
    text = Qwen3_5TextConfig(**TEXT_CONFIGS["tiny"])
    log(f"tok_s: building a random tiny Qwen3.5 target on {dev} ...")
    target = _random_qwen35_target(text, cfg, dev, dtype)
    ds = _synthetic_dataset(text.vocab_size, 8, cfg.max_len)
    return Setup("tiny", cfg, target, ds, "random tiny Qwen3.5 (4 layers, hidden 64), max_len 64, 4 anchors")


def setup_real(args, dev, dtype, log):
    from transformers import Qwen3_5TextConfig

    from trainer.config import preset

    if dev.type != "cuda":
        raise SystemExit("tok_s: the `real` preset needs a CUDA GPU (a 4B-parameter target at 3072 tokens, "
                         "512 anchors); on a CPU run `--preset tiny`.")
    text = Qwen3_5TextConfig(**TEXT_CONFIGS["real"])
    cfg = preset("default", device=str(dev), batch_size=args.batch_size or 1)
    log(f"tok_s: building a random Qwen3.5-4B-like target on {dev} ...")
    target = _random_qwen35_target(text, cfg, dev, dtype)
    ds = _synthetic_dataset(text.vocab_size, 16, cfg.max_len)
    return Setup("real", cfg, target, ds, "random Qwen3.5-4B-like target (32 layers, 3 GDN : 1 attention, "
                 "hidden 2560), published drafter shape, max_len 3072, 512 anchors")


def setup_embedded(args, dev, dtype, log):
    from trainer.build_default import default_paths, ensure
    from trainer.config import preset
    from trainer.data import load_jsonl
    from trainer.target import load_target

    cfg = preset("embedded", device=str(dev), **({"batch_size": args.batch_size} if args.batch_size else {}))
    paths = default_paths(cfg.cache_dir)
    if not os.path.exists(paths["build"]) and args.no_build:
        log(f"tok_s: embedded default not built at {paths['root']} and --no-build given: skipping that preset")
        return None
    ensure(cfg.cache_dir, device=str(dev), log=log)  # built first when missing (it says so; minutes on a CPU)
    log(f"tok_s: loading the embedded default target on {dev} ...")
    target = load_target(paths["target"], cfg.target_layer_ids, cfg.num_target_layers, device=dev, dtype=dtype,
                         elementwise=False)  # routed per group (run_group)
    ds = load_jsonl(paths["train"], target.tokenizer, cfg.max_len, cfg.block_size, vocab_size=target.vocab_size,
                    log=log)
    return Setup("embedded", cfg, target, ds, f"embedded default ({paths['root']})")


SETUPS = {"tiny": setup_tiny, "real": setup_real, "embedded": setup_embedded}
PRECOMPILE = {}  # "pending": the precompile_recorded started before a preset's target build (run_preset)


# ------------------------------------------------------------------------------------- groups
def group_plan(group: str, dev) -> dict:
    """``{"label", "backends": {op: name}, "flex": bool}`` or ``{"skip": reason}``."""
    cpu = dev.type != "cuda"
    if group == "w" and cpu:
        return {"label": "(w) (a) with the drafter's step eager",
                "skip": "the comparison of the step's CUDA graphs: a GPU only"}
    if group in ("a", "e", "f", "k", "m", "n", "r", "s", "w"):
        name = "interpret" if cpu else "auto"
        plan = {"label": "(a) dflash_kernels", "backends": {op: name for op in OPS}, "flex": False,
                "loss": "fused", "adamw": "auto", "elementwise": True}
        if group == "e":
            plan.update(label="(e) (a) with eager norm/RoPE/SwiGLU", elementwise=False)
        if group == "m":
            plan.update(label="(m) (a) with bf16 weight copies written by the step", adamw="copies")
        if group == "k":
            plan.update(label="(k) (a) with fp32 weights cast by autocast", adamw="fused")
        if group == "s":
            plan.update(label="(s) (a) with the split GDN forward", env={"DFLASH_KERNELS_GDN_FWD_SPLIT": "1"})
        if group == "f":
            plan.update(label="(f) (a) with the fused GDN forward", env={"DFLASH_KERNELS_GDN_FWD_SPLIT": "0"})
        if group == "n":
            plan.update(label="(n) (a) with the target's forward eager (no CUDA graphs)", target_graphs=False)
        if group == "r":
            plan.update(label="(r) (a) without the GDN layer route (transformers' GDN layer forward)", gdn_layers=False)
        if group == "w":
            plan.update(label="(w) (a) with the drafter's step eager (no CUDA graphs)", step_graphs=False)
        return plan
    if group == "c":
        return {"label": "(c) reference", "backends": {op: "reference" for op in OPS}, "flex": False,
                "loss": "fused", "adamw": "foreach"}
    if cpu:
        return {"label": {"bn": "(bn) (b) with the target's forward eager",
                          "bw": "(bw) (b) with the drafter's step eager"}.get(group, "(b) peers"),
                "skip": "peers run on CUDA only (fla and causal-conv1d are GPU kernels; "
                "flex is measured on the GPU)"}
    back, missing = peer_backends()
    plan = {"label": "(b) peers", "backends": back, "flex": True, "note": "; ".join(missing),
            "loss": "logits", "adamw": "foreach"}
    if group == "bn":  # the trainer's CUDA-graph default is trainer code, which every group shares
        plan.update(label="(bn) (b) with the target's forward eager (no CUDA graphs)", target_graphs=False)
    if group == "bw":
        plan.update(label="(bw) (b) with the drafter's step eager (no CUDA graphs)", step_graphs=False)
    if group.startswith("b+"):  # b+<loss>[+liger-ew]: (b) with a peer's fused loss and/or Liger's elementwise ops
        parts = group[2:].split("+")
        loss = parts[0] if parts[0] in PLUS_LOSSES else None
        ew = "liger-ew" in parts
        if (loss is None and parts[0] not in ("logits", "liger-ew")) or any(
                p not in PLUS_LOSSES + ("logits", "liger-ew") for p in parts):
            raise SystemExit(f"--groups: unknown (b+) variant {group!r}")
        plan.update(label=f"(b+) {'+'.join(parts)}", peer_loss=loss, liger_elementwise=ew)
        if loss is not None:
            plan["loss"] = "chunked"  # drafter_loss's head-loss path, with the peer's loss patched in
    return plan


def _describe(plan, dev) -> str:
    import dflash_kernels as dk

    parts = []
    for op in OPS:
        if op == "attention" and plan["flex"]:
            parts.append("attn=flex")
            continue
        short = "attn" if op == "attention" else op
        try:
            resolved = dk.runtime.resolve(op, dev)
            # under "auto" the conv may still pick its CUDA extension per shape (timed once per GPU)
            parts.append(f"{short}={'auto:' if dk.get_backend(op) == 'auto' else ''}{resolved}")
        except Exception as e:  # noqa: BLE001
            parts.append(f"{op}=unavailable({e})")
    return " ".join(parts)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# Kernel-name fragments -> the category a profile row is counted in (first match wins).
CATEGORIES = [("gdn", ("gdn", "chunk_gated", "chunk_fwd", "chunk_bwd", "recompute_w_u", "solve_tril",
                       "chunk_scaled_dot", "l2norm", "fused_recurrent")),
              ("conv", ("conv1d", "causal_conv", "_conv_", "convparams")),
              ("loss", ("softmax", "nll_loss", "cross_entropy", "linear_ce", "logsumexp")),
              ("attention", ("attention", "attn", "flex", "flash", "sdpa", "triton_tem_fused", "block_mask")),
              ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lpnorm", "clip")),
              ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "matmul", "_mm_")),
              ("copies/casts", ("copy", "cat", "index", "gather", "scatter", "fill", "embedding", "where")),
              ("norm/rope/activation", ("elementwise", "vectorized", "reduce", "triton_poi", "triton_red",
                                        "triton_per", "silu", "rsqrt", "norm", "swiglu", "rope"))]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def device_kernels(events) -> list:
    """The kernels of a profile, by start time: the device events less the record_function ranges
    mirrored on the device timeline (torch's ``Optimizer.step#AdamW.step``: it spans the kernels it
    launched and would count them twice). A range is a device event flagged as a user annotation, or one
    named like a host event that spans another device event; a kernel named like its host-side launch
    record (torch.compile's Triton kernels, e.g. flex attention's) spans none."""
    cuda = torch.autograd.DeviceType.CUDA
    host = {e.name for e in events if e.device_type != cuda}
    dev = sorted((e for e in events if e.device_type == cuda), key=lambda e: (e.time_range.start, -e.time_range.end))

    def spans_another(i):
        start, end = dev[i].time_range.start, dev[i].time_range.end
        for d in dev[i + 1:]:
            if d.time_range.start > end:
                return False
            if d.time_range.end <= end and (d.time_range.start, d.time_range.end) != (start, end):
                return True
        return False

    return [e for i, e in enumerate(dev)
            if not (getattr(e, "is_user_annotation", False) or (e.name in host and spans_another(i)))]


def kernel_ms(events, n: int) -> dict:
    """``{kernel name: device ms per step}`` from a profile of ``n`` steps (:func:`device_kernels`)."""
    kernels = {}
    for e in device_kernels(events):
        kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 1e3 / n
    return kernels


PROFILE = {"top": 15, "trace": "", "sources": 0.0}  # --profile-top, --trace, --profile-sources
TIMING = {"shape_pass": True, "flex_mask": "compiled", "target_graphs": "auto", "step_graphs": None}  # --shape-pass, --flex-mask, ...

SOURCE_CATEGORIES = ("copies/casts", "norm/rope/activation")  # torch's own kernels are traced to their callers


_PY_FRAME = re.compile(r"\.py\(\d+\): ")
_TORCH_FRAME = re.compile(r"(^|site-packages/|dist-packages/)torch/")  # not /opt/torch/.venv/...'s other packages


def _caller(launch, keep: int = 3):
    """``(outer op, its input shapes, caller)`` of a kernel's host launch record (:func:`_source` of its
    parent)."""
    return _source(launch.cpu_parent, launch.name, keep)


def _source(node, name_if_no_op: str, keep: int = 3):
    """``(outer op, its input shapes, caller)`` of host event ``node``: walking up the profiler's parents
    from it, the outermost ATen op of the first run of ATen ops (``aten::contiguous`` rather than the
    ``aten::copy_`` inside it; ``name_if_no_op`` when there is none), then the first ``keep`` Python frames
    outside torch (``with_stack`` records them as events above the op), or the autograd node for a
    backward kernel."""
    op, frames, in_ops = None, [], True
    while node is not None and len(frames) < keep:
        name = node.name
        if name.startswith("aten::"):
            if in_ops:
                op = node
        else:
            in_ops = in_ops and op is None
            if name.startswith("autograd::engine::evaluate_function: "):
                frames.append(name.split(": ", 1)[1])
            elif _PY_FRAME.search(name) and not _TORCH_FRAME.search(name):
                frames.append(name.rsplit("/", 1)[-1])
        node = node.cpu_parent
    if not frames and op is not None:  # no Python events above the op: its own recorded stack, if any
        frames = [f.rsplit("/", 1)[-1] for f in (getattr(op, "stack", None) or ())
                  if _PY_FRAME.search(f) and not _TORCH_FRAME.search(f)][:keep]
    shapes = str(getattr(op, "input_shapes", "") or "")[:120] if op is not None else ""
    return (op.name if op is not None else name_if_no_op), shapes, " < ".join(frames)


def kernel_sources(events, n: int, min_ms: float, categories=SOURCE_CATEGORIES) -> list:
    """Where the kernels of ``categories`` (copies, casts, torch's elementwise kernels) come from, from a
    profile taken with ``record_shapes`` and ``with_stack``: each kernel's launch record is traced to its
    ATen op, input shapes and caller (:func:`_caller`). Returns ``[(device ms per step, category, kernel,
    op, shapes, caller)]`` of the groups of at least ``min_ms`` per step, largest first."""
    groups = {}
    for e in events:
        for k in getattr(e, "kernels", None) or ():
            cat = category(k.name)
            if cat in categories:
                key = (cat, k.name[:90], *_caller(e))
                groups[key] = groups.get(key, 0.0) + k.duration / 1e3 / n
    rows = [(ms, *key) for key, ms in groups.items() if ms >= min_ms]
    return sorted(rows, key=lambda r: -r[0])


def idle_sources(events, n: int, min_ms: float, walk: int = 4000) -> tuple:
    """Where the GPU waits for the host, from a profile taken with ``with_stack``: the gaps between the
    device's busy intervals (every stream merged), from the first kernel to the last, each attributed to
    what the host was doing at the gap's middle: the most recently started host event still running then
    (any thread; the backward's ops run on autograd's), named by :func:`_source` (its outermost ATen op,
    the Python frames above it). Returns ``(idle ms per step, [(ms per step, gaps per step, op, shapes,
    caller)])``, the groups of at least ``min_ms``, largest first."""
    cuda = torch.autograd.DeviceType.CUDA
    busy = []
    for e in device_kernels(events):
        start, end = e.time_range.start, e.time_range.end
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    host = sorted((e for e in events if e.device_type != cuda), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in host]
    groups, total = {}, 0.0
    for (_, g0), (g1, _) in zip(busy, busy[1:]):
        mid, held = (g0 + g1) / 2, None
        i = bisect.bisect_right(starts, mid) - 1
        for j in range(i, max(i - walk, -1), -1):
            if host[j].time_range.end >= mid:
                held = host[j]
                break
        key = _source(held, held.name) if held is not None else ("(no host event)", "", "")
        ms, count = groups.get(key, (0.0, 0))
        groups[key] = (ms + (g1 - g0) / 1e3 / n, count + 1)
        total += (g1 - g0) / 1e3 / n
    rows = [(ms, count / n, *key) for key, (ms, count) in groups.items() if ms >= min_ms]
    return total, sorted(rows, key=lambda r: -r[0])


def profiler_options(sources: bool) -> dict:
    """torch.profiler keywords: for ``--profile-sources``, shapes and Python stacks, both as events above each
    op and as the op's own recorded ``stack`` (``verbose``: in CUDA profiles with torch 2.11 the Python
    events were not linked above the ops; pytorch/pytorch#100253, #127951), which :func:`_source` reads."""
    if not sources:
        return {"record_shapes": False, "with_stack": False}
    from torch._C._profiler import _ExperimentalConfig

    return {"record_shapes": True, "with_stack": True, "experimental_config": _ExperimentalConfig(verbose=True)}


def profile_steps(step, n: int, dev, label: str, log) -> dict:
    """Run ``step`` n times under torch.profiler; log device ms per step by category and the top kernels.
    Returns ``{category: device ms per step}`` (empty off the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    if dev.type != "cuda":
        log(f"    profile {label}: skipped (the device-time breakdown needs a GPU)")
        return {}
    sources = PROFILE["sources"] > 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **profiler_options(sources)) as prof:
        for _ in range(n):
            step()
        _sync(dev)
    kernels = kernel_ms(prof.events(), n)
    total = sum(kernels.values())
    cats = {}
    for name, ms in kernels.items():
        cats[category(name)] = cats.get(category(name), 0.0) + ms
    log(f"    profile {label}: {total:.1f} device ms per step; " +
        ", ".join(f"{c} {ms:.1f}" for c, ms in sorted(cats.items(), key=lambda x: -x[1])))
    for name, ms in sorted(kernels.items(), key=lambda x: -x[1])[:PROFILE["top"]]:
        log(f"      {ms:8.2f} ms  {category(name):20s} {name[:110]}")
    if sources:
        log(f"      where {' and '.join(SOURCE_CATEGORIES)} come from (>= {PROFILE['sources']} ms per step):")
        for ms, cat, kname, op, shapes, frames in kernel_sources(prof.events(), n, PROFILE["sources"]):
            log(f"      {ms:8.2f} ms  {cat:20s} {op} {shapes} <- {frames or '?'} [{kname[:60]}]")
        idle, rows = idle_sources(prof.events(), n, PROFILE["sources"])
        log(f"      where the GPU waits for the host: {idle:.2f} ms per step between the first and the last kernel, "
            f"by what the host was running (>= {PROFILE['sources']} ms per step):")
        for ms, gaps, op, shapes, frames in rows:
            log(f"      {ms:8.2f} ms  {gaps:7.1f} gaps  {op} {shapes} <- {frames or '?'}")
    if PROFILE["trace"]:
        os.makedirs(PROFILE["trace"], exist_ok=True)
        path = os.path.join(PROFILE["trace"], re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".json")
        prof.export_chrome_trace(path)
        log(f"      trace: {path}")
    return cats


def run_group(setup: Setup, group: str, steps: int, warmup: int, dev, dtype, reference_steps: int = 3,
              profile: int = 0, log=print) -> dict:
    """One group's row (``_run_group``). Every group sets the drafter's norm / RoPE / SwiGLU path
    (``trainer.model.FUSED_OPS``) for its duration: the fused ops where the plan has ``elementwise`` and
    the device is a GPU ((a): the trainer's default there), routed in the target too; the plain
    torch chains otherwise ((b), (c), (e); a CPU, where the ops would run the interpreter). The op
    backends the group sets are restored after it too."""
    import dflash_kernels as dk
    import trainer.model as drafter_model
    from dflash_kernels.integrations.transformers import use_dflash_kernels

    args = (setup, group, steps, warmup, dev, dtype, reference_steps, profile, log)
    plan = group_plan(group, dev)
    fused = bool(plan.get("elementwise")) and dev.type == "cuda"
    before = drafter_model.FUSED_OPS
    drafter_model.FUSED_OPS = fused
    gdn_layers = plan.get("gdn_layers")
    if gdn_layers is None and fused:  # the trainer's rule: the layer route where the target runs as graphs
        gdn_layers = _target_graphs(plan, setup.cfg, dev)
    routing = use_dflash_kernels(setup.target.model, elementwise=True, gdn_layers=gdn_layers) if fused else None
    env = plan.get("env", {})  # the row's library settings (read at each call), restored after it
    env_before = {k: os.environ.get(k) for k in env}
    backends_before = {op: dk.get_backend(op) for op in plan.get("backends", {})}
    os.environ.update(env)
    try:
        if plan.get("peer_loss") or plan.get("liger_elementwise"):
            row = _run_plus_group(plan, *args)
        else:
            row = _run_group(*args)
        if routing is not None:
            row["gdn_layers"] = gdn_layers
        return row
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if routing is not None:
            routing.undo()
        drafter_model.FUSED_OPS = before
        for op, name in backends_before.items():
            dk.set_backend(op, name)


class StepSpans:
    """CUDA events recorded on the stream at each timed step's start, after its target features and after its
    drafter step, read after the clock stops (no synchronization in the steps). ``split()`` gives the mean
    device-side ms per step of ``target`` (start -> features: the copies in, the target's forward),
    ``drafter`` (features -> the drafter's step done) and ``between`` (one step's end -> the next one's
    start: the GPU waiting for the host between steps when positive). Off the GPU, and once ``on`` is
    False, ``mark`` does nothing."""

    def __init__(self, dev):
        self.on = dev.type == "cuda"
        self.steps = []  # one {"start", "target", "drafter"} dict of events per timed step

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if name == "start":
            self.steps.append({})
        elif not self.steps:  # the warm-up and shape-pass steps come before the first start
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.steps[-1][name] = event

    def split(self) -> dict:
        full = [s for s in self.steps if len(s) == 3]
        if not full:
            return {}
        n = len(full)
        out = {"target": sum(s["start"].elapsed_time(s["target"]) for s in full) / n,
               "drafter": sum(s["target"].elapsed_time(s["drafter"]) for s in full) / n}
        if n > 1:
            out["between"] = sum(a["drafter"].elapsed_time(b["start"]) for a, b in zip(full, full[1:])) / (n - 1)
        return {k: round(v, 3) for k, v in out.items()}


def _target_graphs(plan, cfg, dev) -> bool:
    """Whether the row's target forward runs as CUDA graphs: the plan's setting, else the trainer's rule
    (default "auto": on a GPU) as --target-graphs sets it."""
    graphs = plan.get("target_graphs")
    if graphs is None:
        graphs = dataclasses.replace(cfg, target_cuda_graphs=TIMING["target_graphs"]).target_graphs_on(dev)
    return graphs


def _run_plus_group(plan, setup, *args):
    """A (b+) row: (b) with a peer's fused LM-head loss in ``drafter_loss``'s head-loss call and/or
    Liger's RMSNorm / RoPE / SwiGLU in the drafter and target, all undone after the row."""
    import trainer.step as step_mod

    before = step_mod.dflash_head_loss
    undos = []

    def on_drafter(drafter):
        if plan.get("liger_elementwise"):
            undos.append(liger_elementwise(drafter, setup.target.model))
    try:
        if plan.get("peer_loss"):
            step_mod.dflash_head_loss = peer_head_loss(plan["peer_loss"])
        row = _run_group(setup, *args, on_drafter=on_drafter)
    finally:
        step_mod.dflash_head_loss = before
        for undo in undos:
            undo.undo()
    row["elementwise"] = "liger" if plan.get("liger_elementwise") else row.get("elementwise", "eager")
    if plan.get("peer_loss"):
        row["loss_path"] = plan["peer_loss"]
    return row


def _run_group(setup: Setup, group: str, steps: int, warmup: int, dev, dtype, reference_steps: int = 3,
               profile: int = 0, log=print, on_drafter=None) -> dict:
    """Build a fresh drafter (same seed for every group; ``on_drafter(drafter)`` sees it first), set the
    backends, time the training step."""
    import dflash_kernels as dk
    import trainer.model as drafter_model
    from trainer.data import batch_at
    from trainer.target import resolve_mask_token_id
    from trainer.common import build_drafter, lr_lambda
    from trainer.flops import mfu, step_flops
    from trainer.step import drafter_loss, target_features
    from trainer.step_graph import DrafterStep

    cfg, target = setup.cfg, setup.target
    plan = group_plan(group, dev)
    row = {"preset": setup.name, "group": plan["label"]}
    if "skip" in plan:
        row["skipped"] = plan["skip"]
        return row
    if group == "c":
        steps = min(steps, reference_steps)
    graphs = _target_graphs(plan, cfg, dev)
    target.use_cuda_graphs(graphs)
    for op, name in plan["backends"].items():
        dk.set_backend(op, name)
    row["backends"] = _describe(plan, dev)
    if plan.get("note"):
        row["note"] = plan["note"]
    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size, cfg.mask_token_id) \
        if target.tokenizer is not None else (cfg.mask_token_id if cfg.mask_token_id is not None
                                              else target.vocab_size - 1)
    drafter = build_drafter(cfg, target, mask_id).to(dev)
    flex = FlexDrafterAttention(drafter, compiled_mask=TIMING["flex_mask"] == "compiled") if plan["flex"] else None
    if flex is not None:
        row["flex_mask"] = TIMING["flex_mask"]
    if on_drafter is not None:
        on_drafter(drafter)
    cfg = dataclasses.replace(cfg, loss=plan["loss"])
    row["elementwise"] = "fused" if drafter_model.FUSED_OPS else "eager"
    from trainer.compute_weights import make_optimizer

    kind = plan["adamw"]
    if kind == "auto":  # the trainer's rule (TrainConfig.compute_weights="auto")
        kind = "copies" if cfg.compute_weights_for(dev, dtype) == "copies" else "fused"
    opt = make_optimizer(drafter, cfg, dtype, kind)
    row["loss_path"] = cfg.loss
    row["adamw"] = ("copies" if not isinstance(opt, torch.optim.AdamW) else
                    "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "default")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup + steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    step_graphs = plan.get("step_graphs")
    if step_graphs is None:  # the trainer's rule, as --step-graphs sets it
        step_graphs = (cfg if TIMING["step_graphs"] is None else dataclasses.replace(
            cfg, step_cuda_graphs=TIMING["step_graphs"])).step_graphs_on(dev)
    # the trainer's drafter step (trainer.train's loop): eager, or as CUDA graphs per batch shape (the
    # first step of a shape eager, the second captured and replayed)
    dstep = DrafterStep(drafter, target, opt, cfg, dev, dtype, graphs=step_graphs)
    row["step_graphs"] = dstep.graphs
    drafter.train()
    tokens, timed, t_timed = 0, [], None

    def train_step(i, update=True):  # update=False: the shape pass (its shapes compiled and tuned, no step)
        batch = batch_at(setup.dataset, i, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed)
        if not update:
            feats = target_features(target, batch, dev)
            if dstep.is_captured(batch, feats):  # its graph replays it: nothing left to compile or tune
                return batch, None
            loss, _ = drafter_loss(batch, feats, target, drafter, cfg, dev, dtype)
            loss.backward()
            opt.zero_grad(set_to_none=True)
            return batch, loss
        feats = target_features(target, batch, dev)
        spans.mark("target")
        loss, _, _ = dstep(batch, feats)
        spans.mark("drafter")
        sched.step()
        return batch, loss

    row["shape_pass"] = TIMING["shape_pass"]
    row["target_graphs"] = graphs
    precompile_s = 0.0
    if dev.type == "cuda" and not group.startswith(("b", "c")):
        # The library's kernels recorded for this GPU model (shipped, or by an earlier run with this cache)
        # compile in parallel processes before the first step: part of the first step's cost, timed as such.
        t_wait = time.perf_counter()
        pending = PRECOMPILE.pop("pending", None)
        if pending is not None:  # started before the target's build (run_preset)
            bg = pending.wait()
            row["precompiled_during_build"] = {k: bg[k] for k in ("compiled", "workers", "seconds", "errors")}
        rep = dk.precompile_recorded(dev, verbose=False)
        precompile_s = time.perf_counter() - t_wait
        row["precompiled"] = {k: rep[k] for k in ("recorded", "current", "done_before", "compiled", "workers",
                                                  "errors")}

    def compile_tune_s():
        info = dk.cache_info().values()
        return sum(v["compile_s"] for v in info), sum(v["tune_s"] for v in info)

    spans = StepSpans(dev)
    for i in range(warmup + steps):
        if i == warmup:
            if TIMING["shape_pass"]:
                for j in range(warmup, warmup + steps):
                    train_step(j, update=False)
            _sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            if flex is not None:
                flex.mask_s = 0.0
            t_timed = time.perf_counter()
        t0 = time.perf_counter()
        if i == 0:
            compile0, tune0 = compile_tune_s()
        if i >= warmup:
            spans.mark("start")
        batch, loss = train_step(i)
        if i == 0:
            row["loss_step1"] = loss.item()
            _sync(dev)
            wall = time.perf_counter() - t0
            compile1, tune1 = compile_tune_s()
            row["first_step_s"] = precompile_s + wall
            row["first_step_split"] = {"precompile": precompile_s, "compile": compile1 - compile0,
                                       "tune": tune1 - tune0,
                                       "step": wall - (compile1 - compile0) - (tune1 - tune0)}
        if i >= warmup:
            tokens += int(batch["lengths"].sum())
            timed.append(batch)  # its FLOPs are counted after the clock stops (host work, not the step's)
    _sync(dev)
    elapsed = time.perf_counter() - t_timed
    flops = sum(step_flops(target.model, drafter, b, target.layers_run)["total"] for b in timed)
    row.update(steps=steps, tokens_per_step=tokens // max(steps, 1), tok_s=tokens / elapsed,
               ms_step=elapsed / steps * 1e3, model_TFLOP_step=flops / steps / 1e12, mfu=mfu(flops, elapsed))
    row["peak_GiB"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else float("nan")
    # what the process holds: a CUDA graph's pool stays reserved between replays, which allocate nothing
    # (the graphs' peak_GiB counts only what a replay's copies allocate)
    row["reserved_GiB"] = torch.cuda.max_memory_reserved(dev) / 2 ** 30 if dev.type == "cuda" else float("nan")
    row["graphs_captured"] = dstep.info()["captured"]
    row["mask_ms"] = flex.mask_s / steps * 1e3 if flex is not None else float("nan")
    if dev.type == "cuda":
        row["span_ms"] = spans.split()
    spans.on = False  # the profiled steps below are not split
    if profile > 0:
        first = warmup + steps
        it = iter(range(first, first + profile))
        cats = profile_steps(lambda: train_step(next(it)), profile, dev, f"{setup.name} {row['group']}", log)
        if cats:
            row["profile_ms"] = {c: round(ms, 3) for c, ms in sorted(cats.items(), key=lambda x: -x[1])}
            # the step's time the GPU spends waiting for the host (launches, synchronizations): the timed
            # steps' wall time per step less the profiled steps' device time per step
            row["device_idle_ms"] = round(row["ms_step"] - sum(cats.values()), 3)
    return row


PLUS_VARIANTS = PLUS_LOSSES + ("liger-ew",)


def parse_groups(text: str) -> list:
    """``--groups`` -> the group names, ``b+`` last-but-kept in order; unknown names refused."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    for g in groups:
        if g not in GROUPS:
            raise SystemExit(f"--groups: unknown group {g!r}; use one of " + ", ".join(GROUPS))
    if "b+" in groups and "b" not in groups[:groups.index("b+")]:
        raise SystemExit("--groups: b+ compares each peer piece with (b) in the same run: put b before b+")
    return groups


def run_preset(name, args, dev, dtype, log) -> list:
    """One preset's rows, every group in this process (``--isolate off``, or a child's one group)."""
    import dflash_kernels as dk

    cuda = dev.type == "cuda"
    steps = args.steps or (10 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    groups = [args.child_group] if args.child_group else parse_groups(args.groups)
    if cuda and any(not g.startswith(("b", "c")) for g in groups):
        # The library's recorded kernels compile in worker processes while the target is built; the first step
        # of a group on those kernels waits for what is left of it (its "precompile" seconds).
        PRECOMPILE["pending"] = dk.precompile_recorded(dev, verbose=False, background=True)
    t_build = time.perf_counter()
    setup = SETUPS[name](args, dev, dtype, log)
    if setup is None:
        return []
    build_s = time.perf_counter() - t_build
    c = setup.cfg
    log(f"\n== preset {name}: {setup.note}; batch {c.batch_size} x {c.max_len} tokens, {c.num_anchors} anchors, "
        f"drafter {c.num_layers} layers {c.num_heads}x{c.head_dim} heads; {dtype}; {warmup} warm-up + {steps} timed steps")

    def one(g):
        timed = min(steps, args.reference_steps) if g == "c" else steps
        log(f"  {name} ({g}): {warmup} warm-up step(s){' (compiling and tuning its kernels)' if cuda else ''}, "
            f"{'the shape pass, ' if TIMING['shape_pass'] else ''}then {timed} timed ...")
        try:
            row = run_group(setup, g, steps, warmup, dev, dtype, args.reference_steps, args.profile, log)
            row["target_build_s"] = build_s
        except Exception as e:  # noqa: BLE001 - a failing backend is a row, not a crash
            row = {"preset": name, "group": group_plan(g, dev).get("label", g),
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            for op in OPS:
                dk.set_backend(op, "auto")
            if cuda:
                torch.cuda.empty_cache()
        log(row_line(row, args.verbose))
        return row

    if args.child_group:
        return [one(args.child_group)]
    return run_groups(parse_groups(args.groups), one, log, plus_variants=parse_plus(args.plus))


CHILD_FLAGS = ("steps", "warmup", "reference_steps", "batch_size", "profile", "profile_top", "profile_sources",
               "trace", "shape_pass", "flex_mask", "target_graphs", "step_graphs")


def run_preset_isolated(name, args, dev, log, on_row=None) -> list:
    """One preset's rows, each group (and each (b+) variant) in a Python process of its own: this script
    with ``--child-group``, its rows handed back through ``--json``. No group inherits another's
    allocator state, compiled kernels, autotuner state or patched modules. A child that dies is an error
    row naming its exit status; its output (tracebacks included) is this process's."""
    import tempfile

    def one(g):
        with tempfile.TemporaryDirectory(prefix="tok_s-") as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--preset", name, "--device", dev.type,
                   "--child-group", g, "--no-record", "--json", out]
            for flag in CHILD_FLAGS:
                value = getattr(args, flag)
                if value not in (None, ""):  # --warmup 0 is a value
                    value = os.path.abspath(value) if flag == "trace" else value  # the child runs in ROOT
                    cmd += [f"--{flag.replace('_', '-')}", str(value)]
            cmd += [f"--{flag.replace('_', '-')}" for flag in ("no_build", "verbose") if getattr(args, flag)]
            sys.stdout.flush()
            rc = subprocess.run(cmd, cwd=ROOT).returncode
            rows = None
            if os.path.exists(out):
                with open(out) as f:
                    rows = json.load(f)["rows"]
        if rc == 0 and rows is not None and len(rows) == 1:
            return rows[0]
        if rc == 0 and rows == []:  # the preset skipped itself (embedded, not built, --no-build)
            return None
        row = {"preset": name, "group": group_plan(g, dev).get("label", g),
               "error": f"child process for group {g!r} exited with status {rc}"}
        log(row_line(row, args.verbose))
        return row

    return run_groups(parse_groups(args.groups), one, log, on_row, parse_plus(args.plus))


def parse_plus(text: str) -> tuple:
    """``--plus`` -> the (b+) variants to run alone (default all of :data:`PLUS_VARIANTS`)."""
    chosen = tuple(v.strip() for v in text.split(",") if v.strip()) if text else PLUS_VARIANTS
    for v in chosen:
        if v not in PLUS_VARIANTS:
            raise SystemExit(f"--plus: unknown (b+) variant {v!r}; use {', '.join(PLUS_VARIANTS)}")
    return chosen


def run_groups(groups, one, log, on_row=None, plus_variants=PLUS_VARIANTS) -> list:
    """The rows of ``groups`` in order, ``one(group)`` giving each row (None: the preset is skipped).
    ``b+`` runs each peer piece alone, then the pieces that made (b) faster together, and marks the fastest
    of the (b) family's rows; every row gets ``a_over_this``. ``on_row(rows)`` after each row."""
    rows = []

    def run(g):
        row = one(g)
        if row is not None:
            rows.append(row)
            if on_row is not None:
                on_row(rows)
        return row

    for g in groups:
        if g != "b+":
            if run(g) is None:
                return []
            continue
        # (b+): each peer piece added to (b) alone, then the pieces that made (b) faster together
        b = next((r for r in rows if r["group"] == "(b) peers"), None)
        plus = {v: run(f"b+{v}") for v in plus_variants}
        plus = {v: r for v, r in plus.items() if r is not None}
        if b is None or "ms_step" not in b:
            log("    (b+) best: not formed ((b) has no timed row in this run)")
            continue
        losses = {"logits": b["ms_step"], **{v: r["ms_step"] for v, r in plus.items()
                                            if v in PLUS_LOSSES and "ms_step" in r}}
        loss = min(losses, key=losses.get)
        ew = plus.get("liger-ew", {}).get("ms_step", float("inf")) < b["ms_step"]
        best = "+".join(([loss] if loss != "logits" else []) + (["liger-ew"] if ew else [])) or "logits"
        if best != "logits" and best not in plus:
            row = run(f"b+{best}")
            if row is not None:
                plus[best] = row
        mark_b_plus_best([b, *plus.values()])
    base = next((r for r in rows if r["group"].startswith("(a)") and "tok_s" in r), None)
    for r in rows:
        if base is not None and "tok_s" in r:
            r["a_over_this"] = base["tok_s"] / r["tok_s"]
    return rows


def mark_b_plus_best(rows) -> dict:
    """(b+) is the fastest of the measured (b)-family rows: (b), each peer piece alone, and the pieces that
    helped together (which is not always faster than its parts). Marks that row ``b_plus_best`` (and no
    other) and returns it; None when no row was timed."""
    timed = [r for r in rows if "ms_step" in r]
    for r in rows:
        r.pop("b_plus_best", None)
    if not timed:
        return None
    fastest = min(timed, key=lambda r: r["ms_step"])
    fastest["b_plus_best"] = True
    return fastest


# -------------------------------------------------------------------------------------- output
# (row key, header, format, meaningful on a GPU only, legend line): a table on a CPU leaves the GPU-only
# columns out, any table the columns no timed row fills; the legend explains the columns shown.
COLUMNS = [
    ("preset", "preset", "{}", False, ""),
    ("group", "group", "{}", False, ""),
    ("tok_s", "tokens/s", "{:,.0f}", False, "target tokens of the batch per second of training step (the trainer's "
     "tokens/s)"),
    ("ms_step", "ms/step", "{:.1f}", False, "mean wall time of one timed training step"),
    ("model_TFLOP_step", "TFLOP/step", "{:.2f}", True, "model FLOPs of one step: target forward, drafter forward "
     "and backward, LM head, attention over the visible pairs (trainer/flops.py)"),
    ("mfu", "MFU", "{:.1%}", True, "model FLOPs / time / {peak} TFLOP/s (an H100 / H200 SXM's dense bf16 peak)"),
    ("peak_GiB", "peak GiB", "{:.2f}", True, "most device memory allocated during the timed steps"),
    ("reserved_GiB", "reserved GiB", "{:.2f}", True, "most device memory the caching allocator held (CUDA graph "
     "pools included)"),
    ("first_step_s", "1st step s", "{:.1f}", False, "the first step's seconds, compiling and tuning its kernels "
     "included (on a GPU the row's line above splits it: parallel precompile, compile, tune, the step)"),
    ("mask_ms", "mask ms", "{:.1f}", True, "(b)'s flex BlockMask build per step"),
    ("device_idle_ms", "GPU idle ms", "{:.1f}", True, "step time less the profiled device time per step: the GPU "
     "waiting for the host (--profile)"),
    ("loss_step1", "loss@1", "{:.4f}", False, "the first step's loss: every row starts from the same drafter and "
     "batch, so the losses agree when the backends compute the same thing"),
    ("a_over_this", "a / this", "{:.2f}x", False, "group (a)'s tokens/s over this row's: how many times faster (a) "
     "is (above 1x: (a) is faster)"),
    ("backends", "backends", "{}", False, ""),
]


def _empty(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def table_columns(rows, gpu: bool = True) -> list:
    """The :data:`COLUMNS` entries a table of ``rows`` shows: preset and group, then those that mean something
    on the device (``gpu``) and that some timed row fills."""
    timed = [r for r in rows if "skipped" not in r and "error" not in r]
    return [c for c in COLUMNS if c[0] in ("preset", "group") or
            ((gpu or not c[3]) and any(not _empty(r.get(c[0])) for r in timed))]


def format_table(rows, gpu: bool = True) -> str:
    """The rows as a text table (the columns of :func:`table_columns`), then the notes (skipped and failed
    rows, peers missing, the (b+) row) and a legend line per column that needs one."""
    from trainer.flops import PEAK_BF16_FLOPS

    cols = table_columns(rows, gpu)

    def cell(r, key, fmt):
        v = r.get(key)
        return "-" if _empty(v) else fmt.format(v)

    body = [[c[1] for c in cols]]
    notes = []
    for r in rows:
        if "skipped" in r or "error" in r:
            body.append([r["preset"], r["group"]] + ["-"] * (len(cols) - 2))
            notes.append(f"{r['preset']} {r['group']}: {'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r['error']}")
        else:
            body.append([cell(r, key, fmt) for key, _, fmt, _, _ in cols])
            if r.get("note"):
                notes.append(f"{r['preset']} {r['group']}: {r['note']}")
            if r.get("b_plus_best"):
                notes.append(f"{r['preset']} (b+), the fastest peer stack of this run: {r['group']}")
    widths = [max(len(b[i]) for b in body) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    legend = [f"  {header}: {text.format(peak=f'{PEAK_BF16_FLOPS / 1e12:.0f}')}"
              for _, header, _, _, text in cols if text]
    return "\n".join(lines + notes + ([""] + ["columns:"] + legend if legend else []))


def row_line(row: dict, verbose: bool = False) -> str:
    """What a finished row prints: its full record with ``verbose``, else its speed (or why it has none)."""
    if verbose:
        return f"    {row}"
    if "skipped" in row or "error" in row:
        return f"    {row['group']}: {'skipped: ' + row['skipped'] if 'skipped' in row else 'error: ' + row['error']}"
    nan, first, split = float("nan"), row.get("first_step_s"), row.get("first_step_split")
    parts = ""
    if split is not None:
        parts = ": " + ", ".join(f"{name} {split[name]:.1f}s" for name in ("precompile", "compile", "tune", "step")
                                 if name == "step" or split[name] >= 0.05)
        if row.get("target_build_s") is not None:
            parts += f"; target built in {row['target_build_s']:.1f}s before it"
    return (f"    {row['group']}: {row.get('tok_s', nan):,.0f} tokens/s, {row.get('ms_step', nan):.1f} ms/step"
            + (f" (first step {first:.1f}s{parts})" if first is not None else ""))


def env_info() -> dict:
    import triton

    import dflash_kernels as dk
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "dflash_kernels": dk.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


def main(argv=None):
    args = parse_args(argv)
    PROFILE.update(top=args.profile_top, trace=args.trace, sources=args.profile_sources)
    TIMING.update(shape_pass=args.shape_pass == "on", flex_mask=args.flex_mask, target_graphs=args.target_graphs,
                  step_graphs=args.step_graphs)
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        # (a) on a CPU is the library's Triton kernels through the interpreter; the switch must be
        # set before any Triton kernel is defined, i.e. before dflash_kernels is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import warnings
        # exp() of masked (-inf / large) scores in the interpreter's numpy: expected, and noise in the table
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    sys.path.insert(0, ROOT)
    import dflash_kernels as dk
    import trainer  # noqa: F401 - sets the offline switches before transformers is imported

    dev = torch.device("cuda" if want_cuda else "cpu")
    dtype = torch.bfloat16 if want_cuda else torch.float32
    presets = args.preset or (["embedded", "real"] if want_cuda else ["tiny"])
    log = lambda s: print(s, flush=True)  # noqa: E731
    info = env_info()
    log(f"tok_s | dflash_kernels {dk.__version__} | {info['gpu']} | torch {info['torch']} | triton {info['triton']}")
    if not want_cuda:
        log("No CUDA device: a tiny configuration on the CPU ((a) = the Triton kernels through the interpreter, "
            "(c) = the torch references; no peers). These numbers only show the job runs; they say nothing "
            "about GPU speed and are not recorded.")
    isolate = args.isolate == "on" or (args.isolate == "auto" and want_cuda)
    rows = []

    def partial(preset_rows):  # the rows so far, in --json, should the run be cut short
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**info, "rows": rows + preset_rows, "partial": True}, f, indent=1)

    for name in presets:
        if isolate and not args.child_group:
            rows += run_preset_isolated(name, args, dev, log, partial)
        else:
            rows += run_preset(name, args, dev, dtype, log)
    if args.child_group:  # the parent prints the table and records the rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**info, "rows": rows}, f, indent=1)
        return rows
    log("\n" + format_table(rows, gpu=want_cuda))
    if want_cuda and not args.no_record:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "a") as f:
            for r in rows:
                f.write(json.dumps({**info, "op": "tok_s", **r}) + "\n")
        log(f"appended {len(rows)} rows to {RESULTS}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
