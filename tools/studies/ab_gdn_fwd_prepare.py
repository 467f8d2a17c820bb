"""The GDN forward's per-chunk preparation, split (the solve kernel, then the w/u kernel) against fused (one kernel
doing both, kernels_fwd_fused.py), timed against each other in one run.

    python -m tools.studies.ab_gdn_fwd_prepare [--check] [--shapes 1x32768,packed4x32768] [--modes split,fused]
                                               [--quick] [--out FILE] [--no-record] [--timeout S]

Modes (``DFLASH_KERNELS_GDN_FWD_PREPARE``, read by each forward): ``split`` (the default) and ``fused``. Each mode
runs in a process of its own with the variable set, over the shapes of ``benchmarks/bench_gdn.py``'s ``issue45``
set: Hk=16, K=V=128, Hv=32 at 1x3072, 1x8192, 4x8192, 1x32768 and a packed batch of 4 documents summing to 32768
(``cu_seqlens``), and Hv=48 at 4x4096; bf16 q, k, v and beta, fp32 g, ``use_qk_l2norm_in_kernel=True``, no
initial or final state (training).

Per shape and mode: ``fwd_ms`` (the forward under ``torch.no_grad``) and ``fwdbwd_ms`` (the forward and
``torch.autograd.grad`` over q, k, v, g, beta), ``triton.testing.do_bench`` medians; ``peak_MiB`` of the forward
and backward; ``prep_us``, the device time per forward of its prep kernels (split: the solve and the w/u kernel;
fused: the one kernel), and the forward's heaviest kernels (torch.profiler); ``fwd_speedup_vs_split`` and
``fwdbwd_speedup_vs_split``.

``--check``: each mode's process first runs the prep (A, G, w, u, t_bad, through the launcher ``_prep`` after the
l2norm), the forward (o and the final state) and the backward (every gradient: it reads the forward's A and G)
with ``split`` and with its own mode on the same inputs, and reports each tensor's relative error to split's
(``rel_err_<name>``), the names of those not bit for bit split's (``not_bitwise``), and ``check``: "ok" or
what exceeded the tolerance. The two run the same operations, so the results should be split's bit for bit; the
tuned blocks of the w/u products may differ between the two kernels (one rounding of w and u apart at most).

Prints a table, appends the rows (op ``gdn_fwd_prepare``) to ``benchmarks/results/ops.jsonl`` with the GPU,
versions and date unless ``--no-record``, and with ``--out FILE`` also writes them there as JSON lines. Off the
GPU the processes run ``bench_gdn``'s tiny fp32 ``issue45`` shapes through the interpreter (set
``TRITON_INTERPRET=1``) and record nothing: a check that the job runs, not a timing.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]  # the benchmarks' helpers, the library

from tools.studies import ab_modes  # noqa: E402
from tools.studies.ab_modes import gdn_rows, time_forward, with_env  # noqa: E402

MODES = ("split", "fused")
ENV = "DFLASH_KERNELS_GDN_FWD_PREPARE"
PREP = ("A", "gcum", "w", "u", "t_bad")
GRADS = ("dq", "dk", "dv", "dg", "dbeta")
# The prep kernels' names as the profiler reports them (Triton's kernel names), per mode.
PREP_KERNELS = {"split": ("_gdn_fwd_solve_kernel", "_gdn_fwd_wu_kernel"), "fused": ("_gdn_fwd_prepare_kernel",)}


def _tolerance(name, dtype):
    """Bound on a tensor's relative error to split's: t_bad exact; the rest one rounding of the products' sums (fp32
    A and G, and fp32 inputs), or of bf16 w, u and what follows from them."""
    import torch
    if name == "t_bad":
        return 0.0
    return 1e-5 if dtype == torch.float32 or name in ("A", "gcum") else 1e-2


def _bitwise(a, b):
    """Bit for bit equal, NaN where the other is NaN."""
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return bool(torch.equal(a, b))


def _check(row, tensors, kwargs, s, device, dtype, do):
    """Fill ``row`` with each tensor's relative error to split's (module docstring)."""
    import torch

    from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    from dflash_kernels.ops.gated_delta_rule import gated_delta_rule as gdn
    from dflash_kernels.runtime import settings
    from tests.helpers import rel_err

    q, k, v, g, beta = tensors
    layout = gdn._varlen_layout(kwargs["cu_seqlens"], s["B"], s["T"], device)

    def results():
        with torch.no_grad():
            kn = gdn.l2norm_fwd(k)[0]
            prep = gdn._prep(kn, v, g, beta, layout, fused=settings.gdn_fwd_prepare() == "fused")
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, **kwargs)
        o_grad = chunk_gated_delta_rule(*tensors, **kwargs)[0]
        grads = torch.autograd.grad(o_grad, tensors, do)
        return dict(zip(PREP + ("o", "final_state") + GRADS, (*prep, o, ht, *grads)))

    got = results()
    ref = with_env(ENV, "split", results)
    over, not_bitwise = [], []
    for name, a in got.items():
        b = ref[name]
        if not _bitwise(a, b):
            not_bitwise.append(name)
        err = rel_err(a.float(), b.float()) if a.is_floating_point() else float(not torch.equal(a, b))
        row[f"rel_err_{name}"] = err
        if not err <= _tolerance(name, dtype):
            over.append(f"{name}={err:.3g}")
    row["not_bitwise"] = not_bitwise
    row["check"] = f"FAILED against split: {', '.join(over)}" if over else "ok"


def worker(mode, only, check, quick):
    """Rows of one mode (``ENV`` set by the parent), printed as ``ROW {json}`` lines."""
    def fill(row, c):
        if check:
            _check(row, c.tensors, c.kwargs, c.shape, c.device, c.dtype, c.do)
        us = time_forward(row, c, quick)
        if us:
            row["prep_us"] = sum(t for k, t in us.items() if k.startswith(PREP_KERNELS[mode]))

    gdn_rows("gdn_fwd_prepare", mode, ENV, only, fill)


def _table(rows):
    def check(r):
        return r.get("check", "") + (f" (not bit for bit: {', '.join(r['not_bitwise'])})" if r.get("not_bitwise")
                                     else "")

    return ab_modes.speedup_table(rows, "split", [("prep us", "prep_us"), ("peak MiB", "peak_MiB")], check)


def main(argv=None):
    return ab_modes.main(argv, module="tools.studies.ab_gdn_fwd_prepare", op="gdn_fwd_prepare", modes=MODES, env=ENV,
                         worker=worker, table=_table, doc=__doc__,
                         check_help="compare each mode's prep, outputs and gradients with split's first")


if __name__ == "__main__":
    main()
