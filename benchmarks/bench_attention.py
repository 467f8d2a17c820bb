"""Block-sparse attention on the DFlash training mask: dflash_kernels against torch.compile(flex_attention).

Effective FLOPs count only visible (query, key) pairs: a forward is two matmuls (QK^T and PV) of
2 * D flops per pair and head, so ``4 * D * Hq * pairs``; a backward is 2.5x that (five matmuls,
the recomputed QK^T included), so fwd+bwd = ``3.5 * 4 * D * Hq * pairs``. GPU times are
``triton.testing.do_bench`` medians; peak memory is the largest allocation above the inputs during
one call. The mask build is timed on its own (``mask_ms``; flex's ``create_block_mask`` is timed once,
uncompiled, as trainers rebuild it every step). Called by ``benchmarks/ops.py attention``.
"""

import json
import time

import torch
from bench_common import bench_ms, peak_mib

SHAPES = [
    dict(B=4, S=3072, N=512, Hq=32, Hkv=8, D=128, window=None),
    dict(B=4, S=4096, N=512, Hq=32, Hkv=8, D=128, window=None),
    dict(B=4, S=3072, N=512, Hq=32, Hkv=8, D=128, window=2048),
]
CPU_SHAPE = dict(B=1, S=45, N=3, Hq=4, Hkv=1, D=64, window=None)  # checks the job runs; says nothing of speed
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


def _measure(row, fwd, fwd_bwd, flops, quick, device):
    row["fwd_ms"] = bench_ms(fwd, quick, device.type == "cuda")
    row["fwd_TFLOPs_eff"] = flops / row["fwd_ms"] * 1e-9
    row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, device.type == "cuda")
    row["fwdbwd_TFLOPs_eff"] = 3.5 * flops / row["fwdbwd_ms"] * 1e-9
    row["peak_MiB_fwdbwd"] = peak_mib(fwd_bwd, device.type == "cuda")


def _bench_shape(s, device, dtype, quick, with_flex):
    from dflash_kernels.ops.attention import block_sparse_attention, dflash_block_mask

    B, S, N, Hq, Hkv, D, W = s["B"], s["S"], s["N"], s["Hq"], s["Hkv"], s["D"], s["window"]
    Tq, Tk = N * BLOCK, S + N * BLOCK
    g = torch.Generator().manual_seed(0)
    # Sorted, as a trainer samples anchor positions along a sequence. (Our kernels do the same work
    # either way; flex's 128-row tiles mix blocks of distant anchors when they are unsorted.)
    anchors = torch.sort(torch.randint(0, S, (B, N), generator=g), dim=1).values.to(device)
    q = torch.randn(B, Tq, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Tk, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Tk, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(B, Tq, Hq, D, device=device, dtype=dtype)
    mask = dflash_block_mask(anchors, S, BLOCK, window=W)
    pairs = int(mask.visible_pairs().sum())
    flops = 4 * D * Hq * pairs
    base = {"op": "attention", "shape": _shape_name(s), "dtype": str(dtype), "visible_pairs": pairs}

    ours = {**base, "impl": "dflash_kernels"}
    ours["mask_ms"] = bench_ms(lambda: dflash_block_mask(anchors, S, BLOCK, window=W), quick,
                               device.type == "cuda")

    def fwd():
        with torch.no_grad():
            block_sparse_attention(q, k, v, mask)

    def fwd_bwd():
        torch.autograd.grad(block_sparse_attention(q, k, v, mask), (q, k, v), do)

    try:
        fwd_bwd()  # compile (and tune) outside the timings
        _measure(ours, fwd, fwd_bwd, flops, quick, device)
    except Exception as e:  # noqa: BLE001 - report, keep the run going
        ours["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows = [ours]
    if not with_flex:
        return rows

    flex_row = {**base, "impl": "flex (torch.compile)"}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
        t0 = time.perf_counter()
        block_mask = create_block_mask(_flex_mask_mod(anchors, S, W), B, None, Tq, Tk, device=device,
                                       BLOCK_SIZE=128)
        torch.cuda.synchronize()
        flex_row["mask_ms"] = (time.perf_counter() - t0) * 1e3
        qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))

        def flex_fwd():
            with torch.no_grad():
                flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)

        def flex_fwd_bwd():
            torch.autograd.grad(flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True), (q, k, v), dot)

        t0 = time.perf_counter()
        flex_fwd()
        flex_fwd_bwd()
        flex_row["compile_s"] = time.perf_counter() - t0
        _measure(flex_row, flex_fwd, flex_fwd_bwd, flops, quick, device)
        if "fwd_ms" in ours:
            ours["fwd_speedup_vs_flex"] = flex_row["fwd_ms"] / ours["fwd_ms"]
            ours["fwdbwd_speedup_vs_flex"] = flex_row["fwdbwd_ms"] / ours["fwdbwd_ms"]
    except Exception as e:  # noqa: BLE001
        flex_row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(flex_row)
    return rows


# The chip's attention ceiling in the same run: dense causal SDPA at 8k x 8k, 32 heads.
DENSE_SHAPE = dict(B=2, T=8192, H=32, D=128)


def _bench_dense_causal(device, dtype, quick) -> list:
    """Dense causal SDPA through each fused backend torch offers, forward and fwd+bwd, with the same
    effective-FLOP count (visible pairs: T (T + 1) / 2 per sequence and head): what a block-sparse
    kernel's effective TFLOP/s can be compared with."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    B, T, H, D = DENSE_SHAPE["B"], DENSE_SHAPE["T"], DENSE_SHAPE["H"], DENSE_SHAPE["D"]
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device=device, dtype=dtype)
    flops = 4 * D * H * B * (T * (T + 1) // 2)
    rows = []
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        row = {"op": "attention", "shape": f"B={B},T={T},H={H},D={D},causal dense",
               "dtype": str(dtype), "visible_pairs": B * T * (T + 1) // 2, "impl": f"sdpa {name.lower()}"}
        backend = getattr(SDPBackend, name)

        def fwd():
            with torch.no_grad(), sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            with sdpa_kernel(backend):
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)

        try:
            fwd_bwd()
            _measure(row, fwd, fwd_bwd, flops, quick, device)
        except Exception as e:  # noqa: BLE001 - a backend this build lacks: say so, keep the run going
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def run(device, quick: bool) -> list:
    """Rows for ``benchmarks/ops.py attention``: ours and flex per shape (flex on CUDA only)."""
    device = torch.device(device)
    if device.type == "cuda":
        shapes, dtype = (SHAPES[:1] if quick else SHAPES), torch.bfloat16
    else:
        shapes, dtype = [CPU_SHAPE], torch.float32
    rows = []
    for s in shapes:
        new = _bench_shape(s, device, dtype, quick, with_flex=device.type == "cuda")
        for r in new:  # as soon as measured: a run cut short by a time limit keeps its rows in the log
            print("ROW", json.dumps(r), flush=True)
        rows += new
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        for r in _bench_dense_causal(device, dtype, quick):
            print("ROW", json.dumps(r), flush=True)
            rows.append(r)
    return rows


if __name__ == "__main__":
    import sys
    for r in run("cuda" if torch.cuda.is_available() else "cpu", quick="--quick" in sys.argv):
        print(r)
