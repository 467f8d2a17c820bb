"""The Gated DeltaNet forward at the real target's shape, inference only: our fused forward, our split
forward, the library's own pick between them, and fla's, one implementation per process.

    for i in fused split auto fla; do python3 -m tools.studies.bench_gdn_fwd_paths $i; done
    python3 -m tools.studies.bench_gdn_fwd_paths split --batch 4 --heads 48

B=1, T=3072, Hv=32 (``--batch`` / ``--heads`` change the sequences and value heads), K=V=128, bf16, q and k
repeated to the value heads (as transformers 5.17 passes them), ``use_qk_l2norm_in_kernel=True``, under
``torch.inference_mode``. ``fused`` / ``split`` set ``DFLASH_KERNELS_GDN_FWD_SPLIT=0`` / ``1``; ``auto``
leaves it unset. Prints the ``do_bench`` median (host time included: the target's layers run back to
back, so the launch cost shows), the device time per call from torch.profiler and its kernels; saves the
output to ``/tmp/gdn_<impl>.pt`` so the implementations can be compared, and appends a row (op
``gdn_fwd_paths``) to ``benchmarks/results/ops.jsonl`` unless ``--no-record``. Needs a CUDA device.
"""

import argparse
import os
import sys

import torch
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]  # the benchmarks' helpers, the library, the trainer

IMPLS = ("fused", "split", "auto", "fla")
SPLIT_ENV = {"fused": "0", "split": "1"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("impl", choices=IMPLS)
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--heads", type=int, default=32, help="value heads, q and k repeated to them (default 32)")
    p.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/ops.jsonl")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn_fwd_paths: times GPU kernels; no CUDA device here")
    if args.impl in SPLIT_ENV:
        os.environ["DFLASH_KERNELS_GDN_FWD_SPLIT"] = SPLIT_ENV[args.impl]
    else:
        os.environ.pop("DFLASH_KERNELS_GDN_FWD_SPLIT", None)
    if args.impl == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as gdn
    else:
        from dflash_kernels import chunk_gated_delta_rule as gdn
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    B, H, T, K = args.batch, args.heads, 3072, 128
    q, k, v = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(B, T, H, device="cuda") * 0.5
    beta = torch.rand(B, T, H, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        def fwd():
            return gdn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        out = fwd()[0].float()
        ms = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fwd()
            torch.cuda.synchronize()
    events = prof.key_averages()
    device_ms = sum(e.self_device_time_total for e in events) / 20 / 1e3
    kernels_us = {e.key: round(e.self_device_time_total / 20, 1) for e in events if e.self_device_time_total > 0}
    torch.save(out.cpu(), f"/tmp/gdn_{args.impl}.pt")
    print(f"{args.impl} B={B} Hv={H}: fwd median {ms:.3f} ms, device {device_ms:.3f} ms per call")
    print(events.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
    row = {"op": "gdn_fwd_paths", "impl": args.impl, "B": B, "T": T, "Hv": H, "K": K, "V": K, "median_ms": ms,
           "device_ms": device_ms, "kernels_us": kernels_us,
           "split_env": os.environ.get("DFLASH_KERNELS_GDN_FWD_SPLIT", "unset")}
    if not args.no_record:
        from ops import record_rows
        record_rows([row])
    return row


if __name__ == "__main__":
    main()
