"""The threaded training pipeline: target workers feed hidden states to data-parallel drafter workers.

    python -m trainer.train --target-gpus 0-4 --drafter-gpus 5-7 ...   # 5 target + 3 drafter threads
    python -m trainer.train --target-gpus 0 --drafter-gpus 0 ...       # both sharing one GPU
    python -m trainer.train --target-gpus cpu --drafter-gpus cpu:2 ... # CPU (tests)
    python -m trainer.train --preflight ...                            # check everything, then exit
    torchrun --nnodes 2 --nproc-per-node 1 ... -m trainer.train --target-gpus 0-4 --drafter-gpus 5-7

One process, one thread per worker. Step ``s`` trains on ``D`` micro-batches per process (``D``
drafter replicas), each of ``batch_size`` sequences: replica ``d`` of rank ``r`` (of ``P``) takes
micro-batch ``(s * P + r) * D + d`` (:func:`micro_index`) of the data order of :func:`batch_at`, so
every micro-batch is consumed exactly once and a resumed run sees the same ones.

- **Target workers** (``T``, each holding the frozen target on its device) take the micro-batches
  ``j = s * D + d`` with ``j % T == t`` in order, compute the features and hand them to replica ``d``
  through a bounded queue of pair ``(t, d)`` (so each queue delivers in order and no worker waits on
  another's item). On GPUs the hand-off is a device-to-device copy issued on side streams of both
  devices, so it overlaps the next target forward and the drafters' compute; the drafter's stream
  waits on an event, never the host.
- **Drafter workers** (``D`` replicas, identical at start) compute the loss and backward into one
  flat gradient buffer each, meet at a barrier whose action sums the buffers in replica order on the
  first drafter device, all-reduces across processes (:mod:`trainer.distributed`) and divides by
  ``D * P``; every replica copies the mean back and runs the same clip and AdamW step, so the
  replicas stay bit-identical (tested).
- Kernels are compiled before the workers start (``dflash_kernels.precompile`` for the drafter's
  attention, one warm-up forward of the target on each target device) and the workers run under
  ``dflash_kernels.strict()``.
- Utilisation: each worker's :class:`Meter` times its work (CUDA events on its stream) and the host time
  it is blocked on a queue or the gradient barrier; at the end the run logs each device's busy fraction
  per role, the device and blocked ms per micro-batch of each role and each GPU's peak memory, and writes
  them to ``OUT_DIR/pipeline_stats.json`` (:func:`pipeline_stats`).
- Failures: :mod:`trainer.supervise` (any worker's exception stops all of them and is raised here
  with its traceback; a graceful stop request is honoured at the next step, with a checkpoint).
"""

import copy
import hashlib
import json
import math
import os
import queue
import re
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

import dflash_kernels as dk
from trainer.checkpoint import CHECKPOINT_NAME, read_checkpoint, restore, save_checkpoint
from trainer.common import build_drafter, lr_lambda, optimizer_summary, resolve_paths, step_log_line
from trainer.config import TrainConfig, dump
from trainer.data import batch_at, load_jsonl, steps_per_epoch
from trainer.distributed import Dist, init_distributed
from trainer.flops import step_flops
from trainer.loss import expected_accept_length
from trainer.rundir import DRAFTER_DIR, check_resume_config, open_metrics, prepare_run_dir
from trainer.supervise import (EXIT_FAILED, EXIT_OK, RunLog, StopRequest, Stopped, Supervisor, Watchdog, WorkerFailed,
                               fault_point, get_log, hard_exit, install_signal_handlers)
from trainer.target import Target, load_target, resolve_mask_token_id
from trainer.step import attention_precompile_specs, clip_and_step, drafter_loss, target_features

__all__ = ["parse_devices", "micro_index", "run_pipeline", "preflight", "param_digest", "cli", "PipelineState",
           "Meter", "pipeline_stats", "format_pipeline_stats"]

_POLL_S = 0.1  # how often a blocked worker looks at the stop flag
_STATS = 6  # loss, hits, counted, tokens, stop, model TFLOP; then acc_by_pos[block_size]


def parse_devices(spec: str, name: str = "devices") -> list:
    """``"0-4"``, ``"0,2,5"``, ``"cuda:3"`` -> CUDA devices; ``"cpu"`` / ``"cpu:N"`` -> N CPU workers.

    A device may repeat (``"0,0"``: two workers on GPU 0).
    """
    s = (spec or "").strip().lower()
    m = re.fullmatch(r"cpu(?::(\d+))?", s)
    if m:
        n = int(m.group(1) or 1)
        if n < 1:
            raise ValueError(f"{name}: needs at least one worker, got {spec!r}")
        return [torch.device("cpu")] * n
    out = []
    for part in s.replace("cuda:", "").split(","):
        part = part.strip()
        r = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not r:
            raise ValueError(f"{name}: expected GPU indices like '0-4', '0,2' or 'cpu' / 'cpu:N', got {spec!r}")
        lo, hi = int(r.group(1)), int(r.group(2) if r.group(2) is not None else r.group(1))
        if hi < lo:
            raise ValueError(f"{name}: empty range {part!r} in {spec!r}")
        out += [torch.device("cuda", i) for i in range(lo, hi + 1)]
    return out


