#!/usr/bin/env python3
"""The planning-quality report from harness runs' JSON lines (wah.py / alfred.py --out):

  report.py RUN.jsonl [RUN2.jsonl ...] [--out DIR] [--name NAME]
  report.py --self-test

Per dataset (the rows' episode kinds say which) and method: decisions, accuracy +- standard error,
agreement with full, mean KL(full || method), mean recompute ratio, median TTFT, as a markdown
table; then the issue's targets with paired differences (keep at the sweep point nearest 15 %
recompute from below against full, cacheblend, epic; full_reuse against full), each difference
with its standard error over the same decisions; with matplotlib, NAME_accuracy_vs_ratio.png
(accuracy and agreement against the recompute ratio, one point per method; the `keep:decay=...`
runs of a d sweep joined as a line: the paper's Fig. 10). Ablation rows ("METHOD [LABEL]") are
in the table, not the plot.
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


def paired(rows, a, b, key="correct"):
    """Mean and standard error of row[a][key] - row[b][key] over the decisions both scored."""
    by = collections.defaultdict(dict)
    for r in rows:
        by[(r["episode"], r["step"])][r["method"]] = r
    d = [float(x[a][key]) - float(x[b][key]) for x in by.values() if a in x and b in x]
    if len(d) < 2:
        return None
    mean = statistics.mean(d)
    return mean, statistics.stdev(d) / math.sqrt(len(d)), len(d)


def decay_only(m):
    """keep, or keep with only its d set (a point of the d sweep): not a variant such as hop 0 only
    (max_hops), an anchor (anchor_tokens) or an ablation ("[...]" labels)."""
    name, _, rest = m.partition(":")
    return name == "keep" and "[" not in m and all(
        kv.partition("=")[0] == "decay" for kv in filter(None, rest.split("+")))


def reference_keep(agg, target=0.15):
    """The keep sweep point (or plain keep) with the largest ratio not above target."""
    pts = [(a["ratio"], m) for m, a in agg.items()
           if decay_only(m) and a["ratio"] <= target + 1e-9]
    return max(pts)[1] if pts else None


def targets(rows, agg):
    """The issue's targets as a markdown table (empty when full or keep is missing)."""
    keep = reference_keep(agg)
    if keep is None or "full" not in agg:
        return ""
    k = agg[keep]
    lines = [f"Targets, keep = `{keep}` (ratio {k['ratio']:.3f}); differences paired over the "
             "same decisions, ± standard error:", "",
             "| target | figure | met |", "|---|---|---|"]
    d = paired(rows, keep, "full")
    if d:
        lines.append(f"| keep within 1 point of full in accuracy | {100 * d[0]:+.2f} ± "
                     f"{100 * d[1]:.2f} points ({d[2]} decisions) | "
                     f"{'yes' if abs(d[0]) <= 0.01 else 'no'} |")
    lines.append(f"| keep agrees with full on >= 97 % | {100 * k['agree']:.1f} % | "
                 f"{'yes' if k['agree'] >= 0.97 else 'no'} |")
    for base in ("cacheblend", "epic"):
        # The run of the baseline (its default or a knob variant) nearest keep's ratio.
        runs = [m for m in agg if m.split(":")[0] == base and "[" not in m]
        if not runs:
            continue
        other = min(runs, key=lambda m: abs(agg[m]["ratio"] - k["ratio"]))
        o = agg[other]
        da, dg = paired(rows, keep, other), paired(rows, keep, other, "agree")
        if da and dg:
            lines.append(f"| keep above {other} (ratio {o['ratio']:.3f}) | accuracy "
                         f"{100 * da[0]:+.2f} ± {100 * da[1]:.2f}, agreement {100 * dg[0]:+.2f} ± "
                         f"{100 * dg[1]:.2f} points | {'yes' if dg[0] > 0 and da[0] >= 0 else 'no'} |")
    if "full_reuse" in agg:
        da, dg = paired(rows, "full_reuse", "full"), agg["full_reuse"]["agree"]
        if da:
            worse = da[0] + 2 * da[1] < 0 or dg < 0.97
            lines.append(f"| full_reuse measurably worse than full | accuracy {100 * da[0]:+.2f} ± "
                         f"{100 * da[1]:.2f} points, agreement {100 * dg:.1f} % | "
                         f"{'yes' if worse else 'no'} |")
    return "\n".join(lines)


