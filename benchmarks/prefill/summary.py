#!/usr/bin/env python3
"""run.sh's closing table: KEEP against HF per shape and prompt length from prefill-results.jsonl
(bench_prefill's and hf_prefill.py's lines), the speed-up on the medians and, beside it, HF's
median and minimum: HF's median on some machines jumps by 5-10 % for a run (Python-side work), so
a ratio is read with HF's minimum next to it (benchmarks/RESULTS.md, run 20). Then the energy of a
prefill where both measured it (back to back, NVML), then decode.

  summary.py RESULTS_JSONL | --pairings RESULTS_JSONL... | --self-test

--pairings: one results file per pairing (pairings.sh runs run.sh that many times); per shape and
length, each pairing's speed-up on the medians and on HF's minimum, then their median, minimum and
maximum. A target read off one pairing is read off HF's noise; these say how far it holds.
"""
import json
import sys


def find(rows, engine, shape, key, val=None):
    for x in rows:
        if x["engine"] == engine and x["shape"] == shape and key in x and (val is None or x[key] == val):
            return x
    return None


def table(rows):
    lines = ["shape          tokens  keep_ms    hf_ms  hf_min  speedup  on_hf_min  keep_TFLOP/s  graphs_ms"]
    for r in rows:
        if r["engine"] != "keep" or "tokens" not in r:
            continue
        h = find(rows, "hf", r["shape"], "tokens", r["tokens"])
        ng = find(rows, "keep-graphs", r["shape"], "tokens", r["tokens"])
        if not h:
            continue
        hmin = h.get("min_ms")
        lines.append(
            f"{r['shape']:14s} {r['tokens']:6d} {r['ttft_ms']:8.2f} {h['ttft_ms']:8.2f} "
            + (f"{hmin:7.2f}" if hmin is not None else f"{'-':>7s}")
            + f" {h['ttft_ms'] / r['ttft_ms']:7.3f}x "
            + (f"{hmin / r['ttft_ms']:9.3f}x" if hmin is not None else f"{'-':>10s}")
            + f" {r['tflops']:12.1f}"
            + (f"  {ng['ttft_ms']:9.2f}" if ng else ""))
    for r in rows:
        if r["engine"] != "keep" or "joules" not in r:
            continue
        h = find(rows, "hf", r["shape"], "tokens", r["tokens"])
        if h and "joules" in h:
            lines.append(
                f"{r['shape']:14s} {r['tokens']:6d} energy a prefill: keep {r['joules']:.2f} J, "
                f"hf {h['joules']:.2f} J ({r['joules'] / h['joules']:.2f} of HF's)")
    for r in rows:
        if r["engine"] == "keep" and "decode_ms_per_token" in r:
            h = find(rows, "hf", r["shape"], "decode_ms_per_token")
            ng = find(rows, "keep-graphs", r["shape"], "decode_ms_per_token")
            if h:
                lines.append(
                    f"{r['shape']:14s} decode: keep {1000 / r['decode_ms_per_token']:.1f} tok/s, "
                    f"hf {1000 / h['decode_ms_per_token']:.1f} tok/s "
                    f"({h['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x)"
                    + (f", keep with graphs {1000 / ng['decode_ms_per_token']:.1f} tok/s" if ng else ""))
    return lines


def pairings(runs):
    """runs: one list of result rows per pairing. Lines: per KEEP engine (keep: launch by launch;
    keep-graphs: a recurring prefill replayed as CUDA graphs), shape and tokens, each pairing, then
    the spread of the speed-ups."""
    ratios = {}  # (engine, shape, tokens) -> [(keep_ms, hf_ms, on_medians, on_hf_min or None)]
    for rows in runs:
        for r in rows:
            if r["engine"] not in ("keep", "keep-graphs") or "tokens" not in r:
                continue
            h = find(rows, "hf", r["shape"], "tokens", r["tokens"])
            if not h:
                continue
            hmin = h.get("min_ms")
            ratios.setdefault((r["engine"], r["shape"], r["tokens"]), []).append(
                (r["ttft_ms"], h["ttft_ms"], h["ttft_ms"] / r["ttft_ms"],
                 hmin / r["ttft_ms"] if hmin is not None else None))
    lines = []
    for (engine, shape, tokens), xs in ratios.items():
        for i, (k, h, on_med, on_min) in enumerate(xs, 1):
            lines.append(f"{shape:14s} {tokens:6d} pairing {i}: {engine} {k:.2f} ms, hf {h:.2f} ms, "
                         f"{on_med:.3f}x" + (f" ({on_min:.3f}x on hf's minimum)" if on_min else ""))
        meds = sorted(x[2] for x in xs)
        mins = sorted(x[3] for x in xs if x[3] is not None)
        line = (f"{shape:14s} {tokens:6d} {engine}, {len(xs)} pairings: on the medians median "
                f"{meds[len(meds) // 2]:.3f}x, {meds[0]:.3f}-{meds[-1]:.3f}x")
        if mins:
            line += f"; on hf's minimum median {mins[len(mins) // 2]:.3f}x, {mins[0]:.3f}-{mins[-1]:.3f}x"
        lines.append(line)
    return lines