def local_part(spec: str, name: str) -> str:
    """``"0-2;4-6"``: one device list per process of this node, picked by torchrun's ``LOCAL_RANK``
    (several processes on one host, e.g. to exercise NCCL on one 8-GPU machine)."""
    if ";" not in spec:
        return spec
    parts = spec.split(";")
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if len(parts) != local_world:
        raise ValueError(f"{name}: {len(parts)} ';'-separated lists for {local_world} processes on this node: {spec!r}")
    return parts[local_rank]


def micro_index(step: int, rank: int, world: int, replica: int, replicas: int) -> int:
    """The global micro-batch index replica ``replica`` of process ``rank`` trains on at ``step``."""
    return (step * world + rank) * replicas + replica


def param_digest(model: torch.nn.Module) -> str:
    """A hash of the parameters' bytes: equal digests mean bit-identical replicas."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Heads:
    """The target's frozen embedding and LM head on a drafter's device (the drafter has none of its own)."""

    def __init__(self, embed: torch.nn.Module, head: torch.nn.Module):
        self._embed, self._head = embed, head

    def embed(self, ids):
        return self._embed(ids)

    def lm_head(self, h):
        return self._head(h.to(self._head.weight.dtype))

    def lm_head_params(self):
        return self._head.weight, getattr(self._head, "bias", None)


def _get(q: queue.Queue, sup: Supervisor):
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if sup.stop.is_set():
                raise Stopped()


def _put(q: queue.Queue, item, sup: Supervisor):
    while True:
        try:
            return q.put(item, timeout=_POLL_S)
        except queue.Full:
            if sup.stop.is_set():
                raise Stopped()


class _Handoff:
    """Target features to a drafter's device: on GPUs a copy on side streams plus a ready event."""

    def __init__(self, src: torch.device, dsts):
        self.src = src
        self.cuda = src.type == "cuda"
        if self.cuda:
            self.src_stream = torch.cuda.Stream(src)
            self.dst_streams = {d: torch.cuda.Stream(d) for d in set(dsts) if d != src}

    def send(self, feats: torch.Tensor, dst: torch.device):
        """Returns ``(tensor on dst, event or None)``; call from the producing thread after the compute."""
        if not self.cuda:
            return feats.to(dst), None
        compute = torch.cuda.current_stream(self.src)
        if dst == self.src:  # same GPU: no copy, the drafter's stream waits for the target's
            ev = torch.cuda.Event()
            ev.record(compute)
            return feats, ev
        # A cross-device copy runs on the source device's current stream and synchronises with the
        # destination's current stream: make both side streams current, so neither compute stream waits.
        self.src_stream.wait_stream(compute)
        dst_stream = self.dst_streams[dst]
        with torch.cuda.stream(self.src_stream), torch.cuda.stream(dst_stream):
            out = feats.to(dst, non_blocking=True)
        feats.record_stream(self.src_stream)
        ev = torch.cuda.Event()
        ev.record(dst_stream)
        return out, ev


def _receive(feats: torch.Tensor, ev) -> torch.Tensor:
    if ev is not None:
        s = torch.cuda.current_stream(feats.device)
        s.wait_event(ev)
        feats.record_stream(s)  # its memory belongs to another stream's pool: keep it until we are done
    return feats


class _Shared:
    """State the drafter replicas exchange at the gradient barrier."""

    def __init__(self, replicas: int):
        self.flats = [None] * replicas
        self.reduced = None


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


class Meter:
    """One worker's timings: the device time of its work (CUDA events on the worker's stream, from the
    first kernel of a span to its last, gaps included; host time on a CPU) and the host time it spent
    blocked (on a queue or the gradient barrier). Spans are folded into totals as they age, so a long run
    keeps a bounded number of events."""

    _KEEP = 16  # spans kept unresolved; older ones have finished and cost nothing to read

    def __init__(self, role: str, index: int, dev: torch.device):
        self.role, self.index, self.dev = role, index, dev
        self.cuda = dev.type == "cuda"
        self.busy_ms = 0.0
        self.wait_s = 0.0
        self.units = 0
        self._open = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def span(self, start, end) -> None:
        """Count the work between two marks of this worker's (``end`` taken after ``start``)."""
        self._open.append((start, end))
        while len(self._open) > self._KEEP:
            self._fold(*self._open.pop(0))

    def _fold(self, start, end):
        if self.cuda:
            end.synchronize()
            self.busy_ms += start.elapsed_time(end)
        else:
            self.busy_ms += (end - start) * 1e3

    def done(self) -> None:
        """One unit of work (a micro-batch) finished."""
        self.units += 1

    def waited(self, t0: float) -> None:
        self.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        for pair in self._open:
            self._fold(*pair)
        self._open = []


