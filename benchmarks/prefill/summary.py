#!/usr/bin/env python3
"""run.sh's closing table: KEEP against HF per shape and prompt length from prefill-results.jsonl
(bench_prefill's and hf_prefill.py's lines), the speed-up on the medians and, beside it, HF's
median and minimum: HF's median on some machines jumps by 5-10 % for a run (Python-side work), so
a ratio is read with HF's minimum next to it (benchmarks/RESULTS.md, run 20). Then the energy of a
prefill where both measured it (back to back, NVML), then decode.

  summary.py RESULTS_JSONL | --self-test
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
    print("summary.py: self-test passed")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: summary.py RESULTS_JSONL | --self-test")
    if sys.argv[1] == "--self-test":
        self_test()
        return
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    print("\n" + "\n".join(table(rows)))


if __name__ == "__main__":
    main()
