"""Gated DeltaNet chunked scan: dflash_kernels against fla's ``chunk_gated_delta_rule``, same run.

Shapes of Qwen3.5/3.6 GDN layers: Hk=16 q/k heads, Hv=48 value heads,
K=V=128, bf16, ``use_qk_l2norm_in_kernel=True``, no initial state, no final state (training).

Model FLOPs of the chunked forward, per value head and token, with chunk BT=64:
    2 * (BT*K   [K K^T]  + BT*K [w = A X] + BT*V [u = A Y] + K*V [U = u - w S]
         + K*V  [S update] + BT*K [Q K^T] + K*V [Q S]     + BT*V [P U])
  = 2 * (3*BT*K + 2*BT*V + 3*K*V)  (the masked halves of the BT x BT products counted in full);
the backward is about 2.5x that. Times are ``triton.testing.do_bench`` medians; peak memory is the
largest allocation above the inputs during one call. fla's backward refuses on Hopper with triton
3.4 to 3.7.0; that refusal is reported as a row, not a crash. Called by ``benchmarks/ops.py gdn``.

Decode rows (``op`` "gdn_decode"): ``fused_recurrent_gated_delta_rule``, one token for each of B=64 and
B=256 sequences at the GDN heads (Hk=16, Hv=32, K=V=128, bf16, fp32 state in and out), dflash_kernels
and fla, each implementation in a process of its own (``--decode-worker NAME``; a peer's CUDA fault
costs only its rows). Two calls per implementation: ``plain`` (log decay and beta passed) and
``fused`` (raw gate with A_log and dt_bias, beta logits: fla's in-kernel gate and sigmoid). Columns:
the do_bench median, the state traffic it achieves (read and write of B*Hv*K*V fp32), the relative
error of o and of the final state against the fp32 reference (a self-check of the row), and
``host_us``: the host cost of one call on a tiny input (B=1, T=1, Hk=1, Hv=2, K=V=16; the mean over
back-to-back calls without synchronization, best of five rounds). Alone: ``python bench_gdn.py --decode``.
"""


import json
import os
import subprocess
import sys
import time

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


DECODE_BATCHES = [64, 256]
DECODE_HEADS = dict(Hk=16, Hv=32, K=128, V=128)


def _decode_fn(name):
    if name == "dflash_kernels":
        from dflash_kernels.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
    return fn


def _decode_inputs(B, Hk, Hv, K, V, device, fused):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    q, k, v = rand(B, 1, Hk, K), rand(B, 1, Hk, K), rand(B, 1, Hv, V)
    g, beta = rand(B, 1, Hv, dtype=torch.float32), rand(B, 1, Hv)
    kwargs = dict(initial_state=rand(B, Hv, K, V, dtype=torch.float32), output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    if fused:
        kwargs.update(use_gate_in_kernel=True, A_log=rand(Hv, dtype=torch.float32) * 0.5 - 1,
                      dt_bias=rand(Hv, dtype=torch.float32), use_beta_sigmoid_in_kernel=True)
    else:
        g = F.logsigmoid(g)
        beta = beta.float().sigmoid().to(torch.bfloat16)
    return q, k, v, g, beta, kwargs


def _host_us(fn, device, fused):
    """Host cost of one call on a tiny input: calls back to back, no synchronization inside a round."""
    q, k, v, g, beta, kwargs = _decode_inputs(1, 1, 2, 16, 16, device, fused)
    cuda = device.type == "cuda"
    calls = 2000 if cuda else 2
    for _ in range(200 if cuda else 1):
        fn(q, k, v, g=g, beta=beta, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5 if cuda else 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(q, k, v, g=g, beta=beta, **kwargs)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return best


def decode_worker(name, quick, device="cuda"):
    """Rows of one implementation (run in its own process by ``decode_rows``)."""
    from dflash_kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from tests.helpers import rel_err
    device = torch.device(device)
    rows = []
    try:
        fn = _decode_fn(name)
    except Exception as e:  # noqa: BLE001 - absent or broken peer: a row says so
        return [{"op": "gdn_decode", "impl": name, "error": f"absent ({type(e).__name__}: {str(e)[:120]})"}]
    for fused in (False, True):
        variant = "fused" if fused else "plain"
        for B in DECODE_BATCHES:
            s = dict(B=B, T=1, **DECODE_HEADS)
            row = {"op": "gdn_decode", "impl": f"{name} [{variant}]", "shape": _shape_name(s), "dtype": "bf16"}
            try:
                q, k, v, g, beta, kwargs = _decode_inputs(B, *DECODE_HEADS.values(), device, fused)
                o, ht = fn(q, k, v, g=g, beta=beta, **kwargs)
                ro, rht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
                row["rel_err_o"] = rel_err(o, ro)
                row["rel_err_state"] = rel_err(ht, rht)
                row["decode_us"] = bench_ms(lambda: fn(q, k, v, g=g, beta=beta, **kwargs), quick,
                                            device.type == "cuda") * 1e3
                state_bytes = 2 * B * s["Hv"] * s["K"] * s["V"] * 4
                row["state_TBps"] = state_bytes / (row["decode_us"] * 1e-6) / 1e12
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print("ROW", json.dumps(row), flush=True)
        try:
            rows[-1]["host_us"] = _host_us(fn, device, fused)
        except Exception as e:  # noqa: BLE001
            rows[-1]["host_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print("ROW", json.dumps(rows[-1]), flush=True)
    return rows


def decode_rows(quick: bool) -> list:
    """The decode rows of every implementation, each from a process of its own (its ROW lines)."""
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here,
                                                        os.environ.get("PYTHONPATH", "")]))
    for name in ("dflash_kernels", "fla"):
        cmd = [sys.executable, os.path.abspath(__file__), "--decode-worker", name] + (["--quick"] if quick else [])
        try:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            rows.append({"op": "gdn_decode", "impl": name, "error": "timed out (600 s)"})
            continue
        got = {}
        for line in res.stdout.splitlines():
            if line.startswith("ROW "):
                r = json.loads(line[4:])
                got[(r["impl"], r.get("shape"))] = r  # the host_us update reprints the last row
        rows += list(got.values())
        if res.returncode != 0:
            rows.append({"op": "gdn_decode", "impl": name, "error": f"rc={res.returncode}: {res.stderr[-300:]}"})
    fla = {(r["impl"].split(" ", 1)[-1], r.get("shape")): r for r in rows if r["impl"].startswith("fla ")}
    for r in rows:
        other = fla.get((r["impl"].split(" ", 1)[-1], r.get("shape")))
        if r["impl"].startswith("dflash_kernels ") and other and "decode_us" in r and "decode_us" in other:
            r["decode_speedup_vs_fla"] = other["decode_us"] / r["decode_us"]
            if "host_us" in r and "host_us" in other:
                r["host_us_fla"] = other["host_us"]
    return rows


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
    if device.type == "cuda":
        rows += decode_rows(quick)
    return rows


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    if "--decode-worker" in sys.argv:
        decode_worker(sys.argv[sys.argv.index("--decode-worker") + 1], quick)
    elif "--decode" in sys.argv:
        rows = decode_rows(quick)
        for r in rows:
            print(r)
        if torch.cuda.is_available() and "--no-record" not in sys.argv:  # as ops.py records its rows
            from ops import record_rows
            record_rows(rows)
    else:
        for r in run("cuda" if torch.cuda.is_available() else "cpu", quick=quick):
            print(r)
