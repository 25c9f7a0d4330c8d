#!/usr/bin/env python3
"""Where one bench_keep request's GPU time goes, from a CUPTI trace (benchmarks/prefill/
kernel_trace.cpp's CSV): the last request's window (its TTFT, read from bench_keep's output,
back from the trace's last event), the GPU's busy and idle time in it, and the kernels and copies
by total time.

  CUDA_INJECTION64_PATH=libkernel_trace.so KEEP_TRACE_OUT=t.csv \\
      bench_keep --shape qwen2.5-14b --segments 40 --reps 1 --warmup 1 --methods keep > b.log
  benchmarks/keep/kernel_time.py t.csv b.log
(one --segments value and one method per run: the window is the last request's)."""
import collections
import re
import sys


def main(csv_path, log_path, top=25):
    ttft = None
    for line in open(log_path):
        m = re.match(r"\s*\d+\s+(keep d=\S+|\S+)\s+\d+\s+([\d.]+)", line)
        if m:
            ttft = float(m.group(2))
    if ttft is None:
        sys.exit("kernel_time: no result line in " + log_path)
    events = []
    for line in open(csv_path):
        parts = line.rstrip("\n").split(",", 5)
        if parts[0] in ("kernel", "memcpy"):
            events.append((int(parts[1]), int(parts[2]), parts[0] + ":" + parts[5]))
    if not events:
        sys.exit("kernel_time: no events in " + csv_path)
    events.sort()
    end = max(e[1] for e in events)
    start = end - int(ttft * 1e6)
    window = [e for e in events if e[0] >= start]
    busy, span_start, span_end = 0, None, None
    for s, e, _ in window:
        if span_end is None or s > span_end:
            if span_end is not None:
                busy += span_end - span_start
            span_start, span_end = s, e
        else:
            span_end = max(span_end, e)
    busy += span_end - span_start
    print(f"request {ttft:.1f} ms: GPU busy {busy / 1e6:.1f} ms, idle {(end - start - busy) / 1e6:.1f}"
          f" ms, {len(window)} kernels and copies")
    total = collections.defaultdict(lambda: [0, 0])
    for s, e, name in window:
        total[name[:90]][0] += e - s
        total[name[:90]][1] += 1
    for name, (ns, count) in sorted(total.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{ns / 1e6:9.2f} ms {count:6d}x  {name}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