def pipeline_stats(meters, wall_s: float, devices) -> dict:
    """The run's utilisation from its workers' meters: per device the busy fraction of each role (device time
    over the training phase's wall time; roles sharing a GPU overlap, so their sum can pass 1), per role the
    device ms and blocked ms per micro-batch, and each device's peak memory."""
    out = {"wall_s": wall_s, "devices": {}, "roles": {}}
    for m in meters:
        m.close()
    for dev in devices:
        mine = [m for m in meters if m.dev == dev]
        row = {f"{role}_busy": sum(m.busy_ms for m in mine if m.role == role) / 1e3 / max(wall_s, 1e-9)
               for role in sorted({m.role for m in mine})}
        if dev.type == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated(dev) / 2**30
        out["devices"][str(dev)] = row
    for role in sorted({m.role for m in meters}):
        mine = [m for m in meters if m.role == role]
        units = max(sum(m.units for m in mine), 1)
        out["roles"][role] = {"workers": len(mine), "units": units,
                              "device_ms_per_unit": sum(m.busy_ms for m in mine) / units,
                              "blocked_ms_per_unit": sum(m.wait_s for m in mine) * 1e3 / units}
    return out


def format_pipeline_stats(st: dict) -> str:
    devs = "; ".join(f"{d} " + ", ".join(f"{k[:-5]} busy {v:.0%}" for k, v in row.items() if k.endswith("_busy"))
                     + (f", peak {row['peak_GiB']:.1f} GiB" if "peak_GiB" in row else "")
                     for d, row in st["devices"].items())
    roles = "; ".join(f"{r}: {v['device_ms_per_unit']:.1f} ms device + {v['blocked_ms_per_unit']:.1f} ms blocked "
                      f"per micro-batch ({v['workers']} workers, {v['units']} micro-batches)"
                      for r, v in st["roles"].items())
    return f"pipeline: {st['wall_s']:.1f} s of training; {devs}; {roles}"


@dataclass
class PipelineState:
    """A pipeline run's state: what :func:`_setup` built before the workers start, and how far they got."""

    cfg: TrainConfig
    log: RunLog
    tdevs: list = field(default_factory=list)  # one device per target worker (may repeat)
    ddevs: list = field(default_factory=list)  # one device per drafter replica (may repeat)
    kind: str = "cpu"  # "cuda" or "cpu": every worker is of one kind
    dtype: torch.dtype = torch.float32  # compute dtype
    dist: Dist = None  # the process group (a single process: Dist with enabled False)
    mask_id: int = 0  # the drafter's mask token
    pad_id: int = 0
    base: Target = None  # the target as loaded (its sizes and layer ids)
    targets: dict = field(default_factory=dict)  # target device -> Target (workers on one device share it)
    heads: dict = field(default_factory=dict)  # drafter device -> Heads (the target's embedding and LM head)
    ds: object = None  # trainer.data.Dataset
    D: int = 0  # drafter replicas in this process
    T: int = 0  # target workers in this process
    world: int = 1  # micro-batches per step over all processes (D * processes)
    gpus: int = 1  # distinct devices over all processes (the MFU's peak is gpus x one GPU's)
    total: int = 0  # the run's steps
    params_n: int = 0  # drafter parameters (the flat gradient buffer's length before the stats)
    replicas: list = field(default_factory=list)  # the drafter replicas, one per ddevs entry
    opts: list = field(default_factory=list)  # their AdamW optimizers
    scheds: list = field(default_factory=list)  # their LR schedulers
    flats: list = field(default_factory=list)  # their flat gradient + stats buffers
    ckpt_path: str = ""  # OUT_DIR/checkpoint.pt
    resume_from: str = None  # the checkpoint resumed from, or None for a new run
    start: int = 0  # the first step this run trains (the checkpoint's step on resume)
    step: int = 0  # steps completed so far (drafter replica 0 advances it)
    stop_after: int = None  # leave after this step, with a checkpoint (tests)
    record: list = None  # per micro-batch records (tests), see run_pipeline
    history: list = field(default_factory=list)  # metrics.jsonl records (main rank)
    metrics: object = None  # metrics.jsonl open for appending (main rank)
    reduce_stream: object = None  # the gradient reduction's CUDA stream
    stats: dict = None  # pipeline_stats of the training phase


