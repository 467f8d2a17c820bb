"""The trainer's one configuration: a typed dataclass with a comment per field, and named presets.

Values follow DFlash as published and as SpecForge trains it (block 16, 512 anchors, gamma 7,
5 drafter layers, k = 5 target layers from 1 to L-3, AdamW 6e-4 with 4% warm-up and cosine decay).
"""

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

__all__ = ["TrainConfig", "PRESETS", "preset", "default_target_layer_ids", "add_cli_args", "from_cli", "check_betas"]

DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash_trainer")


LOSS_PATHS = ("fused", "logits", "chunked")  # TrainConfig.loss
COMPUTE_WEIGHTS = ("auto", "autocast", "copies")  # TrainConfig.compute_weights
TARGET_GRAPHS = ("auto", "on", "off")  # TrainConfig.target_cuda_graphs and step_cuda_graphs


def check_betas(betas, name: str = "betas") -> tuple:
    """``betas`` as a tuple of two numbers, each in [0, 1) as torch's AdamW requires (beta1 = 1 divides by a
    zero bias correction, beta2 = 1 makes every parameter NaN); ValueError naming ``name`` and the value else."""
    try:
        values = tuple(betas)
    except TypeError:
        raise ValueError(f"{name}: expected two numbers, got {betas!r}") from None
    if len(values) != 2:
        raise ValueError(f"{name}: expected two numbers, got {values!r}")
    for i, b in enumerate(values):
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0 <= b < 1:
            raise ValueError(f"{name}[{i}]: expected a number in [0, 1), got {b!r}")
    return values


def _graphs_on(setting: str, auto: bool) -> bool:
    """A CUDA-graph option's answer: "on" True, "off" False, "auto" whatever ``auto`` says."""
    return auto if setting == "auto" else setting == "on"


