"""The trainer's one configuration: a typed dataclass with a comment per field, and named presets.

Values follow DFlash as published and as SpecForge trains it (block 16, 512 anchors, gamma 7,
5 drafter layers, k = 5 target layers from 1 to L-3, AdamW 6e-4 with 4% warm-up and cosine decay).
"""

import argparse
import ast
import dataclasses
import inspect
import io
import json
import os
import re
import textwrap
import tokenize
from dataclasses import dataclass, field

__all__ = ["TrainConfig", "PRESETS", "PRESET_HELP", "preset", "default_target_layer_ids", "add_cli_args", "from_cli",
           "check_betas", "field_docs", "cli_value", "default_help"]

DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash_trainer")


LOSS_PATHS = ("fused", "logits", "chunked")  # TrainConfig.loss
COMPUTE_WEIGHTS = ("auto", "autocast", "copies")  # TrainConfig.compute_weights
TARGET_GRAPHS = ("auto", "on", "off")  # TrainConfig.target_cuda_graphs and step_cuda_graphs
BUILTIN_TARGETS = ("embedded", "tiny")  # TrainConfig.builtin_target


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
    # Each field's comment is also its flag's --help (field_docs reads them): the trailing comment, else the
    # comment lines right above the field. A "--- title: description ---" line opens the flags' group.
    # --- data: the target, its training data and how records become sequences ---
    target: str = ""  # local HF causal-LM folder; "" = the built-in target that builtin_target names
    # what an empty target / data / eval_prompts stands for: "embedded" (a small hybrid trained on the Python
    # stdlib by python -m trainer.build_default, once: minutes on a CPU) or "tiny" (a random tiny hybrid: seconds)
    builtin_target: str = "embedded"
    data: str = ""  # JSONL: chat conversations ("messages") or pre-tokenized ("input_ids", "loss_mask"); "" = built-in
    eval_prompts: str = ""  # JSONL of held-out prompts for trainer.eval; "" = the built-in target's
    cache_dir: str = DEFAULT_CACHE  # where the built-in targets are built and found again
    max_len: int = 3072  # tokens per sequence; longer records are truncated, shorter ones padded
    pack: bool = False  # concatenate records into rows of max_len (per-document ids; see trainer/data.py)
    # --- model: the DFlash drafter (its hidden size and vocabulary come from the target) ---
    block_size: int = 16  # draft block: position 0 the anchor token, 1..block_size-1 mask tokens
    num_anchors: int = 512  # anchors (draft blocks) per sequence, capped by the valid positions
    gamma: float = 7.0  # loss weight of block position j is exp(-(j - 1) / gamma)
    mask_token_id: int | None = None  # unset: the tokenizer's mask token, else its pad token, else vocab - 1
    num_target_layers: int = 5  # k target hidden states concatenated into the drafter's features
    target_layer_ids: list[int] | None = None  # decoder-layer indices (0-based); unset = k spaced from 1 to L-3
    num_layers: int = 5  # drafter decoder layers
    num_sliding_layers: int = 2  # the first this many layers see only `sliding_window` context tokens
    sliding_window: int = 2048  # context window of the sliding layers
    num_heads: int = 32  # query heads; head_dim * num_heads need not equal the hidden size
    num_kv_heads: int = 8  # key/value heads (GQA)
    head_dim: int = 128  # 64, 128 or 256 (the attention kernel's head dims)
    intermediate_size: int | None = None  # SwiGLU width; unset = the target's
    rope_theta: float = 1_000_000.0  # RoPE base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    # --- optimizer: steps, learning-rate schedule and AdamW ---
    batch_size: int = 1  # sequences per step
    steps: int = 0  # optimizer steps; 0 = epochs * steps per epoch
    epochs: int = 6  # passes over the data when steps == 0
    lr: float = 6e-4  # peak learning rate (AdamW)
    warmup_ratio: float = 0.04  # linear warm-up over this fraction of the steps, then cosine to min_lr_ratio
    min_lr_ratio: float = 0.0  # final lr / peak lr
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas, two numbers in [0, 1)
    grad_clip: float = 1.0  # max global gradient norm; <= 0: no clipping (the norm is still logged)
    seed: int = 0  # model init, data order and anchor sampling
    # --- runtime: devices, precision and the step's code paths ---
    device: str = "auto"  # "auto" = cuda if available else cpu
    dtype: str = "auto"  # compute dtype: "auto" = bfloat16 on GPU, float32 on CPU
    # LM head + loss: "fused" = dflash_kernels.linear_cross_entropy (the logits never exist), "logits" = whole
    # logits then torch's cross-entropy, "chunked" = plain torch in row chunks (a reference for the fused op)
    loss: str = "fused"
    # The drafter's matrix weights in the compute dtype: "autocast" = fp32 masters cast by autocast in every
    # forward (and the gradients cast back); "copies" = 16-bit copies the forward runs with, written by the
    # optimizer step (trainer/compute_weights.py; the single-process loop only): no per-forward casts, at the
    # cost of the copies' memory; "auto" = "copies" for the single-process loop on a CUDA device in a 16-bit
    # dtype, else "autocast" (compute_weights_for).
    compute_weights: str = "auto"  # "auto", "autocast" (fp32 weights cast every forward) or "copies" (16-bit copies)
    # The frozen target's feature forward replayed as CUDA graphs (Target.use_cuda_graphs): its many small
    # kernels then cost no host launches in the step. True / False (configs saved before "auto") read as
    # "on" / "off".
    target_cuda_graphs: str = "auto"  # target forward as CUDA graphs: "auto" (on CUDA), "on" (required), "off"
    # The drafter's forward, backward, clip and AdamW step recorded as one CUDA graph per batch shape and
    # replayed (trainer.step_graph; the single-process loop; the pipeline steps eagerly): the host's launches
    # leave the step. Packed batches always step eagerly. "on" is refused where it cannot run.
    step_cuda_graphs: str = "auto"  # drafter step as CUDA graphs: "auto" (on CUDA), "on" (required), "off"
    # --- run folder: where the run writes, and how often ---
    out_dir: str = "runs/dflash"  # checkpoints, the drafter folder, metrics.jsonl and train.log go here
    log_interval: int = 10  # steps between log lines
    save_interval: int = 500  # steps between checkpoints (and one at the end)
    # --- pipeline: the threaded pipeline (trainer/pipeline.py), used when either GPU list is given ---
    target_gpus: str = ""  # target workers: "0-4", "0,1", "cpu" or "cpu:N"; "" = the single-process loop
    drafter_gpus: str = ""  # drafter replicas, same syntax; "" = the target's list
    queue_depth: int = 2  # feature batches waiting per (target worker, drafter replica) pair
    watchdog_s: float = 600.0  # no training progress for this long: dump all thread stacks and exit 3; 0 = off
    watchdog_setup_s: float = 1800.0  # the same limit before training starts (model load, kernel tuning)
    stop_grace_s: float = 20.0  # after a worker fails, how long the others get to stop before a forced exit
    extra: dict = field(default_factory=dict)  # free-form notes saved with the config (no flag)

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
        if self.builtin_target not in BUILTIN_TARGETS:
            raise ValueError(f"builtin_target: expected one of {BUILTIN_TARGETS}, got {self.builtin_target!r}")
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
    "default": TrainConfig(),
    "embedded": TrainConfig(max_len=512, num_anchors=64, num_heads=4, num_kv_heads=2, head_dim=64,
                            sliding_window=256, batch_size=8, epochs=4, log_interval=20, save_interval=200),
    "tiny": TrainConfig(builtin_target="tiny", max_len=64, num_anchors=4, num_layers=2, num_sliding_layers=1,
                        sliding_window=24, num_heads=2, num_kv_heads=1, head_dim=64, num_target_layers=2, batch_size=2,
                        steps=8, lr=3e-3, warmup_ratio=0.25, log_interval=1, save_interval=4, device="cpu"),
}
# What each preset is for (the --preset help).
PRESET_HELP = {
    "default": "the published DFlash shapes, for a Qwen3-8B-sized --target on a GPU",
    "embedded": "sized for the embedded default target: minutes on one GPU",
    "tiny": "a random tiny target and data built in seconds: a first run on a CPU",
}


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