def _setup(cfg: TrainConfig, resume: bool, log: RunLog, dist: Dist = None, overwrite: bool = False,
           allow_config_change: bool = False, preflight: bool = False) -> PipelineState:
    """Devices, process group, run folder, target copies, data, drafter replicas, kernels.

    ``preflight``: leave the run folder as it is (no checkpoint check, nothing moved or deleted).
    """
    R = PipelineState(cfg=cfg, log=log)
    saved = None
    with log.stage("config"):
        cfg = R.cfg = resolve_paths(cfg, log=log)
        tspec = cfg.target_gpus or cfg.drafter_gpus or ("0" if torch.cuda.is_available() else "cpu")
        dspec = cfg.drafter_gpus or tspec
        per_rank = ";" in tspec or ";" in dspec
        tspec, dspec = local_part(tspec, "target_gpus"), local_part(dspec, "drafter_gpus")
        R.tdevs, R.ddevs = parse_devices(tspec, "target_gpus"), parse_devices(dspec, "drafter_gpus")
        if cfg.queue_depth < 1:
            raise ValueError(f"queue_depth: must be >= 1, got {cfg.queue_depth}")
        kinds = {d.type for d in R.tdevs + R.ddevs}
        if len(kinds) > 1:
            raise ValueError(f"target_gpus / drafter_gpus: mixing CPU and GPU workers ({tspec!r}, {dspec!r})")
        R.kind = kinds.pop()
        auto = torch.bfloat16 if R.kind == "cuda" else torch.float32
        R.dtype = auto if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        os.makedirs(cfg.out_dir, exist_ok=True)
        log(f"config: {json.dumps(cfg.to_dict(), sort_keys=True)}")
        log(f"pipeline: {len(R.tdevs)} target workers on {[str(d) for d in R.tdevs]}, {len(R.ddevs)} drafter "
            f"replicas on {[str(d) for d in R.ddevs]}, queue depth {cfg.queue_depth}, dtype {R.dtype}")
    with log.stage("device init"):
        if R.kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("target_gpus / drafter_gpus: CUDA devices requested but torch.cuda.is_available() "
                                   "is False")
            n = torch.cuda.device_count()
            bad = sorted({d.index for d in R.tdevs + R.ddevs if d.index >= n})
            if bad:
                raise ValueError(f"target_gpus / drafter_gpus: GPU {bad} requested, {n} visible")
            for d in sorted(set(R.tdevs + R.ddevs), key=str):
                free, total = torch.cuda.mem_get_info(d)
                log(f"device {d}: {torch.cuda.get_device_name(d)}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
        # Collectives wait for the slowest process, set-up included (a model load can take minutes).
        R.dist = dist or init_distributed(R.ddevs[0], timeout_s=max(cfg.watchdog_s, cfg.watchdog_setup_s, 60.0),
                                          log=log, per_rank_devices=per_rank)
        R.dist.check_same("config", dump(cfg))
    if not preflight:
        with log.stage("run folder"):
            R.resume_from = prepare_run_dir(cfg.out_dir, resume=resume, overwrite=overwrite, log=log,
                                            modify=R.dist.is_main)
            if R.resume_from is not None:
                saved = read_checkpoint(R.resume_from)
                check_resume_config(saved["config"], cfg.to_dict(), allow_change=allow_config_change,
                                    path=R.resume_from, log=log)
    with log.stage("model load"):
        base = load_target(cfg.target, cfg.target_layer_ids, cfg.num_target_layers, device="cpu", dtype=R.dtype)
        tok = base.tokenizer
        R.mask_id = resolve_mask_token_id(tok, base.vocab_size, cfg.mask_token_id)
        R.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        log(f"target: {cfg.target}: {base.num_layers} layers, hidden {base.hidden_size}, vocab {base.vocab_size}, "
            f"layers {base.layer_ids}, mask token {R.mask_id}")
        # Heads for drafter devices without a target copy, then one target per distinct target device
        # (workers on the same device share it: inference only, no state).
        pair = torch.nn.ModuleList([base.model.get_input_embeddings(), base.model.get_output_embeddings()])
        tset = list(dict.fromkeys(R.tdevs))
        R.heads = {}
        for d in dict.fromkeys(R.ddevs):
            if d not in tset:
                e, h = copy.deepcopy(pair).to(d)
                R.heads[d] = Heads(e, h)
        R.targets = {}
        for i, d in enumerate(tset):
            m = base.model if i == len(tset) - 1 else copy.deepcopy(base.model)
            R.targets[d] = Target(m.to(d), tok, base.layer_ids)
            if cfg.target_graphs_on(d):
                R.targets[d].use_cuda_graphs()
            log(f"target on {d}: loaded")
        for d in dict.fromkeys(R.ddevs):
            if d in R.targets:
                m = R.targets[d].model
                R.heads[d] = Heads(m.get_input_embeddings(), m.get_output_embeddings())
        R.base = base
    with log.stage("data"):
        pack = {"pack": True} if getattr(cfg, "pack", False) else {}
        R.ds = load_jsonl(cfg.data, tok, cfg.max_len, cfg.block_size, vocab_size=base.vocab_size, log=log, **pack)
        R.D, R.T = len(R.ddevs), len(R.tdevs)
        R.world = R.D * R.dist.world
        R.gpus = len(set(R.tdevs + R.ddevs)) * R.dist.world  # the MFU's peak: every process lays out alike
        R.total = cfg.steps or cfg.epochs * steps_per_epoch(len(R.ds), cfg.batch_size * R.world)
        log(f"data: {len(R.ds)} sequences, {R.world} micro-batches of {cfg.batch_size} per step, {R.total} steps")
    with log.stage("drafter"):
        drafter = build_drafter(cfg, base, R.mask_id)
        R.params_n = sum(p.numel() for p in drafter.parameters())
        R.replicas, R.opts, R.scheds, R.flats = [], [], [], []
        for d in R.ddevs:
            m = copy.deepcopy(drafter).to(d)
            m.train()
            ps = list(m.parameters())
            if any(p.dtype != torch.float32 for p in ps):
                raise TypeError("drafter: parameters must be float32 (autocast supplies the compute dtype)")
            flat = torch.zeros(R.params_n + _STATS + cfg.block_size, device=d, dtype=torch.float32)
            off = 0
            for p in ps:  # gradients live in the flat buffer: backward accumulates into these views
                p.grad = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
            opt = torch.optim.AdamW(ps, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                    fused=d.type == "cuda")
            R.replicas.append(m)
            R.opts.append(opt)
            R.scheds.append(torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(R.total, cfg.warmup_ratio,
                                                                             cfg.min_lr_ratio)))
            R.flats.append(flat)
        R.ckpt_path = os.path.join(cfg.out_dir, CHECKPOINT_NAME)
        R.start = 0
        if saved is not None:  # every replica gets the saved states (each its own copy of AdamW's)
            R.start = restore(saved, model=R.replicas, optimizer=R.opts, scheduler=R.scheds, path=R.resume_from)
            was = saved.get("extra", {}).get("micro_batches_per_step")
            saved = None
            if was is not None and was != R.world:
                log(f"resume: WARNING: the checkpoint was written with {was} micro-batches per step, this run has "
                    f"{R.world}; the data order differs from an uninterrupted run")
            log(f"resume: from step {R.start} of {R.resume_from}; optimizer: {optimizer_summary(R.scheds[0])}")
        R.step = R.start
        if R.dist.enabled:  # every process starts from rank 0's weights, whatever its RNG did
            buf = torch.cat([p.detach().reshape(-1) for p in R.replicas[0].parameters()]).to(R.dist.device)
            R.dist.broadcast_(buf)
            for m in R.replicas:  # a copy each: vector_to_parameters makes the parameters views of its input
                torch.nn.utils.vector_to_parameters(buf.to(next(m.parameters()).device, copy=True), m.parameters())
        log(f"drafter: {R.params_n / 1e6:.2f}M trainable parameters, {cfg.num_layers} layers, {R.D} replicas "
            f"x {R.dist.world} processes")
    with log.stage("precompile"):
        _precompile(R)
    return R


