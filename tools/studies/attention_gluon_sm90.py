"""The warp-specialized Gluon forwards (``kernels_gluon_sm90.py`` dense, ``kernels_gluon_sm90_dflash.py`` for
the DFlash mask; both chosen by the op's dispatch on sm_90) on a GPU of compute capability 9.0: each one's output
against a peer's, then its time against the peers.

    python3 -m tools.studies.attention_gluon_sm90 [--out FILE] [--quick]
        [--only dense|dflash|dflash_bwd|causal_bwd|causal_profile]

Shapes (bf16, D = 128): dense causal B=2, H=32, L=8192 (the attention issue's SDPA comparison), the same
without the mask, and causal B=4, L=4096 with GQA (32 query heads over 8 kv heads). Per shape one JSON row:
the relative Frobenius error of o against ``scaled_dot_product_attention`` (a self-check: the tests hold the
fp32 bounds), then ``do_bench`` medians of the Gluon forward, SDPA, and, for the causal shapes,
``block_sparse_attention`` with ``causal_block_mask`` (forward only, no autograd) under backend ``portable``
(``portable_ms``, its tuning as the runtime finds it) and through the op's default dispatch (``op_ms``: the
Gluon forward on sm_90, launched through the kernel cache). Effective TFLOP/s count visible pairs only
(``4 * D * H * pairs``). Rows are printed and appended to FILE when given.

DFlash shapes (bf16, D = 128, S = 3072 context, N = 512 anchors: q ``[B, 8192, 32, 128]``, k / v
``[B, 3072 + 8192, 8, 128]``; B = 1 and 4, window None and 2048): the inputs, sorted anchors and mask exactly
as ``benchmarks/bench_attention.py`` builds them (its ``_shape_inputs``). Per shape one row: the relative
Frobenius error of o against the portable forward (backend ``portable``) and whether the same rows see
nothing, then ``do_bench`` medians of the Gluon DFlash forward (its mask check, a device synchronisation, run
once before the clock) and of ``block_sparse_attention`` (forward only, no autograd) under backend ``portable``
(``portable_ms``) and through the op's default dispatch (``op_ms``), and
TFLOP/s over visible pairs as bench_attention counts them (``4 * D * Hq * visible_pairs``).

Backward (``--only dflash_bwd``, the same DFlash shapes): the Gluon backward (kernels_gluon_sm90_dflash_bwd.py:
delta, dq, dk / dv) against the portable launcher ``attention_bwd`` on the Gluon forward's o and lse; per shape
the relative errors of dq, dk, dv against the portable ones, ``do_bench`` medians of both, TFLOP/s over visible
pairs (``10 * D * Hq * pairs``) and the speedup.

Causal backward (``--only causal_bwd``, never in the default run; bf16, D = 128, B=2 H=32 L=8192 and B=4 L=4096
Hq 32 / Hkv 8): forward + backward (``torch.autograd.grad`` over q, k, v) of ``block_sparse_attention`` with
``causal_block_mask`` through the op's default dispatch (the Gluon causal forward and its Gluon backward sibling)
and the Gluon causal backward (kernels_gluon_sm90_causal_bwd.py) alone through its launcher on the Gluon forward's
o and lse, each against
``scaled_dot_product_attention(is_causal=True)`` in the same process; per shape the relative errors of dq, dk, dv
of the op (``rel_err_*_op_vs_sdpa``) and of the Gluon backward (``rel_err_*_gluon_vs_sdpa``) against SDPA's,
``do_bench`` medians of fwd + bwd for the op and SDPA (``op_fwd_bwd_ms``, ``sdpa_fwd_bwd_ms``), of the backward
alone (the Gluon launcher, delta included: ``gluon_bwd_ms``; SDPA's backward through ``torch.autograd.grad`` on a
retained graph: ``sdpa_bwd_ms``), TFLOP/s over visible pairs (``4 * D * H * pairs`` forward, ``10 * D * H *
pairs`` backward) and the ratios to SDPA. The Gluon backward runs last (after the op's and SDPA's timings, errors
included): a fault it causes cannot spoil the others' numbers.

Causal profile (``--only causal_profile``, never in the default run; B=2 H=32 L=8192): each kernel's device time of
the op's forward + backward and of SDPA's cuDNN backend under ``torch.profiler``, ``do_bench`` medians of three
interleaved rounds (the launcher, the op and SDPA, forward and forward + backward) and the op's Python time per call.

A forward that hangs (the prototype's barriers never ran on a GPU before) is cut by the
caller's timeout: run it under ``timeout``.
"""

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

SHAPES = [dict(B=2, H=32, Hkv=32, L=8192, D=128, causal=True), dict(B=2, H=32, Hkv=32, L=8192, D=128, causal=False),
          dict(B=4, H=32, Hkv=8, L=4096, D=128, causal=True)]
