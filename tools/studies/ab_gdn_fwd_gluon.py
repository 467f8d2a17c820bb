"""The GDN forward after its solve: the Triton kernels (the w/u kernel, then the fused or split scan) against the
warp-specialized Gluon kernel (kernels_gluon_sm90_fwd.py; sm_90 only), timed against each other in one run.

    python -m tools.studies.ab_gdn_fwd_gluon [--check] [--shapes 1x32768,4x8192] [--modes triton,gluon]
                                             [--quick] [--out FILE] [--no-record] [--timeout S]

Modes (``DFLASH_KERNELS_GDN_FWD``, read by each forward): ``triton`` (the default) and ``gluon``, each in a process
of its own, over ``benchmarks/bench_gdn.py``'s ``issue45`` shapes (ab_modes.py; the packed shape's ``cu_seqlens``
is not taken by the Gluon kernel: its row holds the error). Per shape and mode: ``fwd_ms`` and ``fwdbwd_ms``
(``do_bench`` medians; the backward is the same in both modes), ``peak_MiB``, ``fwd_device_us`` and the forward's
heaviest kernels (torch.profiler), and the speed-ups against ``triton``.

``--check``: each mode's process first runs the op's forward and backward on the same inputs in its own mode and
in ``triton``'s, and reports o's, the final state's and every gradient's relative error to ``triton``'s
(``rel_err_<name>``) and ``check``: "ok" or what exceeded 3e-2 (the two round differently: the Gluon kernel rounds
X and U to bf16, the Triton kernels w and u).

Prints a table, appends the rows (op ``gdn_fwd_gluon``) to ``benchmarks/results/ops.jsonl`` unless
``--no-record`` (GPU only), and with ``--out FILE`` also writes them there.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]  # the benchmarks' helpers, the library

from tools.studies import ab_modes  # noqa: E402
from tools.studies.ab_modes import gdn_rows, time_forward, with_env  # noqa: E402

MODES = ("triton", "gluon")
ENV = "DFLASH_KERNELS_GDN_FWD"
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")
TOL = 3e-2


def _check(row, tensors, kwargs, do):
    """Fill ``row`` with o's, the final state's and every gradient's relative error to ``triton``'s."""
    import torch

    from dflash_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    from tests.helpers import rel_err

    def results():
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        o, ht = chunk_gated_delta_rule(*leaves, output_final_state=True, **kwargs)
        grads = torch.autograd.grad(o, leaves, do)
        return dict(zip(NAMES, (o.detach(), ht.detach(), *grads)))

    got = results()
    ref = with_env(ENV, "triton", results)
    over = []
    for name in NAMES:
        err = rel_err(got[name].float(), ref[name].float())
        row[f"rel_err_{name}"] = err
        if not err <= TOL:
            over.append(f"{name}={err:.3g}")
    row["check"] = f"FAILED against triton: {', '.join(over)}" if over else "ok"


def worker(mode, only, check, quick):
    """Rows of one mode (``ENV`` set by the parent), printed as ``ROW {json}`` lines."""
    def fill(row, c):
        if check:
            _check(row, c.tensors, c.kwargs, c.do)
        time_forward(row, c, quick)

    gdn_rows("gdn_fwd_gluon", mode, ENV, only, fill)


def _table(rows):
    return ab_modes.speedup_table(rows, "triton", [("fwd dev us", "fwd_device_us")])


def main(argv=None):
    return ab_modes.main(argv, module="tools.studies.ab_gdn_fwd_gluon", op="gdn_fwd_gluon", modes=MODES, env=ENV,
                         worker=worker, table=_table, doc=__doc__,
                         check_help="compare each mode's outputs and gradients with triton's first")


if __name__ == "__main__":
    main()