def _precompile(R: PipelineState):
    cfg, log = R.cfg, R.log
    specs = attention_precompile_specs(cfg, R.replicas[0].config, R.dtype)
    models = {}
    for d in dict.fromkeys(list(R.ddevs) + list(R.targets)):
        if torch.device(d).type == "cuda":
            models.setdefault(torch.cuda.get_device_name(d), d)
    for d in models.values():  # Triton's compile cache is per GPU model: one parallel pass each
        rep = dk.precompile_recorded(d, verbose=False)
        log(f"precompile: {rep['compiled']} recorded kernels compiled by {rep['workers']} processes on "
            f"{torch.cuda.get_device_name(d)} in {rep['seconds']:.1f}s")
    for d in dict.fromkeys(R.ddevs):
        rep = dk.precompile(specs, devices=[d])
        log(f"precompile: drafter attention on {d}: {len(rep['keys'])} kernels in {rep['seconds']:.1f}s")
        log.progress(f"precompile {d}")
    # Then the exact calls of training on one real batch: the target's own kernels (a hybrid's Gated
    # DeltaNet and conv; packed rows take other variants) and the drafter's step as the workers run it.
    batch = batch_at(R.ds, micro_index(R.start, R.dist.rank, R.dist.world, 0, R.D), cfg.batch_size, cfg.max_len,
                     cfg.num_anchors, cfg.block_size, cfg.seed, R.pad_id)
    feats = None
    for d, target in R.targets.items():
        t0, before = time.perf_counter(), len(dk.cache_info())
        feats = target_features(target, batch, d)
        _sync(d)
        log(f"precompile: target warm-up on {d}: {len(dk.cache_info()) - before} new kernels in "
            f"{time.perf_counter() - t0:.1f}s")
        log.progress(f"warm-up target {d}")
    for i, d in enumerate(R.ddevs):
        if d in R.ddevs[:i]:
            continue
        t0, before = time.perf_counter(), len(dk.cache_info())
        loss, _ = drafter_loss(batch, feats.to(d), R.heads[d], R.replicas[i], cfg, d, R.dtype)
        loss.backward()
        R.flats[i].zero_()  # the gradients of the warm-up step go nowhere
        _sync(d)
        log(f"precompile: drafter warm-up step on {d}: {len(dk.cache_info()) - before} new kernels in "
            f"{time.perf_counter() - t0:.1f}s")
        log.progress(f"warm-up drafter {d}")


def _target_worker(sup: Supervisor, R: PipelineState, t: int, queues, meter: Meter):
    cfg, dev = R.cfg, R.tdevs[t]
    target = R.targets[dev]
    handoff = _Handoff(dev, R.ddevs)
    ctx = [torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev))] if dev.type == "cuda" else []
    for c in ctx:
        c.__enter__()
    try:
        j = R.start * R.D + (t - R.start * R.D) % R.T
        n = 0
        while True:
            step, d = divmod(j, R.D)
            if step >= R.total:
                break
            k = micro_index(step, R.dist.rank, R.dist.world, d, R.D)
            batch = batch_at(R.ds, k, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed,
                             R.pad_id)
            fault_point("target", t, n, R.log)
            if dev.type == "cuda":
                batch = {key: v.pin_memory() if torch.is_tensor(v) else v for key, v in batch.items()}
            m0 = meter.mark()
            feats = target_features(target, batch, dev)
            meter.span(m0, meter.mark())
            out, ev = handoff.send(feats, R.ddevs[d])
            del feats
            w0 = time.perf_counter()
            _put(queues[t][d], (step, k, batch, out, ev), sup)
            meter.waited(w0)
            meter.done()
            R.log.progress(f"target{t} batch {n}")
            j += R.T
            n += 1
    finally:
        for c in reversed(ctx):
            c.__exit__(None, None, None)