def self_test():
    rows = [
        {"engine": "keep", "shape": "s", "tokens": 1024, "ttft_ms": 40.0, "min_ms": 39.5, "tflops": 700.0,
         "joules": 30.0},
        {"engine": "hf", "shape": "s", "tokens": 1024, "ttft_ms": 64.0, "min_ms": 58.0, "tflops": 450.0,
         "joules": 40.0},
        {"engine": "keep", "shape": "s", "tokens": 2048, "ttft_ms": 80.0, "tflops": 700.0,
         "joules": 60.0},  # HF's energy missing: no energy line
        {"engine": "hf", "shape": "s", "tokens": 2048, "ttft_ms": 100.0, "tflops": 560.0},  # no min
        {"engine": "keep", "shape": "s", "tokens": 4096, "ttft_ms": 90.0, "tflops": 700.0},  # no HF
        {"engine": "keep", "shape": "s", "decode_ms_per_token": 5.0},
        {"engine": "hf", "shape": "s", "decode_ms_per_token": 20.0},
    ]
    lines = table(rows)
    assert len(lines) == 5, lines
    assert "1.600x" in lines[1] and "1.450x" in lines[1] and "58.00" in lines[1], lines[1]
    assert "1.250x" in lines[2] and lines[2].count(" - ") + lines[2].count("-  ") >= 1, lines[2]
    assert "keep 30.00 J, hf 40.00 J (0.75 of HF's)" in lines[3] and "1024" in lines[3], lines[3]
    assert "keep 200.0 tok/s, hf 50.0 tok/s (4.00x)" in lines[4], lines[4]
    runs = [
        [{"engine": "keep", "shape": "s", "tokens": 1024, "ttft_ms": 40.0, "tflops": 1.0},
         {"engine": "hf", "shape": "s", "tokens": 1024, "ttft_ms": 60.0, "min_ms": 58.0, "tflops": 1.0}],
        [{"engine": "keep", "shape": "s", "tokens": 1024, "ttft_ms": 40.0, "tflops": 1.0},
         {"engine": "hf", "shape": "s", "tokens": 1024, "ttft_ms": 56.0, "min_ms": 56.0, "tflops": 1.0}],
        [{"engine": "keep", "shape": "s", "tokens": 1024, "ttft_ms": 50.0, "tflops": 1.0},
         {"engine": "hf", "shape": "s", "tokens": 1024, "ttft_ms": 80.0, "tflops": 1.0}],  # no min
    ]
    runs[0].append({"engine": "keep-graphs", "shape": "s", "tokens": 1024, "ttft_ms": 30.0,
                    "tflops": 1.0})
    lines = pairings(runs)
    assert len(lines) == 6, lines
    assert "pairing 1: keep 40.00 ms, hf 60.00 ms, 1.500x (1.450x on hf's minimum)" in lines[0], lines[0]
    assert "pairing 3:" in lines[2] and "minimum" not in lines[2], lines[2]
    assert "3 pairings: on the medians median 1.500x, 1.400-1.600x" in lines[3], lines[3]
    assert "on hf's minimum median 1.450x, 1.400-1.450x" in lines[3], lines[3]
    assert "pairing 1: keep-graphs 30.00 ms, hf 60.00 ms, 2.000x (1.933x on hf's minimum)" in lines[4], lines[4]
    assert "keep-graphs, 1 pairings: on the medians median 2.000x" in lines[5], lines[5]
    print("summary.py: self-test passed")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--pairings":
        runs = [[json.loads(line) for line in open(f) if line.strip()] for f in sys.argv[2:]]
        print("\n" + "\n".join(pairings(runs)))
        return
    if len(sys.argv) != 2:
        sys.exit("usage: summary.py RESULTS_JSONL | --pairings RESULTS_JSONL... | --self-test")
    if sys.argv[1] == "--self-test":
        self_test()
        return
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    print("\n" + "\n".join(table(rows)))


if __name__ == "__main__":
    main()
