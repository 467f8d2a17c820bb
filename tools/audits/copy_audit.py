"""Where a training step copies, casts and runs strided fp32 elementwise ops.

A GPU profile names kernels, not the code that launched them: a non-vectorized
``elementwise_kernel<128, 2, ... BinaryFunctor<float>>`` or a ``direct_copy_kernel_cuda`` says nothing
about which line of the step made it. This module finds those lines on the CPU: :class:`CopyLogger` is a
``TorchDispatchMode`` that sees every aten op of a step (forward, and backward through autograd's current
node and the forward stack anomaly mode records for it) and keeps the ones a GPU runs as copies, casts or
non-vectorized elementwise kernels:

- ``cast``: ``_to_copy`` / ``copy_`` between dtypes (a ``.float()``, ``.to(dtype)``, autocast's weight
  casts and their gradients' casts back);
- ``copy``: a same-dtype copy (``clone``, ``contiguous``, ``copy_``, ``cat``, ``stack``, a ``reshape``
  that cannot be a view); ``strided`` when a source or the destination is not contiguous (CUDA runs
  those as the non-vectorized ``direct_copy_kernel_cuda``);
- ``strided-fp32`` (``-mixed`` with a bf16 operand too) / ``strided-bfloat16``: a pointwise op whose
  TensorIterator is not contiguous: an operand broadcast to the output's shape (a per-row scale, a weight
  over rows, a 0-dim device tensor) or a non-contiguous operand. CUDA vectorizes an elementwise kernel
  only when every operand is contiguous and of the output's shape; the rest is
  ``elementwise_kernel<128, 2 (fp32) or 4, ...>``, and mixed dtypes take its slower dynamic-casting form;
- ``strided-other``: any other op with a non-contiguous fp32 input (reductions, GEMMs: mostly harmless);
- ``op`` (``all_ops=True`` only): everything else, to total a step's traffic per source.

Each event carries its shapes, strides and dtypes, the bytes it moves (inputs read + output written), the
repository / transformers / torch.optim frames that issued it and, for a backward op, the autograd node
and the forward frames of that node. :func:`audit_step` runs one step of the trainer's path (the same
``forward_loss`` -> backward -> clip -> AdamW as ``benchmarks/tok_s.py`` and ``trainer.train``) under the
logger with the drafter in fp32 master weights under bf16 autocast (as on a GPU) and returns the events.

``python -m tools.audits.copy_audit`` runs it on a shrunken Qwen3.5-like target whose every dimension is a
distinct small number and scales each event to the ``real`` preset of ``benchmarks/tok_s.py`` (hidden
2560, 3,072 target tokens, 512 anchors x 16 = 8,192 draft tokens, 5 drafter layers, 32 target layers)
by mapping each small dimension to its real one, then ranks the sources by bytes moved per real step.
``python -m tools.audits.copy_audit --ops add`` ranks every call of the named aten ops instead (of any kind:
where a kernel that a GPU profile names, e.g. a bf16 ``CUDAFunctor_add``, comes from).
``python -m tools.audits.copy_audit --profile real`` is the GPU side: ``benchmarks/tok_s.py``'s real step
under ``torch.profiler``, each kernel's device time charged to the function (and autograd node) that issued it.
``tests/trainer/test_no_hidden_copies.py`` keeps the trainer's list of such ops to the ones it chose.
"""

import ast
import contextlib
import dataclasses
import functools
import os
import re
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CopyLogger", "Event", "audit_step", "trainer_step", "aggregate", "report", "owner", "real_bytes",
           "select_ops", "shrunken_real_setup",
           "profile_sources", "profile_tok_s", "AUDIT_DIMS", "REAL_DIMS"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
_THIS = os.path.abspath(__file__)

COPY_OPS = {"_to_copy", "copy_", "copy", "clone", "cat", "stack", "_copy_from", "_copy_from_and_resize",
            "expand_copy", "slice_scatter", "select_scatter", "as_strided_scatter", "index_copy",
            "_unsafe_view_copy", "contiguous"}
