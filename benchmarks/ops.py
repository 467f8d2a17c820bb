"""Op benchmarks against the peers, in one run: ``python benchmarks/ops.py [conv|attention|gdn|overhead|all]``.

On a CUDA machine every op is timed at the shapes of ../shared/ANCHORS.md next to its peers
(causal-conv1d, fla, torch.compile(flex_attention)) measured in the same run, with
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


def copy_bandwidth_tbs() -> float:
    """Device-to-device copy, bytes read + written per second: the memory-bound ceiling."""
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------- conv
CONV_SHAPES = [(1, 10240, 4096), (4, 10240, 4096), (8, 10240, 16384)]


def _peer_conv():
    peers = {}
    try:
        from causal_conv1d import causal_conv1d_fn
        peers["causal_conv1d"] = causal_conv1d_fn
    except Exception as e:  # noqa: BLE001 - report any import failure, never crash the run
        print(f"  causal-conv1d: not available ({type(e).__name__}: {e})")
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d as fla_conv
        peers["fla"] = fla_conv
    except Exception as e:  # noqa: BLE001
        print(f"  fla: not available ({type(e).__name__}: {e})")
    return peers


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def bench_conv(quick: bool, rows: list, only=None) -> list:
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shapes = CONV_SHAPES if cuda else [(1, 64, 256)]
    if quick and cuda:
        shapes = shapes[:2]
    dtype = torch.bfloat16 if cuda else torch.float32
    peers = _peer_conv() if cuda else {}
    W = 4
    from dflash_kernels.ops.conv1d import conv1d as conv_mod
    backend = dk.runtime.resolve("conv1d", torch.device(dev))  # "cuda" when the extension is forced
    # fla's Triton conv faults (illegal memory access) at B=4 on the H200, which kills
    # the CUDA context: it runs last. causal-conv1d runs first, on a context nothing else has touched.
    order = {"causal_conv1d (CUDA)": 0, "fla (Triton)": 2}
    for pass_, (B, D, T) in [(p, s) for p in (0, 1, 2) for s in shapes]:
        x = torch.randn(B, D, T, device=dev, dtype=dtype, requires_grad=True)
        x_btd = x.detach().transpose(1, 2).contiguous().requires_grad_()  # fla's native [B, T, D]
        w = torch.randn(D, W, device=dev, dtype=dtype, requires_grad=True)
        bias = torch.randn(D, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        bytes_fwd = 2 * x.numel() * x.element_size()  # read x, write y (weights are negligible)
        impls = {
            "dflash_kernels": (lambda: dk.causal_conv1d(x, w, bias, "silu"), x),
            "dflash_kernels[channel_last]": (lambda: dk.causal_conv1d(x_btd.transpose(1, 2), w, bias, "silu"), x_btd),
            "dflash_kernels[launcher, no autograd]": (
                lambda: conv_mod.causal_conv1d_fwd(x.detach(), w.detach(), bias.detach(), None, None, True, False)[0],
                None),
            "torch_conv1d": (lambda: torch.nn.functional.silu(torch.nn.functional.conv1d(
                x, w.unsqueeze(1), bias, padding=W - 1, groups=D)[..., :T]), x),
        }
        if not cuda:  # the launcher needs a GPU backend (the CPU run goes through the reference op)
            del impls["dflash_kernels[launcher, no autograd]"]
        if "causal_conv1d" in peers:
            fn = peers["causal_conv1d"]
            impls["causal_conv1d (CUDA)"] = (lambda: _first(fn(x, w, bias, activation="silu")), x)
        if "fla" in peers:
            fn = peers["fla"]
            impls["fla (Triton)"] = (lambda: fn(x_btd, w, bias, activation="silu")[0], x_btd)
        for name, (fwd, inp) in impls.items():
            if order.get(name, 1) != pass_ or (only and not any(name.startswith(o) for o in only)):
                continue
            print(f"  conv {name} B={B} D={D} T={T} ...", flush=True)
            try:
                out = fwd()
                grad = dy if out.shape == dy.shape else dy.transpose(1, 2).contiguous()
                ms_f = bench_ms(lambda: fwd(), quick, cuda)
                if inp is None:  # forward only
                    ms_fb = mem = float("nan")
                else:
                    ms_fb = bench_ms(lambda: torch.autograd.grad(fwd(), (inp, w, bias), grad), quick, cuda)
                    mem = peak_mib(lambda: torch.autograd.grad(fwd(), (inp, w, bias), grad), cuda)
                rows.append({"op": "conv", "impl": name, "shape": f"B={B} D={D} T={T} W={W}",
                             **({"backend": backend} if name.startswith("dflash") else {}),
                             "dtype": str(dtype), "fwd_ms": ms_f, "fwdbwd_ms": ms_fb,
                             "fwd_TBps": bytes_fwd / (ms_f * 1e-3) / 1e12, "peak_MiB_fwdbwd": mem})
                if cuda:
                    torch.cuda.synchronize()  # surface an asynchronous fault in this row, not the next
                print(f"    {rows[-1]}", flush=True)
            except Exception as e:  # noqa: BLE001 - a failing peer is a row, not a crash
                rows.append({"op": "conv", "impl": name, "shape": f"B={B} D={D} T={T} W={W}",
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"    {rows[-1]}", flush=True)
        del x, x_btd, dy
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
    parser.add_argument("--impls", default="", help="conv: only implementations whose names start with one of "
                        "these (comma-separated), e.g. 'causal_conv1d' to run a peer in a process of its own")
    args = parser.parse_args()
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
    if cuda:
        bw = copy_bandwidth_tbs()
        rows.append({"op": "copy", "impl": "torch copy_ 1 GiB", "TBps": bw})
    if "overhead" in what:  # first: a peer's CUDA fault later in the run must not cost this row
        try:
            rows += bench_overhead(args.quick)
        except Exception as e:  # noqa: BLE001
            rows.append({"op": "overhead", "impl": "(aborted)", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    if "conv" in what:
        try:
            bench_conv(args.quick, rows, [o for o in args.impls.split(",") if o] or None)
        except Exception as e:  # noqa: BLE001 - a sticky CUDA error: report what was measured so far
            rows.append({"op": "conv", "impl": "(aborted)", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    if "attention" in what:
        rows += bench_optional("bench_attention", args.quick)
    if "gdn" in what:
        rows += bench_optional("bench_gdn", args.quick)
    if "linear_ce" in what:
        rows += bench_optional("bench_linear_ce", args.quick)
    print_rows(rows)
    if cuda and not args.no_record:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "a") as f:
            for r in rows:
                f.write(json.dumps({**info, **r}) + "\n")
        print(f"appended {len(rows)} rows to {RESULTS}")


if __name__ == "__main__":
    main()