def _reduce(R: PipelineState, shared: _Shared, stop: StopRequest):
    """The barrier's action (runs once per step, in one replica's thread): mean of all gradients."""
    dev = R.dist.device if R.dist.enabled else R.ddevs[0]
    ctx = [torch.cuda.device(dev), torch.cuda.stream(R.reduce_stream)] if dev.type == "cuda" else []
    for c in ctx:
        c.__enter__()
    try:
        acc = shared.flats[0].to(dev, copy=True)
        for f in shared.flats[1:]:  # fixed order: the sum has the same bits every time
            acc += f.to(dev)
        acc[R.params_n + 4] = float(bool(stop))  # any process asking to stop stops all after this step
        R.dist.all_reduce_sum_(acc)
        acc /= R.world
        _sync(dev)
        shared.reduced = acc
    finally:
        for c in reversed(ctx):
            c.__exit__(None, None, None)


def _drafter_worker(sup: Supervisor, R: PipelineState, d: int, queues, barrier: threading.Barrier,
                    shared: _Shared, meter: Meter):
    cfg, dev, log = R.cfg, R.ddevs[d], R.log
    drafter, opt, sched, flat, heads = R.replicas[d], R.opts[d], R.scheds[d], R.flats[d], R.heads[dev]
    params = list(drafter.parameters())
    n = R.params_n
    main = d == 0 and R.dist.is_main
    ctx = [torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev))] if dev.type == "cuda" else []
    for c in ctx:
        c.__enter__()
    try:
        t_last = time.perf_counter()
        window = []
        for step in range(R.start, R.total):
            t = (step * R.D + d) % R.T
            w0 = time.perf_counter()
            got_step, k, batch, feats, ev = _get(queues[t][d], sup)
            meter.waited(w0)
            assert got_step == step, (got_step, step, d)
            fault_point("drafter", d, step, log)
            feats = _receive(feats, ev)
            m0 = meter.mark()
            loss, st = drafter_loss(batch, feats, heads, drafter, cfg, dev, R.dtype)
            loss.backward()
            del feats
            tail = flat[n:]
            tail[0] = loss.detach()
            tail[1] = st["acc"] * st["tokens"]
            tail[2] = st["tokens"]
            tail[3] = float(batch["lengths"].sum())
            tail[4] = 0.0
            tail[5] = step_flops(R.base.model, drafter, batch, R.base.layers_run)["total"] / 1e12  # host batch
            tail[_STATS:] = st["acc_by_pos"].to(dev)
            if R.record is not None:
                R.record.append({"step": step, "replica": d, "rank": R.dist.rank, "micro": k,
                                 "ids_sum": int(batch["input_ids"].sum())})
            meter.span(m0, meter.mark())
            _sync(dev)
            shared.flats[d] = flat
            w0 = time.perf_counter()
            barrier.wait()
            meter.waited(w0)
            red = shared.reduced
            m0 = meter.mark()
            if red.device != dev:
                flat.copy_(red, non_blocking=True)
            else:
                flat.copy_(red)
            gnorm = clip_and_step(opt, params, cfg.grad_clip)
            sched.step()
            opt.zero_grad(set_to_none=False)  # keep the views into the flat buffer
            meter.span(m0, meter.mark())
            meter.done()
            stats = red[n:].tolist()
            stop_now = stats[4] > 0
            cur = step + 1
            if d == 0:
                log.progress(f"step {cur}")
                R.step = cur
            if not main:
                if stop_now or cur == R.stop_after:
                    break
                continue
            _sync(dev)  # this stream only: a target sharing the GPU keeps running
            now = time.perf_counter()
            rec = {"step": cur, "loss": stats[0], "acc": stats[1] / max(stats[2], 1e-12), "lr": sched.get_last_lr()[0],
                   "grad_norm": float(gnorm), "tokens": int(round(stats[3] * R.world)), "epoch": batch["epoch"],
                   "tau_est": expected_accept_length(torch.tensor(stats[_STATS:])), "ms": (now - t_last) * 1e3,
                   "tflop": stats[5] * R.world}
            t_last = now
            R.history.append(rec)
            window.append(rec)
            R.metrics.write(json.dumps(rec) + "\n")
            R.metrics.flush()
            if cur % cfg.log_interval == 0 or cur == R.total:
                log(step_log_line(window, cur, R.total, dev, gpus=R.gpus))
                window = []
            if cur % cfg.save_interval == 0 or cur == R.total or stop_now or cur == R.stop_after:
                _save(R, cur)
            if stop_now or cur == R.stop_after:
                break
        if d == 0:
            sup.stop.set()  # every replica is past the last barrier: release the target workers
    finally:
        for c in reversed(ctx):
            c.__exit__(None, None, None)


def _save(R: PipelineState, step: int):
    t0 = time.perf_counter()
    save_checkpoint(R.ckpt_path, model=R.replicas[0], optimizer=R.opts[0], scheduler=R.scheds[0], step=step,
                    config=R.cfg.to_dict(), extra={"micro_batches_per_step": R.world})
    R.replicas[0].save_pretrained(os.path.join(R.cfg.out_dir, DRAFTER_DIR))
    R.log(f"checkpoint: step {step} -> {R.ckpt_path} ({time.perf_counter() - t0:.1f}s)")