# Ops that only look at metadata or make views: never logged.
_VIEW_OPS = {"detach", "view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand", "select",
             "slice", "split", "split_with_sizes", "chunk", "unsqueeze", "squeeze", "alias", "_reshape_alias",
             "unbind", "narrow", "diagonal", "unfold", "view_as_real", "view_as_complex", "lift_fresh"}


def _is_dense_contiguous(t: torch.Tensor) -> bool:
    """Contiguous in some memory format (what a vectorized CUDA elementwise kernel needs of a same-shape operand)."""
    if t.is_contiguous():
        return True
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return True
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return True
    return False


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _stored_numel(shape, stride) -> int:
    """Elements a tensor of this shape and stride reads from memory (a broadcast, stride-0 dim: once)."""
    n = 1
    for d, s in zip(shape, stride):
        if s != 0:
            n *= d
    return n


def _nbytes(t: torch.Tensor) -> int:
    return _stored_numel(t.shape, t.stride()) * t.element_size()


@functools.lru_cache(maxsize=None)
def _functions_of(path: str):
    """``[(first line, last line, qualname)]`` of every function in a source file (innermost last)."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((child.lineno, child.end_lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)
    walk(tree, "")
    return out


def qualname(path: str, line: int) -> str:
    """The innermost function of ``path`` containing ``line`` (``Class.method``), or ``""``."""
    best = ""
    best_span = None
    for lo, hi, name in _functions_of(path):
        if lo <= line <= hi and (best_span is None or hi - lo < best_span):
            best, best_span = name, hi - lo
    return best


def _keep_frame(path: str) -> bool:
    path = os.path.abspath(path)
    if path == _THIS:
        return False
    installed = any(f"{os.sep}{k}{os.sep}" in path for k in ("site-packages", "dist-packages"))
    if path.startswith(ROOT + os.sep) and not installed:  # a virtual environment may sit inside the repository
        return True
    return (f"{os.sep}transformers{os.sep}models{os.sep}" in path or f"{os.sep}torch{os.sep}optim{os.sep}" in path
            or f"{os.sep}torch{os.sep}nn{os.sep}utils{os.sep}clip_grad" in path)


def _short(path: str) -> str:
    """A repository file relative to the repository; an installed package's from the package on."""
    path = os.path.abspath(path)
    for key in ("site-packages", "dist-packages"):
        i = path.rfind(os.sep + key + os.sep)
        if i >= 0:
            return path[i + len(key) + 2:]
    if path.startswith(ROOT + os.sep):
        return os.path.relpath(path, ROOT)
    return os.path.basename(path)


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str  # repository-relative (or from the package's folder on)
    line: int
    func: str  # qualname

    def __str__(self):
        return f"{self.file}:{self.line} ({self.func})"


def _frames_from_stack(limit: int):
    frames = []
    for fs in traceback.extract_stack()[:-2]:
        if _keep_frame(fs.filename):
            frames.append(Frame(_short(fs.filename), fs.lineno, qualname(os.path.abspath(fs.filename), fs.lineno)))
    return tuple(frames[-limit:])


_TB_LINE = re.compile(r'File "([^"]+)", line (\d+), in')


def _frames_from_traceback(tb, limit: int):
    text = "".join(tb) if isinstance(tb, (list, tuple)) else str(tb)
    frames = []
    for path, line in _TB_LINE.findall(text):
        if _keep_frame(path):
            frames.append(Frame(_short(path), int(line), qualname(os.path.abspath(path), int(line))))
    return tuple(frames[-limit:])


@dataclasses.dataclass
class Event:
    kind: str  # "cast", "copy", "strided-fp32", "strided-bf16", "strided-other"
    op: str  # aten overload, e.g. "aten.mul.Tensor"
    inputs: tuple  # ((shape, stride, dtype), ...) of the tensor inputs
    outputs: tuple  # same for the tensor outputs
    nbytes: int  # tensor inputs read + outputs written, at the audit's sizes
    frames: tuple  # Frame, innermost last: the issuing code (forward frames of the node in backward)
    node: str  # the autograd node running it ("" in forward)
    strided: bool  # a copy with a non-contiguous source or destination (CUDA: non-vectorized)
    reason: str  # why it was kept
    param: bool = False  # a cast of a parameter (autocast's weight cast) or of its gradient (to the fp32 master)

    @property
    def phase(self) -> str:
        return "backward" if self.node else "forward"

    def source(self) -> str:
        return str(self.frames[-1]) if self.frames else "?"


