#!/usr/bin/env python3
"""The TTFT benchmark's report (benchmarks/keep/run.sh writes its inputs):

  summary.py RESULTS.jsonl HF.jsonl [--trace trace.csv --trace-log bench.log] [--out DIR]
  summary.py --self-test

RESULTS.jsonl: bench_keep --json lines (shape, segments, method, prompt_tokens, ttft_ms, min_ms,
max_ms, recompute_ratio, bytes_loaded). HF.jsonl: hf_prefill.py --json lines (engine "hf", shape,
tokens, ttft_ms, min_ms), at the same prompt lengths. Prints, per shape, a markdown table of TTFT
medians [min-max] per method and segment count with the recompute ratio each reached, and the
ratios against our full prefill and HF's at 40 segments. With --trace (one bench_keep request
traced with CUPTI, benchmarks/prefill/kernel_trace.cpp): a per-layer timeline of that request --
compute, importance (the pooling pass), idle on the layers' stream, and the loader's busy time in
each layer's window -- as timeline.csv. With matplotlib: ttft_vs_segments.png and timeline.png
in --out (else a note that the plots were skipped).
"""
import argparse
import collections
import csv
import json
import os
import sys

from kernel_time import union_ns as union  # the busy-time report's interval arithmetic

METHOD_ORDER = ["hf", "full", "prefix", "full_reuse", "cacheblend", "epic"]


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def method_key(m):
    return (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m)


def tables(results, hf):
    """Markdown lines: per shape, TTFT median [min-max] (recompute ratio) by segments x method."""
    by_shape = collections.defaultdict(list)
    for r in results:
        by_shape[r["shape"]].append(r)
    hf_ms = {(h["shape"], h["tokens"]): h for h in hf}
    out = []
    for shape in sorted(by_shape):
        rows = by_shape[shape]
        methods = sorted({r["method"] for r in rows}, key=method_key)
        if any((shape, r["prompt_tokens"]) in hf_ms for r in rows):
            methods = ["hf"] + methods
        segs = sorted({r["segments"] for r in rows})
        out.append(f"{shape} (TTFT median ms [min-max]; recompute ratio where not 0 or 1):")
        out.append("")
        out.append("| segments (memory tokens) | " + " | ".join(methods) + " |")
        out.append("|---" * (len(methods) + 1) + "|")
        for n in segs:
            at = {r["method"]: r for r in rows if r["segments"] == n}
            any_row = next(iter(at.values()))
            cells = []
            for m in methods:
                if m == "hf":
                    h = hf_ms.get((shape, any_row["prompt_tokens"]))
                    cells.append(f"{h['ttft_ms']:.1f}" if h else "")
                    continue
                r = at.get(m)
                if r is None:
                    cells.append("")
                    continue
                c = f"{r['ttft_ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}]"
                if 0.0 < r["recompute_ratio"] < 1.0:
                    c += f" ({r['recompute_ratio']:.2f})"
                cells.append(c)
            out.append(f"| {n} ({any_row['memory_tokens']}) | " + " | ".join(cells) + " |")
        out.append("")
        # Ratios at 40 segments (or the largest below).
        n = max([s for s in segs if s <= 40] or segs)
        at = {r["method"]: r for r in rows if r["segments"] == n}
        full = at.get("full")
        h = hf_ms.get((shape, next(iter(at.values()))["prompt_tokens"]))
        parts = []
        for m in sorted(at, key=method_key):
            if m == "full":
                continue
            r = at[m]
            s = f"{m} {r['ttft_ms']:.1f} ms"
            if full:
                s += f" = {full['ttft_ms'] / r['ttft_ms']:.2f}x full"
            if h:
                s += f", {h['ttft_ms'] / r['ttft_ms']:.2f}x HF"
            s += f", {r['bytes_loaded'] / 2**20:.0f} MiB loaded"
            parts.append(s)
        out.append(f"At {n} segments: " + "; ".join(parts) + ".")
        out.append("")
    return out


def read_trace(csv_path):
    events = []
    with open(csv_path) as f:
        for row in csv.reader(f):
            if row and row[0] in ("kernel", "memcpy"):
                events.append((int(row[1]), int(row[2]), row[3], row[0] + ":" + ",".join(row[5:])))
    events.sort()
    return events


