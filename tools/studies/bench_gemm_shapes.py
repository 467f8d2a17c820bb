"""Where a training step's GEMM time goes: every matrix product of one step, by shape, timed alone.

    python -m tools.studies.bench_gemm_shapes [--preset real] [--top 30] [--lm-head-chunks 1024,2048] [--no-record]

A profile names cuBLAS kernels (``nvjet_sm90_tst_192x192_...``), not the products they compute. This script
runs one step of the trainer's path (``tools.audits.copy_audit.trainer_step``: target features, the drafter's
forward and backward with the library's ops and fused LM-head loss, clip, AdamW) under a ``TorchDispatchMode``
that records every ``aten.mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` call with its operands' shapes, strides and
dtypes and the code that issued it (the innermost repository or transformers frame; in the backward the
autograd node). Each distinct call is then timed alone on fresh operands of the same layout
(``triton.testing.do_bench`` median) and reported with its calls per step, ms per step and TFLOP/s
(``2 M N K`` per product), largest first; the sum is what the step's GEMMs would take one at a time.

``--lm-head-chunks`` also times the fused LM-head loss's two products (``logits = h_c @ W.T`` and
``dX_c = G_c @ W``) over all of the step's predicted rows for each chunk row count given (the op's
``chunk_rows`` picks one from ``DFLASH_KERNELS_LINEAR_CE_CHUNK_MIB``): the chunk size that the GEMMs like best.

Rows (one per distinct product and one per chunk size; op ``gemm_step`` / ``lm_head_chunks``) are appended to
``benchmarks/results/ops.jsonl`` when a GPU ran them. On a CPU (``--preset tiny``) the job only shows it runs.
"""

import argparse
import collections
import os
import sys
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]  # the benchmarks' helpers, the library, the trainer

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")


def _layout(t: torch.Tensor):
    return tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", "")


def gemm_flops(op: str, shapes) -> float:
    """``2 M N K`` (times the batch for bmm) of one call, from its operand shapes."""
    if op in ("mm", "addmm"):
        (m, k), (_, n) = shapes[-2], shapes[-1]
        return 2.0 * m * n * k
    (b, m, k), (_, _, n) = shapes[-2], shapes[-1]
    return 2.0 * b * m * n * k


class GemmLogger(TorchDispatchMode):
    """Counts every GEMM call of the code it wraps by (op, operand layouts, out layout, scalars, source)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in GEMM_OPS:
            from tools.audits.copy_audit import _frames_from_stack

            tensors = tuple(_layout(a) for a in args if isinstance(a, torch.Tensor))
            scalars = tuple((k, v) for k, v in sorted(kwargs.items()) if not isinstance(v, torch.Tensor))
            out = kwargs.get("out")
            from tools.audits.copy_audit import _frames_from_traceback

            node = torch._C._current_autograd_node()
            if node is None:
                frames = _frames_from_stack(1)
            else:  # the forward line that made the node (anomaly mode's record)
                frames = _frames_from_traceback(node.metadata.get("traceback_", ""), 1)
            where = (f"{node.name()} <- " if node is not None else "") + (str(frames[-1]) if frames else "?")
            key = (name, func._overloadname, tensors, _layout(out) if isinstance(out, torch.Tensor) else None, scalars, where)
            self.calls[key] += 1
        elif func.namespace == "dflash_kernels":  # the library's custom ops: log the products inside them too
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


def _fresh(layout, dev):
    """A tensor of ``layout`` (shape, stride, dtype) over finite random storage (broadcast strides too)."""
    shape, stride, dtype = layout
    size = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
    base = torch.empty(size, dtype=getattr(torch, dtype), device=dev)
    if base.is_floating_point():
        base.normal_(0, 0.02)
    return base.as_strided(shape, stride)


def time_call(key, dev, bench):
    """ms of one call of ``key``'s product on fresh operands of its layouts."""
    name, overload, tensors, out, scalars, _ = key
    func = getattr(getattr(torch.ops.aten, name), overload)
    args = [_fresh(t, dev) for t in tensors]
    kwargs = dict(scalars)
    if out is not None:
        kwargs["out"] = _fresh(out, dev)
    return bench(lambda: func(*args, **kwargs))


def collect(preset: str, dev, dtype):
    """GEMM calls of one step (after one unlogged warm-up step) of the trainer's path at ``preset``."""
    from tok_s import SETUPS

    from tools.audits.copy_audit import trainer_step

    setup = SETUPS[preset](types.SimpleNamespace(batch_size=None, no_build=True), dev, dtype, print)
    backend = "auto" if dev.type == "cuda" else "interpret"
    with trainer_step((setup.cfg, setup.target, setup.dataset), dtype, backend) as (step, batch):
        step(batch(0))
        logger = GemmLogger()
        with torch.autograd.set_detect_anomaly(True, check_nan=False), logger:
            step(batch(1))
    return setup, logger.calls