def _desc(t: torch.Tensor):
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))


class CopyLogger(TorchDispatchMode):
    """Records every copy / cast and every strided or broadcasting pointwise op of the code it wraps.

    Args:
        min_bytes: events moving fewer bytes (at the run's sizes) are dropped.
        frames: how many issuing frames to keep per event.
    Run the backward inside ``torch.autograd.set_detect_anomaly(True, check_nan=False)`` to attribute
    backward ops to the forward line that made their node (:func:`audit_step` does).
    """

    def __init__(self, min_bytes: int = 0, frames: int = 4, all_ops: bool = False):
        super().__init__()
        self.min_bytes = min_bytes
        self.frames = frames
        self.all_ops = all_ops  # also keep every other op that reads or writes a tensor (kind "op")
        self.events: list[Event] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._inspect(func, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - the logger must never change what the step does
            print(f"copy_audit: could not inspect {func}: {type(e).__name__}: {e}", file=sys.stderr)
        return out

    def _inspect(self, func, args, kwargs, out):
        name = func._overloadpacket.__name__
        if name in _VIEW_OPS:
            return
        ins = [t for t in _tensors((args, kwargs)) if t.device.type != "meta"]
        outs = list(_tensors(out))
        if name == "copy_":  # out-of-place view of an in-place copy: the destination is written
            outs = [args[0]]
            ins = [args[1]] if len(args) > 1 and isinstance(args[1], torch.Tensor) else []
        if not outs:
            return
        float_ts = [t for t in ins + outs if t.is_floating_point()]
        kind, strided, reason = None, False, ""
        if name in COPY_OPS:
            dtypes = {t.dtype for t in ins + outs}
            strided = any(not _is_dense_contiguous(t) for t in ins + outs)
            if name in ("cat", "stack"):
                kind, reason = "copy", f"{name} of {len(ins)} tensors"
            elif len(dtypes) > 1:
                kind, reason = "cast", " -> ".join(str(t.dtype).replace("torch.", "") for t in (ins[:1] + outs[:1]))
            else:
                kind, reason = "copy", "same-dtype copy"
            if strided:
                reason += "; non-contiguous source or destination"
        elif torch.Tag.pointwise in func.tags and float_ts:
            shape = tuple(outs[0].shape)
            why = []
            for t in ins:
                if t.numel() == 1 and t.dim() == 0:
                    why.append("0-dim tensor operand")
                elif tuple(t.shape) != shape:
                    why.append(f"broadcast {tuple(t.shape)} -> {shape}")
                elif not _is_dense_contiguous(t):
                    why.append(f"non-contiguous input {tuple(t.shape)} stride {tuple(t.stride())}")
            for t in outs:
                if not _is_dense_contiguous(t):
                    why.append(f"non-contiguous output stride {tuple(t.stride())}")
            if why and outs[0].numel() > 1:
                dts = {t.dtype for t in ins + outs if t.dim() > 0 or t.numel() > 1}
                if torch.float32 in dts:
                    kind = "strided-fp32" if len(dts) == 1 else "strided-fp32-mixed"
                else:
                    kind = "strided-" + str(outs[0].dtype).replace("torch.", "")
                if len(dts) > 1:
                    why.append("mixed dtypes " + "/".join(sorted(str(d).replace("torch.", "") for d in dts)))
                reason = "; ".join(dict.fromkeys(why))
        elif any(t.dtype == torch.float32 and not _is_dense_contiguous(t) and t.numel() > 1 for t in ins):
            kind, reason = "strided-other", "non-contiguous fp32 input"
        if kind is None:
            if not self.all_ops:
                return
            kind, reason = "op", ""
        nbytes = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        if nbytes < self.min_bytes:
            return
        node = torch._C._current_autograd_node()
        if node is not None:
            frames = _frames_from_traceback(node.metadata.get("traceback_", ""), self.frames)
            node_name = node.name()
            param = kind == "cast" and any(nf is not None and "AccumulateGrad" in nf.name()
                                           for nf, _ in node.next_functions)
        else:
            frames, node_name = _frames_from_stack(self.frames), ""
            param = kind == "cast" and any(isinstance(t, torch.nn.Parameter) for t in ins)
        if param:
            reason += "; parameter" if node is None else "; gradient of a parameter"
        self.events.append(Event(kind, str(func), tuple(_desc(t) for t in ins), tuple(_desc(t) for t in outs),
                                 nbytes, frames, node_name, strided, reason, param))


# ------------------------------------------------------------------------------------------ the step
@contextlib.contextmanager
def trainer_step(setup, dtype=torch.bfloat16, backend="interpret"):
    """``(step, batch)`` of the trainer's path on ``setup`` = ``(cfg, target, dataset)``, with the library's
    ops on ``backend`` until the block ends: ``batch(i)`` is the data loader's batch i, ``step(b)`` one
    step on it (``forward_loss`` -> backward -> clip -> fused AdamW) of a fresh drafter built in fp32
    (master weights; under ``dtype`` autocast when that is lower, as on a GPU)."""
    import dflash_kernels as dk
    from trainer.common import build_drafter
    from trainer.data import batch_at
    from trainer.step import clip_and_step, forward_loss

    cfg, target, ds = setup
    dev = target.device
    ops = ("attention", "gdn", "conv1d", "linear_cross_entropy", "rms_norm", "rope", "swiglu")
    before = {op: dk.get_backend(op) for op in ops}
    for op in ops:
        dk.set_backend(op, backend)
    try:
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.vocab_size - 1
        drafter = build_drafter(cfg, target, mask_id).to(dev)
        drafter.train()
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                weight_decay=cfg.weight_decay, fused=True)

        def batch(i):
            return batch_at(ds, i, cfg.batch_size, cfg.max_len, cfg.num_anchors, cfg.block_size, cfg.seed)

        def step(b):
            loss, _ = forward_loss(b, target, drafter, cfg, dev, dtype)
            loss.backward()
            clip_and_step(opt, drafter.parameters(), cfg.grad_clip)
            opt.zero_grad(set_to_none=True)
            return loss

        yield step, batch
    finally:
        for op, name in before.items():
            dk.set_backend(op, name)


