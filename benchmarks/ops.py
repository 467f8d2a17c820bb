"""Op benchmarks against the peers, in one run:
``python benchmarks/ops.py [conv|attention|gdn|linear_ce|overhead|all]``.

On a CUDA machine every op is timed at the shapes of the DFlash training step (Qwen3.5-class targets)
next to its peers (causal-conv1d, fla, torch.compile(flex_attention), Liger Kernel, Cut
Cross-Entropy) measured in the same run, with
``triton.testing.do_bench`` medians, and the rows are appended to ``benchmarks/results/ops.jsonl``
with the GPU name, torch / triton versions and the date. On a CPU-only machine it runs tiny shapes
through the interpreter/reference backends to show the job works, says so, and records nothing.
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash_kernels as dk  # noqa: E402
from bench_common import bench_ms, peak_mib  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ops.jsonl")


def env_info() -> dict:
    import triton
    info = {"torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return info


def record_rows(rows: list, info: dict = None) -> None:
    """Append ``rows`` to ``benchmarks/results/ops.jsonl``, each with the run's GPU, versions, date and command."""
    info = info or env_info()
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "a") as f:
        for r in rows:
            f.write(json.dumps({**info, **r}) + "\n")
    print(f"appended {len(rows)} rows to {RESULTS}")


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy, bytes read + written per second: the memory-bound ceiling."""
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------- conv
# bf16, W=4, SiLU, bias; x [B, C, T] channel-first (the "[channel_last]" rows: the transpose of a
# [B, T, C] tensor).
CONV_SHAPES = [(1, 10240, 4096), (4, 10240, 4096), (8, 10240, 16384)]
CONV_W = 4
HOST_SHAPE = (1, 64, 16)  # the host-cost rows: an input so small that the call's host path is the time
# One process per implementation, in this order, each under CONV_TIMEOUT_S: a fault or a hang costs
# only that implementation's rows, and no implementation inherits another's allocator or context state.
# The timeout is generous because tuning the Triton kernels (and auto's CUDA-vs-Triton timing) from a
# cold cache takes minutes.
CONV_IMPLS = ("copy", "causal_conv1d", "dflash:triton", "dflash:cuda", "dflash:auto", "torch_conv1d", "fla")
CONV_TIMEOUT_S = 300


def _shape_name(B, D, T):
    return f"B={B} D={D} T={T} W={CONV_W}"


def _emit(row: dict):
    """A child's result line, read back by the parent (``bench_conv``)."""
    print("ROW " + json.dumps(row), flush=True)


