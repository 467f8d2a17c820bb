"""The optimizer step: dflash_kernels' ``fused_adamw_`` against torch's AdamW over a drafter's parameter
list, each implementation in a process of its own.

    python benchmarks/bench_adamw.py [--impls torch_foreach,torch_fused,ours_fp32,ours] [--case real] [--no-record]

Implementations (fp32 parameters and moments, weight decay 0.01, the learning rate and step counts on the
device, as the trainer's capturable step has them):
- ``torch_foreach``: ``torch.optim.AdamW(foreach=True, capturable=True)``, fp32 gradients ((b)'s optimizer);
- ``torch_fused``: ``torch.optim.AdamW(fused=True, capturable=True)``, fp32 gradients (the autocast path's);
- ``ours_fp32``: ``fused_adamw_`` with fp32 gradients, no compute copies (like for like with ``torch_fused``);
- ``ours``: ``fused_adamw_`` as the trainer's default runs it: bf16 gradients, the clip's device scale, bf16
  compute copies written in the same pass, the step counts incremented on the device.

Cases: ``real`` (the drafter of the ``real`` preset of ``tok_s.py``, built on the meta device: only its
parameter shapes are used) and ``tiny`` (the ``tiny`` preset's; CPU runs only show the job works).

Each row: ``ms``, the ``do_bench`` median of the whole list's step replayed as one CUDA graph (the trainer
replays it so; on the CPU, host-timed eager calls), ``eager_ms`` the same step called eagerly (the host's
launches included), ``TBps`` the bytes the step must move (28 per parameter: p, m, v read and written, the
gradient read, a bf16 copy written where it has 2-byte gradients) over ``ms``, ``rel_err``, the worst relative
error (``||x - ref|| / ||ref||``) over the parameters and moments after one step from the same state against the
fp32 reference (``naive_adamw_``), and for ``ours`` ``copy_rel_err``, its bf16 copies (poisoned with NaN first)
against the reference's parameters rounded to bf16. Rows are appended to
``benchmarks/results/ops.jsonl`` (op ``adamw``) when a GPU ran them.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_common import bench_ms  # noqa: E402

IMPLS = ["torch_foreach", "torch_fused", "ours_fp32", "ours"]
CASES = ["real", "tiny"]
HP = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def param_shapes(case: str) -> list:
    """The drafter's parameter shapes for ``case``, the drafter built on the meta device as tok_s builds it."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tok_s import TEXT_CONFIGS
    from trainer.common import build_drafter
    from trainer.config import default_target_layer_ids, preset
    from trainer.target import Target

    text = Qwen3_5TextConfig(**TEXT_CONFIGS[case])
    cfg = preset("default" if case == "real" else "tiny")
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(text)
        target = Target(model, None, cfg.target_layer_ids
                        or default_target_layer_ids(text.num_hidden_layers, cfg.num_target_layers))
        drafter = build_drafter(cfg, target, text.vocab_size - 1)
    return [tuple(p.shape) for p in drafter.parameters()]


def _state(shapes, dev, grad_dtype):
    g = torch.Generator().manual_seed(0)
    ps = [(torch.randn(s, generator=g) * 0.02).to(dev) for s in shapes]
    gs = [(torch.randn(s, generator=g) * 1e-3).to(dev, grad_dtype) for s in shapes]
    ms = [(torch.randn(s, generator=g) * 1e-4).to(dev) for s in shapes]
    vs = [(torch.rand(s, generator=g) * 1e-7).to(dev) for s in shapes]
    return ps, gs, ms, vs


