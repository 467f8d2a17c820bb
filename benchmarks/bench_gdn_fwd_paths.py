"""The Gated DeltaNet forward at the real target's shape, inference only: our fused forward, our split
forward (``DFLASH_KERNELS_GDN_FWD_SPLIT=1``) and fla's, one implementation per process.

    for i in fused split fla; do python3 benchmarks/bench_gdn_fwd_paths.py $i; done
    python3 benchmarks/bench_gdn_fwd_paths.py split 4 48   # B=4 sequences, 48 value heads

B=1, T=3072, Hv=32 (or the batch and value heads given after the implementation), K=V=128, bf16, q and k repeated to the value heads (as transformers 5.17 passes them),
``use_qk_l2norm_in_kernel=True``, under ``torch.inference_mode``. Prints the ``do_bench`` median (host
time included: the target's layers run back to back, so the launch cost shows), the device time per call
from torch.profiler and its kernels; saves the output to ``/tmp/gdn_<impl>.pt`` so the three can be compared.
"""

import os
import sys

import torch
import triton.testing

impl = sys.argv[1] if len(sys.argv) > 1 else "fused"
if impl not in ("fused", "split", "fla"):
    raise SystemExit(f"impl: expected fused, split or fla; got {impl!r}")
if impl == "split":
    os.environ["DFLASH_KERNELS_GDN_FWD_SPLIT"] = "1"
if impl == "fla":
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as gdn
else:
    from dflash_kernels import chunk_gated_delta_rule as gdn
from torch.profiler import ProfilerActivity, profile  # noqa: E402

torch.manual_seed(0)
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
H = int(sys.argv[3]) if len(sys.argv) > 3 else 32
T, K = 3072, 128
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
device_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 20 / 1e3
torch.save(out.cpu(), f"/tmp/gdn_{impl}.pt")
print(f"{impl} B={B} Hv={H}: fwd median {ms:.3f} ms, device {device_ms:.3f} ms per call")
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