def audit_step(setup, dtype=torch.bfloat16, backend="interpret", min_bytes: int = 0, steps: int = 1,
               frames: int = 4, warmup: int = 1, all_ops: bool = False):
    """Events of ``steps`` training steps (after ``warmup`` unlogged ones) of the trainer's path.

    ``setup``: ``(cfg, target, dataset)``; the target's weights in ``dtype``. The drafter is built in fp32
    (master weights) and runs under ``dtype`` autocast when ``dtype`` is not fp32, as on a GPU; the
    library's ops (and the fused norm / RoPE / SwiGLU, where ``trainer.model.FUSED_OPS`` turns them on) run
    on ``backend`` (``interpret``: the Triton kernels' own wrappers, as group (a) of ``benchmarks/tok_s.py``;
    ``reference``: plain torch, fast). The loss is the fused LM-head CE, the optimizer torch's fused AdamW.
    """
    with trainer_step(setup, dtype, backend) as (step, batch):
        for i in range(warmup):  # optimizer state and lazily built caches exist before the logged steps
            step(batch(i))
        logger = CopyLogger(min_bytes=min_bytes, frames=frames, all_ops=all_ops)
        with torch.autograd.set_detect_anomaly(True, check_nan=False), logger:
            for i in range(warmup, warmup + steps):
                step(batch(i))
        return logger.events