_GROUP_LINE = re.compile(r"---\s*(?P<title>[^:]+?)\s*(?::\s*(?P<description>.*?))?\s*---")


def field_docs(cls=None) -> tuple[dict, dict]:
    """``({field: (group title, help)}, {group title: description})`` read from the comments in the body
    of ``cls`` (default :class:`TrainConfig`), so the code's readers and ``--help`` share one text: a
    field's help is its trailing comment, else the comment lines right above it (a blank line or a group
    line ends those); its group is the last ``# --- title: description ---`` line above it."""
    cls = cls or TrainConfig
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped (a frozen build): flags without help
        return {f.name: ("options", "") for f in dataclasses.fields(cls)}, {}
    lines = src.splitlines()
    comments = {}  # line number -> (text, the line holds only the comment)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (tok.string.lstrip("#").strip(), not lines[row - 1][:col].strip())
    docs, groups, group, prev_end = {}, {}, "options", 1
    for node in ast.parse(src).body[0].body:
        above = []
        for row in range(prev_end + 1, node.lineno):
            text, alone = comments.get(row, ("", False))
            m = _GROUP_LINE.fullmatch(text) if alone else None
            if m:
                group, above = m["title"], []
                groups[group] = m["description"] or ""
            elif alone:
                above.append(text)
            else:
                above = []
        prev_end = node.end_lineno
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            trailing = [comments[r][0] for r in range(node.lineno, node.end_lineno + 1)
                        if r in comments and not comments[r][1]]
            docs[node.target.id] = (group, " ".join(trailing) or " ".join(above))
    return docs, groups