def sweep(agg):
    """The keep:decay=... points, by recompute ratio: [(ratio, acc, agree, label)]."""
    pts = [(a["ratio"], a["acc"], a["agree"], m) for m, a in agg.items()
           if m.startswith("keep:") and decay_only(m)]
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
            if (m.startswith("keep:") and decay_only(m)) or "[" in m:
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
        at = dict(episode="e", step=i)
        rows.append(dict(at, method="full", correct=i < 6, agree=True, kl=0.0, ratio=1.0,
                         ttft=0.1))
        rows.append(dict(at, method="keep:decay=0.9", correct=i < 5, agree=i < 9, kl=0.02,
                         ratio=0.2, ttft=0.05))
        rows.append(dict(at, method="keep:decay=0.8", correct=i < 4, agree=i < 8, kl=0.05,
                         ratio=0.1, ttft=0.04))
    agg = aggregate(rows)
    assert list(agg) == ["full", "keep:decay=0.9", "keep:decay=0.8"], list(agg)
    assert abs(agg["full"]["acc"] - 0.6) < 1e-12
    assert abs(agg["full"]["se"] - math.sqrt(0.24 / 10)) < 1e-12
    assert abs(agg["keep:decay=0.9"]["agree"] - 0.9) < 1e-12
    assert [p[3] for p in sweep(agg)] == ["keep:decay=0.8", "keep:decay=0.9"]
    # Variants are neither sweep points nor the reference.
    assert decay_only("keep") and decay_only("keep:decay=0.8")
    assert not decay_only("keep:decay=0.8+anchor_tokens=1")
    assert not decay_only("keep:decay=0.8+max_hops=0") and not decay_only("keep [never static]")
    assert "| keep:decay=0.8 | 10 | 40.0 ± 15.5 % | 80.0 % | 0.0500 | 0.100 | 40.0 |" in table(agg)
    # keep:decay=0.8 (ratio 0.1) is the reference: 2 of 10 decisions lost against full.
    assert reference_keep(agg) == "keep:decay=0.8"
    mean, se, n = paired(rows, "keep:decay=0.8", "full")
    assert n == 10 and abs(mean + 0.2) < 1e-12, (mean, n)
    assert abs(se - statistics.stdev([-1.0] * 2 + [0.0] * 8) / math.sqrt(10)) < 1e-12
    t = targets(rows, agg)
    assert "| keep within 1 point of full in accuracy | -20.00 ± 13.33 points (10 decisions) | no |" \
        in t, t
    assert "| keep agrees with full on >= 97 % | 80.0 % | no |" in t, t
    # Against a baseline, the run nearest keep's ratio (0.1): epic's k = 4 run, not its default.
    for i in range(10):
        at = dict(episode="e", step=i, correct=i < 4, kl=0.01, ttft=0.04)
        rows.append(dict(at, method="epic", agree=True, ratio=0.3))
        rows.append(dict(at, method="epic:epic_tokens=4", agree=i < 7, ratio=0.12))
    t = targets(rows, aggregate(rows))
    assert "| keep above epic:epic_tokens=4 (ratio 0.120) | accuracy +0.00 ± 0.00, agreement " \
        "+10.00 ± 10.00 points | yes |" in t, t
    print("report.py: self-test passed")


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        self_test()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="", help="the plot's file name prefix")
    a = ap.parse_args()
    try:
        rows = load(a.runs)
    except (OSError, ValueError) as e:
        sys.exit(f"report: {e}")
    if not rows:
        sys.exit("report: no rows")
    agg = aggregate(rows)
    print(table(agg))
    t = targets(rows, agg)
    if t:
        print("\n" + t)
    plot(agg, os.path.join(a.out, (a.name + "_" if a.name else "") + "accuracy_vs_ratio.png"))


if __name__ == "__main__":
    main()
