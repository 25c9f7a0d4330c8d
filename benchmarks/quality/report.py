#!/usr/bin/env python3
"""The planning-quality report from harness runs' JSON lines (wah.py / alfred.py --out):

  report.py RUN.jsonl [RUN2.jsonl ...] [--out DIR]
  report.py --self-test

Per dataset (the rows' episode kinds say which) and method: decisions, accuracy +- standard error,
agreement with full, mean KL(full || method), mean recompute ratio, median TTFT, as a markdown
table; with matplotlib, accuracy_vs_ratio.png (accuracy and agreement against the recompute
ratio, one point per method; the `keep:decay=...` runs of a d sweep joined as a line: the
paper's Fig. 10).
"""
import argparse
import collections
import json
import math
import os
import statistics
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def aggregate(rows):
    """{method: dict(n, acc, se, agree, kl, ratio, ttft_ms)} in first-seen method order."""
    by = collections.OrderedDict()
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    out = collections.OrderedDict()
    for m, rs in by.items():
        n = len(rs)
        acc = sum(r["correct"] for r in rs) / n
        out[m] = dict(n=n, acc=acc, se=math.sqrt(acc * (1 - acc) / n),
                      agree=sum(r["agree"] for r in rs) / n,
                      kl=statistics.mean(r["kl"] for r in rs),
                      ratio=statistics.mean(r["ratio"] for r in rs),
                      ttft_ms=1000 * statistics.median(r["ttft"] for r in rs))
    return out


def table(agg):
    lines = ["| method | decisions | accuracy | agreement with full | KL(full ‖ method) | "
             "recompute ratio | TTFT ms (median) |", "|---|---|---|---|---|---|---|"]
    for m, a in agg.items():
        lines.append(f"| {m} | {a['n']} | {100 * a['acc']:.1f} ± {100 * a['se']:.1f} % | "
                     f"{100 * a['agree']:.1f} % | {a['kl']:.4f} | {a['ratio']:.3f} | "
                     f"{a['ttft_ms']:.1f} |")
    return "\n".join(lines)


def sweep(agg):
    """The keep:decay=... points, by recompute ratio: [(ratio, acc, agree, label)]."""
    pts = [(a["ratio"], a["acc"], a["agree"], m) for m, a in agg.items()
           if m.startswith("keep:") and "decay=" in m]
    return sorted(pts)


def plot(agg, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(plot skipped: no matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "acc", "next-step accuracy"),
                           (axes[1], "agree", "agreement with full")):
        for m, a in agg.items():
            if m.startswith("keep:") and "decay=" in m:
                continue
            ax.plot(a["ratio"], 100 * a[key], "o")
            ax.annotate(m, (a["ratio"], 100 * a[key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        pts = sweep(agg)
        if pts:
            ax.plot([p[0] for p in pts], [100 * p[1 if key == "acc" else 2] for p in pts], "k.-",
                    label="keep, d sweep")
            ax.legend(fontsize=8)
        ax.set_xlabel("average recompute ratio")
        ax.set_ylabel("%")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def self_test():
    rows = []
    for i in range(10):
        rows.append(dict(method="full", correct=i < 6, agree=True, kl=0.0, ratio=1.0, ttft=0.1))
        rows.append(dict(method="keep:decay=0.9", correct=i < 5, agree=i < 9, kl=0.02, ratio=0.2,
                         ttft=0.05))
        rows.append(dict(method="keep:decay=0.8", correct=i < 4, agree=i < 8, kl=0.05, ratio=0.1,
                         ttft=0.04))
    agg = aggregate(rows)
    assert list(agg) == ["full", "keep:decay=0.9", "keep:decay=0.8"], list(agg)
    assert abs(agg["full"]["acc"] - 0.6) < 1e-12
    assert abs(agg["full"]["se"] - math.sqrt(0.24 / 10)) < 1e-12
    assert abs(agg["keep:decay=0.9"]["agree"] - 0.9) < 1e-12
    assert [p[3] for p in sweep(agg)] == ["keep:decay=0.8", "keep:decay=0.9"]
    assert "| keep:decay=0.8 | 10 | 40.0 ± 15.5 % | 80.0 % | 0.0500 | 0.100 | 40.0 |" in table(agg)
    print("report.py: self-test passed")


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        self_test()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    try:
        rows = load(a.runs)
    except (OSError, ValueError) as e:
        sys.exit(f"report: {e}")
    if not rows:
        sys.exit("report: no rows")
    agg = aggregate(rows)
    print(table(agg))
    plot(agg, os.path.join(a.out, "accuracy_vs_ratio.png"))


if __name__ == "__main__":
    main()
