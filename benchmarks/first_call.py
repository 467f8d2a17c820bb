"""First calls on a fresh machine: each public op's first forward and backward, in a process of its own with
empty caches, at a shape the package's shipped caches cover and at one they do not.

    python benchmarks/first_call.py [--ops attention,gdn,conv1d,linear_cross_entropy,rms_norm,swiglu]
                                    [--cases covered,uncovered] [--json FILE]

``covered``: the op benchmarks' shapes (``python -m dflash_kernels.precompile --preset ops``), with the shipped
tuning and compiled kernels. ``uncovered``: another shape bucket, with the shipped tuning and kernels turned off
(``DFLASH_KERNELS_PACKAGED_TUNING=0``, ``DFLASH_KERNELS_SHIPPED_KERNELS=0``): a GPU the package ships nothing for,
so the call compiles and tunes. Each process gets new empty ``TRITON_CACHE_DIR`` and ``DFLASH_KERNELS_CACHE_DIR``
folders. The CUDA context and cuBLAS are started before the clock runs; the times are host wall time of the call
and a device synchronization (the op's own work is milliseconds). The second call's time is printed for
comparison. GPU only.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (covered shape: one of --preset ops's, uncovered shape: another bucket of every size)
CASES = {
    "attention": (dict(B=1, S=3072, N=512, Hq=32, Hkv=8, D=128), dict(B=2, S=1500, N=200, Hq=16, Hkv=4, D=64)),
    "gdn": (dict(B=1, T=8192, Hk=16, Hv=32, K=128, V=128), dict(B=2, T=1500, Hk=8, Hv=16, K=128, V=128)),
    "conv1d": (dict(B=1, D=10240, T=4096, W=4), dict(B=2, D=3000, T=1500, W=4)),
    "linear_cross_entropy": (dict(N=8192, H=2560, V=248320), dict(N=3000, H=1024, V=50000)),
    "rms_norm": (dict(N=3072, D=2560), dict(N=1500, D=1000)),
    "swiglu": (dict(N=3072, C=9728), dict(N=1500, C=3000)),
}


def run_op(op: str, s: dict, dev):
    """Inputs, then (forward, backward) closures of ``op`` at ``s`` (bf16; every input with a gradient in training)."""
    import dflash_kernels as dk

    bf = dict(device=dev, dtype=torch.bfloat16)
    if op == "attention":
        S, N = s["S"], s["N"]
        anchors = torch.sort(torch.randperm(S - 16, device=dev)[:N]).values.view(1, N).expand(s["B"], N).contiguous()
        L = N * 16
        q = torch.randn(s["B"], L, s["Hq"], s["D"], **bf, requires_grad=True)
        k = torch.randn(s["B"], S + L, s["Hkv"], s["D"], **bf, requires_grad=True)
        v = torch.randn(s["B"], S + L, s["Hkv"], s["D"], **bf, requires_grad=True)
        ins = (q, k, v)

        def fwd():
            mask = dk.dflash_block_mask(anchors, S, 16)
            return dk.block_sparse_attention(q, k, v, mask)
    elif op == "gdn":
        B, T, Hk, Hv, K, V = (s[n] for n in ("B", "T", "Hk", "Hv", "K", "V"))
        q = torch.randn(B, T, Hk, K, **bf, requires_grad=True)
        k = torch.randn(B, T, Hk, K, **bf, requires_grad=True)
        v = torch.randn(B, T, Hv, V, **bf, requires_grad=True)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, device=dev)).requires_grad_(True)
        beta = torch.rand(B, T, Hv, **bf).requires_grad_(True)
        ins = (q, k, v, g, beta)

        def fwd():
            return dk.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    elif op == "conv1d":
        x = torch.randn(s["B"], s["D"], s["T"], **bf, requires_grad=True)
        w = torch.randn(s["D"], s["W"], **bf, requires_grad=True)
        b = torch.randn(s["D"], **bf, requires_grad=True)
        ins = (x, w, b)

        def fwd():
            return dk.causal_conv1d(x, w, b, activation="silu")
    elif op == "linear_cross_entropy":
        h = torch.randn(s["N"], s["H"], **bf, requires_grad=True)
        w = (torch.randn(s["V"], s["H"], **bf) * 0.02).requires_grad_(True)
        labels = torch.randint(0, s["V"], (s["N"],), device=dev)
        ins = (h, w)

        def fwd():
            return dk.linear_cross_entropy(h, w, labels)
    elif op == "rms_norm":
        x = torch.randn(s["N"], s["D"], **bf, requires_grad=True)
        w = torch.ones(s["D"], **bf, requires_grad=True)
        ins = (x, w)

        def fwd():
            return dk.rms_norm(x, w, 1e-6)
    elif op == "swiglu":
        x = torch.randn(s["N"], 2 * s["C"], **bf, requires_grad=True)
        ins = (x,)

        def fwd():
            return dk.swiglu_packed(x)
    else:
        raise ValueError(f"--ops: unknown op {op!r}; choose from {sorted(CASES)}")

    def bwd(out):  # a dense upstream gradient, as a training step's loss sends back
        return torch.autograd.grad(out, ins, torch.randn_like(out))
    return fwd, bwd


def child(op: str, case: str) -> dict:
    t_start = time.perf_counter()
    import dflash_kernels as dk

    t_import = time.perf_counter() - t_start
    dev = torch.device("cuda")
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    (a @ a).sum().item()  # CUDA context and cuBLAS before the clock
    # torch's own first autograd.grad with a gradient given imports torch.fx's symbolic shapes (sympy: about 2 s
    # where Python has no bytecode cache): every training process pays it once, whatever its ops
    b = a.float().requires_grad_()
    torch.autograd.grad(b * 2, b, torch.ones_like(b))
    shape = CASES[op][0 if case == "covered" else 1]
    fwd, bwd = run_op(op, shape, dev)
    torch.cuda.synchronize()
    times = {}
    for i in (1, 2):
        t0 = time.perf_counter()
        out = fwd()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        bwd(out)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        times[i] = (t1 - t0, t2 - t1)
    info = dk.cache_info()
    sources = {}
    for v in info.values():
        sources[v["tuned_from"]] = sources.get(v["tuned_from"], 0) + 1
    return {"op": op, "case": case, "shape": shape, "import_s": t_import, "first_fwd_s": times[1][0],
            "first_bwd_s": times[1][1], "second_fwd_s": times[2][0], "second_bwd_s": times[2][1],
            "kernels": len(info), "compile_s": sum(v["compile_s"] for v in info.values()),
            "tune_s": sum(v["tune_s"] for v in info.values()), "tuned_from": sources}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--cases", default="covered,uncovered", help="covered, uncovered or both")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--child", nargs=2, metavar=("OP", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(child(*args.child)), flush=True)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("first_call: needs a CUDA GPU (on a CPU the kernels are interpreted: nothing compiles)")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in CASES]
    if bad:
        p.error(f"--ops: unknown {bad}; choose from {sorted(CASES)}")
    cases = [c for c in args.cases.split(",") if c]
    if set(cases) - {"covered", "uncovered"}:
        p.error(f"--cases: covered and/or uncovered, got {args.cases!r}")
    rows = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; each row a process with empty caches")
    print(f"{'op':22} {'case':10} {'1st fwd s':>9} {'1st bwd s':>9} {'2nd fwd+bwd ms':>14} {'kernels':>7} "
          f"{'compile s':>9} {'tune s':>7}  tuning from")
    for op in ops:
        for case in cases:
            with tempfile.TemporaryDirectory(prefix="first_call_") as tmp:
                env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                           DFLASH_KERNELS_CACHE_DIR=os.path.join(tmp, "dk"), PYTHONPATH=ROOT)
                if case == "uncovered":
                    env.update(DFLASH_KERNELS_PACKAGED_TUNING="0", DFLASH_KERNELS_SHIPPED_KERNELS="0")
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", op, case], env=env,
                                   capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in r.stdout.splitlines() if x.startswith("ROW ")), None)
            if r.returncode or line is None:
                print(f"{op:22} {case:10} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
                rows.append({"op": op, "case": case, "error": r.stderr[-2000:]})
                continue
            row = json.loads(line[4:])
            rows.append(row)
            print(f"{op:22} {case:10} {row['first_fwd_s']:9.2f} {row['first_bwd_s']:9.2f} "
                  f"{(row['second_fwd_s'] + row['second_bwd_s']) * 1e3:14.1f} {row['kernels']:7d} "
                  f"{row['compile_s']:9.2f} {row['tune_s']:7.2f}  {row['tuned_from']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