def clip(intervals, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def timeline(events, ttft_ms):
    """Per layer of the last request (the trace's last ttft_ms): dicts of layer, start_ms (from the
    request's start), window_ms, compute_ms, importance_ms, idle_ms, load_ms."""
    end = max(e[1] for e in events)
    start = end - int(ttft_ms * 1e6)
    window = [e for e in events if e[0] >= start]
    loader = {e[2] for e in window if "load_kv_runs" in e[3]}
    compute = [e for e in window if e[2] not in loader and e[3].startswith("kernel:")]
    compute.sort()
    # A layer starts at the norm two kernels before its qkv_finish (norm, QKV product, finish).
    marks = [i for i, e in enumerate(compute) if "qkv_finish" in e[3]]
    if not marks:
        raise ValueError("no qkv_finish kernel in the request's window")
    bounds = [start] + [compute[max(i - 2, 0)][0] for i in marks[1:]] + [end]
    # Importance: the pooling pass (one-hot values, the attention over them, the head sums). With
    # the pooling fused into the attention pass (pool_fused) only the head sums are left: the
    # pooling's own products then count in the attention kernel's compute.
    importance = set()
    for i, e in enumerate(compute):
        if "onehot_kernel" in e[3] or "sum_heads_kernel" in e[3] or "pool_kernel" in e[3]:
            importance.add(i)
            if "onehot_kernel" in e[3] and i + 1 < len(compute):
                importance.add(i + 1)
    loads = [(e[0], e[1]) for e in window if e[2] in loader]
    out = []
    for layer in range(len(bounds) - 1):
        lo, hi = bounds[layer], bounds[layer + 1]
        comp = [(e[0], e[1]) for i, e in enumerate(compute) if i not in importance]
        imp = [(e[0], e[1]) for i, e in enumerate(compute) if i in importance]
        c = union(clip(comp, lo, hi))
        m = union(clip(imp, lo, hi))
        busy = union(clip(comp + imp, lo, hi))
        out.append(dict(layer=layer, start_ms=(lo - start) / 1e6, window_ms=(hi - lo) / 1e6,
                        compute_ms=c / 1e6, importance_ms=m / 1e6,
                        idle_ms=(hi - lo - busy) / 1e6, load_ms=union(clip(loads, lo, hi)) / 1e6))
    return out


def ttft_from_log(path):
    ttft = None
    with open(path) as f:
        for line in f:
            parts = line.split()
            # "40  keep d=0.85  4108  52.33 ..." or "40 full_reuse 4108 19.19 ..."
            if len(parts) >= 4 and parts[0].isdigit():
                i = 3 if parts[1] == "keep" else 2
                try:
                    ttft = float(parts[i + 1])
                except (ValueError, IndexError):
                    pass
    if ttft is None:
        raise ValueError("no result line in " + path)
    return ttft


def plots(results, hf, tl, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(plots skipped: no matplotlib; pip install matplotlib)")
        return
    shapes = sorted({r["shape"] for r in results})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in results if r["shape"] == shape]
        for m in sorted({r["method"] for r in rows}, key=method_key):
            pts = sorted((r["segments"], r["ttft_ms"]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        toks = {r["segments"]: r["prompt_tokens"] for r in rows}
        hpts = sorted((n, h["ttft_ms"]) for n, t in toks.items() for h in hf
                      if h["shape"] == shape and h["tokens"] == t)
        if hpts:
            ax.plot([p[0] for p in hpts], [p[1] for p in hpts], "k--", marker="x", label="HF full")
        ax.set_title(shape)
        ax.set_xlabel("retrieved segments")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ttft_vs_segments.png"), dpi=120)
    if tl:
        fig, ax = plt.subplots(figsize=(10, 4))
        x = [t["layer"] for t in tl]
        c = [t["compute_ms"] for t in tl]
        m = [t["importance_ms"] for t in tl]
        i = [t["idle_ms"] for t in tl]
        ax.bar(x, c, label="compute", color="#4477aa")
        ax.bar(x, m, bottom=c, label="importance (pooling)", color="#ee6677")
        ax.bar(x, i, bottom=[a + b for a, b in zip(c, m)], label="idle (layers' stream)",
               color="#bbbbbb")
        ax.plot(x, [t["load_ms"] for t in tl], "k.-", label="loader busy in the layer")
        ax.set_xlabel("layer")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "timeline.png"), dpi=120)
    print(f"plots in {out_dir}")


def self_test():
    import tempfile
    # Two layers: norm, qkv, finish, attention, [onehot, attention, sum_heads], mlp; a loader.
    def k(s, e, name, stream="13"):
        return (s, e, stream, "kernel:" + name)
    ev = [k(0, 10, "add_rmsnorm"), k(10, 20, "qkv"), k(20, 25, "qkv_finish"), k(25, 40, "attn"),
          k(40, 42, "onehot_kernel"), k(42, 52, "attn"), k(52, 54, "sum_heads_kernel"),
          k(60, 80, "mlp"),  # 6 ns idle before it
          k(80, 90, "add_rmsnorm"), k(90, 95, "qkv"), k(95, 100, "qkv_finish"), k(100, 110, "mlp"),
          k(5, 30, "load_kv_runs_kernel", "15"), k(85, 88, "load_kv_runs_kernel", "15")]
    tl = timeline(sorted(ev), 110e-6)
    assert len(tl) == 2, tl
    assert abs(tl[0]["window_ms"] - 80e-6) < 1e-12, tl[0]
    assert abs(tl[0]["importance_ms"] - 14e-6) < 1e-12, tl[0]
    assert abs(tl[0]["compute_ms"] - 60e-6) < 1e-12, tl[0]
    assert abs(tl[0]["idle_ms"] - 6e-6) < 1e-12, tl[0]
    assert abs(tl[0]["load_ms"] - 25e-6) < 1e-12, tl[0]
    assert abs(tl[1]["load_ms"] - 3e-6) < 1e-12 and tl[1]["idle_ms"] == 0, tl[1]
    res = [dict(shape="s", segments=10, method=m, memory_tokens=100, prompt_tokens=260,
                ttft_ms=t, min_ms=t, max_ms=t, recompute_ratio=r, bytes_loaded=2**20)
           for m, t, r in (("full", 50.0, 1.0), ("keep d=0.85", 10.0, 0.15))]
    lines = tables(res, [dict(engine="hf", shape="s", tokens=260, ttft_ms=100.0, min_ms=99.0)])
    text = "\n".join(lines)
    assert "| hf | full | keep d=0.85 |" in text, text
    assert "10.0 [10.0-10.0] (0.15)" in text, text
    assert "5.00x full, 10.00x HF" in text, text
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "b.log")
        with open(log, "w") as f:
            f.write("segments method mem_tok ttft_ms\n40       keep d=0.85      4108      52.33   1\n")
        assert ttft_from_log(log) == 52.33
    print("summary.py: self-test passed")


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        self_test()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("hf")
    ap.add_argument("--trace")
    ap.add_argument("--trace-log")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    try:
        results = load_jsonl(a.results)
        hf = load_jsonl(a.hf) if os.path.exists(a.hf) else []
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"summary: {e}")
    print("\n".join(tables(results, hf)))
    tl = []
    if a.trace:
        try:
            tl = timeline(read_trace(a.trace), ttft_from_log(a.trace_log))
        except (OSError, ValueError) as e:
            sys.exit(f"summary: {e}")
        path = os.path.join(a.out, "timeline.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(tl[0]))
            w.writeheader()
            w.writerows(tl)
        tot = {k: sum(t[k] for t in tl) for k in ("window_ms", "compute_ms", "importance_ms",
                                                   "idle_ms", "load_ms")}
        print(f"timeline of the traced request ({len(tl)} layers, {path}): "
              f"{tot['window_ms']:.1f} ms = compute {tot['compute_ms']:.1f} + importance "
              f"{tot['importance_ms']:.1f} + idle {tot['idle_ms']:.1f} "
              f"({100 * tot['idle_ms'] / tot['window_ms']:.1f} %); loader busy {tot['load_ms']:.1f}")
    plots(results, hf, tl, a.out)


if __name__ == "__main__":
    main()