@dataclass
class TrainConfig:
    # --- target and data ---
    target: str = ""  # local HF causal-LM folder; "" = the embedded default (python -m trainer.build_default)
    data: str = ""  # JSONL: chat conversations ("messages") or pre-tokenized ("input_ids", "loss_mask"); "" = default
    eval_prompts: str = ""  # JSONL of held-out prompts for trainer.eval; "" = the embedded default's
    out_dir: str = "runs/dflash"  # checkpoints, the drafter folder and metrics.jsonl go here
    max_len: int = 3072  # tokens per sequence; longer records are truncated, shorter ones padded
    pack: bool = False  # concatenate records into rows of max_len (per-document ids; see trainer/data.py)
    # --- DFlash ---
    block_size: int = 16  # draft block: position 0 the anchor token, 1..block_size-1 mask tokens
    num_anchors: int = 512  # anchors (draft blocks) per sequence, capped by the valid positions
    gamma: float = 7.0  # loss weight of block position j is exp(-(j - 1) / gamma)
    mask_token_id: int | None = None  # None: tokenizer's mask token, else its pad token, else vocab - 1
    num_target_layers: int = 5  # k target hidden states concatenated into the drafter's features
    target_layer_ids: list[int] | None = None  # decoder-layer indices (0-based); None = k spaced from 1 to L-3
    # --- drafter architecture (hidden size, vocab come from the target) ---
    num_layers: int = 5  # drafter decoder layers
    num_sliding_layers: int = 2  # the first this many layers see only `sliding_window` context tokens
    sliding_window: int = 2048  # context window of the sliding layers
    num_heads: int = 32  # query heads; head_dim * num_heads need not equal the hidden size
    num_kv_heads: int = 8  # key/value heads (GQA)
    head_dim: int = 128  # 64, 128 or 256 (the attention kernel's head dims)
    intermediate_size: int | None = None  # SwiGLU width; None = the target's
    rope_theta: float = 1_000_000.0  # RoPE base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    # --- optimisation ---
    batch_size: int = 1  # sequences per step
    steps: int = 0  # optimiser steps; 0 = epochs * steps per epoch
    epochs: int = 6  # passes over the data when steps == 0
    lr: float = 6e-4  # peak learning rate (AdamW)
    warmup_ratio: float = 0.04  # linear warm-up over this fraction of the steps, then cosine to min_lr_ratio
    min_lr_ratio: float = 0.0  # final lr / peak lr
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    grad_clip: float = 1.0  # max global gradient norm; <= 0: no clipping (the norm is still logged)
    # LM head + loss: "fused" = dflash_kernels.linear_cross_entropy (the logits never exist; frozen
    # head: no weight-gradient GEMM); "logits" = the whole [rows, vocab] logits then torch's
    # cross-entropy (the path of a trainer without the library); "chunked" = plain torch in row chunks
    # (trainer.loss.dflash_head_loss), a reference for the fused op.
    loss: str = "fused"
    # The drafter's matrix weights in the compute dtype: "autocast" = fp32 masters cast by autocast in every
    # forward (and the gradients cast back); "copies" = bf16 copies the forward runs with, written by the
    # optimizer step (trainer/compute_weights.py; the single-process loop only); "auto" = "copies" for the
    # single-process loop on a CUDA device in a 16-bit dtype, else "autocast" (compute_weights_for). On the
    # H200 (tok_s (m) against (a), 2026-12-03, alternating, after the AdamW tuning fix): real 133.8 -> 131.4 ms
    # per step (copies/casts 4.8 -> 2.4 ms), the same loss curve (embedded, 128 steps), +1.2 GiB reserved.
    compute_weights: str = "auto"
    # The frozen target's feature forward replayed as CUDA graphs (Target.use_cuda_graphs): "auto" = for a
    # target on a CUDA device (never slower in four A/Bs on the H200, 2026-12-02: the host's launches of the
    # target's many small kernels leave the step), "on" = required (refused off CUDA), "off" = eager.
    # True / False (configs saved before "auto") read as "on" / "off".
    target_cuda_graphs: str = "auto"
    # The drafter's forward, backward, clip and AdamW step recorded as one CUDA graph per batch shape and
    # replayed (trainer.step_graph; the single-process loop; the pipeline steps eagerly): "auto" = for a
    # drafter on a CUDA device (either compute_weights), "on" = required (refused where it cannot
    # run), "off" = eager. Packed batches always step eagerly. On the H200 (tok_s, 2026-12-03): embedded
    # 30.0 -> 4.4 ms per step (the host's launches were 87% of it), real 137.5 -> 136.8 ms.
    step_cuda_graphs: str = "auto"
    seed: int = 0  # model init, data order and anchor sampling
    # --- runtime ---
    device: str = "auto"  # "auto" = cuda if available else cpu
    dtype: str = "auto"  # compute dtype: "auto" = bfloat16 on GPU, float32 on CPU
    log_interval: int = 10  # steps between log lines
    save_interval: int = 500  # steps between checkpoints (and one at the end)
    cache_dir: str = DEFAULT_CACHE  # where the embedded default is built and found
    # --- threaded pipeline (trainer/pipeline.py; used when either GPU list is given) ---
    target_gpus: str = ""  # target workers: "0-4", "0,1", "cpu" or "cpu:N"; "" = the single-process loop
    drafter_gpus: str = ""  # drafter replicas, same syntax; "" = the target's list
    queue_depth: int = 2  # feature batches waiting per (target worker, drafter replica) pair
    watchdog_s: float = 600.0  # no training progress for this long: dump all thread stacks and exit 3; 0 = off
    watchdog_setup_s: float = 1800.0  # the same limit before training starts (model load, kernel tuning)
    stop_grace_s: float = 20.0  # after a worker fails, how long the others get to stop before a forced exit
    extra: dict = field(default_factory=dict)  # free-form notes saved with the config

    def __post_init__(self):
        for name in ("target_cuda_graphs", "step_cuda_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # configs saved before "auto" hold True / False
                value = "on" if value else "off"
                setattr(self, name, value)
            if value not in TARGET_GRAPHS:
                raise ValueError(f"{name}: expected one of {TARGET_GRAPHS}, got {value!r}")
        if self.compute_weights not in COMPUTE_WEIGHTS:
            raise ValueError(f"compute_weights: expected one of {COMPUTE_WEIGHTS}, got {self.compute_weights!r}")
        if self.loss not in LOSS_PATHS:
            raise ValueError(f"loss: unknown {self.loss!r}; choose one of {list(LOSS_PATHS)}")
        self.betas = check_betas(self.betas)

    def compute_weights_for(self, device, dtype, pipeline: bool = False) -> str:
        """"autocast" or "copies" for a drafter on ``device`` in ``dtype`` (``pipeline``: trainer.pipeline,
        which runs "autocast" only; an explicit "copies" is refused there by name)."""
        if self.compute_weights != "auto":
            return self.compute_weights
        cuda = str(device).startswith("cuda")
        half = str(dtype) in ("torch.bfloat16", "torch.float16", "bfloat16", "float16")
        return "copies" if cuda and not pipeline and half else "autocast"

    def target_graphs_on(self, device) -> bool:
        """Whether the target on ``device`` (a ``torch.device`` or its string) replays its feature forward
        as CUDA graphs: "on" always (``Target.use_cuda_graphs`` refuses a non-CUDA target by name), "auto"
        on CUDA devices only, "off" never."""
        return _graphs_on(self.target_cuda_graphs, str(device).startswith("cuda"))

    def step_graphs_on(self, device) -> bool:
        """Whether the drafter's step on ``device`` runs as CUDA graphs (``trainer.step_graph.DrafterStep``):
        "on" always (refused by name where it cannot run), "auto" on CUDA devices, "off" never."""
        return _graphs_on(self.step_cuda_graphs, str(device).startswith("cuda"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        if "chunked_loss" in d and "loss" not in d:  # configs saved before the loss field
            d["loss"] = "chunked" if d.pop("chunked_loss") else "logits"
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"config: unknown fields {sorted(unknown)}")
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """k decoder-layer indices spaced evenly from 1 to L-3 (DFlash's choice), rounded.

    Layer index i means the output of decoder layer i, i.e. HF's ``hidden_states[i + 1]``.
    """
    if k < 1:
        raise ValueError(f"num_target_layers: must be >= 1, got {k}")
    L = num_target_layers
    if L < 1:
        raise ValueError(f"target: needs at least one decoder layer, got {L}")
    lo, hi = min(1, L - 1), max(min(1, L - 1), L - 3)
    if k == 1:
        return [(lo + hi) // 2]
    return [int(round(lo + i * (hi - lo) / (k - 1))) for i in range(k)]


PRESETS = {
    # Published DFlash shapes (a Qwen3-8B-sized target on an H200).
    "default": TrainConfig(),
    # The embedded default target (python -m trainer.build_default): small, trains on one GPU in minutes.
    "embedded": TrainConfig(max_len=512, num_anchors=64, num_heads=4, num_kv_heads=2, head_dim=64,
                            sliding_window=256, batch_size=8, epochs=4, log_interval=20, save_interval=200),
    # CPU tests: a few seconds per step on the reference backends.
    "tiny": TrainConfig(max_len=64, num_anchors=4, num_layers=2, num_sliding_layers=1, sliding_window=24,
                        num_heads=2, num_kv_heads=1, head_dim=64, num_target_layers=2, batch_size=2, steps=8,
                        lr=3e-3, warmup_ratio=0.25, log_interval=1, save_interval=4, device="cpu"),
}


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One ``--field`` flag per config field (``--preset`` picks the base values)."""
    parser.add_argument("--preset", default=None, help=f"base values: {sorted(PRESETS)} (default: embedded when "
                        "--target is not given, else default)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("extra",):
            continue
        if f.type is bool:
            parser.add_argument(flag, action="store_true", default=None)
            continue
        if f.name in ("target_layer_ids", "betas"):
            parser.add_argument(flag, type=lambda s: [float(x) if "." in x else int(x) for x in s.split(",")],
                                default=None, help="comma-separated")
            continue
        typ = f.type if f.type in (int, float, str) else int if f.type == (int | None) else str
        parser.add_argument(flag, type=typ, default=None)


def from_cli(args: argparse.Namespace) -> TrainConfig:
    overrides = {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            overrides[f.name] = tuple(v) if f.name == "betas" else v
    name = args.preset or ("default" if overrides.get("target") else "embedded")
    return preset(name, **overrides)


def dump(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=1, sort_keys=True)
