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

Named shape sets (``--shapes NAME``; without it the run above is unchanged): dflash_kernels, fla and
FlashQLA (``flash_qla.chunk_gated_delta_rule``, the Qwen team's TileLang kernels, fla's signature, the
l2-norm of q and k in its kernel too), each in a process of its own (``--worker NAME``), forward and
forward + backward (``torch.autograd.grad`` over q, k, v, g, beta), bf16, fp32 g. ``issue45``: Hk=16,
K=V=128, Hv=32 at 1 x 3072, 1 x 8192, 4 x 8192, 1 x 32768 and a packed batch of 4 documents summing to
32768 (``cu_seqlens``, int64, B=1), and Hv=48 at 4 x 4096. Each peer row first checks its output (and,
where its backward runs, every gradient) against dflash_kernels on the same inputs in its own process
(``rel_err_*``; ``check`` says "ok" or what exceeded CHECK_TOL) and is timed after. A peer that is not
installed, or cannot load here, gives a row whose ``error`` says so. FlashQLA is not on the GPU machine:
its wheels travel as the kit in ``.peers_qla/`` (KIT.md there). Off the GPU, ``--shapes`` runs tiny fp32
versions of the shapes (``CPU_SHAPE_SETS``) through the same processes: dflash_kernels only; the peers
report that they need CUDA. ``--impls``, ``--only`` (shape labels) and ``--timeout`` split a long run
over several calls; ``--out FILE`` also writes the rows as JSON lines.
"""


import argparse
import importlib.util
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

# Named shape sets for ``--shapes``: label -> shape. ``docs``: a packed batch (B=1, T = their sum,
# cu_seqlens from them).
_GDN = dict(Hk=16, K=128, V=128)
SHAPE_SETS = {
    "default": {f"{s['B']}x{s['T']}": {**s, **HEADS} for s in SHAPES},
    "issue45": {
        "1x3072": dict(B=1, T=3072, Hv=32, **_GDN),
        "1x8192": dict(B=1, T=8192, Hv=32, **_GDN),
        "4x8192": dict(B=4, T=8192, Hv=32, **_GDN),
        "1x32768": dict(B=1, T=32768, Hv=32, **_GDN),
        "packed4x32768": dict(B=1, T=32768, Hv=32, docs=(3000, 11000, 5000, 13768), **_GDN),
        "4x4096hv48": dict(B=4, T=4096, Hv=48, **_GDN),
    },
}
# Off the GPU: the same kinds of shape (GVA ratios, batch, packed with odd lengths), tiny, fp32.
_TINY = dict(Hk=1, K=16, V=16)
CPU_SHAPE_SETS = {
    "default": {"1x100": dict(CPU_SHAPE)},
    "issue45": {
        "1x100": dict(B=1, T=100, Hv=2, **_TINY),
        "2x70": dict(B=2, T=70, Hv=2, **_TINY),
        "packed3x100": dict(B=1, T=100, Hv=2, docs=(37, 20, 43), **_TINY),
        "2x64hv3": dict(B=2, T=64, Hv=3, **_TINY),
    },
}
WORKER_IMPLS = ("dflash_kernels", "fla", "flashqla")  # the order of the processes
CHECK_TOL = 5e-2  # a peer's relative error against ours above this: its row's ``check`` says so


def model_flops_fwd(B, T, Hv, K, V):
    return 2 * B * T * Hv * (3 * BT * K + 2 * BT * V + 3 * K * V)


def _shape_name(s):
    name = f"B={s['B']},T={s['T']},Hk={s['Hk']},Hv={s['Hv']},K={s['K']},V={s['V']}"
    if s.get("docs"):
        name += ",docs=" + "+".join(str(n) for n in s["docs"])
    return name


def _inputs(s, device, dtype):
    B, T, Hk, Hv, K, V = (s[n] for n in ("B", "T", "Hk", "Hv", "K", "V"))
    q = torch.randn(B, T, Hk, K, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, Hk, K, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, Hv, V, device=device, dtype=dtype, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, Hv, device=device, dtype=torch.float32)).requires_grad_()
    beta = torch.rand(B, T, Hv, device=device, dtype=dtype).requires_grad_()
    return q, k, v, g, beta


def _cu_seqlens(s, device):
    """int64 ``[N + 1]`` boundaries of a packed shape (fla's convention), or None."""
    docs = s.get("docs")
    if not docs:
        return None
    assert s["B"] == 1 and sum(docs) == s["T"], s
    bounds = [0]
    for n in docs:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.long, device=device)


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


