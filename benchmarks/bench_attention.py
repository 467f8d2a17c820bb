"""Block-sparse attention on the DFlash training mask: dflash_kernels against torch.compile(flex_attention).

Effective FLOPs count only visible (query, key) pairs: a forward is two matmuls (QK^T and PV) of
2 * D flops per pair and head, so ``4 * D * Hq * pairs``; a backward is 2.5x that (five matmuls,
the recomputed QK^T included), so fwd+bwd = ``3.5 * 4 * D * Hq * pairs``. Times are
``triton.testing.do_bench`` medians; peak memory is the largest allocation above the inputs seen
during one forward + backward. Called by ``benchmarks/ops.py attention``.
"""

import time

import torch

SHAPES = [
    dict(B=4, S=3072, N=512, Hq=32, Hkv=8, D=128, window=None),
    dict(B=4, S=4096, N=512, Hq=32, Hkv=8, D=128, window=None),
    dict(B=4, S=3072, N=512, Hq=32, Hkv=8, D=128, window=2048),
]
BLOCK = 16  # DFlash draft block size


def _shape_name(s):
    w = "" if s["window"] is None else f",W={s['window']}"
    return f"B={s['B']},S={s['S']},N={s['N']},Hq={s['Hq']},Hkv={s['Hkv']},D={s['D']}{w}"


def _flex_mask_mod(anchors, S, window):
    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // BLOCK
        a = anchors[b, blk]
        ctx = (kv_idx < a) if window is None else (kv_idx < a) & (kv_idx >= a - window)
        own = (kv_idx >= S) & ((kv_idx - S) // BLOCK == blk)
        return ctx | own
    return mask_mod


def _time_ms(fn, quick):
    import triton
    return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")


def _peak_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _row(name, shape, flops, ms_fwd, ms_fwd_bwd, peak, mask_ms, note=""):
    return {"name": name, "shape": shape, "ms_fwd": ms_fwd, "ms_fwd_bwd": ms_fwd_bwd,
            "tflops_fwd": flops / ms_fwd * 1e-9, "tflops_fwd_bwd": 3.5 * flops / ms_fwd_bwd * 1e-9,
            "peak_mib_fwd_bwd": peak, "ms_mask": mask_ms, "note": note}


def _bench_shape(s, device, quick, with_flex):
    from dflash_kernels.ops.attention import block_sparse_attention, dflash_block_mask

    B, S, N, Hq, Hkv, D, W = s["B"], s["S"], s["N"], s["Hq"], s["Hkv"], s["D"], s["window"]
    Tq, Tk = N * BLOCK, S + N * BLOCK
    g = torch.Generator().manual_seed(0)
    # Sorted, as a trainer samples anchor positions along a sequence. (Our kernels do the same work
    # either way; flex's 128-row tiles mix blocks of distant anchors when they are unsorted.)
    anchors = torch.sort(torch.randint(0, S, (B, N), generator=g), dim=1).values.to(device)
    q = torch.randn(B, Tq, Hq, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Tk, Hkv, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Tk, Hkv, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, Tq, Hq, D, device=device, dtype=torch.bfloat16)

    mask_ms = _time_ms(lambda: dflash_block_mask(anchors, S, BLOCK, window=W), quick)
    mask = dflash_block_mask(anchors, S, BLOCK, window=W)
    pairs = int(mask.visible_pairs().sum()) * (B if mask.batch_size == 1 else 1)
    flops = 4 * D * Hq * pairs

    def ours_fwd():
        with torch.no_grad():
            block_sparse_attention(q, k, v, mask)

    def ours_fwd_bwd():
        o = block_sparse_attention(q, k, v, mask)
        torch.autograd.grad(o, (q, k, v), do)

    ours_fwd_bwd()  # compile + tune outside the timings
    name = _shape_name(s)
    rows = [_row("dflash_kernels", name, flops, _time_ms(ours_fwd, quick), _time_ms(ours_fwd_bwd, quick),
                 _peak_mib(ours_fwd_bwd), mask_ms, note=f"visible pairs {pairs}")]
    if not with_flex:
        return rows

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    t0 = time.perf_counter()
    block_mask = create_block_mask(_flex_mask_mod(anchors, S, W), B, None, Tq, Tk, device=device, BLOCK_SIZE=128)
    torch.cuda.synchronize()
    flex_mask_ms = (time.perf_counter() - t0) * 1e3
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    dot = do.transpose(1, 2)

    def flex_fwd():
        with torch.no_grad():
            flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)

    def flex_fwd_bwd():
        o = flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), dot)

    t0 = time.perf_counter()
    flex_fwd()
    flex_fwd_bwd()
    compile_s = time.perf_counter() - t0
    rows.append(_row("flex (torch.compile)", name, flops, _time_ms(flex_fwd, quick), _time_ms(flex_fwd_bwd, quick),
                     _peak_mib(flex_fwd_bwd), flex_mask_ms,
                     note=f"create_block_mask uncompiled, BLOCK_SIZE=128; compile {compile_s:.1f} s"))
    return rows


def run(device, quick: bool) -> list:
    """Rows for ``benchmarks/ops.py attention``: ours and flex per shape (flex only on CUDA)."""
    device = torch.device(device)
    with_flex = device.type == "cuda"
    shapes = SHAPES[:1] if quick else SHAPES
    rows = []
    for s in shapes:
        rows += _bench_shape(s, device, quick, with_flex)
    return rows


if __name__ == "__main__":
    import sys
    for r in run("cuda", quick="--quick" in sys.argv):
        print(r)