CAUSAL_BWD_SHAPES = [dict(B=2, H=32, Hkv=32, L=8192, D=128), dict(B=4, H=32, Hkv=8, L=4096, D=128)]
DFLASH_SHAPES = [dict(B=B, S=3072, N=512, Hq=32, Hkv=8, D=128, window=w) for B in (1, 4) for w in (None, 2048)]


@contextlib.contextmanager
def _backend(name):
    """The attention op under backend ``name`` (``auto``: the default dispatch) for the block."""
    from dflash_kernels import set_backend

    set_backend("attention", name)
    try:
        yield
    finally:
        set_backend("attention", "auto")


def run(shape, quick=False):
    from dflash_kernels import block_sparse_attention, causal_block_mask
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90

    B, H, Hkv, L, D, causal = (shape[k] for k in ("B", "H", "Hkv", "L", "D", "causal"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = D ** -0.5
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=Hkv != H)

    o, _ = attention_fwd_gluon_sm90(q, k, v, causal, scale)
    ref = sdpa().transpose(1, 2).float()
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **shape,
           "rel_err_vs_sdpa": ((o.float() - ref).norm() / ref.norm()).item()}
    reps = dict(warmup=10, rep=50) if quick else {}
    row["gluon_ms"] = do_bench(lambda: attention_fwd_gluon_sm90(q, k, v, causal, scale), **reps)
    row["sdpa_ms"] = do_bench(sdpa, **reps)
    if causal:
        mask = causal_block_mask(L, device="cuda")
        for key, backend in (("portable_ms", "portable"), ("op_ms", "auto")):
            with _backend(backend), torch.no_grad():
                block_sparse_attention(q, k, v, mask)  # compiled and tuned before the clock
                row[key] = do_bench(lambda: block_sparse_attention(q, k, v, mask), **reps)
    pairs = B * H * (L * (L + 1) // 2 if causal else L * L)
    for key in [x for x in row if x.endswith("_ms")]:
        row[key[:-3] + "_TFLOPs"] = 4 * D * pairs / row[key] / 1e9
    return row


def run_dflash(shape, quick=False):
    from benchmarks.bench_attention import _shape_inputs
    from dflash_kernels import block_sparse_attention
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import attention_fwd_gluon_sm90_dflash

    _, q, k, v, _, mask, pairs = _shape_inputs(shape, torch.device("cuda"), torch.bfloat16)
    q, k, v = (x.detach() for x in (q, k, v))
    scale = shape["D"] ** -0.5
    o, lse = attention_fwd_gluon_sm90_dflash(q, k, v, mask, scale)  # checks the mask's form once
    with _backend("portable"), torch.no_grad():
        po, plse = block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)  # compiled and tuned
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mask": "dflash", **shape,
           "visible_pairs": pairs, "rel_err_vs_portable": ((o.float() - po.float()).norm() / po.float().norm()).item(),
           "same_unseen_rows": bool(torch.equal(lse.isinf(), plse.isinf()))}
    reps = dict(warmup=10, rep=50) if quick else {}
    row["gluon_ms"] = do_bench(lambda: attention_fwd_gluon_sm90_dflash(q, k, v, mask, scale, check_mask=False),
                               **reps)
    for key, backend in (("portable_ms", "portable"), ("op_ms", "auto")):
        with _backend(backend), torch.no_grad():
            block_sparse_attention(q, k, v, mask, scale=scale)  # compiled before the clock
            row[key] = do_bench(lambda: block_sparse_attention(q, k, v, mask, scale=scale), **reps)
    for key in [x for x in row if x.endswith("_ms")]:
        row[key[:-3] + "_TFLOPs"] = 4 * shape["D"] * shape["Hq"] * pairs / row[key] / 1e9
    return row