def _bench_one(name, fn, s, device, dtype, quick, reference=None):
    """One row: ``fn`` timed forward (no grad) and forward + backward at shape ``s``. With ``reference``
    (ours, for a peer's row), the output and each gradient are first compared with the reference's on
    the same inputs (``rel_err_*``, ``check``); the timings follow."""
    row = {"op": "gdn", "impl": name, "shape": _shape_name(s), "dtype": str(dtype)}
    if isinstance(fn, str):
        row["error"] = fn
        return row
    q, k, v, g, beta = _inputs(s, device, dtype)
    tensors = (q, k, v, g, beta)
    cu_seqlens = _cu_seqlens(s, device)
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens

    def fwd():
        return fn(q, k, v, g, beta, **kwargs)[0]

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    do = torch.randn(q.shape[0], q.shape[1], v.shape[2], v.shape[3], device=device, dtype=dtype)
    ref = None
    if reference is not None:
        try:
            ref_o = reference(q, k, v, g, beta, **kwargs)[0]
            ref = (ref_o.detach(), torch.autograd.grad(ref_o, tensors, do))
            del ref_o
        except Exception as e:  # noqa: BLE001 - no reference: the row says so, the timing goes on
            row["check"] = f"no reference: {type(e).__name__}: {str(e)[:160]}"

    try:
        if ref is not None:
            row["rel_err_o"] = _rel_err(fwd_nograd(), ref[0])
            _set_check(row)
        fwd_nograd()
        row["fwd_ms"] = bench_ms(fwd_nograd, quick, device.type == "cuda")
        row["fwd_TFLOPs_model"] = model_flops_fwd(s["B"], s["T"], s["Hv"], s["K"], s["V"]) / row["fwd_ms"] / 1e9
        row["peak_MiB_fwd"] = peak_mib(fwd_nograd, device.type == "cuda")
    except Exception as e:  # noqa: BLE001
        row["error"] = f"fwd: {type(e).__name__}: {str(e)[:200]}"
        return row

    def fwd_bwd():
        return torch.autograd.grad(fwd(), tensors, do)

    try:
        grads = fwd_bwd()
    except Exception as e:  # noqa: BLE001 - fla refuses its backward on this stack
        row["fwdbwd_ms"] = f"refused ({type(e).__name__}: {str(e)[:160]})"
        return row
    if ref is not None:
        for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, ref[1]):
            row[f"rel_err_{n}"] = _rel_err(a, b)
        _set_check(row)
    del grads, ref
    row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, device.type == "cuda")
    row["fwdbwd_over_fwd"] = row["fwdbwd_ms"] / row["fwd_ms"]
    row["peak_MiB_fwdbwd"] = peak_mib(fwd_bwd, device.type == "cuda")
    return row


def _rel_err(a, b):
    from tests.helpers import rel_err
    return rel_err(a, b)


def _set_check(row):
    over = [f"{k}={row[k]:.3g}" for k in row if k.startswith("rel_err_") and not row[k] <= CHECK_TOL]
    row["check"] = f"FAILED against dflash_kernels (tolerance {CHECK_TOL}): {', '.join(over)}" if over else "ok"


# ------------------------------------------------------------------ named shape sets, one process each
def _flashqla():
    """FlashQLA's ``chunk_gated_delta_rule`` (fla's signature), or a string saying why not."""
    if importlib.util.find_spec("flash_qla") is None:
        return ("absent: FlashQLA is not installed (pip package flash-qla 0.1.3, module flash_qla; "
                "install the kit in .peers_qla/, see its KIT.md)")
    if not torch.cuda.is_available():
        return "skipped: FlashQLA needs a CUDA GPU (sm90, sm100/103 or sm120/121); none here"
    try:
        from flash_qla import chunk_gated_delta_rule as qla_chunk
    except Exception as e:  # noqa: BLE001 - broken install, tilelang or nvcc missing, unsupported GPU
        return f"unavailable: import flash_qla failed ({type(e).__name__}: {str(e)[:300]})"
    return qla_chunk


def _worker_impl(name):
    if name == "dflash_kernels":
        return _ours()["dflash_kernels"]
    if name == "fla":
        if not torch.cuda.is_available():
            return "skipped: fla's kernels need a CUDA GPU; none here"
        return _implementations()["fla"]
    if name == "flashqla":
        return _flashqla()
    raise SystemExit(f"bench_gdn: unknown implementation {name!r} (one of {', '.join(WORKER_IMPLS)})")


def _shape_set(set_name, only, cuda):
    sets = SHAPE_SETS if cuda else CPU_SHAPE_SETS
    if set_name not in sets:
        raise SystemExit(f"bench_gdn: unknown shape set {set_name!r} (one of {', '.join(sets)})")
    shapes = sets[set_name]
    if only:
        unknown = [x for x in only if x not in shapes]
        if unknown:
            raise SystemExit(f"bench_gdn: no shape {', '.join(unknown)} in {set_name!r} here "
                             f"({', '.join(shapes)})")
        shapes = {x: shapes[x] for x in only}
    return shapes