def aggregate(events, scale=None, depth: int = 1):
    """``[(key, {"count", "bytes", "real_bytes", "example": Event})]`` by (kind, op, node, the ``depth`` innermost
    frames), largest first. ``scale(event) -> bytes`` gives an event's bytes at another size (``real_bytes``)."""
    groups = {}
    for e in events:
        key = (e.kind, e.op, e.node, e.frames[-depth:] if depth else e.frames)
        g = groups.setdefault(key, {"count": 0, "bytes": 0, "real_bytes": 0.0, "example": e})
        g["count"] += 1
        g["bytes"] += e.nbytes
        g["real_bytes"] += scale(e) if scale else e.nbytes
    return sorted(groups.items(), key=lambda kv: -kv[1]["real_bytes"])


# --------------------------------------------------------------------------- the shrunken real preset
# Every dimension of the audit run is a distinct small number, so a logged shape maps back to what it
# is; REAL_DIMS holds the `real` preset's value of each (benchmarks/tok_s.py: Qwen3.5-4B-like target,
# the default trainer preset: 5 drafter layers, 32 x 128 query heads, 8 kv heads, 3,072 tokens, 512
# anchors of 16).
AUDIT_DIMS = dict(H=40, I=72, V=448, S=56, N=5, bs=16, Hq=18, Hkv=2, D=64, k=3, L=4, tH=8, tKV=4, tD=24,
                  lkh=7, lvh=14, lkd=12, drafter_layers=2)
REAL_DIMS = dict(H=2560, I=9216, V=248320, S=3072, N=512, bs=16, Hq=32, Hkv=8, D=128, k=5, L=32, tH=16, tKV=4,
                 tD=256, lkh=16, lvh=32, lkd=128, drafter_layers=5)


