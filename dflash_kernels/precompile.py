"""Compile (and tune) ahead of time, from the command line: ``python -m dflash_kernels.precompile``.

    python -m dflash_kernels.precompile --preset real            # the main job's kernels (tok_s / trainer)
    python -m dflash_kernels.precompile --preset real,embedded,27b,ops
    python -m dflash_kernels.precompile --op "gdn:B=1,T=8192,Hk=16,Hv=32,K=128,V=128" --dtype bfloat16
    python -m dflash_kernels.precompile --list                   # the presets recorded for this GPU
    python -m dflash_kernels.precompile --export-kernels k.tar.xz  # this machine's compiled kernels, to copy
    python -m dflash_kernels.precompile --import-kernels k.tar.xz  # on another machine of the same GPU

``--preset``: the kernel launches a run of that preset recorded for this GPU model, shipped with the package
(the H100 and H200; ``ops`` is the op benchmarks' shapes) or recorded on this machine by an earlier run
(``DFLASH_KERNELS_RECORD_TAG=NAME`` tags a run's launches). Their compiled kernels come from the package's
shipped bundle where it matches this machine, else worker processes compile them, with the stored tuning's
config (every candidate where none is stored).

``--op``: an op at a shape, as :func:`dflash_kernels.precompile` takes it (``OP:KEY=VALUE,...``, values as JSON:
numbers, true / false, null): compiled in parallel, then run once so that untuned keys are timed.

Everything lands in the caches every later process reads: Triton's cache folder (``TRITON_CACHE_DIR``) and the
tuning file (``DFLASH_KERNELS_CACHE_DIR``). Importing this module keeps ``dflash_kernels.precompile`` callable
as the function :func:`dflash_kernels.runtime.precompile.precompile`.
"""

import argparse
import importlib
import json
import os
import sys
import types

import torch

# By path: the attribute ``dflash_kernels.runtime.precompile`` is the function, not its module.
_rt = importlib.import_module("dflash_kernels.runtime.precompile")
from dflash_kernels.runtime import kernel_bundle  # noqa: E402

__all__ = ["main", "parse_op"]

PRESETS = ("real", "embedded", "27b", "ops")

# ``--preset ops``: the shapes ``benchmarks/ops.py`` times ours at and ``benchmarks/first_call.py``'s covered shapes
# (bf16, forward and backward), run as specs.
_ATTN = dict(S=3072, N=512, Hq=32, Hkv=8, D=128)
_GDN = dict(Hk=16, K=128, V=128)
OP_SHAPES = (
    [("attention", dict(_ATTN, B=b, window=w)) for b in (1, 4) for w in (None, 2048)]
    + [("attention", dict(_ATTN, B=4, S=4096))]
    + [("gdn", dict(_GDN, B=b, T=t, Hv=32)) for b, t in ((1, 3072), (1, 8192), (4, 8192), (1, 32768))]
    + [("gdn", dict(_GDN, B=1, T=32768, Hv=32, docs="3000+11000+5000+13768"))]  # bench_gdn's packed batch
    + [("gdn", dict(_GDN, B=b, T=t, Hv=48)) for b, t in ((1, 4096), (4, 4096), (1, 16384))]
    + [("conv1d", dict(B=b, D=d, T=t, W=4)) for b, d, t in ((1, 10240, 4096), (4, 10240, 4096), (8, 10240, 16384))]
    + [("linear_cross_entropy", dict(N=8192, H=2560, V=248320)),
       ("linear_cross_entropy", dict(N=8192, H=2560, V=248320, weights=False, argmax=False)),  # the op's defaults
       ("linear_cross_entropy", dict(N=16384, H=5120, V=248320))]
    + [("rms_norm", dict(N=3072, D=2560)), ("swiglu", dict(N=3072, C=9728, packed=True))]
)