def run_dflash_bwd(shape, quick=False):
    """The DFlash shapes' backward: the Gluon backward (kernels_gluon_sm90_dflash_bwd.py, on the Gluon
    forward's o and lse, delta included) against the portable launcher ``attention_bwd`` (kernels.py's
    preprocess, dq and dk / dv kernels; its tuning as the runtime finds it) on the same inputs; relative
    errors of dq, dk, dv against the portable ones, then ``do_bench`` medians and TFLOP/s over visible pairs
    (``10 * D * Hq * visible_pairs``: the backward's five matmuls)."""
    from benchmarks.bench_attention import _shape_inputs
    from dflash_kernels.ops.attention.attention import attention_bwd
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash import attention_fwd_gluon_sm90_dflash
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import attention_bwd_gluon_sm90_dflash

    _, q, k, v, _, mask, pairs = _shape_inputs(shape, torch.device("cuda"), torch.bfloat16)
    q, k, v = (x.detach() for x in (q, k, v))
    scale = shape["D"] ** -0.5
    o, lse = attention_fwd_gluon_sm90_dflash(q, k, v, mask, scale)  # checks the mask's form once
    do = torch.randn_like(o)
    fields = tuple(t.contiguous() for t in (mask.segments, mask.seg_count, mask.tiles, mask.rev_offsets,
                                            mask.rev_full, mask.rev_entries))

    def gluon_bwd():
        return attention_bwd_gluon_sm90_dflash(do, q, k, v, o, lse, mask, scale, check_mask=False)

    def portable_bwd():
        return attention_bwd(do, q, k, v, o, lse, *fields, mask.q_block, mask.kv_tile, mask.tile_width, scale)

    got, ref = gluon_bwd(), portable_bwd()  # compiled (and the portable one tuned) before the clock
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mask": "dflash", "pass": "bwd",
           **shape, "visible_pairs": pairs}
    for name, x, y in zip(("dq", "dk", "dv"), got, ref):
        row[f"rel_err_{name}_vs_portable"] = ((x.float() - y.float()).norm() / y.float().norm()).item()
    reps = dict(warmup=10, rep=50) if quick else {}
    row["gluon_bwd_ms"] = do_bench(gluon_bwd, **reps)
    row["portable_bwd_ms"] = do_bench(portable_bwd, **reps)
    for key in [x for x in row if x.endswith("_ms")]:
        row[key[:-3] + "_TFLOPs"] = 10 * shape["D"] * shape["Hq"] * pairs / row[key] / 1e9
    row["speedup"] = row["portable_bwd_ms"] / row["gluon_bwd_ms"]
    return row