def run_pipeline(cfg: TrainConfig, resume: bool = False, log: RunLog = None, stop: StopRequest = None,
                 stop_after: int = None, record: list = None, dist: Dist = None, overwrite: bool = False,
                 allow_config_change: bool = False, stats: dict = None) -> list:
    """Train with the threaded pipeline; returns the per-step records (``metrics.jsonl``, rank 0).

    Args:
        resume: continue from ``OUT_DIR/checkpoint.pt`` (its config must match, see :mod:`trainer.rundir`).
        overwrite: start a new run in an ``OUT_DIR`` that holds an earlier one (else refused).
        allow_config_change: resume although the config differs from the checkpoint's.
        stop: a graceful stop request (signals set it); honoured after the current step, with a checkpoint.
        stop_after: leave after that global step, with a checkpoint (tests).
        record: if a list, each replica appends ``{step, replica, rank, micro, ids_sum}`` per micro-batch.
        stats: if a dict, filled with :func:`pipeline_stats` of the run (also logged, and written to
            ``OUT_DIR/pipeline_stats.json`` by the main rank).
    Raises:
        trainer.supervise.WorkerFailed: a worker raised (its traceback is in the log and in ``.tb``).
    """
    if cfg.compute_weights == "copies":  # "auto" runs autocast here (TrainConfig.compute_weights_for)
        raise ValueError(f"compute_weights: {cfg.compute_weights!r} is supported by the single-process loop only "
                         f"so far; the pipeline runs with 'autocast'")
    log = log or get_log()
    stop = stop if stop is not None else StopRequest()
    R = _setup(cfg, resume, log, dist, overwrite=overwrite, allow_config_change=allow_config_change)
    cfg = R.cfg
    # A signal during set-up: nothing trained, nothing to save. Several processes instead agree on the
    # stop at the first gradient reduction (each may have got the signal at a different point).
    if stop and not R.dist.enabled:
        log(f"stopped by {stop.reason} before training started")
        return []
    R.stop_after, R.record, R.history = stop_after, record, []
    R.reduce_stream = torch.cuda.Stream(R.dist.device if R.dist.enabled else R.ddevs[0]) if R.kind == "cuda" else None
    if R.dist.is_main:  # the lines up to the checkpoint are kept: one trajectory
        R.history, R.metrics = open_metrics(cfg.out_dir, R.start if R.resume_from is not None else None, log)
    sup = Supervisor(log, stop_grace_s=cfg.stop_grace_s)
    shared = _Shared(R.D)
    barrier = threading.Barrier(R.D, action=lambda: _reduce(R, shared, stop))
    sup.add_abort(barrier.abort)
    queues = [[queue.Queue(maxsize=cfg.queue_depth) for _ in range(R.D)] for _ in range(R.T)]
    meters = [Meter("target", t, dev) for t, dev in enumerate(R.tdevs)] + [
        Meter("drafter", d, dev) for d, dev in enumerate(R.ddevs)]
    t0 = time.perf_counter()
    try:
        with dk.strict():
            log(f"training: steps {R.start}..{R.total} under dflash_kernels.strict()")
            log.progress("training start")
            log.phase = "train"
            for t in range(R.T):
                sup.spawn(f"target{t}", _target_worker, R, t, queues, meters[t])
            for d in range(R.D):
                sup.spawn(f"drafter{d}", _drafter_worker, R, d, queues, barrier, shared, meters[R.T + d])
            sup.wait()
    finally:
        log.phase = "setup"
        if R.dist.is_main:
            R.metrics.close()
    wall = time.perf_counter() - t0
    R.stats = pipeline_stats(meters, wall, sorted({*R.tdevs, *R.ddevs}, key=str))
    log(format_pipeline_stats(R.stats))
    if R.dist.is_main:
        with open(os.path.join(cfg.out_dir, "pipeline_stats.json"), "w") as f:
            json.dump({**R.stats, "rank": R.dist.rank, "steps": R.step - R.start}, f, indent=1)
    if stats is not None:
        stats.update(R.stats)
    step = R.step
    # Equal values in separate storage: replicas that shared parameters would compare equal trivially
    # while each step updated them once per replica.
    storages = [{(p.device, p.untyped_storage().data_ptr()) for p in m.parameters()} for m in R.replicas]
    same = sum(map(len, storages)) == len(set().union(*storages)) and all(
        torch.equal(p0, p.to(p0.device)) for m in R.replicas[1:]
        for p0, p in zip(R.replicas[0].parameters(), m.parameters()))
    log(f"replicas: {R.D} in this process, identical: {same}; parameter digest {param_digest(R.replicas[0])} "
        f"(rank {R.dist.rank})")
    if not same:
        raise RuntimeError("drafter replicas diverged or share parameter storage; the gradient reduction is broken")
    if stop and step < R.total:
        log(f"stopped by {stop.reason} after step {step} of {R.total}; checkpoint at {R.ckpt_path}; "
            f"continue with --resume")
    else:
        log(f"done: {step} steps in {time.perf_counter() - t0:.1f}s; drafter at {os.path.join(cfg.out_dir, 'drafter')}")
    R.dist.close()
    return R.history


