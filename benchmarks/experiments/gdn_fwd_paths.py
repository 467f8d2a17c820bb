"""A/B of the GDN forward's l2norm placement (``chunk._FWD_FUSED_NORM``) against fla's forward, GPU only.

``python benchmarks/experiments/gdn_fwd_paths.py``: for each shape of ``bench_gdn.SHAPES`` (Hk=16, Hv=48,
K=V=128, bf16, l2norm in kernel, no state), the forward time (``bench_ms``, tuned) of each path and
of fla, the output's relative difference between the paths, and the per-kernel profile of each path
at B=4, T=4096. Prints ``AB`` lines.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]

import torch  # noqa: E402
from bench_common import bench_ms  # noqa: E402
from bench_gdn import HEADS, SHAPES, _implementations, _inputs  # noqa: E402
from profile_ops import _table  # noqa: E402

from dflash_kernels.ops.gated_delta_rule import chunk as gdn_chunk  # noqa: E402

VARIANTS = [False, True]  # _FWD_FUSED_NORM


def main():
    impls = _implementations()
    ours, fla = impls["dflash_kernels"], impls.get("fla")
    for s in SHAPES:
        s = {**s, **HEADS}
        q, k, v, g, beta = (t.detach() for t in _inputs(s, "cuda", torch.bfloat16))
        outs = {}
        for var in VARIANTS:
            gdn_chunk._FWD_FUSED_NORM = var
            fn = lambda: ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)  # noqa: E731
            outs[var] = fn()[0].float()
            print(f"AB shape=B{s['B']},T{s['T']} fused_norm={var} fwd_ms={bench_ms(fn):.4f}", flush=True)
        if callable(fla):
            fn = lambda: fla(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)  # noqa: E731
            ref = fn()[0].float()
            print(f"AB shape=B{s['B']},T{s['T']} impl=fla fwd_ms={bench_ms(fn):.4f}", flush=True)
            for var, o in outs.items():
                print(f"AB shape=B{s['B']},T{s['T']} fused_norm={var} rel_diff_vs_fla="
                      f"{((o - ref).norm() / ref.norm()).item():.3e}", flush=True)
        torch.cuda.empty_cache()
    s = {**SHAPES[1], **HEADS}
    q, k, v, g, beta = (t.detach() for t in _inputs(s, "cuda", torch.bfloat16))
    for var in VARIANTS:
        gdn_chunk._FWD_FUSED_NORM = var
        _table(f"gdn fwd fused_norm={var}", lambda: ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True))


if __name__ == "__main__":
    main()