def cli_value(value) -> str:
    """A config value as a flag takes it (lists comma-separated, booleans on / off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "unset"
    if value == "":
        return '""'
    if isinstance(value, (list, tuple)):
        return ",".join(cli_value(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def default_help(name: str) -> str:
    """``default: V`` (the ``default`` preset's value), then each other preset's value where it differs."""
    base = getattr(PRESETS["default"], name)
    others = [f"{p}: {cli_value(getattr(c, name))}" for p, c in PRESETS.items()
              if p != "default" and getattr(c, name) != base]
    return f"default: {cli_value(base)}" + (f"; {', '.join(others)}" if others else "")


_METAVARS = {int: "N", float: "X", str: "STR"}  # short: a flag and its metavar then leave room for the help


def _list_arg(text: str) -> list:
    return [float(x) if "." in x else int(x) for x in text.split(",")]


def add_cli_args(parser: argparse.ArgumentParser) -> dict:
    """``--preset`` and one ``--field`` flag per config field, in argument groups; each flag's help is the
    field's comment (:func:`field_docs`) and its default. Returns ``{group title: argument group}``."""
    docs, titles = field_docs()
    groups = {title: parser.add_argument_group(title, description or None) for title, description in titles.items()}
    names = ", ".join(f"{name} ({text})" for name, text in PRESET_HELP.items())
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS), metavar="NAME",
                        help=f"the values the flags below start from: {names} (default: embedded without --target, "
                        "else default; each flag's help names the presets' values)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        title, text = docs.get(f.name, ("options", ""))
        group = groups[title] if title in groups else parser
        flag = "--" + f.name.replace("_", "-")
        help_text = (f"{text} ({default_help(f.name)})" if text else f"({default_help(f.name)})").replace("%", "%%")
        if f.type is bool:
            group.add_argument(flag, action="store_true", default=None, help=help_text)
        elif f.name in ("target_layer_ids", "betas"):
            group.add_argument(flag, type=_list_arg, default=None, metavar="A,B,..", help=help_text)
        else:
            typ = f.type if f.type in (int, float, str) else int if f.type == (int | None) else str
            group.add_argument(flag, type=typ, default=None, metavar=_METAVARS[typ], help=help_text)
    return groups


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
