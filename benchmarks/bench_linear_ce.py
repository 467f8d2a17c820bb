"""Fused LM head + weighted cross-entropy: dflash_kernels' ``linear_cross_entropy`` against torch, Liger
Kernel and Cut Cross-Entropy, and against the GEMM floor, each implementation in a process of its own.

    python benchmarks/bench_linear_ce.py [--quick] [--impls torch,ours] [--shapes real,27b] [--no-record]

Shapes: ``real`` N=8192 H=2560 V=248320 and ``27b`` N=16384 H=5120 V=248320 (``--quick``: one small
shape), bf16, frozen head (only ``hidden`` gets a gradient), random labels with ~10% ignored rows
(-100) and DFlash-like per-row weights ``exp(-(j - 1) / 7)`` for positions j = 1..15 of blocks of 15 rows.

Implementations:
- ``torch``: ``F.linear`` + ``.float()`` + ``F.cross_entropy(reduction="none") * w``, ``sum / sum(w)``
  (the trainer's whole-logits path);
- ``liger``: ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy`` (Liger 0.8.5);
- ``cce``: ``cut_cross_entropy.linear_cross_entropy`` (CCE 25.1.1, its default ``filter_eps``);
- ``ours``: ``dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy`` (``ours+argmax`` also
  returns the argmax, as the trainer calls it);
- ``gemm_floor``: the same GEMMs through plain ``torch.matmul`` on the same bf16 data: the logits GEMM
  (forward), the logits GEMM + the hidden-gradient GEMM (forward + backward); ``gemm_floor_chunked``:
  those GEMMs in the row chunks ``ours`` uses (what the chunking alone costs).
Liger and CCE take no per-row weights (Liger's ``ce_weight`` is per class): they run the unweighted
mean over the rows not ignored, and their row says so; their correctness is checked against that.

Each implementation runs in a fresh process (``--impl NAME --shape NAME``, a timeout each) that
prints one ``RESULT {json}`` line, so a peer that faults or runs out of memory costs its row only,
and every peak-memory figure starts from a clean allocator. Times are ``triton.testing.do_bench``
medians (``bench_common.bench_ms``): the forward without grad, and forward + backward as
``torch.autograd.grad(loss, (hidden,))``. Peak memory is the most allocated above what was allocated
before the call (the inputs). Correctness per row: the loss and the hidden gradient against torch's
result (bf16 logits, fp32 cross-entropy) computed in row chunks in the same process, as relative
errors. The table comes last; the rows are appended to ``benchmarks/results/ops.jsonl`` (op
``linear_ce``). Without a CUDA device the script says so and exits (``--cpu-smoke`` runs a tiny
shape on the CPU to check the script itself; nothing recorded).
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

from bench_common import bench_ms, peak_mib  # noqa: E402

SHAPES = {"real": dict(N=8192, H=2560, V=248320), "27b": dict(N=16384, H=5120, V=248320)}
QUICK_SHAPES = {"quick": dict(N=2048, H=1024, V=32768)}
CPU_SHAPES = {"cpu": dict(N=90, H=48, V=1000)}
IMPLS = ["torch", "liger", "cce", "ours", "ours+argmax", "ours@256MiB", "ours@1024MiB", "gemm_floor",
         "gemm_floor_chunked", "gemm_floor_chunked@256MiB"]
# "NAME@<n>MiB": ours / gemm_floor_chunked with CHUNK_BYTES = n MiB of logits per chunk instead of the
# default 512 (larger chunks: fewer, larger hidden-gradient GEMMs; more memory). Any n is accepted.
PEERS = ("liger", "cce")
BLOCK, GAMMA, IGNORED = 15, 7.0, 0.10
REF_CHUNK = 1024  # rows per chunk of the in-process torch reference


def shape_name(s: dict) -> str:
    return f"N={s['N']},H={s['H']},V={s['V']}"


def make_inputs(s: dict, dev, dtype):
    """The same data in every process: seeded on the device. Returns hidden (requires grad), the
    frozen weight, labels (~10% -100) and fp32 per-row weights."""
    N, H, V = s["N"], s["H"], s["V"]
    g = torch.Generator(device=dev).manual_seed(1234)
    hidden = torch.randn(N, H, device=dev, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=dev, generator=g) * (2.0 / H ** 0.5)).to(dtype)
    labels = torch.randint(0, V, (N,), device=dev, generator=g)
    labels[torch.rand(N, device=dev, generator=g) < IGNORED] = -100
    j = torch.arange(N, device=dev) % BLOCK + 1
    w = torch.exp(-(j - 1).float() / GAMMA)
    return hidden, weight, labels, w


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    d = b.norm().item()
    return (a - b).norm().item() / d if d > 0 else (a - b).norm().item()


def torch_reference(hidden, weight, labels, w):
    """torch's loss and hidden gradient (bf16 logits, fp32 cross-entropy, ``sum(w * ce) / sum(w)``;
    ``w`` None: the unweighted mean), in row chunks so that it fits beside any implementation."""
    valid = labels != -100
    wv = (torch.ones_like(labels, dtype=torch.float32) if w is None else w) * valid
    denom = wv.sum()
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    dx = torch.empty_like(hidden)
    for r0 in range(0, hidden.shape[0], REF_CHUNK):
        r1 = min(r0 + REF_CHUNK, hidden.shape[0])
        hc = hidden[r0:r1].detach().requires_grad_()
        ce = F.cross_entropy(F.linear(hc, weight).float(), labels[r0:r1], reduction="none", ignore_index=-100)
        part = (ce * wv[r0:r1]).sum() / denom
        (g,) = torch.autograd.grad(part, (hc,))
        dx[r0:r1] = g
        total += part.detach()
    return total, dx


def implementation(name: str):
    """``(loss_fn(hidden, weight, labels, w), weighted, note)``; raises ImportError for an absent peer."""
    if name == "torch":
        def fn(h, wt, lab, w):
            ce = F.cross_entropy(F.linear(h, wt).float(), lab, reduction="none", ignore_index=-100)
            return (ce * w).sum() / (w * (lab != -100)).sum()
        return fn, True, "F.linear + fp32 F.cross_entropy(none) * w / sum(w)"
    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger
        return (lambda h, wt, lab, w: liger(h, wt, lab, ignore_index=-100, reduction="mean"), False,
                "unweighted mean: Liger takes per-class ce_weight, not per-row weights")
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy as cce
        return (lambda h, wt, lab, w: cce(h, wt, lab, ignore_index=-100, reduction="mean"), False,
                "unweighted mean: CCE 25.1.1 has no per-row weights; default filter_eps='high'")
    if name in ("ours", "ours+argmax"):
        from dflash_kernels.ops.linear_cross_entropy import linear_cross_entropy as ours
        if name == "ours":
            return lambda h, wt, lab, w: ours(h, wt, lab, weights=w), True, "weighted mean"
        return (lambda h, wt, lab, w: ours(h, wt, lab, weights=w, return_argmax=True)[0], True,
                "weighted mean, argmax returned")
    raise ValueError(f"impl: unknown {name!r}; choose from {IMPLS}")


def _gemm_fns(name, hidden, weight):
    h = hidden.detach()
    if name == "gemm_floor":
        return (lambda: torch.matmul(h, weight.t()),
                lambda: torch.matmul(torch.matmul(h, weight.t()), weight))
    from dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy import chunk_rows
    N, V = h.shape[0], weight.shape[0]
    C = chunk_rows(N, V, h.element_size())
    buf = torch.empty(C, V, device=h.device, dtype=h.dtype)
    dx = torch.empty_like(h)

    def fwd():
        for r0 in range(0, N, C):
            torch.mm(h[r0:r0 + C], weight.t(), out=buf[: min(C, N - r0)])

    def fwd_bwd():
        for r0 in range(0, N, C):
            n = min(C, N - r0)
            torch.mm(h[r0:r0 + n], weight.t(), out=buf[:n])
            torch.mm(buf[:n], weight, out=dx[r0:r0 + n])
    return fwd, fwd_bwd


def _split_chunk(impl: str):
    """``"ours@512MiB"`` -> ``("ours", 512)``; no suffix -> ``(impl, None)``."""
    if "@" not in impl:
        return impl, None
    base, size = impl.split("@", 1)
    if base not in ("ours", "ours+argmax", "gemm_floor_chunked") or not size.endswith("MiB") or \
            not size[:-3].isdigit() or int(size[:-3]) < 1:
        raise ValueError(f"impl: {impl!r}: a chunk size suffix is '@<n>MiB' on ours or gemm_floor_chunked")
    return base, int(size[:-3])


def measure(impl: str, sname: str, s: dict, quick: bool) -> dict:
    """One implementation at one shape, in this process."""
    name, chunk_mib = _split_chunk(impl)
    if chunk_mib is not None:
        from dflash_kernels.ops.linear_cross_entropy import linear_cross_entropy as _  # noqa: F401
        lce = sys.modules["dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy"]
        lce.CHUNK_BYTES = chunk_mib << 20
    impl_label, impl = impl, name
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    row = {"op": "linear_ce", "impl": impl_label, "shape": shape_name(s), "dtype": str(dtype), "frozen_head": True}
    N, H, V = s["N"], s["H"], s["V"]
    flops_fwd = 2.0 * N * H * V
    if not cuda:  # smoke runs: the runtime's fixes of Triton's CPU interpreter serve the peers' kernels too
        import dflash_kernels.runtime  # noqa: F401
    hidden, weight, labels, w = make_inputs(s, dev, dtype)
    if impl.startswith("gemm_floor"):
        fwd, fwd_bwd = _gemm_fns(impl, hidden, weight)
        row["note"] = "cuBLAS GEMMs only" + (" (ours' row chunks)" if impl.endswith("chunked") else "")
    else:
        try:
            fn, weighted, row["note"] = implementation(impl)
        except Exception as e:  # noqa: BLE001 - an absent or broken peer is a row, not a crash
            row["error"] = f"absent ({type(e).__name__}: {str(e)[:160]})"
            return row
        try:  # correctness first: one forward + backward against torch's result in this process
            loss = fn(hidden, weight, labels, w)
            (dx,) = torch.autograd.grad(loss, (hidden,))
            ref_loss, ref_dx = torch_reference(hidden, weight, labels, w if weighted else None)
            row["loss"] = float(loss)
            row["loss_rel_err"] = _rel_err(loss, ref_loss)
            row["dx_rel_err"] = _rel_err(dx, ref_dx)
            del loss, dx, ref_loss, ref_dx
        except Exception as e:  # noqa: BLE001
            row["error"] = f"run: {type(e).__name__}: {str(e)[:240]}"
            return row
        if cuda:
            torch.cuda.empty_cache()

        def fwd():  # inference: hidden does not require grad (Liger keys its gradient work on that flag)
            with torch.no_grad():
                return fn(hidden.detach(), weight, labels, w)

        def fwd_bwd():
            return torch.autograd.grad(fn(hidden, weight, labels, w), (hidden,))
    try:
        row["fwd_ms"] = bench_ms(fwd, quick, cuda)
        row["peak_MiB_fwd"] = peak_mib(fwd, cuda)
        row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, cuda)
        row["peak_MiB_fwdbwd"] = peak_mib(fwd_bwd, cuda)
        row["fwd_TFLOPs"] = flops_fwd / row["fwd_ms"] / 1e9
        row["fwdbwd_TFLOPs"] = 2 * flops_fwd / row["fwdbwd_ms"] / 1e9  # logits GEMM + hidden-gradient GEMM
    except Exception as e:  # noqa: BLE001 - out of memory and the like: what was measured stays
        row["error"] = f"timing: {type(e).__name__}: {str(e)[:240]}"
    if impl.startswith("ours"):
        from dflash_kernels.ops.linear_cross_entropy.linear_cross_entropy import chunk_rows
        from dflash_kernels.runtime import cache_info
        row["chunk_rows"] = chunk_rows(N, V, hidden.element_size())
        row["rows_kernel"] = sorted({json.dumps(v["config"], sort_keys=True) for k, v in cache_info().items()
                                     if k[0] == "linear_ce_rows"})
    return row


def _spawn(impl: str, sname: str, quick: bool, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--shape", sname] + (["--quick"] if quick else [])
    shape = shape_name({**SHAPES, **QUICK_SHAPES, **CPU_SHAPES}[sname])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"op": "linear_ce", "impl": impl, "shape": shape, "error": f"timed out after {timeout:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT "):])
            row["process_s"] = round(time.time() - t0, 1)
            return row
    tail = (proc.stderr or proc.stdout)[-600:].replace("\n", " | ")
    return {"op": "linear_ce", "impl": impl, "shape": shape, "error": f"exit {proc.returncode}: {tail}"}


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def add_ratios(rows: list) -> None:
    """Per shape: each row's time over torch's, over the faster peer's and over the GEMM floor's."""
    for shape in {r["shape"] for r in rows}:
        at = {r["impl"]: r for r in rows if r["shape"] == shape}
        for key in ("fwd_ms", "fwdbwd_ms"):
            base = {"torch": at.get("torch", {}).get(key), "gemm_floor": at.get("gemm_floor", {}).get(key)}
            peers = [at[p][key] for p in PEERS if p in at and _num(at[p].get(key))]
            base["best_peer"] = min(peers) if peers else None
            for r in at.values():
                if not _num(r.get(key)):
                    continue
                for name, b in base.items():
                    if _num(b):
                        r[f"{key[:-3]}_vs_{name}"] = r[key] / b


def print_table(rows: list) -> None:
    cols = [("shape", "shape", "{}"), ("impl", "impl", "{}"), ("fwd_ms", "fwd ms", "{:.3f}"),
            ("fwdbwd_ms", "fwd+bwd ms", "{:.3f}"), ("fwdbwd_vs_torch", "f+b / torch", "{:.3f}"),
            ("fwdbwd_vs_best_peer", "f+b / min(liger,cce)", "{:.3f}"),
            ("fwdbwd_vs_gemm_floor", "f+b / GEMM floor", "{:.3f}"), ("fwd_vs_gemm_floor", "fwd / GEMM floor", "{:.3f}"),
            ("peak_MiB_fwd", "peak fwd MiB", "{:.0f}"), ("peak_MiB_fwdbwd", "peak f+b MiB", "{:.0f}"),
            ("loss_rel_err", "loss err", "{:.2e}"), ("dx_rel_err", "dX err", "{:.2e}")]
    table = [[title for _, title, _ in cols] + ["note / error"]]
    for r in rows:
        line = []
        for key, _, fmt in cols:
            v = r.get(key)
            line.append("-" if v is None else fmt.format(v) if not isinstance(v, float) or math.isfinite(v) else str(v))
        line.append(r.get("error") or r.get("note", ""))
        table.append(line)
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print(" | ".join(c.ljust(w) for c, w in zip(t, widths)) + " | " + t[-1])


def run(device="cuda", quick: bool = False, shapes=None, impls=None, timeout: float = 900.0) -> list:
    """Every implementation at every shape, one process each; prints the table and returns the rows
    (``benchmarks/ops.py linear_ce`` records them; :func:`main` records them when run alone)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    if not str(device).startswith("cuda") and shapes is None:
        print("bench_linear_ce: no CUDA device; GPU timings only, nothing run (--cpu-smoke checks the script)")
        return []
    table = QUICK_SHAPES if quick else SHAPES
    shapes = shapes or list(table)
    rows = []
    for sname in shapes:
        for impl in impls or IMPLS:
            print(f"  linear_ce {impl} {sname} ...", flush=True)
            row = _spawn(impl, sname, quick, timeout)
            rows.append(row)
            print("ROW", json.dumps(row), flush=True)  # a run cut short keeps its rows in the log
    add_ratios(rows)
    print()
    print_table(rows)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"one small shape {QUICK_SHAPES['quick']}, fewer reps")
    parser.add_argument("--shapes", default="", help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--impls", default="", help=f"comma-separated subset of {IMPLS}")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per implementation's process")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: checks the script only")
    parser.add_argument("--impl", help=argparse.SUPPRESS)  # child mode: one implementation, one shape
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.impl:
        s = {**SHAPES, **QUICK_SHAPES, **CPU_SHAPES}[args.shape]
        row = measure(args.impl, args.shape, s, args.quick)
        print("RESULT " + json.dumps(row), flush=True)
        return
    impls = [i for i in args.impls.split(",") if i] or IMPLS
    try:
        unknown = [i for i in impls if _split_chunk(i)[0] not in IMPLS]
    except ValueError as e:
        raise SystemExit(f"--impls: {e}")
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from {IMPLS}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("bench_linear_ce: no CUDA device on this machine. It times GPU kernels against cuBLAS and the "
              "peers at N=8192..16384, V=248320; nothing was run or recorded. Run it on the GPU machine "
              "(peers on PYTHONPATH), or add --cpu-smoke to check the script on a tiny shape.")
        return
    if cuda:
        shapes = [s for s in args.shapes.split(",") if s] or list(QUICK_SHAPES if args.quick else SHAPES)
        bad = [s for s in shapes if s not in {**SHAPES, **QUICK_SHAPES}]
        if bad:
            raise SystemExit(f"--shapes: unknown {bad}; choose from {list(SHAPES)}")
    else:
        print("No CUDA device: --cpu-smoke runs a tiny shape on the CPU (interpreter or reference backend); "
              "the timings say nothing about GPU speed and are not recorded.")
        shapes = list(CPU_SHAPES)
    rows = run("cuda" if cuda else "cpu", args.quick, shapes=shapes, impls=impls, timeout=args.timeout)
    if cuda and not args.no_record:
        from ops import record_rows
        record_rows(rows)


if __name__ == "__main__":
    main()