def preflight(cfg: TrainConfig, log: RunLog = None) -> bool:
    """Check devices, distributed set-up, model, data and kernels; print what was found; True if all passed.

    Runs the real set-up (the same stages as training) and then one drafter step's forward and backward
    on the first micro-batch under ``dflash_kernels.strict()``, so a kernel the run would compile
    mid-training fails here.
    """
    log = log or get_log()
    found = []
    try:
        R = _setup(cfg, False, log, preflight=True)
    except Exception as e:  # noqa: BLE001 - preflight reports, it does not crash
        log(f"preflight: FAILED during set-up: {type(e).__name__}: {e}")
        return False
    found.append(f"devices: targets {[str(d) for d in R.tdevs]}, drafters {[str(d) for d in R.ddevs]}")
    if R.kind == "cuda":
        for d in sorted(set(R.tdevs + R.ddevs), key=str):
            p = torch.cuda.get_device_properties(d)
            free, total = torch.cuda.mem_get_info(d)
            found.append(f"  {d}: {p.name}, sm {p.major}.{p.minor}, {free / 2**30:.1f}/{total / 2**30:.1f} GiB free")
        for a in sorted(set(R.tdevs), key=str):
            for b in sorted(set(R.ddevs), key=str):
                if a != b:
                    found.append(f"  peer access {a} -> {b}: {torch.cuda.can_device_access_peer(a.index, b.index)}")
    found.append(f"distributed: rank {R.dist.rank} of {R.dist.world} ({R.dist.backend or 'single process'})")
    b = R.base
    found.append(f"model: {R.cfg.target}: {b.num_layers} layers, hidden {b.hidden_size}, vocab {b.vocab_size}, "
                 f"feature layers {b.layer_ids}, mask token {R.mask_id}, dtype {R.dtype}")
    found.append(f"data: {R.ds.stats.report(R.cfg.data)}; {R.total} steps of {R.world} x {R.cfg.batch_size} sequences")
    found.append(f"drafter: {R.params_n / 1e6:.2f}M parameters")
    ckpt = os.path.join(R.cfg.out_dir, CHECKPOINT_NAME)
    found.append(f"out_dir: {R.cfg.out_dir}: " + ("holds a checkpoint: a run there needs --resume or --overwrite"
                                                 if os.path.exists(ckpt) else "no checkpoint (a new run)"))
    found.append(f"kernels: backends {dk.backends()}; {len(dk.cache_info())} compiled")
    ok = True
    try:
        with log.stage("trial step"), dk.strict():
            d = R.ddevs[0]
            batch = batch_at(R.ds, 0, R.cfg.batch_size, R.cfg.max_len, R.cfg.num_anchors, R.cfg.block_size,
                             R.cfg.seed, R.pad_id)
            feats = target_features(R.targets[R.tdevs[0]], batch, R.tdevs[0]).to(d)
            loss, st = drafter_loss(batch, feats, R.heads[d], R.replicas[0], R.cfg, d, R.dtype)
            loss.backward()
            R.opts[0].zero_grad(set_to_none=False)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"trial step: loss {loss.item()}")
            found.append(f"trial step: loss {loss.item():.4f}, {st['tokens']} counted positions, no compile under "
                         f"strict mode")
    except Exception as e:  # noqa: BLE001
        found.append(f"trial step: FAILED: {type(e).__name__}: {e}")
        ok = False
    R.dist.close()
    log("preflight:\n  " + "\n  ".join(found) + f"\npreflight: {'OK' if ok else 'FAILED'}")
    return ok


def cli(cfg: TrainConfig, resume: bool = False, preflight_only: bool = False, log_file: str = None,
        overwrite: bool = False, allow_config_change: bool = False) -> int:
    """The supervised entry point (``python -m trainer.train --target-gpus ...``); exits the process.

    Exit status: 0 finished (or stopped by SIGTERM / SIGINT after writing a checkpoint, or preflight
    passed), 1 an exception anywhere (traceback in the log) or a failed preflight, 3 the watchdog.
    """
    log = get_log()
    if log.file is None:  # called in-process rather than as the entry point: open the log now
        from trainer.supervise import log_path_for
        log.attach(log_file or log_path_for(["--out-dir", cfg.out_dir]))
    stop = StopRequest()
    install_signal_handlers(log, stop)
    watchdog = Watchdog(log, cfg.watchdog_s, cfg.watchdog_setup_s).start()
    try:
        if preflight_only:
            ok = preflight(cfg, log)
            hard_exit(EXIT_OK if ok else EXIT_FAILED, log)
        run_pipeline(cfg, resume=resume, log=log, stop=stop, overwrite=overwrite,
                     allow_config_change=allow_config_change)
    except WorkerFailed as e:
        hard_exit(EXIT_FAILED, log, f"failed: {e} (traceback above)")
    except BaseException as e:  # noqa: BLE001 - set-up failures end here; the log must say why
        if not getattr(e, "_dflash_logged", False):
            log(f"failed: {type(e).__name__}: {e}\n{traceback.format_exc().rstrip()}")
        hard_exit(EXIT_FAILED, log, f"failed: {type(e).__name__}: {e}")
    watchdog.stop()
    hard_exit(EXIT_OK, log)
