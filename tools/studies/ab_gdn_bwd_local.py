"""The GDN backward's local kernel in each of its modes, timed against each other in one run.

    python -m tools.studies.ab_gdn_bwd_local [--check] [--shapes 1x8192,packed4x32768] [--modes twopass,group]
                                             [--quick] [--out FILE] [--no-record] [--timeout S]

Modes (``DFLASH_KERNELS_GDN_BWD_LOCAL``, read by each backward): ``twopass`` (the default kernel: a pass over V,
then one per column block of K), ``onepass`` (one pass over V, K whole) and ``group`` (the one-pass kernel per
key head, summing its value heads' dq and dk and applying the l2norm backward itself: no fp32 per-value-head
dq / dk, no l2norm backward launches). Each mode runs in a process of its own with the variable set, over the
shapes of ``benchmarks/bench_gdn.py``'s ``issue45`` set: Hk=16, K=V=128, Hv=32 at 1x3072, 1x8192, 4x8192,
1x32768 and a packed batch of 4 documents summing to 32768 (``cu_seqlens``), and Hv=48 at 4x4096; bf16 q, k, v
and beta, fp32 g, ``use_qk_l2norm_in_kernel=True``, no initial or final state (training).

Per shape and mode: ``fwdbwd_ms``, the ``triton.testing.do_bench`` median of the forward and
``torch.autograd.grad`` over q, k, v, g, beta; ``peak_MiB``; ``local_us`` and ``l2norm_bwd_us``, the device time
per call of the local kernel and of the l2norm backward launches (torch.profiler); ``speedup_vs_twopass``.
``--check``: each mode's process first computes the gradients with ``twopass`` and with its mode on the same
inputs and reports the relative error of each (``rel_err_d*``, ``check``: "ok" or what exceeded the tolerance).

Prints a table, appends the rows (op ``gdn_bwd_local``) to ``benchmarks/results/ops.jsonl`` with the GPU,
versions and date unless ``--no-record``, and with ``--out FILE`` also writes them there as JSON lines. Off the
GPU the processes run ``bench_gdn``'s tiny fp32 ``issue45`` shapes through the interpreter (set
``TRITON_INTERPRET=1``) and record nothing: a check that the job runs, not a timing.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]  # the benchmarks' helpers, the library

from tools.studies import ab_modes  # noqa: E402
from tools.studies.ab_modes import device_us, gdn_rows, with_env  # noqa: E402

MODES = ("twopass", "onepass", "group")
ENV = "DFLASH_KERNELS_GDN_BWD_LOCAL"
GRADS = ("dq", "dk", "dv", "dg", "dbeta")
# The local kernels' and the l2norm backward's names as the profiler reports them (Triton's kernel names).
LOCAL_KERNELS = ("_gdn_bwd_local_kernel", "_gdn_bwd_onepass_kernel")
L2NORM_BWD = "_gdn_l2norm_bwd_kernel"


def _tolerance(dtype):
    """Bound on a mode's gradients' relative error against twopass's: the order of the fp32 sums, or for bf16
    the roundings of the products' operands (dw's product, group's scaled tiles)."""
    import torch
    return 1e-4 if dtype == torch.float32 else 2e-2


def worker(mode, only, check, quick):
    """Rows of one mode (``ENV`` set by the parent), printed as ``ROW {json}`` lines."""
    import torch
    from bench_common import bench_ms, peak_mib

    from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    from tests.helpers import rel_err

    def fill(row, c):
        def fwd_bwd():
            return torch.autograd.grad(chunk_gated_delta_rule(*c.tensors, **c.kwargs)[0], c.tensors, c.do)

        grads = fwd_bwd()
        if check:
            ref = with_env(ENV, "twopass", fwd_bwd)
            tol = _tolerance(c.dtype)
            for name, a, b in zip(GRADS, grads, ref):
                row[f"rel_err_{name}"] = rel_err(a, b)
            over = [f"{n}={row[f'rel_err_{n}']:.3g}" for n in GRADS if not row[f"rel_err_{n}"] <= tol]
            row["check"] = f"FAILED against twopass (tolerance {tol}): {', '.join(over)}" if over else "ok"
            del ref
        del grads
        row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, c.cuda)
        row["peak_MiB"] = peak_mib(fwd_bwd, c.cuda)
        if c.cuda:
            us = device_us(fwd_bwd)
            row["local_us"] = sum(t for k, t in us.items() if k.startswith(LOCAL_KERNELS))
            row["l2norm_bwd_us"] = sum(t for k, t in us.items() if k.startswith(L2NORM_BWD))
            row["kernels_us"] = {k: round(t, 1) for k, t in sorted(us.items(), key=lambda x: -x[1])[:12]}

    gdn_rows("gdn_bwd_local", mode, ENV, only, fill)


def _table(rows):
    base = {r["label"]: r for r in rows if r.get("impl") == "twopass" and isinstance(r.get("fwdbwd_ms"), float)}
    lines = [f"{'shape':16s} {'mode':8s} {'fwd+bwd ms':>10s} {'vs twopass':>10s} {'local us':>9s} "
             f"{'l2norm us':>9s} {'peak MiB':>9s}  check"]
    for r in rows:
        if "error" in r or "fwdbwd_ms" not in r:
            lines.append(f"{r.get('label', '-'):16s} {r.get('impl', '-'):8s} error: {r.get('error', '?')[:150]}")
            continue
        b = base.get(r["label"])
        if b is not None:
            r["speedup_vs_twopass"] = b["fwdbwd_ms"] / r["fwdbwd_ms"]
        speed = f"{r['speedup_vs_twopass']:.3f}x" if "speedup_vs_twopass" in r else "-"
        lines.append(f"{r['label']:16s} {r['impl']:8s} {r['fwdbwd_ms']:10.3f} {speed:>10s} "
                     f"{r.get('local_us', float('nan')):9.1f} {r.get('l2norm_bwd_us', float('nan')):9.1f} "
                     f"{r.get('peak_MiB', float('nan')):9.1f}  {r.get('check', '')}")
    return "\n".join(lines)


def main(argv=None):
    return ab_modes.main(argv, module="tools.studies.ab_gdn_bwd_local", op="gdn_bwd_local", modes=MODES, env=ENV,
                         worker=worker, table=_table, doc=__doc__,
                         check_help="compare each mode's gradients with twopass's first")


if __name__ == "__main__":
    main()