def shape_worker(name, set_name, quick, only=None):
    """Rows of one implementation over a named shape set, printed as ROW lines (run in its own process by
    ``shape_set_rows``). A peer is checked against dflash_kernels, run here on the same inputs."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    fn = _worker_impl(name)
    reference = None if name == "dflash_kernels" or isinstance(fn, str) else _ours()["dflash_kernels"]
    rows = []
    for label, s in _shape_set(set_name, only, cuda).items():
        torch.manual_seed(0)
        try:
            row = _bench_one(name, fn, s, device, dtype, quick, reference=reference)
        except Exception as e:  # noqa: BLE001 - one shape's failure (out of memory, say) costs its row only
            row = {"op": "gdn", "impl": name, "shape": _shape_name(s), "dtype": str(dtype),
                   "error": f"{type(e).__name__}: {str(e)[:200]}"}
        row.update(shape_set=set_name, label=label)
        rows.append(row)
        print("ROW", json.dumps(row), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def shape_set_rows(set_name, quick, impls=WORKER_IMPLS, only=None, timeout=600, out=None):
    """Every implementation's rows over a named shape set, each implementation in a process of its own;
    dflash_kernels' rows gain the speedups over the peers timed in the same run. Each worker's ROW
    lines are echoed, and appended to ``out``, as they come: a run cut short keeps them."""
    import tempfile
    import threading
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here,
                                                        os.environ.get("PYTHONPATH", "")]))
    for name in impls:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--shapes", set_name]
        cmd += (["--quick"] if quick else []) + (["--only", ",".join(only)] if only else [])
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            try:
                for line in proc.stdout:
                    if not line.startswith("ROW "):
                        continue
                    rows.append(json.loads(line[4:]))
                    print(line, end="", flush=True)
                    if out:
                        with open(out, "a") as f:
                            f.write(line[4:])
                rc = proc.wait()
            finally:
                timed_out = not timer.is_alive() and proc.returncode != 0
                timer.cancel()
            err.seek(0)
            tail = err.read()[-300:]
        if rc != 0:
            why = f"timed out ({timeout} s)" if timed_out else f"rc={rc}"
            rows.append({"op": "gdn", "impl": name, "shape_set": set_name, "error": f"{why}: {tail}"})
            print("ROW", json.dumps(rows[-1]), flush=True)
    ours = {r["label"]: r for r in rows if r["impl"] == "dflash_kernels" and "label" in r}
    for r in rows:
        mine = ours.get(r.get("label"))
        if r["impl"] == "dflash_kernels" or mine is None:
            continue
        for key in ("fwd_ms", "fwdbwd_ms"):
            if isinstance(r.get(key), float) and isinstance(mine.get(key), float):
                mine[f"{key.split('_')[0]}_speedup_vs_{r['impl']}"] = r[key] / mine[key]
    return rows


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


def _main(argv=None):
    parser = argparse.ArgumentParser(
        description="Gated DeltaNet chunked scan (and decode) benchmark: dflash_kernels against fla and "
                    "FlashQLA. Without --shapes or --decode: the run of benchmarks/ops.py gdn (default shapes, "
                    "ours and fla in this process, then the decode rows).")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions (and fewer default shapes)")
    parser.add_argument("--decode", action="store_true", help="only the decode rows")
    parser.add_argument("--decode-worker", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", metavar="SET", choices=sorted(SHAPE_SETS),
                        help="a named shape set (%(choices)s), each implementation in a process of its own")
    parser.add_argument("--impls", default=",".join(WORKER_IMPLS),
                        help="with --shapes: comma-separated, in order (default %(default)s)")
    parser.add_argument("--only", default="",
                        help="with --shapes: comma-separated shape labels of the set (issue45: "
                             + ", ".join(SHAPE_SETS["issue45"]) + ")")
    parser.add_argument("--timeout", type=int, default=600, help="with --shapes: seconds per process (%(default)s)")
    parser.add_argument("--out", metavar="FILE", help="also write the rows to FILE as JSON lines (with --shapes, "
                        "each worker's rows go to FILE.partial as they come, for a run cut short)")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append the rows to benchmarks/results/ops.jsonl (GPU runs record)")
    args = parser.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    if args.decode_worker:
        decode_worker(args.decode_worker, args.quick)
        return
    if args.worker:
        if not args.shapes:
            parser.error("--worker needs --shapes")
        shape_worker(args.worker, args.shapes, args.quick, only)
        return
    record = torch.cuda.is_available() and not args.no_record
    if args.shapes:
        impls = [x for x in args.impls.split(",") if x]
        bad = [x for x in impls if x not in WORKER_IMPLS]
        if bad:
            parser.error(f"unknown implementation(s) {', '.join(bad)}; one of {', '.join(WORKER_IMPLS)}")
        _shape_set(args.shapes, only, torch.cuda.is_available())  # an unknown label fails before any process
        rows = shape_set_rows(args.shapes, args.quick, impls, only, args.timeout,
                              out=args.out and args.out + ".partial")
    elif args.decode:
        rows = decode_rows(args.quick)
    else:
        rows = run("cuda" if torch.cuda.is_available() else "cpu", quick=args.quick)
        record = False  # as before: benchmarks/ops.py gdn records these
    for r in rows:
        print(r)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if record:  # as ops.py records its rows
        from ops import record_rows
        record_rows(rows)


if __name__ == "__main__":
    _main()
