"""What the mode A/B studies share (ab_gdn_bwd_local.py, ab_gdn_fwd_prepare.py, ab_gdn_fwd_gluon.py): a library
switch read from an environment variable, each mode timed in a process of its own over ``benchmarks/bench_gdn.py``'s
shape sets.

- :func:`with_env`: run a function with the variable set to another mode (the worker's ``--check`` against the
  default mode, in the same process and on the same inputs).
- :func:`device_us`: device microseconds per call by kernel name (torch.profiler).
- :func:`gdn_rows`: a worker's loop over the GDN shapes (inputs, one row each, a shape's failure kept in its row).
- :func:`time_forward`: the forward studies' timings of one shape.
- :func:`speedup_table`: the forward studies' table (forward and forward + backward against the default mode).
- :func:`main`: the parent's command line: ``--modes``, ``--shapes``, ``--check``, ``--quick``, ``--out``,
  ``--no-record``, ``--timeout`` and the hidden ``--worker``; one child process per mode, the rows printed as a
  table, written to ``--out`` and appended to ``benchmarks/results/ops.jsonl`` on a GPU.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def with_env(name, value, fn):
    """``fn()`` with the environment variable ``name`` set to ``value``, restored afterwards."""
    prev = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if prev is None:
            del os.environ[name]
        else:
            os.environ[name] = prev


def device_us(fn, calls=5):
    """Device microseconds per call of ``fn``, by kernel name (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls for e in prof.key_averages() if e.self_device_time_total > 0}


def gdn_rows(op, mode, env, only, fill):
    """A worker's rows over ``bench_gdn``'s ``issue45`` shapes (``only``: their labels), printed as ``ROW {json}``
    lines: per shape, seeded inputs (q, k, v, g, beta; bf16 on a GPU, fp32 tiny shapes on a CPU), the op's keywords
    (l2norm in the kernel, the packed shapes' ``cu_seqlens``) and an upstream gradient, then ``fill(row, case)``
    adds the measurements (``case``: ``shape``, ``tensors``, ``kwargs``, ``do``, ``device``, ``dtype``, ``cuda``).
    An exception (out of memory, say) costs its shape's row only: ``row["error"]``."""
    from types import SimpleNamespace

    import torch
    from bench_gdn import _cu_seqlens, _inputs, _shape_name, _shape_set

    assert os.environ.get(env) == mode, (os.environ.get(env), mode)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    for label, s in _shape_set("issue45", only, cuda).items():
        row = {"op": op, "impl": mode, "label": label, "shape": _shape_name(s), "dtype": str(dtype)}
        try:
            torch.manual_seed(0)
            tensors = _inputs(s, device, dtype)
            kwargs = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=_cu_seqlens(s, device))
            do = torch.randn(s["B"], s["T"], s["Hv"], s["V"], device=device, dtype=dtype)
            fill(row, SimpleNamespace(shape=s, tensors=tensors, kwargs=kwargs, do=do, device=device, dtype=dtype,
                                      cuda=cuda))
        except Exception as e:  # noqa: BLE001 - one shape's failure (out of memory, say) costs its row only
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("ROW", json.dumps(row), flush=True)
        if cuda:
            torch.cuda.empty_cache()


def time_forward(row, c, quick):
    """The forward studies' timings of the op at case ``c`` (:func:`gdn_rows`): ``fwd_ms`` (under no_grad),
    ``fwdbwd_ms`` (``torch.autograd.grad`` over the inputs), ``peak_MiB`` of the latter, and on a GPU
    ``fwd_device_us`` with the forward's heaviest kernels (``kernels_us``). Returns the forward's device
    microseconds by kernel (empty off the GPU)."""
    import torch
    from bench_common import bench_ms, peak_mib

    from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule

    def fwd():
        with torch.no_grad():
            return chunk_gated_delta_rule(*c.tensors, **c.kwargs)

    def fwd_bwd():
        return torch.autograd.grad(chunk_gated_delta_rule(*c.tensors, **c.kwargs)[0], c.tensors, c.do)

    row["fwd_ms"] = bench_ms(fwd, quick, c.cuda)
    row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, c.cuda)
    row["peak_MiB"] = peak_mib(fwd_bwd, c.cuda)
    if not c.cuda:
        return {}
    us = device_us(fwd)
    row["fwd_device_us"] = sum(us.values())
    row["kernels_us"] = {k: round(t, 1) for k, t in sorted(us.items(), key=lambda x: -x[1])[:8]}
    return us


