"""The Hopper forward of block-sparse attention (``kernels_sm90.py``, not chosen by the dispatch) against the
portable forward, each of its tuning candidates forced alone (GPU of compute capability 9.0 only).

    python3 -m tools.studies.attention_sm90_fwd [--out FILE]

Shapes: the DFlash mask of ``benchmarks/bench_attention.py`` (S=3072, N=512 anchors, block 16, Hq=32, Hkv=8,
D=128, bf16) at B=1 and B=4, full context and window 2048, the same inputs as that benchmark; and the dense
causal mask (``causal_block_mask``, B=2, L=8192, H=32), with ``scaled_dot_product_attention(is_causal=True)``
beside it. The portable forward runs tuned (its pick printed); each Hopper candidate is the kernel's only
config, its output compared with the portable forward's (relative Frobenius error). ``do_bench`` medians,
forward only, launchers called directly (no autograd). Effective TFLOP/s count visible pairs only
(``4 * D * Hq * pairs``). Prints one JSON row per line and appends them to FILE when given.
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]


def _launch(fn, q, k, v, mask, scale):
    return fn(q, k, v, mask.segments, mask.seg_count, mask.tiles, mask.q_block, mask.tile_width, scale)


def _shape_rows(name, q, k, v, mask, flops):
    from dflash_kernels.ops.attention import kernels as portable
    from dflash_kernels.ops.attention.attention import attention_fwd
    from dflash_kernels.ops.attention.kernels_sm90 import attention_fwd_sm90, block_sparse_attn_fwd_sm90 as sm90

    scale = q.shape[-1] ** -0.5
    rows = []
    with torch.no_grad():
        ref, _ = _launch(attention_fwd, q, k, v, mask, scale)
        t_port = do_bench(lambda: _launch(attention_fwd, q, k, v, mask, scale), warmup=50, rep=300)
        picks = [c["config"] for c in portable.attention_fwd_kernel.cache_info().values()]
        rows.append(dict(shape=name, impl="portable (tuned)", ms=t_port, TFLOPs_eff=flops / t_port * 1e-9,
                         config=picks[-1] if picks else None))
        candidates = list(sm90.configs)
        try:
            for c in candidates:
                sm90.configs = [c]
                sm90.reset()
                row = dict(shape=name, impl="sm90", config=c.as_dict())
                try:
                    o, _ = _launch(attention_fwd_sm90, q, k, v, mask, scale)
                    row["rel_err_vs_portable"] = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    row["ms"] = do_bench(lambda: _launch(attention_fwd_sm90, q, k, v, mask, scale), warmup=50,
                                         rep=300)
                    row["TFLOPs_eff"] = flops / row["ms"] * 1e-9
                    row["speedup_vs_portable"] = t_port / row["ms"]
                except Exception as e:  # noqa: BLE001 - a candidate that does not fit is a row, not a stop
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
        finally:
            sm90.configs = candidates
            sm90.reset()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="append the rows (JSON lines) to this file")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        sys.exit("attention_sm90_fwd: needs a GPU of compute capability 9.0")
    from bench_attention import _shape_inputs
    from dflash_kernels.ops.attention import causal_block_mask

    dev = torch.device("cuda")
    cases = []
    for B in (1, 4):
        for W in (None, 2048):
            s = dict(B=B, S=3072, N=512, Hq=32, Hkv=8, D=128, window=W)
            _, q, k, v, _, mask, pairs = _shape_inputs(s, dev, torch.bfloat16)
            cases.append((f"dflash B={B} W={W}", q.detach(), k.detach(), v.detach(), mask, 4 * 128 * 32 * pairs))
    L = 8192
    q, k, v = (torch.randn(2, L, 32, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    causal_flops = 4 * 128 * 32 * (L * (L + 1) // 2) * 2
    cases.append((f"causal B=2 L={L}", q, k, v, causal_block_mask(L, device=dev), causal_flops))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, command="python3 -m tools.studies.attention_sm90_fwd")
    rows = []
    for case in cases:
        rows += _shape_rows(*case)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    t = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True), warmup=50,
                 rep=300)
    rows.append(dict(shape=f"causal B=2 L={L}", impl="sdpa is_causal", ms=t, TFLOPs_eff=causal_flops / t * 1e-9))
    with open(args.out, "a") if args.out else open(os.devnull, "w") as f:
        for r in rows:
            r = {**meta, **r}
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