def _dim_map():
    """``{audit value: real value}`` of every dimension (and product of dimensions) a logged shape can hold;
    raises when two quantities of different real sizes share an audit value."""
    a, r = AUDIT_DIMS, REAL_DIMS
    quantities = [("H",), ("I",), ("V",), ("S",), ("N",), ("N", "bs"), ("Hq",), ("Hkv",), ("D",), ("Hq", "D"),
                  ("Hkv", "D"), ("k",), ("k", "H"), ("tH",), ("tD",), ("tH", "tD"), ("tKV", "tD"), ("lkh",),
                  ("lvh",), ("lkd",), ("lkh", "lkd"), ("lvh", "lkd"), ("N", "bs", "Hq"), ("N", "bs", "H"),
                  ("S", "H"), ("S", "k", "H"), ("V", "H"), ("I", "H"), ("Hq", "D", "H"), ("Hkv", "D", "H"),
                  ("k", "H", "H")]

    def prod(d, names):
        out = 1
        for n in names:
            out *= d[n]
        return out

    pairs = [(prod(a, q), prod(r, q)) for q in quantities]
    pairs += [(a["Hq"] // a["Hkv"], r["Hq"] // r["Hkv"]), (a["S"] + a["N"] * a["bs"], r["S"] + r["N"] * r["bs"]),
              (2 * a["tH"] * a["tD"], 2 * r["tH"] * r["tD"]), (a["tD"] // 4, r["tD"] // 4),  # gated q; rotary dims
              (2 * a["lkh"] * a["lkd"] + a["lvh"] * a["lkd"], 2 * r["lkh"] * r["lkd"] + r["lvh"] * r["lkd"])]  # conv
    out = {}
    for small, real in pairs:
        if small != 1 and out.setdefault(small, real) != real:
            raise AssertionError(f"AUDIT_DIMS: {small} stands for both {out[small]} and {real} at the real preset")
    return out


DIM_MAP = _dim_map()


def real_numel(shape) -> float:
    """Elements of ``shape`` at the real preset: each dimension mapped through :data:`DIM_MAP` (unknown
    dimensions, e.g. the kernels' own tile counts, stay as they are)."""
    n = 1.0
    for d in shape:
        n *= DIM_MAP.get(d, d)
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def layer_scale(frames) -> float:
    """How many times more often a source runs per real step: drafter-layer code 5 / 2, target-layer
    code 32 / 4, the rest once."""
    for f in frames:
        if f.file == "trainer/model.py" and f.func.split(".")[0] in ("DecoderLayer", "Attention", "MLP"):
            return REAL_DIMS["drafter_layers"] / AUDIT_DIMS["drafter_layers"]
        if "modeling_qwen3_5" in f.file and any(k in f.func for k in ("DecoderLayer", "GatedDeltaNet", "Attention",
                                                                       "MLP", "apply_rotary", "RMSNormGated")):
            return REAL_DIMS["L"] / AUDIT_DIMS["L"]
    return 1.0


def real_bytes(e: Event) -> float:
    """An event's bytes at the real preset, times how often its code runs there (:func:`layer_scale`)."""
    b = sum(real_numel([d for d, st in zip(s, strides) if st != 0]) * _itemsize(dt)
            for s, strides, dt in e.inputs + e.outputs)
    return b * layer_scale(e.frames)


def shrunken_real_setup(dtype=torch.bfloat16, batch_size=1, seed=0, elementwise=False):
    """``(cfg, target, dataset)`` of :data:`AUDIT_DIMS`: a Qwen3.5 hybrid (3 GDN : 1 attention) on the CPU,
    random weights in ``dtype``, the trainer's default preset shrunk to those dimensions. The target's
    routing through dflash_kernels is ``target.routing`` (``undo()`` restores transformers' functions);
    ``elementwise`` routes its norms, SiLU MLPs and RoPE too, as on a GPU."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from trainer.config import default_target_layer_ids, preset
    from trainer.data import Dataset, DataStats
    from trainer.target import Target

    import dflash_kernels.integrations.transformers as integ

    a = AUDIT_DIMS
    text = Qwen3_5TextConfig(vocab_size=a["V"], hidden_size=a["H"], intermediate_size=a["I"], num_hidden_layers=a["L"],
                             num_attention_heads=a["tH"], num_key_value_heads=a["tKV"], head_dim=a["tD"],
                             linear_num_key_heads=a["lkh"], linear_num_value_heads=a["lvh"],
                             linear_key_head_dim=a["lkd"], linear_value_head_dim=a["lkd"], linear_conv_kernel_dim=4,
                             max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)
    cfg = preset("default", device="cpu", batch_size=batch_size, max_len=a["S"], num_anchors=a["N"],
                 num_layers=a["drafter_layers"], num_sliding_layers=1, sliding_window=a["S"] // 2,
                 num_heads=a["Hq"], num_kv_heads=a["Hkv"], head_dim=a["D"], num_target_layers=a["k"], seed=seed)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3_5ForCausalLM(text)
    finally:
        torch.set_default_dtype(prev)
    routing = integ.use_dflash_kernels(model, elementwise=elementwise)
    target = Target(model, None, default_target_layer_ids(a["L"], a["k"]))
    target.routing = routing
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(4):
        ids = torch.randint(8, a["V"], (a["S"],), generator=g)
        lm = torch.ones(a["S"], dtype=torch.bool)
        lm[:8] = False
        seqs.append((ids, lm))
    return cfg, target, Dataset(seqs, DataStats(records=4, kept=4))


def _fmt_bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def owner(e: Event) -> str:
    """Whose code issued an event: ``trainer``, ``dflash_kernels``, ``transformers``, ``torch`` or ``?``."""
    if not e.frames:
        return "?"
    return e.frames[-1].file.split("/")[0]


def report(events, top: int = 40, tb_s: float = 4.0, kinds=None, depth: int = 1) -> str:
    """The sources ranked by bytes per real step, with the ms they would take at ``tb_s`` TB/s: totals per
    (kind, owner) first, then each source (kind, op, autograd node, the ``depth`` innermost frames)."""
    events = [e for e in events if kinds is None or e.kind in kinds]
    rows = aggregate(events, real_bytes, depth)
    total = sum(g["real_bytes"] for _, g in rows)
    lines = [f"{len(events)} events, {len(rows)} sources; {_fmt_bytes(total)} per real step "
             f"= {total / tb_s / 1e9:.2f} ms at {tb_s} TB/s", "by kind and owner:"]
    per = {}
    for e in events:
        k = (e.kind + (" (strided)" if e.strided else ""), owner(e))
        per[k] = per.get(k, 0.0) + real_bytes(e)
    for (kind, who), b in sorted(per.items(), key=lambda kv: -kv[1]):
        lines.append(f"{_fmt_bytes(b):>10} {b / tb_s / 1e9:6.2f} ms  {kind:24s} {who}")
    lines.append("by source:")
    for (kind, op, node, _), g in rows[:top]:
        e = g["example"]
        frames = e.frames
        ins = ", ".join(f"{list(s)}{'' if st == _contig(s) else ' st' + str(list(st))} {dt}" for s, st, dt in e.inputs)
        outs = ", ".join(f"{list(s)} {dt}" for s, _, dt in e.outputs)
        lines.append(f"{_fmt_bytes(g['real_bytes']):>10} {g['real_bytes'] / tb_s / 1e9:6.2f} ms  x{g['count']:<3} "
                     f"{kind:13s} {op}{'  [bw ' + node + ']' if node else ''}")
        lines.append(f"{'':30s}in: {ins} -> {outs}; {e.reason}")
        for f in frames[::-1][:4]:
            lines.append(f"{'':30s}at {f}")
    return "\n".join(lines)


def _contig(shape):
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(st))


# ------------------------------------------------------------------------- the same sources on a GPU
_STACK_LINE = re.compile(r"^(.*)\((\d+)\): (.*)$")


def _profiler_path(name: str):
    """The file of a profiler frame name worth keeping (absolute), or None. The profiler writes installed
    packages' files relative to their site-packages folder (``torch/optim/adam.py``)."""
    if not os.path.isabs(name):
        in_repo = os.path.join(ROOT, name)
        name = in_repo if os.path.exists(in_repo) else os.path.join(os.sep, "site-packages", name)
    return os.path.abspath(name) if _keep_frame(name) else None


def profile_sources(fn, n: int = 1, frames: int = 3):
    """Run ``fn`` ``n`` times under ``torch.profiler`` with Python stacks and total the time of each kernel per
    (kernel, aten op, autograd node, issuing frames): ``Counter`` of ms per call of ``fn``.

    On a GPU the time is each kernel's device time, charged to the aten op that launched it (backward ops
    carry their forward op's frames, linked by autograd's sequence number); without one, each leaf
    op's own CPU time. The CPU audit above says which lines copy, cast or broadcast; this says what each
    costs on the device.
    """
    import collections

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]

    def py_frames(e):  # the Python frames the profiler records as the op's ancestors, innermost first
        out, p = [], e.cpu_parent
        while p is not None:
            m = _STACK_LINE.match(p.name)
            path = _profiler_path(m.group(1)) if m else None
            if path:
                out.append(Frame(_short(path), int(m.group(2)), qualname(path, int(m.group(2))) or m.group(3)))
            p = p.cpu_parent
        return out

    def backward_fn(e):
        p = e.cpu_parent
        while p is not None and getattr(p, "scope", 0) != 1:  # 1: RecordScope.BACKWARD_FUNCTION
            p = p.cpu_parent
        return p

    forward = {}  # sequence number -> the forward op's frames (backward ops point back to them)
    for e in events:
        if e.sequence_nr >= 0 and e.sequence_nr not in forward and backward_fn(e) is None:
            forward[e.sequence_nr] = py_frames(e)
    rows = collections.Counter()
    for e in events:
        if cuda:
            items = [(k.name, k.duration) for k in e.kernels]
        else:
            items = [] if e.cpu_children or not e.name.startswith("aten::") else [(e.name, e.self_cpu_time_total)]
        if not items:
            continue
        bw = backward_fn(e)
        src = tuple(forward.get(bw.sequence_nr, []) if bw is not None else py_frames(e))[:frames]
        node = bw.name if bw is not None else ""
        for name, us in items:
            rows[(name, e.name, node, src)] += us / 1e3 / n
    return rows


def profile_report(rows, top: int = 60) -> str:
    total = sum(rows.values())
    lines = [f"{total:.1f} ms per step in {len(rows)} (kernel, op, node, source) rows"]
    for (kernel, op, node, src), ms in rows.most_common(top):
        where = " < ".join(str(f) for f in src) or "?"
        lines.append(f"{ms:8.3f} ms  {kernel[:110]}")
        lines.append(f"{'':13s}{op}{'  [bw ' + node + ']' if node else ''}  at {where}")
    return "\n".join(lines)


def profile_tok_s(preset: str = "real", group: str = "a", steps: int = 2, top: int = 60, log=print):
    """``benchmarks/tok_s.py``'s step of ``preset`` / ``group`` (its own setup and ``run_group``), its
    ``--profile`` steps through :func:`profile_sources`: device time per source line, not only per kernel."""
    bench = os.path.join(ROOT, "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import tok_s

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args = tok_s.parse_args(["--preset", preset, "--groups", group])
    setup = tok_s.SETUPS[preset](args, dev, dtype, log)

    def profile_steps(step, n, dev_, label, log_):
        rows = profile_sources(step, n)
        log(f"profile {label}:\n" + profile_report(rows, top))
        cats = {}
        for (kernel, *_), ms in rows.items():
            cats[tok_s.category(kernel)] = cats.get(tok_s.category(kernel), 0.0) + ms
        return cats

    before = tok_s.profile_steps
    tok_s.profile_steps = profile_steps
    try:
        return tok_s.run_group(setup, group, 2, 1, dev, dtype, 1, steps, log)
    finally:
        tok_s.profile_steps = before


def select_ops(events, names) -> list:
    """The events of the aten ops ``names`` (packet names: ``add`` keeps ``aten.add.Tensor`` and every other
    overload of ``add``)."""
    names = {n.strip() for n in names if n.strip()}
    return [e for e in events if e.op.split(".")[1] in names]


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--kinds", default="", help="comma-separated kinds to show (default: all)")
    p.add_argument("--min-mb", type=float, default=0.0, help="drop events below this many MB at the real preset")
    p.add_argument("--backend", default="interpret", help="dflash_kernels backend of the library's ops: interpret "
                   "(their Triton kernels' wrappers, as on a GPU; about a minute) or reference (plain torch, seconds)")
    p.add_argument("--depth", type=int, default=1, help="innermost frames that tell sources apart (0: all kept)")
    p.add_argument("--fused", action="store_true", help="the fused RMSNorm / RoPE / SwiGLU in the drafter (FUSED_OPS) "
                   "and the target (use_dflash_kernels(..., elementwise=True)), as tok_s group (a) on a GPU")
    p.add_argument("--ops", default="", metavar="NAMES",
                   help="instead of copies and casts: every call of these aten ops (comma-separated packet names, "
                        "e.g. add,_foreach_norm), of any kind, ranked the same way (where a kernel a profile names "
                        "comes from)")
    p.add_argument("--profile", default="", metavar="PRESET[:GROUP]",
                   help="instead: benchmarks/tok_s.py's PRESET (real, embedded, tiny) and GROUP (a, f; default a) "
                        "under torch.profiler, device time per (kernel, op, source line): the GPU check of the audit")
    args = p.parse_args(argv)
    if args.profile:
        if not torch.cuda.is_available():  # group (a) on a CPU: the Triton kernels through the interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        preset, _, group = args.profile.partition(":")
        row = profile_tok_s(preset, group or "a", top=args.top)
        print({k: v for k, v in row.items() if k != "profile_ms"})
        return
    if args.backend == "interpret":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before dflash_kernels is imported
    import warnings
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    import trainer.model as model_mod
    model_mod.FUSED_OPS = args.fused
    setup = shrunken_real_setup(elementwise=args.fused)
    try:
        events = audit_step(setup, backend=args.backend, frames=8, all_ops=bool(args.ops))
    finally:
        setup[1].routing.undo()
    if args.ops:
        events = select_ops(events, args.ops.split(","))
    events = [e for e in events if real_bytes(e) >= args.min_mb * 1e6]
    kinds = set(args.kinds.split(",")) if args.kinds else None
    print(report(events, args.top, kinds=kinds, depth=args.depth))


if __name__ == "__main__":
    main()
