"""Gated DeltaNet chunked scan: dflash_kernels against fla's ``chunk_gated_delta_rule``, same run.

Shapes of Qwen3.5/3.6 GDN layers (../shared/ANCHORS.md): Hk=16 q/k heads, Hv=48 value heads,
K=V=128, bf16, ``use_qk_l2norm_in_kernel=True``, no initial state, no final state (training).

Model FLOPs of the chunked forward, per value head and token, with chunk BT=64:
    2 * (BT*K   [K K^T]  + BT*K [w = A X] + BT*V [u = A Y] + K*V [U = u - w S]
         + K*V  [S update] + BT*K [Q K^T] + K*V [Q S]     + BT*V [P U])
  = 2 * (3*BT*K + 2*BT*V + 3*K*V)  (the masked halves of the BT x BT products counted in full);
the backward is about 2.5x that. Times are ``triton.testing.do_bench`` medians; peak memory is the
largest allocation above the inputs during one call. fla's backward refuses on Hopper with triton
3.4 to 3.7.0; that refusal is reported as a row, not a crash. Called by ``benchmarks/ops.py gdn``.
"""


import json
import os

import torch
from bench_common import bench_ms, peak_mib
import torch.nn.functional as F

SHAPES = [dict(B=1, T=4096), dict(B=4, T=4096), dict(B=1, T=16384)]
HEADS = dict(Hk=16, Hv=48, K=128, V=128)
CPU_SHAPE = dict(B=1, T=100, Hk=1, Hv=2, K=16, V=16)  # interpreter/reference: shows the job runs
BT = 64


def model_flops_fwd(B, T, Hv, K, V):
    return 2 * B * T * Hv * (3 * BT * K + 2 * BT * V + 3 * K * V)


def _shape_name(s):
    return f"B={s['B']},T={s['T']},Hk={s['Hk']},Hv={s['Hv']},K={s['K']},V={s['V']}"


def _inputs(s, device, dtype):
    B, T, Hk, Hv, K, V = (s[n] for n in ("B", "T", "Hk", "Hv", "K", "V"))
    q = torch.randn(B, T, Hk, K, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, Hk, K, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, Hv, V, device=device, dtype=dtype, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, Hv, device=device, dtype=torch.float32)).requires_grad_()
    beta = torch.rand(B, T, Hv, device=device, dtype=dtype).requires_grad_()
    return q, k, v, g, beta


def _saving_states(fn):
    """``fn`` with DFLASH_KERNELS_GDN_SAVE_STATES=1 during each call: its backward reuses the forward's
    per-chunk states instead of recomputing them (the no-grad forward is the same as ``fn``'s)."""
    def call(*args, **kwargs):
        prev = os.environ.get("DFLASH_KERNELS_GDN_SAVE_STATES")
        os.environ["DFLASH_KERNELS_GDN_SAVE_STATES"] = "1"
        try:
            return fn(*args, **kwargs)
        finally:
            if prev is None:
                del os.environ["DFLASH_KERNELS_GDN_SAVE_STATES"]
            else:
                os.environ["DFLASH_KERNELS_GDN_SAVE_STATES"] = prev
    return call


def _ours():
    from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    return {"dflash_kernels": chunk_gated_delta_rule,
            "dflash_kernels[save states]": _saving_states(chunk_gated_delta_rule)}


def _implementations():
    impls = _ours()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        impls["fla"] = fla_chunk
    except Exception as e:  # noqa: BLE001 - absent or broken peer: a row says so
        impls["fla"] = f"absent ({type(e).__name__}: {str(e)[:120]})"
    return impls


def _bench_one(name, fn, s, device, dtype, quick):
    row = {"op": "gdn", "impl": name, "shape": _shape_name(s), "dtype": str(dtype)}
    if isinstance(fn, str):
        row["error"] = fn
        return row
    q, k, v, g, beta = _inputs(s, device, dtype)
    tensors = (q, k, v, g, beta)

    def fwd():
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    try:
        fwd_nograd()
        row["fwd_ms"] = bench_ms(fwd_nograd, quick, device.type == "cuda")
        row["fwd_TFLOPs_model"] = model_flops_fwd(s["B"], s["T"], s["Hv"], s["K"], s["V"]) / row["fwd_ms"] / 1e9
        row["peak_MiB_fwd"] = peak_mib(fwd_nograd, device.type == "cuda")
    except Exception as e:  # noqa: BLE001
        row["error"] = f"fwd: {type(e).__name__}: {str(e)[:200]}"
        return row
    do = torch.randn(q.shape[0], q.shape[1], v.shape[2], v.shape[3], device=device, dtype=dtype)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), tensors, do)

    try:
        fwd_bwd()
    except Exception as e:  # noqa: BLE001 - fla refuses its backward on this stack
        row["fwdbwd_ms"] = f"refused ({type(e).__name__}: {str(e)[:160]})"
        return row
    row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, device.type == "cuda")
    row["fwdbwd_over_fwd"] = row["fwdbwd_ms"] / row["fwd_ms"]
    row["peak_MiB_fwdbwd"] = peak_mib(fwd_bwd, device.type == "cuda")
    return row


def run(device, quick: bool) -> list:
    """Rows for ``benchmarks/ops.py gdn``: dflash_kernels and fla per shape (fla on CUDA only)."""
    device = torch.device(device)
    if device.type == "cuda":
        shapes = [{**s, **HEADS} for s in (SHAPES[:2] if quick else SHAPES)]
        impls, dtype = _implementations(), torch.bfloat16
    else:
        shapes, dtype = [CPU_SHAPE], torch.float32
        impls = _ours()
    rows = []
    for s in shapes:
        for name, fn in impls.items():
            rows.append(_bench_one(name, fn, s, device, dtype, quick))
            print("ROW", json.dumps(rows[-1]), flush=True)  # a run cut short keeps its rows in the log
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ours = {r["shape"]: r for r in rows if r["impl"] == "dflash_kernels" and "fwd_ms" in r}
    for r in rows:
        if r["impl"] == "fla" and "fwd_ms" in r and r["shape"] in ours:
            ours[r["shape"]]["fwd_speedup_vs_fla"] = r["fwd_ms"] / ours[r["shape"]]["fwd_ms"]
    return rows


if __name__ == "__main__":
    import sys
    for r in run("cuda" if torch.cuda.is_available() else "cpu", quick="--quick" in sys.argv):
        print(r)
