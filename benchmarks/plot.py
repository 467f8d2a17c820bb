"""Render ``benchmarks/results/ops.jsonl`` into PNG charts: ``python benchmarks/plot.py [--out DIR]``.

One chart per (op, GPU): for every shape, the forward and forward+backward milliseconds of each
implementation measured in the latest run that has that op (so bars in one chart come from one run,
with the peers timed beside the library). Rows that failed are listed under the chart, not dropped.
Needs matplotlib (``pip install matplotlib``).
"""

import argparse
import json
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "ops.jsonl")


def load_latest_runs(path):
    """``{(op, gpu): rows of the newest run of that op on that GPU}``, a run being one date stamp."""
    runs = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if row.get("op") in (None, "copy", "overhead") or "shape" not in row and "error" not in row:
                continue
            runs[(row["op"], row.get("gpu", "?"))][row["date"]].append(row)
    return {key: by_date[max(by_date)] for key, by_date in runs.items()}


def plot_op(op, gpu, rows, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "fwd_ms" in r]
    failed = [r for r in rows if "fwd_ms" not in r]
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    if not shapes:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 3 * len(shapes) * 2), 4.5), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for ax, metric, title in zip(axes[0], ("fwd_ms", "fwdbwd_ms"), ("forward", "forward + backward")):
        for j, impl in enumerate(impls):
            values = []
            for shape in shapes:
                match = [r.get(metric) for r in ok if r["shape"] == shape and r["impl"] == impl]
                values.append(match[0] if match and isinstance(match[0], (int, float)) else 0.0)
            xs = [i + j * width for i in range(len(shapes))]
            bars = ax.bar(xs, values, width, label=impl)
            for bar, v in zip(bars, values):
                if v:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                                fontsize=7)
        ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(shapes))])
        ax.set_xticklabels(shapes, fontsize=7)
        ax.set_ylabel("ms (median, lower is better)")
        ax.set_title(f"{op} {title}")
    axes[0][0].legend(fontsize=7)
    date = rows[0]["date"]
    note = f"{gpu} | torch {rows[0].get('torch')} | triton {rows[0].get('triton')} | {date}"
    if failed:
        note += "\nfailed: " + "\n        ".join(f"{r['impl']} {r.get('shape', '')}: {r.get('error', '')[:60]}"
                                         for r in failed)
    fig.text(0.01, 0.01, note, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.06 + 0.035 * len(failed), 1, 1))
    path = os.path.join(out_dir, f"{op}-{gpu.replace(' ', '_')}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plots"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for (op, gpu), rows in sorted(load_latest_runs(args.results).items()):
        path = plot_op(op, gpu, rows, args.out)
        print(path or f"{op} on {gpu}: no successful rows to plot")


if __name__ == "__main__":
    main()