def _causal_inputs(shape):
    """The causal studies' inputs at ``shape`` (B, H, Hkv, L, D): seeded bf16 q, k, v and the upstream gradient
    ``[B, L, heads, D]``, leaf copies of q, k, v for autograd, the scale and ``causal_block_mask(L)``."""
    from dflash_kernels import causal_block_mask

    B, H, Hkv, L, D = (shape[k] for k in ("B", "H", "Hkv", "L", "D"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, L, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for n in (H, Hkv, Hkv, H))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    return q, k, v, do, qg, kg, vg, D ** -0.5, causal_block_mask(L, device="cuda")


def run_causal_bwd(shape, quick=False):
    """Dense causal forward + backward through the op (on sm_90 the Gluon forward and the Gluon backward) and the
    Gluon causal backward alone through its launcher, each against SDPA (module docstring, ``--only causal_bwd``)."""
    from dflash_kernels import block_sparse_attention
    from dflash_kernels.ops.attention.attention import forward_path
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90
    from dflash_kernels.ops.attention.kernels_gluon_sm90_causal_bwd import attention_bwd_gluon_sm90_causal

    B, H, Hkv, L, D = (shape[k] for k in ("B", "H", "Hkv", "L", "D"))
    q, k, v, do, qg, kg, vg, scale, mask = _causal_inputs(shape)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    do_t = do.transpose(1, 2)

    def op_fwd_bwd():
        o = block_sparse_attention(qg, kg, vg, mask, scale=scale)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    def sdpa_fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=Hkv != H)

    def sdpa_fwd_bwd():
        return torch.autograd.grad(sdpa_fwd(), (qt, kt, vt), do_t)

    def errors(got, tag):
        for name, x, y in zip(("dq", "dk", "dv"), got, ref):
            y = y.transpose(1, 2).float()
            row[f"rel_err_{name}_{tag}_vs_sdpa"] = ((x.float() - y).norm() / y.norm()).item()

    got, ref = op_fwd_bwd(), sdpa_fwd_bwd()  # compiled before the clock
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mask": "causal", "pass": "fwd+bwd",
           "op_path": forward_path(q, k, v, mask), **shape}
    errors(got, "op")
    reps = dict(warmup=10, rep=50) if quick else {}
    row["op_fwd_bwd_ms"] = do_bench(op_fwd_bwd, **reps)
    row["sdpa_fwd_bwd_ms"] = do_bench(sdpa_fwd_bwd, **reps)
    out = sdpa_fwd()
    row["sdpa_bwd_ms"] = do_bench(lambda: torch.autograd.grad(out, (qt, kt, vt), do_t, retain_graph=True), **reps)
    o, lse = attention_fwd_gluon_sm90(q, k, v, True, scale)

    def gluon_bwd():
        return attention_bwd_gluon_sm90_causal(do, q, k, v, o, lse, scale)

    errors(gluon_bwd(), "gluon")
    torch.cuda.synchronize()
    row["gluon_bwd_ms"] = do_bench(gluon_bwd, **reps)
    pairs = B * H * (L * (L + 1) // 2)
    for key, flops in (("op_fwd_bwd_ms", 14), ("sdpa_fwd_bwd_ms", 14), ("gluon_bwd_ms", 10), ("sdpa_bwd_ms", 10)):
        row[key[:-3] + "_TFLOPs"] = flops * D * pairs / row[key] / 1e9
    row["fwd_bwd_vs_sdpa"] = row["op_fwd_bwd_ms"] / row["sdpa_fwd_bwd_ms"]
    row["gluon_bwd_vs_sdpa"] = row["gluon_bwd_ms"] / row["sdpa_bwd_ms"]
    return row


def run_causal_profile(shape, quick=False):
    """Where the dense causal forward + backward's time goes (``--only causal_profile``): each kernel's device time
    under ``torch.profiler`` (mean of 3 calls, right after warm-up) for the op and for SDPA's cuDNN backend, then
    ``do_bench`` medians of 3 interleaved rounds of the launcher, the op and SDPA (its default and cuDNN), forward
    and forward + backward, and the op's Python time per forward call (20 calls queued, no synchronisation)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from dflash_kernels import block_sparse_attention
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90

    H, Hkv = shape["H"], shape["Hkv"]
    q, k, v, do, qg, kg, vg, scale, mask = _causal_inputs(shape)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous() for x in (q, k, v))
    qtg, ktg, vtg = (x.detach().requires_grad_() for x in (qt, kt, vt))
    do_t = do.transpose(1, 2).contiguous()

    def cudnn(fn):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return fn()
        return run

    def op_fwd():
        with torch.no_grad():
            return block_sparse_attention(q, k, v, mask, scale=scale)

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=Hkv != H)

    fns = {"launcher_fwd": lambda: attention_fwd_gluon_sm90(q, k, v, True, scale), "op_fwd": op_fwd,
           "sdpa_fwd": sdpa_fwd, "sdpa_cudnn_fwd": cudnn(sdpa_fwd),
           "op_fwd_bwd": lambda: torch.autograd.grad(block_sparse_attention(qg, kg, vg, mask, scale=scale),
                                                     (qg, kg, vg), do),
           "sdpa_fwd_bwd": lambda: torch.autograd.grad(F.scaled_dot_product_attention(
               qtg, ktg, vtg, is_causal=True, scale=scale, enable_gqa=Hkv != H), (qtg, ktg, vtg), do_t)}
    fns["sdpa_cudnn_fwd_bwd"] = cudnn(fns["sdpa_fwd_bwd"])
    for fn in fns.values():  # compiled before the clock
        fn()
    torch.cuda.synchronize()
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mask": "causal", "pass": "profile",
           **shape, "kernels_ms": {}}
    for name in ("op_fwd_bwd", "sdpa_cudnn_fwd_bwd"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fns[name]()
            torch.cuda.synchronize()
        row["kernels_ms"][name] = {e.key[:80]: e.device_time_total / 3e3 for e in prof.key_averages()
                                   if e.device_time_total > 0}
    for name in ("op_fwd", "launcher_fwd"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fns[name]()
        row[f"{name}_python_us"] = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
    reps = dict(warmup=10, rep=50) if quick else dict(warmup=25, rep=100)
    rounds = {}
    for _ in range(3):
        for name, fn in fns.items():
            rounds.setdefault(name, []).append(do_bench(fn, **reps))
    row.update({f"{name}_ms": sorted(x)[1] for name, x in rounds.items()})
    row["op_fwd_bwd_vs_sdpa_cudnn"] = row["op_fwd_bwd_ms"] / row["sdpa_cudnn_fwd_bwd_ms"]
    row["op_kernels_vs_sdpa_cudnn_kernels"] = (sum(row["kernels_ms"]["op_fwd_bwd"].values())
                                               / sum(row["kernels_ms"]["sdpa_cudnn_fwd_bwd"].values()))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", metavar="FILE", help="append the rows to FILE as JSON lines")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument("--only", choices=("dense", "dflash", "dflash_bwd", "causal_bwd", "causal_profile"),
                        help="run one kernel's shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("attention_gluon_sm90: needs a GPU of compute capability 9.0 (H100 / H200)")
    runs = [(run, x) for x in SHAPES] if args.only in (None, "dense") else []
    runs += [(run_dflash, x) for x in DFLASH_SHAPES] if args.only in (None, "dflash") else []
    runs += [(run_dflash_bwd, x) for x in DFLASH_SHAPES] if args.only in (None, "dflash_bwd") else []
    # not in the default run (module docstring)
    runs += [(run_causal_bwd, x) for x in CAUSAL_BWD_SHAPES] if args.only == "causal_bwd" else []
    runs += [(run_causal_profile, CAUSAL_BWD_SHAPES[0])] if args.only == "causal_profile" else []
    for fn, shape in runs:
        row = fn(shape, args.quick)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