def parse_op(text: str) -> tuple:
    """``"gdn:B=1,T=8192"`` -> ``("gdn", {"B": 1, "T": 8192})``; values read as JSON, else kept as text."""
    op, sep, rest = text.partition(":")
    op = op.strip()
    if not op or not sep:
        raise ValueError(f"--op: expected OP:KEY=VALUE,... (e.g. 'gdn:B=1,T=8192,Hk=16,Hv=32,K=128,V=128'), "
                         f"got {text!r}")
    shape = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--op: {item!r} in {text!r} is not KEY=VALUE")
        try:
            shape[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            shape[key.strip()] = value.strip()
    return op, shape


def recorded_tags(device) -> dict:
    """``{tag: launches}`` recorded for ``device``'s GPU model (shipped and local), of the current kernels."""
    counts = {}
    for sig in kernel_bundle.recorded_launches(device)[1].values():
        for tag in sig.get("tags", ()) or ("(untagged)",):
            counts[tag] = counts.get(tag, 0) + 1
    return counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash_kernels.precompile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None,
                   help=f"comma-separated: {', '.join(PRESETS)}, or any tag a run recorded under; 'all' for every "
                        f"recorded launch of this GPU model")
    p.add_argument("--op", action="append", default=[], metavar="OP:KEY=VALUE,...",
                   help="an op at a shape (repeatable), e.g. 'attention:B=1,S=3072,N=512,Hq=32,Hkv=8,D=128'")
    p.add_argument("--dtype", default="bfloat16", help="the --op specs' dtype (default bfloat16)")
    p.add_argument("--forward-only", action="store_true", help="--op: leave out the backward kernels")
    p.add_argument("--device", default=None, help="default: the current CUDA device")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: the machine's cores, <= 16)")
    p.add_argument("--list", action="store_true", help="print the presets recorded for this GPU model and the ops")
    p.add_argument("--import-kernels", default=None, metavar="FILE",
                   help="copy a bundle of compiled kernels (made by --export-kernels on a machine with the same "
                        "GPU architecture, Triton and driver version) into Triton's cache folder, first")
    p.add_argument("--export-kernels", default=None, metavar="FILE",
                   help="last, write the compiled kernels of this GPU model's recorded launches (of --preset's tags "
                        "when given) to FILE ('shipped': the package's own bundle for this machine, which keeps the "
                        "kernels of the other GPU models of its architecture)")
    p.add_argument("--run", default=None, help="--export-kernels: the run that recorded the launches, for the manifest")
    args = p.parse_args(argv)
    if not (args.preset or args.op or args.list or args.import_kernels or args.export_kernels):
        p.error("nothing to do: give --preset, --op, --list, --import-kernels or --export-kernels")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        p.error(f"--dtype: {args.dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    args.dtype = dtype
    try:
        args.op = [parse_op(t) for t in args.op]
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import dflash_kernels  # noqa: F401 - registers every op's kernels and precompile builders

    cuda = torch.cuda.is_available()
    dev = torch.device(args.device) if args.device else (torch.device("cuda", torch.cuda.current_device())
                                                          if cuda else torch.device("cpu"))
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU"
    if args.list:
        print(f"precompilable ops: {', '.join(sorted(_rt._builders))}")
        if dev.type == "cuda":
            counts = recorded_tags(dev.index)
            print(f"recorded launches on {where}: " + (", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
                                                       or "none"))
    status = 0
    if args.import_kernels:
        if dev.type != "cuda":
            print(f"--import-kernels: nothing to do on {where}")
        else:
            r = kernel_bundle.install(args.import_kernels, dev)
            print(f"--import-kernels {args.import_kernels}: " + (
                f"not installed: {r['skipped']}" if r["skipped"] else
                f"{r['installed']} entries copied into {kernel_bundle._cache_root()}, {r['present']} there already"))
            status = 1 if r["skipped"] else 0
    tags = [t.strip() for t in (args.preset or "").split(",") if t.strip()]
    if "ops" in tags:  # the op benchmarks' shapes, as specs: compiled and tuned on any GPU
        tags.remove("ops")
        if dev.type == "cuda":
            args.op = [(op, dict(shape)) for op, shape in OP_SHAPES] + args.op
        else:
            print(f"--preset ops: nothing to compile on {where} (kernels run in the Triton interpreter)")
    if tags:
        if dev.type != "cuda":
            print(f"--preset {','.join(tags)}: nothing to compile on {where} (kernels run in the Triton interpreter)")
        else:
            known = recorded_tags(dev.index)
            missing = [t for t in tags if t != "all" and t not in known]
            rep = _rt.precompile_recorded(dev, workers=args.workers, verbose=False,
                                          tags=None if "all" in tags else tags)
            print(f"--preset {','.join(tags)} on {where}: {rep['current']} recorded launches; "
                  f"{rep['shipped']} shipped compiled (skipped), {rep['done_before']} compiled before, "
                  f"{rep['compiled']} kernels compiled now by {rep['workers']} processes in {rep['seconds']:.1f}s; "
                  f"{rep['current'] - rep['untuned']} with stored tuning, {rep['untuned']} untuned (every candidate "
                  f"compiled, timed at the first call)")
            for e in rep["errors"]:
                print(f"  problem: {e}")
            if missing:
                print(f"  no recorded launches for {', '.join(missing)} on {where}: run that preset once "
                      f"(e.g. DFLASH_KERNELS_RECORD_TAG={missing[0]} python benchmarks/tok_s.py --preset {missing[0]}) "
                      f"or give --op specs")
                status = 1
            if rep["errors"]:
                status = 1
    if args.op:
        specs = [(op, shape, args.dtype) for op, shape in args.op]
        try:
            rep = _rt.precompile(specs, devices=[dev], backward=not args.forward_only, verbose=False,
                                 workers=args.workers)
        except ValueError as e:
            print(f"--op: {e}", file=sys.stderr)
            return 2
        except KeyError as e:  # a shape without one of the op's sizes: say which, and what the op takes
            op = next((op for op, shape in args.op if e.args and e.args[0] not in shape), args.op[0][0])
            doc = " ".join((_rt._builders[op].__doc__ or "").split())
            print(f"--op {op}: the shape has no {e.args[0]!r}; {op} takes: {doc}", file=sys.stderr)
            return 2
        for it in rep["items"]:
            print(f"--op {it['op']} {it['shape']} {it['dtype']} on {where}: {it['compiled']} kernels, {it['tuned']} "
                  f"tuned now, {it['stored']} with stored tuning, {it['seconds']:.1f}s")
        if rep["parallel"]:
            print(f"  parallel pass: {rep['parallel']['compiled']} kernels by {rep['parallel']['workers']} processes "
                  f"in {rep['parallel']['seconds']:.1f}s")
            for e in rep["parallel"]["errors"]:
                print(f"  problem: {e}")
        if dev.type != "cuda":
            print("  (on the CPU the kernels run in the Triton interpreter: nothing was compiled)")
    if args.export_kernels:
        if dev.type != "cuda":
            print(f"--export-kernels: nothing compiled on {where}", file=sys.stderr)
            return 2
        # The shipped bundle holds every GPU model of its architecture: this model's entry is replaced.
        path, merge = args.export_kernels, args.export_kernels == "shipped"
        if merge:
            path = os.path.join(kernel_bundle.SHIPPED_DIR, kernel_bundle.bundle_name(kernel_bundle.bundle_key(dev)))
        m = kernel_bundle.export(path, dev, tags=tags or None, run=args.run, merge=merge)
        gpu = kernel_bundle.gpu_model(dev)
        this, others = m["models"][gpu], sorted(set(m["models"]) - {gpu})
        print(f"--export-kernels: wrote {path}: {this['kernels']} kernels of {len(this['signatures'])} recorded "
              f"launches on this GPU model" + (f" (kept: {', '.join(others)}'s)" if others else "")
              + f"; {m['kernels']} kernels, {m['host_modules']} host modules in all, "
              f"{os.path.getsize(path) / 2**20:.1f} MiB")
    return status


class _CallableModule(types.ModuleType):
    """Importing ``dflash_kernels.precompile`` binds this module where the package had the function
    ``precompile``: calling the module calls that function, so ``dflash_kernels.precompile(specs)`` keeps
    working either way."""

    def __call__(self, *args, **kwargs):
        return _rt.precompile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