def lm_head_chunks(setup, chunks, dev, dtype, bench):
    """Per chunk row count C: ms per step of the LM-head loss's logits and hidden-gradient products over the
    step's predicted rows (B * anchors * (block_size - 1)), in C-row chunks as the fused op runs them."""
    cfg, target = setup.cfg, setup.target
    N = cfg.batch_size * cfg.num_anchors * (cfg.block_size - 1)
    W = target.lm_head_params()[0].detach()
    V, H = W.shape
    h = torch.randn(N, H, device=dev, dtype=dtype) * 0.02
    rows = []
    for C in chunks:
        C = min(C, N)
        buf = torch.empty(C, V, device=dev, dtype=dtype)
        dx = torch.empty(N, H, device=dev, dtype=dtype)
        sizes = [min(C, N - r0) for r0 in range(0, N, C)]

        def fwd():
            for r0, n in zip(range(0, N, C), sizes):
                torch.mm(h[r0:r0 + n], W.t(), out=buf[:n])

        def bwd():
            for r0, n in zip(range(0, N, C), sizes):
                torch.mm(buf[:n], W, out=dx[r0:r0 + n])

        f_ms, b_ms = bench(fwd), bench(bwd)
        flops = 2.0 * N * V * H
        rows.append(dict(chunk_rows=C, rows=N, V=V, H=H, chunks=len(sizes), fwd_ms=f_ms, bwd_ms=b_ms,
                         fwd_TFLOPs=flops / f_ms / 1e9, bwd_TFLOPs=flops / b_ms / 1e9))
        del buf, dx
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, choices=["real", "tiny", "embedded"],
                   help="default: real on a GPU, tiny on a CPU")
    p.add_argument("--top", type=int, default=30, help="distinct products listed")
    p.add_argument("--lm-head-chunks", default="", help="comma-separated chunk row counts to time (GPU)")
    p.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import trainer  # noqa: F401 - offline switches before transformers
    from bench_common import bench_ms
    from ops import env_info, record_rows

    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    preset = args.preset or ("real" if cuda else "tiny")
    setup, calls = collect(preset, dev, dtype)
    bench = lambda fn: bench_ms(fn, cuda=cuda)  # noqa: E731
    rows = []
    for key, n in calls.items():
        name, _, tensors, out, _, where = key
        shapes = [t[0] for t in tensors]
        ms = time_call(key, dev, bench)
        flops = gemm_flops(name, shapes)
        rows.append(dict(preset=preset, gemm=name, operands=[list(t) for t in tensors], calls=n, ms_call=ms,
                         ms_step=ms * n, TFLOPs=flops / ms / 1e9, TFLOP_step=flops * n / 1e12, where=where))
    rows.sort(key=lambda r: -r["ms_step"])
    total_ms = sum(r["ms_step"] for r in rows)
    total_tf = sum(r["TFLOP_step"] for r in rows)
    print(f"\n{preset}: {sum(r['calls'] for r in rows)} GEMM calls per step, {len(rows)} distinct; "
          f"{total_ms:.2f} ms one at a time, {total_tf:.2f} TFLOP, {total_tf / total_ms * 1e3:.0f} TFLOP/s")
    print(f"{'ms/step':>8} {'calls':>5} {'ms/call':>8} {'TFLOP/s':>7}  {'operands (shape stride dtype)':<60} where")
    for r in rows[: args.top]:
        ops_ = " x ".join(f"{tuple(s)}{tuple(st)}" for s, st, _ in r["operands"][-2:])
        print(f"{r['ms_step']:8.3f} {r['calls']:5d} {r['ms_call']:8.4f} {r['TFLOPs']:7.1f}  {r['gemm']} {ops_:<56} "
              f"{r['where']}")
    chunk_rows = []
    if args.lm_head_chunks:
        chunks = [int(c) for c in args.lm_head_chunks.split(",") if c]
        chunk_rows = [dict(preset=preset, **r) for r in lm_head_chunks(setup, chunks, dev, dtype, bench)]
        print("\nLM-head loss products over the step's predicted rows, per chunk row count:")
        print(f"{'C':>6} {'chunks':>6} {'fwd ms':>8} {'TFLOP/s':>7} {'dX ms':>8} {'TFLOP/s':>7} {'sum ms':>8}")
        for r in chunk_rows:
            print(f"{r['chunk_rows']:6d} {r['chunks']:6d} {r['fwd_ms']:8.3f} {r['fwd_TFLOPs']:7.1f} {r['bwd_ms']:8.3f} "
                  f"{r['bwd_TFLOPs']:7.1f} {r['fwd_ms'] + r['bwd_ms']:8.3f}")
    if cuda and not args.no_record:
        info = env_info()
        record_rows([{"op": "gemm_step", **r} for r in rows] + [{"op": "lm_head_chunks", **r} for r in chunk_rows],
                    info)
    return rows, chunk_rows


if __name__ == "__main__":
    main()
