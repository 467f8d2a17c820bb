"""Render ``benchmarks/results/`` into PNG charts: ``python benchmarks/plot.py [--out DIR]``.

- One chart per (op, GPU) from ``ops.jsonl``: for every shape, the forward and forward+backward
  milliseconds of each implementation in the latest session that measured that op (rows stamped
  within ``SESSION_S`` of the newest one: a session runs each peer in a process of its own), the
  newest row per (implementation, shape, backend). Failed rows are listed under the chart.
- ``tok_s-<GPU>.png`` from ``tok_s.jsonl``: tokens/s per preset and backend group, latest session
  (rows tagged ``variant``, a non-default trainer setting, are left out).
- ``loss-<run>.png`` for each ``train/*-metrics.jsonl``: the training loss and accuracy per step.
Needs matplotlib (``pip install matplotlib``).
"""

import argparse
import datetime
import glob
import json
import os
import textwrap
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "ops.jsonl")
SESSION_S = 1800  # rows stamped this close to a chart's newest row belong to its session


def _seconds(date: str):
    try:
        return datetime.datetime.fromisoformat(date).timestamp()
    except ValueError:  # not an ISO stamp: only equal stamps are one session
        return None


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest_session(rows, key):
    """The rows of the newest session, newest row per ``key(row)``, in first-measured order."""
    newest = max(r["date"] for r in rows)
    t_new = _seconds(newest)

    def same_session(r):
        if r["date"] == newest:
            return True
        t = _seconds(r["date"])
        return t is not None and t_new is not None and t_new - t <= SESSION_S

    keep = {}
    for r in sorted((r for r in rows if same_session(r)), key=lambda r: r["date"]):
        keep[key(r)] = r  # a later row of the same key replaces the earlier one
    return sorted(keep.values(), key=lambda r: r["date"])


def load_latest_runs(path):
    """``{(op, gpu): rows of the newest session that measured that op on that GPU}``."""
    runs = defaultdict(list)
    for row in _read(path):
        if row.get("op") in (None, "copy", "overhead") or "shape" not in row and "error" not in row:
            continue
        runs[(row["op"], row.get("gpu", "?"))].append(row)
    return {k: latest_session(rows, lambda r: (r.get("impl"), r.get("shape"), r.get("backend")))
            for k, rows in runs.items()}


def plot_op(op, gpu, rows, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "fwd_ms" in r]
    failed = [r for r in rows if "fwd_ms" not in r]
    label = {id(r): r["impl"] + (f" [{r['backend']}]" if r.get("backend") else "") for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    impls = list(dict.fromkeys(label[id(r)] for r in ok))
    if not shapes:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 3 * len(shapes) * 2), 4.5), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for ax, metric, title in zip(axes[0], ("fwd_ms", "fwdbwd_ms"), ("forward", "forward + backward")):
        for j, impl in enumerate(impls):
            values = []
            for shape in shapes:
                match = [r.get(metric) for r in ok if r["shape"] == shape and label[id(r)] == impl]
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
    date = rows[0]["date"] if rows[0]["date"] == rows[-1]["date"] else f"{rows[0]['date']} .. {rows[-1]['date']}"
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


# The step's device-time categories (benchmarks/tok_s.py ``--profile``), bottom to top of a stacked bar.
CATEGORY_ORDER = ("gemm", "attention", "gdn", "conv", "loss", "norm/rope/activation", "optimizer", "copies/casts",
                  "other")


def charted_tok_s_rows(path) -> dict:
    """``{gpu: rows}`` of ``tok_s.jsonl`` that a chart may show: rows with tokens/s, except those of a
    non-default trainer variant (tagged ``variant``) and those found invalid afterwards (tagged
    ``defect``), which stay in the file."""
    by_gpu = defaultdict(list)
    for r in _read(path):
        if isinstance(r.get("tok_s"), (int, float)) and "variant" not in r and "defect" not in r:
            by_gpu[r.get("gpu", "?")].append(r)
    return dict(by_gpu)