def make_step(impl: str, ps, gs, ms, vs, dev):
    """``(step, copies)``: one optimizer step over the list (in place), and the compute copies it writes."""
    # the trainer's device learning rates: fp32 for torch's AdamW, fp64 for MasterAdamW (its lr_dtype)
    lr = torch.full((1,) if impl.startswith("ours") else (), HP["lr"], device=dev,
                    dtype=torch.float64 if impl.startswith("ours") else torch.float32)
    if impl.startswith("torch_"):
        opt = torch.optim.AdamW(ps, lr=lr if dev.type == "cuda" else HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                eps=HP["eps"], weight_decay=HP["weight_decay"], capturable=dev.type == "cuda",
                                **({"fused": True} if impl == "torch_fused" else {"foreach": True}))
        for p, g, m, v in zip(ps, gs, ms, vs):
            p.grad = g
            opt.state[p] = {"step": torch.ones((), dtype=torch.float32, device=dev if dev.type == "cuda" else "cpu"),
                            "exp_avg": m, "exp_avg_sq": v}
        return opt.step, None
    from dflash_kernels import fused_adamw_

    steps = [torch.ones((), dtype=torch.float32, device=dev) for _ in ps]
    copies = [torch.full(p.shape, float("nan"), dtype=torch.bfloat16, device=dev) for p in ps] \
        if impl == "ours" else None
    scale = torch.ones(1, dtype=torch.float32, device=dev) if impl == "ours" else None

    def step():
        torch._foreach_add_(steps, 1)
        fused_adamw_(ps, gs, ms, vs, lr=lr, step=steps, beta1=HP["beta1"], beta2=HP["beta2"], eps=HP["eps"],
                     weight_decay=HP["weight_decay"], grad_scale=scale, compute_copies=copies)
    return step, copies


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def measure(impl: str, case: str) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = param_shapes(case)
    n = sum(torch.Size(s).numel() for s in shapes)
    grad_dtype = torch.bfloat16 if impl == "ours" else torch.float32
    row = {"op": "adamw", "impl": impl, "case": case, "tensors": len(shapes), "params_M": n / 1e6,
           "grad_dtype": str(grad_dtype).replace("torch.", ""), "device": dev.type}
    # correctness: one step from the same state as the fp32 reference's (step 2: both start from count 1)
    ps, gs, ms, vs = _state(shapes, dev, grad_dtype)
    ref = [[t.clone() for t in xs] for xs in (ps, ms, vs)]
    step, copies = make_step(impl, ps, gs, ms, vs, dev)
    step()
    from dflash_kernels.ops.adamw.naive import naive_adamw_

    naive_adamw_(ref[0], gs, ref[1], ref[2], step=2, **HP)
    row["rel_err"] = max(_rel(a, b) for got, want in zip((ps, ms, vs), ref) for a, b in zip(got, want))
    if copies is not None:  # against the reference's parameter rounded to nearest even (the Triton interpreter
        # truncates instead: up to one bf16 ulp on the CPU)
        row["copy_rel_err"] = max(_rel(c.float(), p.to(torch.bfloat16).float()) for c, p in zip(copies, ref[0]))
    # speed
    if dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        row["ms"] = bench_ms(graph.replay)
        row["eager_ms"] = bench_ms(step)
    else:
        row["ms"] = row["eager_ms"] = bench_ms(step, cuda=False)
    row["TBps"] = 28 * n / (row["ms"] * 1e-3) / 1e12
    return row


def _spawn(impl: str, case: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--case", case]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"op": "adamw", "impl": impl, "case": case, "error": f"timed out after {timeout:.0f}s"}
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    row = rows[0] if rows else {"op": "adamw", "impl": impl, "case": case, "error":
                                f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-600:].replace("\n", " | ")}
    row["process_s"] = round(time.time() - t0, 1)
    return row


def print_table(rows):
    base = next((r["ms"] for r in rows if r["impl"] == "torch_fused" and "ms" in r), None)
    print("impl          | tensors | params M | grads    | ms (graph) | eager ms | TB/s  | torch_fused / this "
          "| rel err | copy err")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<13} | {r['error']}")
            continue
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        print(f"{r['impl']:<13} | {r['tensors']:>7} | {r['params_M']:>8.1f} | {r['grad_dtype']:<8} | "
              f"{r['ms']:>10.3f} | {r['eager_ms']:>8.3f} | {r['TBps']:>5.2f} | {ratio:>18} | {r['rel_err']:.1e} | "
              + (f"{r['copy_rel_err']:.1e}" if "copy_rel_err" in r else "-"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    parser.add_argument("--case", default="real", choices=CASES)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per implementation's process")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    parser.add_argument("--impl", help=argparse.SUPPRESS)  # child mode: one implementation
    args = parser.parse_args(argv)
    if args.impl:
        print("RESULT " + json.dumps(measure(args.impl, args.case)), flush=True)
        return []
    impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from {IMPLS}")
    if args.case == "real" and not torch.cuda.is_available():
        print("bench_adamw: no CUDA device on this machine; the `real` case times GPU kernels (0.5 G parameters). "
              "Nothing was run or recorded; `--case tiny` runs the harness on the CPU.")
        return []
    rows = []
    for impl in impls:
        print(f"  bench_adamw {impl} ...", flush=True)
        rows.append(_spawn(impl, args.case, args.timeout))
        print("ROW", json.dumps(rows[-1]), flush=True)
    print()
    print_table(rows)
    if torch.cuda.is_available() and not args.no_record:
        from ops import record_rows
        record_rows(rows)
    return rows


if __name__ == "__main__":
    main()