def speedup_table(rows, base, extra=(), check=None):
    """The forward A/B studies' printed table: per row the forward's and the forward + backward's ms and their
    speed-ups against mode ``base`` at the same shape (also stored in the row: ``fwd_speedup_vs_<base>``,
    ``fwdbwd_speedup_vs_<base>``), the ``extra`` columns ``(header, key)`` (one decimal), and ``check(row)``
    (default: the row's ``check``); a row with an error prints it instead."""
    ref = {r["label"]: r for r in rows if r.get("impl") == base and isinstance(r.get("fwdbwd_ms"), float)}
    vs = f"vs {base}"
    keys = (f"fwd_speedup_vs_{base}", f"fwdbwd_speedup_vs_{base}")
    lines = [f"{'shape':16s} {'mode':6s} {'fwd ms':>8s} {vs:>9s} {'fwd+bwd ms':>10s} {vs:>9s} "
             + "".join(f"{h:>10s} " for h, _ in extra) + " check"]
    for r in rows:
        if "error" in r or "fwdbwd_ms" not in r:
            lines.append(f"{r.get('label', '-'):16s} {r.get('impl', '-'):6s} error: {r.get('error', '?')[:150]}")
            continue
        b = ref.get(r["label"])
        if b is not None:
            r[keys[0]], r[keys[1]] = b["fwd_ms"] / r["fwd_ms"], b["fwdbwd_ms"] / r["fwdbwd_ms"]
        fwd, both = (f"{r[k]:.3f}x" if k in r else "-" for k in keys)
        cols = "".join(f"{r.get(k, float('nan')):10.1f} " for _, k in extra)
        lines.append(f"{r['label']:16s} {r['impl']:6s} {r['fwd_ms']:8.3f} {fwd:>9s} {r['fwdbwd_ms']:10.3f} "
                     f"{both:>9s} {cols} {(check or (lambda x: x.get('check', '')))(r)}")
    return "\n".join(lines)


def main(argv, *, module, op, modes, env, worker, table, doc, check_help):
    """The study's command line (module docstring). ``module``: the study's module name (``-m`` of its child
    processes); ``op``: its rows' op; ``modes``: the switch's values, the default first; ``env``: the switch's
    variable; ``worker(mode, only, check, quick)``: a child's rows, printed as ``ROW {json}`` lines;
    ``table(rows)``: the printed table."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(modes), help="modes to run, comma-separated (default: all)")
    p.add_argument("--shapes", default="", help="shape labels of the issue45 set, comma-separated (default: all)")
    p.add_argument("--check", action="store_true", help=check_help)
    p.add_argument("--quick", action="store_true", help="shorter do_bench runs")
    p.add_argument("--out", help="also write the rows to FILE as JSON lines")
    p.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per mode's process (default 1200)")
    p.add_argument("--worker", choices=modes, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    only = [x for x in args.shapes.split(",") if x] or None
    if args.worker:
        return worker(args.worker, only, args.check, args.quick)
    chosen = [m for m in args.modes.split(",") if m]
    bad = [m for m in chosen if m not in modes]
    if bad:
        raise SystemExit(f"{module.rsplit('.', 1)[-1]}: unknown modes {bad}; choose from {', '.join(modes)}")

    import torch
    from bench_common import run_rows

    rows = []
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for mode in chosen:
        cmd = [sys.executable, "-m", module, "--worker", mode]
        cmd += (["--shapes", ",".join(only)] if only else []) + (["--check"] if args.check else [])
        cmd += ["--quick"] if args.quick else []
        rows += run_rows(cmd, op, mode, args.timeout, env={**child_env, env: mode})
    print(table(rows))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if not args.no_record and torch.cuda.is_available():
        from ops import record_rows
        record_rows(rows)
    return rows