def plot_tok_s(path, out_dir):
    """Per GPU, the newest session's rows: tokens/s per (preset, group) with each row's MFU, and, for
    the rows measured with ``--profile``, a stacked bar of the step's device time per category."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for gpu, rows in charted_tok_s_rows(path).items():
        everything = rows
        rows = latest_session(rows, lambda r: (r["preset"], r["group"]))
        profiled = _newest_profiles(everything, rows)
        rows = _with_older_peers(everything, rows)  # the peers' bars, from an older run where this one has none
        ncols = 2 if profiled else 1
        fig, axes = plt.subplots(1, ncols, figsize=(2 + 1.6 * len(rows) + (2 + 1.3 * len(profiled) if profiled else 0),
                                                    4.5), squeeze=False)
        ax = axes[0][0]
        names = [f"{r['preset']}\n{_wrap(r['group'])}" + (f"\n({r['label_date']})" if r.get("label_date") else "")
                 for r in rows]
        bars = ax.bar(range(len(rows)), [r["tok_s"] for r in rows])
        for bar, r in zip(bars, rows):
            mfu = r.get("mfu")
            text = f"{r['tok_s']:,.0f}" + (f"\nMFU {100 * mfu:.1f}%" if isinstance(mfu, (int, float)) else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, r["tok_s"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel("drafter-training tokens/s (higher is better)")
        ax.set_title(f"tok_s on {gpu} (MFU vs 989 TFLOP/s)")
        ax.margins(y=0.18)
        if profiled:
            _plot_step_breakdown(axes[0][1], profiled)
        newest = max(r["date"] for r in rows if not r.get("label_date"))
        fig.text(0.01, 0.01, f"torch {rows[0].get('torch')} | triton {rows[0].get('triton')} | {newest}",
                 fontsize=7)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        out = os.path.join(out_dir, f"tok_s-{gpu.replace(' ', '_')}.png")
        fig.savefig(out, dpi=120)
        plt.close(fig)
        paths.append(out)
    return paths


IDLE = "GPU idle (host)"


def _has_profile(r):
    return isinstance(r.get("profile_ms"), dict) and bool(r["profile_ms"])


def _newest_profiles(everything, newest):
    """The breakdown's rows: per (preset, group), the newest row with a profile. The newest session's
    groups come first; a row from an older run is marked with its date (``step_breakdown``'s label)."""
    return _with_older_peers(everything, newest, _has_profile)


def _with_older_peers(everything, newest, usable=lambda r: True):
    """Per (preset, group) of the newest session, its newest ``usable`` row; then (b) and the fastest (b+)
    of those presets from older runs where the newest session has none, marked with their date."""
    latest = {}
    current = {(r["preset"], r["group"]) for r in newest}
    for r in everything:
        key = (r["preset"], r["group"])
        # older runs fill in (b) and the fastest (b+) stack only (the three bars), of the presets
        # the newest session ran
        wanted = key in current or ((r["group"] == "(b) peers" or r.get("b_plus_best"))
                                    and r["preset"] in {p for p, _ in current})
        if wanted and usable(r) and (key not in latest or r.get("date", "") > latest[key].get("date", "")):
            latest[key] = r
    order = [(r["preset"], r["group"]) for r in newest] + sorted(set(latest) - {(r["preset"], r["group"]) for r in newest})
    date = max((r.get("date", "") for r in newest), default="")
    out = []
    for key in order:
        if key in latest:
            r = latest[key]
            out.append(r if r.get("date", "") == date else dict(r, label_date=r.get("date", "")[:16].replace("T", " ")))
    return out


def _wrap(group: str) -> str:
    """A group's name on lines of at most 20 characters (the bars' labels must not run into each other)."""
    return "\n".join(textwrap.wrap(group, 20))


def step_breakdown(rows):
    """``(labels, {category: [ms per row]})`` of rows with ``profile_ms``, categories in CATEGORY_ORDER
    (then any other category a row has), zero where a row has none; last, :data:`IDLE`: the row's
    ms/step less its device time (what the GPU waits for the host), where the row has ms/step."""
    cats = list(CATEGORY_ORDER) + sorted({c for r in rows for c in r["profile_ms"]} - set(CATEGORY_ORDER))
    cats = [c for c in cats if any(r["profile_ms"].get(c) for r in rows)]
    per_cat = {c: [float(r["profile_ms"].get(c, 0.0)) for r in rows] for c in cats}
    idle = [max(float(r["ms_step"]) - sum(r["profile_ms"].values()), 0.0) if isinstance(r.get("ms_step"), (int, float))
            else 0.0 for r in rows]
    if any(idle):
        per_cat[IDLE] = idle
    return [f"{r['preset']}\n{_wrap(r['group'])}" + (f"\n({r['label_date']})" if r.get("label_date") else "") for r in rows], per_cat


def _plot_step_breakdown(ax, rows):
    labels, per_cat = step_breakdown(rows)
    bottom = [0.0] * len(rows)
    for cat, values in per_cat.items():
        ax.bar(range(len(rows)), values, bottom=bottom, label=cat,
               **({"color": "white", "edgecolor": "black", "hatch": "//"} if cat == IDLE else {}))
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f} ms", (x, total), ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max(bottom, default=1.0) * 1.08)  # room for the totals above the bars
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("ms per step: device time (profile) + GPU idle")
    ax.set_title("where a step's time goes")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_loss(path, out_dir):
    """Loss and accuracy per step of one training run's metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(path)
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted block CE")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["acc"] for r in rows], color="tab:orange", label="accuracy")
    ax2.set_ylabel("draft-token accuracy")
    name = os.path.basename(path).replace("-metrics.jsonl", "")
    ax.set_title(f"training run {name}")
    fig.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    out = os.path.join(out_dir, f"loss-{name}.png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plots"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for (op, gpu), rows in sorted(load_latest_runs(args.results).items()):
        path = plot_op(op, gpu, rows, args.out)
        print(path or f"{op} on {gpu}: no successful rows to plot")
    results_dir = os.path.dirname(os.path.abspath(args.results))
    tok_s = os.path.join(results_dir, "tok_s.jsonl")
    if os.path.exists(tok_s):
        for path in plot_tok_s(tok_s, args.out):
            print(path)
    for metrics in sorted(glob.glob(os.path.join(results_dir, "train", "*-metrics.jsonl"))):
        print(plot_loss(metrics, args.out))


if __name__ == "__main__":
    main()
