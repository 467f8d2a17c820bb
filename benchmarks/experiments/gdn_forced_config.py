"""One GDN scan config forced alone against the kernel's first config, in one process (GPU only).

    python benchmarks/experiments/gdn_forced_config.py KERNEL BV WARPS LOOP_STAGES

KERNEL: state_output (the forward's scan: the forward is timed) | state | bwd_state (the backward's
recompute and state scans: forward+backward is timed); LOOP_STAGES 0 = not set. At B=4, T=4096 and
B=1, T=16384 (bench_gdn's heads), prints the time with the kernel's first config, the time with the
forced one and the largest relative difference of the outputs (or gradients) between the two. Run each
candidate in a process of its own (a faulting config kills only that process), with
DFLASH_KERNELS_TUNE=0 (the other kernels then run their first configs in both timings).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]

import torch  # noqa: E402
from bench_common import bench_ms  # noqa: E402
from bench_gdn import HEADS, SHAPES, _inputs  # noqa: E402

from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from dflash_kernels.ops.gated_delta_rule import kernels_bwd, kernels_fwd  # noqa: E402
from dflash_kernels.runtime import Config  # noqa: E402

# The KERNEL argument's names: the bf16 kernels of the forward scan, the backward's recompute scan and
# the backward's state scan.
KERNELS = {"state_output": kernels_fwd.gdn_fwd_scan_kernel.default,
           "state": kernels_fwd.gdn_fwd_scan_states_kernel.default,
           "bwd_state": kernels_bwd.gdn_bwd_state_kernel.default}


def main():
    name, BV, W, LS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kern = KERNELS[name]
    base_cfg = kern.configs[0]
    meta = dict(BV=BV) if LS == 0 else dict(BV=BV, LOOP_STAGES=LS)
    cfg = Config(num_warps=W, num_stages=2, **meta)

    def force(c):
        kern.configs = [c]
        kern.reset()

    for s in (SHAPES[1], SHAPES[2]):
        s = {**s, **HEADS}
        leaves = _inputs(s, "cuda", torch.bfloat16)
        q, k, v, g, beta = (t.detach() for t in leaves)
        do = torch.randn(s["B"], s["T"], s["Hv"], s["V"], device="cuda", dtype=torch.bfloat16)

        def fwd():
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

        def fwd_bwd():
            o = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
            return torch.autograd.grad(o, leaves, do)

        fn = fwd if name == "state_output" else fwd_bwd
        res = {}
        for tag, c in (("base", base_cfg), ("variant", cfg)):
            force(c)
            out = fn()
            out = [out] if torch.is_tensor(out) else list(out)
            torch.cuda.synchronize()
            res[tag] = ([t.float() for t in out], bench_ms(fn))
        rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(res["variant"][0], res["base"][0]))
        finite = all(torch.isfinite(t).all().item() for t in res["variant"][0])
        print(f"FORCED kernel={name} shape=B{s['B']},T{s['T']} base={base_cfg} base_ms={res['base'][1]:.4f} "
              f"variant={cfg} ms={res['variant'][1]:.4f} max_rel_vs_base={rel:.2e} finite={finite}", flush=True)
        del leaves, q, k, v, g, beta, res
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
