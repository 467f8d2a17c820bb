"""The DFlash step's fused elementwise ops: dflash_kernels' ``rms_norm`` / ``apply_rope`` / ``swiglu``
against Liger Kernel 0.8.5 and the eager torch chains they replace, each implementation in a process of
its own.

    python benchmarks/bench_fused.py [--impls eager,liger,ours] [--cases rms8192_w,...] [--no-record]

Cases (bf16 activations):
- ``rms8192_w`` / ``rms3072_w``: RMSNorm ``[8192 | 3072, 2560]``, offset 0, fp32 weight (the drafter's
  norms under autocast); ``rms8192_1pw`` / ``rms3072_1pw``: offset 1, bf16 weight (the target's
  Qwen3.5 ``(1 + w)`` norms). Eager: the drafter's chain / transformers' ``Qwen3_5RMSNorm`` formula;
  Liger: ``liger_rms_norm(x, w, eps, offset, casting_mode="gemma")`` (fp32 inside, as ours).
- ``rope_q``: q ``[1, 8192, 32, 128]``; ``rope_k``: k ``[1, 3072 + 8192, 8, 128]``; cos / sin
  ``[1, T, 1, 128]`` bf16 (the drafter's). Eager: the drafter's ``apply_rope`` chain; Liger:
  ``liger_rope`` takes q and k together with one sequence length, so it gets the tensor timed plus a
  one-head companion (head-major views, as transformers passes them), a few percent more work; it
  rotates them in place, so the output error is taken against a reference computed first.
- ``swiglu``: gate, up ``[8192, 9216]``. Eager: ``F.silu(g) * u``; Liger: ``LigerSiLUMulFunction``.
- ``addrms8192_w``: the residual add and RMSNorm of the drafter's layers, x and residual ``[8192, 2560]``,
  fp32 weight, both outputs (the norm and the sum) given a gradient. Eager: ``x + r`` then the drafter's
  chain; Liger: ``liger_fused_add_rms_norm(x, r, w, eps, 0, casting_mode="gemma", in_place=False)``;
  ours: ``fused_add_rms_norm``.

Times are ``triton.testing.do_bench`` medians (``bench_common.bench_ms``): the forward with inputs not
requiring grad, and forward + backward as ``torch.autograd.grad`` over every input that takes a
gradient (x and weight; x; gate and up; x, residual and weight). Each row also gives the output's relative
error against the fp32 reference (``naive.py``). Each implementation runs every case in a fresh process
(``--impl NAME``) that prints ``RESULT {json}`` lines; the table comes last and the rows are appended to
``benchmarks/results/ops.jsonl`` (ops ``rms_norm``, ``rope``, ``swiglu``, ``add_rms_norm``). Without a CUDA
device the script says so and exits.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_common import bench_ms  # noqa: E402

IMPLS = ["eager", "liger", "ours"]
CASES = {
    "rms8192_w": dict(op="rms_norm", N=8192, D=2560, offset=0.0, wdtype=torch.float32),
    "rms3072_w": dict(op="rms_norm", N=3072, D=2560, offset=0.0, wdtype=torch.float32),
    "rms8192_1pw": dict(op="rms_norm", N=8192, D=2560, offset=1.0, wdtype=torch.bfloat16),
    "rms3072_1pw": dict(op="rms_norm", N=3072, D=2560, offset=1.0, wdtype=torch.bfloat16),
    "rope_q": dict(op="rope", B=1, T=8192, H=32, D=128),
    "rope_k": dict(op="rope", B=1, T=3072 + 8192, H=8, D=128),
    "swiglu": dict(op="swiglu", N=8192, C=9216),
    "addrms8192_w": dict(op="add_rms_norm", N=8192, D=2560, offset=0.0, wdtype=torch.float32),
}
EPS = 1e-6


def _shape(c):
    if c["op"] in ("rms_norm", "add_rms_norm"):
        return f"[{c['N']},{c['D']}] offset={c['offset']:g} w={str(c['wdtype']).replace('torch.', '')}"
    if c["op"] == "rope":
        return f"[{c['B']},{c['T']},{c['H']},{c['D']}]"
    return f"[{c['N']},{c['C']}]"


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------ implementations
def _eager_rms(x, w, offset):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if offset:
        return (xf * (1.0 + w.float())).type_as(x)
    return (w.float() * xf).to(x.dtype)


def _eager_rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def rms_fn(impl):
    if impl == "eager":
        return _eager_rms
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_rms_norm
        return lambda x, w, offset: liger_rms_norm(x, w, EPS, offset, casting_mode="gemma")
    from dflash_kernels.ops.rms_norm import rms_norm
    return lambda x, w, offset: rms_norm(x, w, EPS, offset)


def add_rms_fn(impl):
    if impl == "eager":
        def run(x, r, w, offset):
            h = x + r
            return _eager_rms(h, w, offset), h
        return run
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_add_rms_norm
        return lambda x, r, w, offset: liger_fused_add_rms_norm(x, r, w, EPS, offset, casting_mode="gemma",
                                                                in_place=False)
    from dflash_kernels.ops.rms_norm import fused_add_rms_norm
    return lambda x, r, w, offset: fused_add_rms_norm(x, r, w, EPS, offset)


def rope_fn(impl):
    if impl == "eager":
        return _eager_rope
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_rope

        def run(x, cos, sin, _extra={}):
            B, T = x.shape[:2]
            if "k" not in _extra or _extra["k"].shape[:2] != (B, T):
                _extra["k"] = torch.zeros(B, T, 1, x.shape[-1], device=x.device, dtype=x.dtype)
            q, _ = liger_rope(x.transpose(1, 2), _extra["k"].transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
            return q.transpose(1, 2)
        return run
    from dflash_kernels.ops.rope import apply_rope
    return apply_rope


def swiglu_fn(impl):
    if impl == "eager":
        return lambda g, u: F.silu(g) * u
    if impl == "liger":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        return LigerSiLUMulFunction.apply
    from dflash_kernels.ops.swiglu import swiglu
    return swiglu


def _inputs(c, dev):
    bf = torch.bfloat16
    if c["op"] == "add_rms_norm":
        x = (torch.randn(c["N"], c["D"], device=dev) * 2).to(bf)
        r = (torch.randn(c["N"], c["D"], device=dev) * 4).to(bf)
        w = (torch.randn(c["D"], device=dev) * 0.2 + 1.0).to(c["wdtype"])
        return [x, r, w], [True, True, True]
    if c["op"] == "rms_norm":
        x = (torch.randn(c["N"], c["D"], device=dev) * 2).to(bf)
        w = (torch.randn(c["D"], device=dev) * 0.2 + (0.0 if c["offset"] else 1.0)).to(c["wdtype"])
        return [x, w], [True, True]
    if c["op"] == "rope":
        B, T, H, D = c["B"], c["T"], c["H"], c["D"]
        x = torch.randn(B, T, H, D, device=dev).to(bf)
        inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D)
        ang = torch.arange(T, device=dev, dtype=torch.float64)[None, :, None] * inv
        ang = torch.cat([ang, ang], -1)[:, :, None, :]
        return [x, ang.cos().to(bf), ang.sin().to(bf)], [True, False, False]
    g = (torch.randn(c["N"], c["C"], device=dev) * 2).to(bf)
    u = torch.randn(c["N"], c["C"], device=dev).to(bf)
    return [g, u], [True, True]


def _reference(c, args):
    if c["op"] == "add_rms_norm":
        from dflash_kernels.ops.rms_norm.naive import naive_fused_add_rms_norm
        return naive_fused_add_rms_norm(args[0].float(), args[1].float(), args[2], EPS, c["offset"])[0]
    if c["op"] == "rms_norm":
        from dflash_kernels.ops.rms_norm.naive import naive_rms_norm
        return naive_rms_norm(args[0], args[1], EPS, c["offset"]).float()
    if c["op"] == "rope":
        from dflash_kernels.ops.rope.naive import naive_apply_rope
        return naive_apply_rope(args[0].float(), args[1], args[2])
    from dflash_kernels.ops.swiglu.naive import naive_swiglu
    return naive_swiglu(args[0].float(), args[1].float())


def measure(impl: str, cname: str) -> dict:
    c = CASES[cname]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    fn = {"rms_norm": rms_fn, "rope": rope_fn, "swiglu": swiglu_fn, "add_rms_norm": add_rms_fn}[c["op"]](impl)
    args, needs = _inputs(c, dev)
    extra = (c["offset"],) if c["op"] in ("rms_norm", "add_rms_norm") else ()
    row = {"op": c["op"], "impl": impl, "case": cname, "shape": _shape(c), "dtype": "torch.bfloat16"}
    with torch.no_grad():
        # The reference first: Liger's RoPE rotates q and k in place (its inputs are projection
        # outputs nobody reads again), so after the call the inputs are no longer the inputs.
        ref = _reference(c, args)
        out = fn(*args, *extra)
        outs = out if isinstance(out, tuple) else (out,)  # add_rms_norm: (norm, sum); the error is the norm's
        row["out_rel_err"] = _rel(outs[0].float(), ref)
        del ref
        row["fwd_ms"] = bench_ms(lambda: fn(*args, *extra))
    leaves = [a.detach().clone().requires_grad_(n) for a, n in zip(args, needs)]
    grads_of = [t for t in leaves if t.requires_grad]
    dys = [torch.randn_like(o) for o in outs]

    def fwd_bwd():
        y = fn(*leaves, *extra)
        return torch.autograd.grad(y if isinstance(y, tuple) else (y,), grads_of, dys)
    fwd_bwd()
    row["fwdbwd_ms"] = bench_ms(fwd_bwd)
    moved = sum(a.numel() * a.element_size() for a in args) + sum(o.numel() * o.element_size() for o in outs)
    row["fwd_GBps"] = moved / row["fwd_ms"] / 1e6
    return row


# ------------------------------------------------------------------------------------ driver
def _spawn(impl: str, cases: list, timeout: float) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--cases", ",".join(cases)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return [{"op": CASES[c]["op"], "impl": impl, "case": c, "shape": _shape(CASES[c]),
                 "error": f"timed out after {timeout:.0f}s"} for c in cases]
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    done = {r["case"] for r in rows}
    tail = (proc.stderr or proc.stdout)[-600:].replace("\n", " | ")
    rows += [{"op": CASES[c]["op"], "impl": impl, "case": c, "shape": _shape(CASES[c]),
              "error": f"exit {proc.returncode}: {tail}"} for c in cases if c not in done]
    for r in rows:
        r["process_s"] = round(time.time() - t0, 1)
    return rows


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def add_ratios(rows):
    for case in {r["case"] for r in rows}:
        at = {r["impl"]: r for r in rows if r["case"] == case}
        for key in ("fwd_ms", "fwdbwd_ms"):
            for base in ("eager", "liger"):
                b = at.get(base, {}).get(key)
                for r in at.values():
                    if _num(b) and _num(r.get(key)):
                        r[f"{key[:-3]}_vs_{base}"] = r[key] / b


def print_table(rows):
    cols = [("case", "case", "{}"), ("shape", "shape", "{}"), ("impl", "impl", "{}"), ("fwd_ms", "fwd ms", "{:.3f}"),
            ("fwdbwd_ms", "fwd+bwd ms", "{:.3f}"), ("fwd_vs_eager", "fwd/eager", "{:.2f}"),
            ("fwdbwd_vs_eager", "f+b/eager", "{:.2f}"), ("fwd_vs_liger", "fwd/liger", "{:.2f}"),
            ("fwdbwd_vs_liger", "f+b/liger", "{:.2f}"), ("fwd_GBps", "fwd GB/s", "{:.0f}"),
            ("out_rel_err", "out err", "{:.1e}")]
    table = [[t for _, t, _ in cols] + ["error"]]
    for r in sorted(rows, key=lambda r: (list(CASES).index(r["case"]), IMPLS.index(r["impl"]))):
        line = []
        for key, _, fmt in cols:
            v = r.get(key)
            line.append("-" if v is None else fmt.format(v))
        line.append(r.get("error", ""))
        table.append(line)
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print(" | ".join(x.ljust(w) for x, w in zip(t, widths)) + " | " + t[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="", help=f"comma-separated subset of {IMPLS}")
    parser.add_argument("--cases", default="", help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per implementation's process")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    parser.add_argument("--impl", help=argparse.SUPPRESS)  # child mode: one implementation, the cases given
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c] or list(CASES)
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}; choose from {list(CASES)}")
    if args.impl:
        for c in cases:
            try:
                row = measure(args.impl, c)
            except Exception as e:  # noqa: BLE001 - one failing case costs its row only
                row = {"op": CASES[c]["op"], "impl": args.impl, "case": c, "shape": _shape(CASES[c]),
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print("RESULT " + json.dumps(row), flush=True)
            torch.cuda.empty_cache()
        return
    impls = [i for i in args.impls.split(",") if i] or IMPLS
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from {IMPLS}")
    if not torch.cuda.is_available():
        print("bench_fused: no CUDA device on this machine. It times GPU kernels (ours, Liger Kernel, eager "
              "torch) at the real step's shapes; nothing was run or recorded. Run it on the GPU machine with "
              "liger_kernel importable (PYTHONPATH).")
        return
    rows = []
    for impl in impls:
        print(f"  bench_fused {impl} ...", flush=True)
        got = _spawn(impl, cases, args.timeout)
        for r in got:
            print("ROW", json.dumps(r), flush=True)
        rows += got
    add_ratios(rows)
    print()
    print_table(rows)
    if not args.no_record:
        from ops import record_rows
        record_rows(rows)


if __name__ == "__main__":
    main()