def _time_conv(name, shape, fwd, leaves, dy, quick, cuda, extra=None, dtype=torch.bfloat16) -> dict:
    """fwd ms and fwd+bwd ms (``torch.autograd.grad`` over ``leaves``, never ``.backward``: nothing
    accumulates into ``.grad``); ``leaves`` None: forward only."""
    B, D, T = shape
    x_bytes = B * D * T * dtype.itemsize
    row = {"op": "conv", "impl": name, "shape": _shape_name(B, D, T), **(extra or {})}
    row.setdefault("dtype", str(dtype))
    try:
        out = fwd()
        if leaves is not None:
            torch.autograd.grad(out, leaves, dy)
        row["fwd_ms"] = bench_ms(fwd, quick, cuda)
        if leaves is None:
            row["fwdbwd_ms"] = row["peak_MiB_fwdbwd"] = float("nan")
        else:
            row["fwdbwd_ms"] = bench_ms(lambda: torch.autograd.grad(fwd(), leaves, dy), quick, cuda)
            row["peak_MiB_fwdbwd"] = peak_mib(lambda: torch.autograd.grad(fwd(), leaves, dy), cuda)
        row["fwd_TBps"] = 2 * x_bytes / (row["fwd_ms"] * 1e-3) / 1e12  # read x, write y
        if cuda:
            torch.cuda.synchronize()  # an asynchronous fault shows in this row
    except Exception as e:  # noqa: BLE001 - a failing call is a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def _host_us(fn, n: int, cuda: bool) -> float:
    """Wall time per call of ``fn`` over ``n`` back-to-back calls with one sync at the end (best of 5):
    on a tiny input this is the host path's cost, the GPU being idle most of the time."""
    for _ in range(100):
        fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def _host_row(name, call, dev, quick, extra=None) -> dict:
    """µs per call of ``call(x, weight, bias)`` (SiLU) on HOST_SHAPE: forward, and forward + backward."""
    B, D, T = HOST_SHAPE
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(B, D, T, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(D, CONV_W, device=dev, dtype=dtype, requires_grad=True)
    b = torch.randn(D, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(B, D, T, device=dev, dtype=dtype)
    n = (200 if quick else 2000) if cuda else 20
    row = {"op": "conv_host", "impl": name, "shape": _shape_name(B, D, T), **(extra or {}), "dtype": str(dtype)}
    try:
        with torch.no_grad():
            row["fwd_us_per_call"] = _host_us(lambda: call(x, w, b), n, cuda)
        row["fwdbwd_us_per_call"] = _host_us(lambda: torch.autograd.grad(call(x, w, b), (x, w, b), dy), n, cuda)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def _auto_choice(conv_mod, x, w, bias) -> str:
    """Which implementation ``auto`` ran for this input's forward and backward (the runtime Choice)."""
    from dflash_kernels.ops.conv1d import cuda as conv_cuda
    if not conv_cuda.available():
        return "triton (extension not built)"
    got = []
    for kind, args in (("fwd", (x, w, bias, None, None, True, False)),
                       ("bwd", (x, None, x, w, bias, None, None, True))):
        impl = conv_mod._impl_choice.get(x.device, conv_mod._impl_bucket(kind, args))
        got.append(f"{kind}={impl or 'not chosen'}")
    return " ".join(got)


def conv_child(impl: str, quick: bool):
    """Time one implementation (``CONV_IMPLS``) at every shape; rows go to stdout as ``ROW {json}``."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shapes = CONV_SHAPES if cuda else [(1, 64, 256)]
    if quick and cuda:
        shapes = shapes[:2]
    dtype = torch.bfloat16 if cuda else torch.float32
    F = torch.nn.functional
    if impl == "copy":  # the memory-bound ceiling of the forward: read x, write a tensor like it
        if cuda:
            _emit({"op": "copy", "impl": "torch copy_ 1 GiB", "TBps": copy_bandwidth_tbs()})
        for B, D, T in shapes:
            x = torch.randn(B, D, T, device=dev, dtype=dtype)
            y = torch.empty_like(x)
            ms = bench_ms(lambda: y.copy_(x), quick, cuda)
            _emit({"op": "copy", "impl": "torch copy_ of x", "shape": _shape_name(B, D, T), "dtype": str(dtype),
                   "fwd_ms": ms, "TBps": 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e12})
            del x, y
        return
    extra, calls = {}, {}
    if impl == "causal_conv1d":
        import causal_conv1d
        from causal_conv1d import causal_conv1d_fn
        extra = {"version": getattr(causal_conv1d, "__version__", "?")}
        # Its documented call: x [B, C, T] contiguous, weight [C, W], bias [C], all bf16.
        calls["causal_conv1d (CUDA)"] = lambda x, w, b: causal_conv1d_fn(x, w, b, activation="silu")
        host = calls["causal_conv1d (CUDA)"]
    elif impl.startswith("dflash:"):
        backend = impl.split(":", 1)[1]
        from dflash_kernels.ops.conv1d import conv1d as conv_mod
        from dflash_kernels.ops.conv1d import cuda as conv_cuda
        if backend == "cuda" and not conv_cuda.available():
            _emit({"op": "conv", "impl": "dflash_kernels", "backend": "cuda",
                   "error": "the CUDA extension dflash_kernels._C is not built here"})
            return
        if cuda or backend == "auto":
            dk.set_backend("conv1d", backend)
        extra = {"backend": backend if cuda or backend != "auto" else dk.runtime.resolve("conv1d", torch.device(dev))}
        calls["dflash_kernels"] = lambda x, w, b: dk.causal_conv1d(x, w, b, "silu")
        calls["dflash_kernels[channel_last]"] = "channel_last"
        if cuda:
            calls["dflash_kernels[launcher, no autograd]"] = "launcher"
        host = calls["dflash_kernels"]
    elif impl == "torch_conv1d":
        calls["torch_conv1d"] = lambda x, w, b: F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=CONV_W - 1,
                                                                groups=x.shape[1])[..., :x.shape[2]])
        host = None
    elif impl == "fla":
        from fla.modules.causal_conv1d.ops import causal_conv1d as fla_conv
        calls["fla (Triton)"] = "fla"
        host = None
    else:
        raise SystemExit(f"unknown conv implementation {impl!r}; one of {CONV_IMPLS}")
    for B, D, T in shapes:
        x = torch.randn(B, D, T, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(D, CONV_W, device=dev, dtype=dtype, requires_grad=True)
        bias = torch.randn(D, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(B, D, T, device=dev, dtype=dtype)
        for name, call in calls.items():
            print(f"  conv {name} B={B} D={D} T={T} ...", flush=True)
            row_extra = dict(extra, dtype=str(dtype))
            if call == "channel_last":  # x as the transpose of a [B, T, C] tensor, dy likewise
                x_btd = x.detach().transpose(1, 2).contiguous().requires_grad_()
                dy_cl = dy.transpose(1, 2).contiguous().transpose(1, 2)
                row = _time_conv(name, (B, D, T), lambda: dk.causal_conv1d(x_btd.transpose(1, 2), w, bias, "silu"),
                                 (x_btd, w, bias), dy_cl, quick, cuda, row_extra)
                del x_btd, dy_cl
            elif call == "launcher":
                xd, wd, bd = x.detach(), w.detach(), bias.detach()
                row = _time_conv(name, (B, D, T),
                                 lambda: conv_mod.causal_conv1d_fwd(xd, wd, bd, None, None, True, False)[0],
                                 None, None, quick, cuda, row_extra)
            elif call == "fla":  # fla's native layout [B, T, C]
                x_btd = x.detach().transpose(1, 2).contiguous().requires_grad_()
                dy_btd = dy.transpose(1, 2).contiguous()
                row = _time_conv(name, (B, D, T), lambda: fla_conv(x_btd, w, bias, activation="silu")[0],
                                 (x_btd, w, bias), dy_btd, quick, cuda, row_extra)
                del x_btd, dy_btd
            else:
                row = _time_conv(name, (B, D, T), lambda call=call: call(x, w, bias), (x, w, bias), dy, quick, cuda,
                                 row_extra)
            if impl == "dflash:auto" and cuda and name == "dflash_kernels":
                row["auto_choice"] = _auto_choice(conv_mod, x.detach(), w.detach(), bias.detach())
            _emit(row)
        del x, w, bias, dy
        if cuda:
            torch.cuda.empty_cache()
    if host is not None and os.environ.get("TRITON_INTERPRET", "0") != "1":  # interpreted calls time nothing
        name = "dk.causal_conv1d" if impl.startswith("dflash:") else "causal_conv1d_fn"
        _emit(_host_row(name, host, dev, quick, extra))


def _child_env(impl: str) -> dict:
    """The environment of an implementation's process: ours with the conv's backend for dflash:<backend>."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    spec = [s for s in env.get("DFLASH_KERNELS_BACKEND", "").split(",") if s and not s.strip().startswith("conv1d=")]
    if impl.startswith("dflash:") and impl != "dflash:auto":
        spec.append("conv1d=" + impl.split(":", 1)[1])
    env["DFLASH_KERNELS_BACKEND"] = ",".join(spec)
    return env


def _run_child(impl: str, quick: bool, timeout_s: float) -> list:
    """Run ``conv_child(impl)`` in a fresh process; its rows, or one error row saying how it ended."""
    from bench_common import run_rows
    cmd = [sys.executable, os.path.abspath(__file__), "conv", "--child", impl] + (["--quick"] if quick else [])
    return run_rows(cmd, "conv", impl, timeout_s, _child_env(impl))


def _conv_ratios(rows: list):
    """Add each conv row's time over causal-conv1d's and over the copy of the same tensors (same run)."""
    ref = {r["shape"]: r for r in rows if r.get("impl") == "causal_conv1d (CUDA)" and "fwd_ms" in r}
    copy = {r["shape"]: r["fwd_ms"] for r in rows if r.get("op") == "copy" and "shape" in r}
    host_ref = next((r for r in rows if r.get("impl") == "causal_conv1d_fn" and "fwd_us_per_call" in r), None)
    for r in rows:
        if r.get("op") == "conv" and "fwd_ms" in r:
            peer = ref.get(r["shape"])
            if peer is not None:
                r["fwd_vs_causal_conv1d"] = r["fwd_ms"] / peer["fwd_ms"]
                r["fwdbwd_vs_causal_conv1d"] = r["fwdbwd_ms"] / peer["fwdbwd_ms"]
            if r["shape"] in copy:
                r["fwd_vs_copy"] = r["fwd_ms"] / copy[r["shape"]]
        if r.get("op") == "conv_host" and host_ref is not None and "fwd_us_per_call" in r:
            r["fwd_vs_causal_conv1d"] = r["fwd_us_per_call"] / host_ref["fwd_us_per_call"]
            r["fwdbwd_vs_causal_conv1d"] = r["fwdbwd_us_per_call"] / host_ref["fwdbwd_us_per_call"]


def print_conv_table(rows: list):
    """The conv rows as one table per kind: timings, and ratios to causal-conv1d and the copy."""
    def f(v, spec):
        return format(v, spec) if isinstance(v, float) else ("" if v is None else str(v))
    conv = [r for r in rows if r.get("op") in ("conv", "copy") and "shape" in r or r.get("op") == "conv"]
    if conv:
        print(f"\n{'shape':<26} {'implementation':<38} {'backend':<8} {'fwd ms':>8} {'fwd+bwd ms':>10} "
              f"{'TB/s':>5} {'fwd/cc1d':>8} {'f+b/cc1d':>8} {'fwd/copy':>8}  note")
        for r in sorted(conv, key=lambda r: (r.get("shape", "~"), r.get("op") != "copy")):
            note = r.get("error") or r.get("auto_choice") or ""
            print(f"{r.get('shape', ''):<26} {r['impl'][:38]:<38} {r.get('backend', ''):<8} "
                  f"{f(r.get('fwd_ms'), '8.4f'):>8} {f(r.get('fwdbwd_ms'), '10.4f'):>10} "
                  f"{f(r.get('fwd_TBps', r.get('TBps')), '5.2f'):>5} {f(r.get('fwd_vs_causal_conv1d'), '8.3f'):>8} "
                  f"{f(r.get('fwdbwd_vs_causal_conv1d'), '8.3f'):>8} {f(r.get('fwd_vs_copy'), '8.3f'):>8}  {note[:90]}")
    host = [r for r in rows if r.get("op") == "conv_host"]
    if host:
        print(f"\nhost cost per call, {_shape_name(*HOST_SHAPE)} (wall time over many calls, one sync at the end)")
        print(f"{'implementation':<22} {'backend':<8} {'fwd us':>8} {'fwd+bwd us':>10} {'fwd/cc1d':>8} {'f+b/cc1d':>8}  note")
        for r in host:
            print(f"{r['impl']:<22} {r.get('backend', ''):<8} {f(r.get('fwd_us_per_call'), '8.2f'):>8} "
                  f"{f(r.get('fwdbwd_us_per_call'), '10.2f'):>10} {f(r.get('fwd_vs_causal_conv1d'), '8.3f'):>8} "
                  f"{f(r.get('fwdbwd_vs_causal_conv1d'), '8.3f'):>8}  {r.get('error', '')[:90]}")


def bench_conv(quick: bool, rows: list, only=None, timeout_s: float = CONV_TIMEOUT_S) -> list:
    """Every implementation of ``CONV_IMPLS`` (or those starting with one of ``only``) in a process of
    its own; appends their rows to ``rows`` with the ratios to causal-conv1d and to the copy."""
    impls = [i for i in CONV_IMPLS if not only or any(i.startswith(o) for o in only)]
    if not torch.cuda.is_available():  # the CPU run shows the job works: no peers, no CUDA extension
        impls = [i for i in impls if i in ("copy", "dflash:auto", "torch_conv1d")]
    conv_rows = []
    for impl in impls:
        print(f"conv: {impl} (a process of its own, {timeout_s:.0f} s limit)", flush=True)
        conv_rows += _run_child(impl, quick, timeout_s)
    _conv_ratios(conv_rows)
    rows += conv_rows
    return rows


# ------------------------------------------------------------------------------------ overhead
def bench_overhead(quick: bool) -> list:
    """Host cost per call on a cache hit: the runtime's launch vs Triton's compiled-kernel launcher."""
    if not torch.cuda.is_available():
        return []
    from dflash_kernels.ops.conv1d import conv1d as conv_mod
    from dflash_kernels.ops.conv1d.kernels import conv1d_fwd_kernel as kernel
    x = torch.randn(1, 64, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16)
    y, _ = conv_mod.causal_conv1d_fwd(x, w, None, None, None, True, False)  # compile
    (key, entry), = [(k, e) for k, e in kernel._cache.items() if k[3] == x.device.index and
                     dict(k[1])["HAS_BIAS"] is False and dict(k[1])["ACT"] is True][:1]
    B, D, T = x.shape
    args = (x, w, w, x, x, y, y, T, D, x.stride(0), x.stride(1), x.stride(2), x.stride(0), x.stride(1),
            x.stride(2), x.stride(0), 0, 0, 0)
    consts = dict(key[1])
    compiled = kernel.fn.warmup(*args, *kernel._full_meta(entry.meta), grid=(1,),
                                num_warps=entry.config.num_warps, num_stages=entry.config.num_stages)
    grid = (1, 1, 1)
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *kernel._full_meta(entry.meta))

    def runtime():
        kernel(grid, *args, bucket=key[0], **consts)

    def jit_run():
        kernel.fn[grid](*args, **entry.meta, num_warps=entry.config.num_warps,
                        num_stages=entry.config.num_stages)

    def public_op():
        dk.causal_conv1d(x, w, activation="silu")

    n = 2000 if quick else 20000
    rows = []
    for name, fn in [("compiled.run (direct)", direct), ("dflash runtime TritonKernel", runtime),
                     ("triton JITFunction[grid]", jit_run), ("dk.causal_conv1d (public op)", public_op)]:
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        rows.append({"op": "overhead", "impl": name, "us_per_call": best})
    base = rows[0]["us_per_call"]
    for r in rows:
        r["added_us_vs_direct"] = r["us_per_call"] - base
    return rows


# ------------------------------------------------------------------------------------ attention / gdn
def bench_optional(module: str, quick: bool) -> list:
    try:
        mod = __import__(module)
    except ImportError as e:
        print(f"  {module}: not present ({e})")
        return []
    return mod.run("cuda" if torch.cuda.is_available() else "cpu", quick)


def print_rows(rows):
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", default=["all"], help="conv, attention, gdn, linear_ce, overhead or all")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    parser.add_argument("--impls", default="", help="conv: only the implementations whose names start with one "
                        f"of these (comma-separated), of {', '.join(CONV_IMPLS)}")
    parser.add_argument("--timeout", type=float, default=CONV_TIMEOUT_S,
                        help="conv: seconds each implementation's process may run")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # conv: one implementation, rows on stdout
    args = parser.parse_args()
    if args.child:
        conv_child(args.child, args.quick)
        return
    what = set(args.what)
    if "all" in what:
        what = {"conv", "attention", "gdn", "linear_ce", "overhead"}
    cuda = torch.cuda.is_available()
    info = env_info()
    print(f"dflash_kernels {dk.__version__} | {info['gpu']} | torch {info['torch']} | triton {info['triton']}")
    if not cuda:
        print("No CUDA device: running tiny shapes through the "
              f"{dk.runtime.resolve('conv1d', torch.device('cpu'))} backend to check the job runs; "
              "these timings say nothing about GPU speed and are not recorded.")
    rows = []
    if cuda and what - {"conv"}:  # the conv's copy rows come from a process of their own
        bw = copy_bandwidth_tbs()
        rows.append({"op": "copy", "impl": "torch copy_ 1 GiB", "TBps": bw})
    if "overhead" in what:  # first: a peer's CUDA fault later in the run must not cost this row
        try:
            rows += bench_overhead(args.quick)
        except Exception as e:  # noqa: BLE001
            rows.append({"op": "overhead", "impl": "(aborted)", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    if "conv" in what:
        bench_conv(args.quick, rows, [o for o in args.impls.split(",") if o] or None, args.timeout)
    if "attention" in what:
        rows += bench_optional("bench_attention", args.quick)
    if "gdn" in what:
        rows += bench_optional("bench_gdn", args.quick)
    if "linear_ce" in what:
        rows += bench_optional("bench_linear_ce", args.quick)
    print_rows(rows)
    if cuda and not args.no_record:
        record_rows(rows, info)
    print_conv_table(rows)


if __name__ == "__main__":
    main()
