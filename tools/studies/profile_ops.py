"""Per-kernel GPU time of one op call, for finding where the time goes (GPU only).

``python -m tools.studies.profile_ops attention gdn conv``: each op at its benchmark shape (the first of
``bench_attention.SHAPES`` / ``bench_gdn.SHAPES[1]`` / B=8, C=10240, T=16384 conv), forward + backward,
(``gdn_issue45``: ours at every shape of ``bench_gdn``'s ``issue45`` set, forward and forward + backward),
through ``torch.profiler``; prints one line per kernel (calls, total and mean microseconds per call
of the op) and the config the runtime chose for each compiled key. fla's GDN forward is profiled
beside ours when installed. Run after ``benchmarks/ops.py`` in the same cache dir to see tuned configs.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

REPS = 5


def _table(title, fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count >= REPS:
            rows.append((t / REPS, e.count // REPS, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"PROFILE {title}: {total:.1f} us of kernels per call")
    for t, n, key in rows[:14]:
        print(f"PROFILE   {t:9.1f} us {n:3d}x  {key[:110]}")


def attention():
    from bench_attention import BLOCK, SHAPES
    from dflash_kernels import block_sparse_attention, dflash_block_mask
    s = SHAPES[0]
    B, S, N, Hq, Hkv, D = s["B"], s["S"], s["N"], s["Hq"], s["Hkv"], s["D"]
    dev, dt = "cuda", torch.bfloat16
    anchors = torch.sort(torch.randint(0, S, (B, N)), dim=1).values.to(dev)
    q = torch.randn(B, N * BLOCK, Hq, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, S + N * BLOCK, Hkv, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    mask = dflash_block_mask(anchors, S, BLOCK)
    _table("attention fwd+bwd", lambda: torch.autograd.grad(block_sparse_attention(q, k, v, mask), (q, k, v), do))


def gdn():
    from bench_gdn import HEADS, SHAPES, _implementations, _inputs
    s = {**SHAPES[1], **HEADS}
    q, k, v, g, beta = _inputs(s, "cuda", torch.bfloat16)
    do = torch.randn_like(v)
    impls = _implementations()
    ours = impls["dflash_kernels"]
    _table("gdn ours fwd", lambda: ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True))
    _table("gdn ours fwd+bwd", lambda: torch.autograd.grad(
        ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0], (q, k, v, g, beta), do))
    if callable(impls["fla"]):
        with torch.no_grad():
            _table("gdn fla fwd", lambda: impls["fla"](q, k, v, g, beta, use_qk_l2norm_in_kernel=True))


def gdn_issue45():
    """Ours, forward and forward + backward, at each shape of bench_gdn's ``issue45`` set (its inputs)."""
    from bench_gdn import SHAPE_SETS, _cu_seqlens, _inputs
    from dflash_kernels import chunk_gated_delta_rule
    for label, s in SHAPE_SETS["issue45"].items():
        q, k, v, g, beta = _inputs(s, "cuda", torch.bfloat16)
        cu = _cu_seqlens(s, "cuda")
        do = torch.randn_like(v)

        def fwd():
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]

        with torch.no_grad():
            _table(f"gdn {label} fwd", fwd)
        _table(f"gdn {label} fwd+bwd", lambda: torch.autograd.grad(fwd(), (q, k, v, g, beta), do))


def conv():
    from dflash_kernels import causal_conv1d
    B, C, T, W = 8, 10240, 16384, 4
    x = torch.randn(B, C, T, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(C, W, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    _table("conv fwd+bwd", lambda: torch.autograd.grad(causal_conv1d(x, w, activation="silu"), (x, w), dy))


if __name__ == "__main__":
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [os.path.join(root, "benchmarks"), root]  # bench_attention, bench_gdn; the library
    import dflash_kernels
    for name in sys.argv[1:] or ["attention", "gdn", "conv"]:
        try:
            {"attention": attention, "gdn": gdn, "gdn_issue45": gdn_issue45, "conv": conv}[name]()
        except Exception as e:  # noqa: BLE001 - one op failing must not hide the others
            print(f"PROFILE {name} failed: {type(e).__name__}: {e}"[:400])
    for key, e in dflash_kernels.cache_info().items():
        print("CONFIG", key[0], key[1], e["config"], "tuned" if e["tune_s"] else "untuned")
