#!/usr/bin/env python3
"""Where one bench_keep request's GPU time goes, from a CUPTI trace (benchmarks/prefill/
kernel_trace.cpp's CSV): the last request's window (its TTFT, read from bench_keep's output,
back from the trace's last event), the GPU's busy and idle time in it (any stream), each stream's
busy time (the layers' and the loader's), and the kernels and copies by total time.

  CUDA_INJECTION64_PATH=libkernel_trace.so KEEP_TRACE_OUT=t.csv \\
      bench_keep --shape qwen2.5-14b --segments 40 --reps 1 --warmup 1 --methods keep > b.log
  benchmarks/keep/kernel_time.py t.csv b.log [--layers LO-HI|LO-end]
(one --segments value and one method per run: the window is the last request's; --layers narrows
it to those layers' windows, as summary.py's timeline bounds them; HI "end": the last layer).
  benchmarks/keep/kernel_time.py --self-test     (its arithmetic on a synthetic trace)"""
import collections
import re
import sys


def summarize(csv_path, log_path, top=25, layers=None):
    """Returns (ttft_ms, busy_ms, idle_ms, [(name, ms, count), ...] by time, per-stream busy);
    with layers=(lo, hi) the window is layers lo..hi's (busy and idle within it)."""
    ttft = None
    for line in open(log_path):
        m = re.match(r"\s*\d+\s+(keep \S+|\S+)\s+\d+\s+([\d.]+)", line)
        if m:
            ttft = float(m.group(2))
    if ttft is None:
        raise ValueError("no result line in " + log_path)
    events = []
    for line in open(csv_path):
        parts = line.rstrip("\n").split(",", 5)
        if parts[0] in ("kernel", "memcpy"):
            events.append((int(parts[1]), int(parts[2]), parts[0] + ":" + parts[5], parts[3]))
    if not events:
        raise ValueError("no events in " + csv_path)
    events.sort()
    end = max(e[1] for e in events)
    start = end - int(ttft * 1e6)
    if layers is not None:
        import summary  # the timeline's layer bounds (same directory)
        tl = summary.timeline(summary.read_trace(csv_path), ttft)
        lo, hi = layers
        if hi is None:  # "LO-end": to the request's last layer
            hi = len(tl) - 1
        if not 0 <= lo <= hi < len(tl):
            raise ValueError(f"layers {lo}-{hi} outside the request's {len(tl)}")
        start, end = (start + int(tl[lo]["start_ms"] * 1e6),
                      start + int((tl[hi]["start_ms"] + tl[hi]["window_ms"]) * 1e6))
    window = [(max(e[0], start), min(e[1], end)) + e[2:] for e in events
              if e[1] > start and e[0] < end]
    busy = union_ns(window)
    streams = collections.defaultdict(list)
    for ev in window:
        streams[ev[3]].append(ev)
    per_stream = sorted(((sid, union_ns(evs) / 1e6) for sid, evs in streams.items()),
                        key=lambda x: -x[1])
    total = collections.defaultdict(lambda: [0, 0])
    for s, e, name, _ in window:
        total[name[:90]][0] += e - s
        total[name[:90]][1] += 1
    ranked = sorted(total.items(), key=lambda x: -x[1][0])[:top]
    return (ttft, busy / 1e6, (end - start - busy) / 1e6,
            [(name, ns / 1e6, count) for name, (ns, count) in ranked], per_stream)


def union_ns(events):
    """Time covered by the union of the events' [start, end) intervals (sorted by start)."""
    busy, span_start, span_end = 0, None, None
    for s, e, *_ in sorted(events):
        if span_end is None or s > span_end:
            if span_end is not None:
                busy += span_end - span_start
            span_start, span_end = s, e
        else:
            span_end = max(span_end, e)
    if span_end is not None:
        busy += span_end - span_start
    return busy


def self_test():
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        csv = os.path.join(d, "t.csv")
        log = os.path.join(d, "b.log")
        with open(csv, "w") as f:
            f.write("what,start_ns,end_ns,stream,blocks_or_bytes,name\n")
            f.write("kernel,0,5000000,7,1,earlier_request\n")         # outside the window
            f.write("kernel,10000000,14000000,7,1,pool\n")            # 4 ms
            f.write("kernel,13000000,15000000,7,1,gemm\n")            # overlaps: 1 ms more busy
            f.write("memcpy,17000000,18000000,7,64,kind1\n")          # 1 ms, after a 2 ms gap
            f.write("kernel,18000000,20000000,7,1,pool\n")            # 2 ms
            f.write("kernel,11000000,12000000,9,1,load\n")           # another stream, covered
        with open(log, "w") as f:
            f.write("segments method mem_tok ttft_ms\n")
            f.write("40       keep d=0.96      4108      99.00     99.00  99.00\n")
            f.write("40       keep ~0.15       4108      10.00     10.00  10.00\n")
        ttft, busy, idle, ranked, per_stream = summarize(csv, log)
        assert ttft == 10.0, ttft
        assert abs(busy - 8.0) < 1e-9, busy     # [10,15] + [17,20]
        assert abs(idle - 2.0) < 1e-9, idle
        assert ranked[0][0] == "kernel:pool" and abs(ranked[0][1] - 6.0) < 1e-9 and ranked[0][2] == 2
        assert all(name != "kernel:earlier_request" for name, _, _ in ranked)
        assert per_stream == [("7", 8.0), ("9", 1.0)], per_stream
        # --layers: two layers (norm, qkv, qkv_finish, mlp); layer 1 starts at its norm.
        with open(csv, "w") as f:
            f.write("what,start_ns,end_ns,stream,blocks_or_bytes,name\n")
            t = 10000000
            for layer in range(2):
                for name, ms in (("norm", 1), ("gemm", 2), ("qkv_finish", 1), ("mlp%d" % layer, 3)):
                    f.write(f"kernel,{t},{t + ms * 1000000},7,1,{name}\n")
                    t += ms * 1000000
                t += 1000000  # 1 ms idle after each layer
        with open(log, "w") as f:
            f.write("40       keep ~0.15       4108      16.00     16.00  16.00\n")
        ttft, busy, idle, ranked, _ = summarize(csv, log, layers=(1, 1))
        names = {name for name, _, _ in ranked}
        assert "kernel:mlp1" in names and "kernel:mlp0" not in names, names
        assert abs(busy - 7.0) < 1e-9 and abs(idle) < 1e-9, (busy, idle)
        # Layer 0: from the request's start (1 ms before its first kernel) to layer 1's norm.
        _, busy, idle, ranked, _ = summarize(csv, log, layers=(0, 0))
        assert {name for name, _, _ in ranked} == {"kernel:norm", "kernel:gemm",
                                                    "kernel:qkv_finish", "kernel:mlp0"}
        assert abs(busy - 7.0) < 1e-9 and abs(idle - 2.0) < 1e-9, (busy, idle)
        # "1-end": the last layer is 1.
        assert summarize(csv, log, layers=(1, None))[1:4] == summarize(csv, log, layers=(1, 1))[1:4]
        assert parse_layers("25-end") == (25, None) and parse_layers("3-7") == (3, 7)
        try:
            summarize(csv, log, layers=(1, 2))
            raise AssertionError("layers past the request's accepted")
        except ValueError:
            pass
    print("kernel_time.py: self-test passed")


def parse_layers(text):
    """"LO-HI" or "LO-end" -> (LO, HI), HI None for the last layer."""
    lo, hi = text.split("-", 1)
    return int(lo), None if hi == "end" else int(hi)


def main(csv_path, log_path, layers=None):
    try:
        ttft, busy, idle, ranked, per_stream = summarize(csv_path, log_path, layers=layers)
    except ValueError as e:
        sys.exit("kernel_time: " + str(e))
    where = (f", layers {layers[0]}-{'end' if layers[1] is None else layers[1]}"
             if layers else "")
    print(f"request {ttft:.1f} ms{where}: GPU busy {busy:.1f} ms, idle {idle:.1f} ms")
    for sid, ms in per_stream:
        print(f"  stream {sid}: busy {ms:.1f} ms")
    for name, ms, count in ranked:
        print(f"{ms:9.2f} ms {count:6d}x  {name}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        self_test()
    elif len(sys.argv) == 3:
        main(sys.argv[1], sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[3] == "--layers" and "-" in sys.argv[4]:
        try:
            layers = parse_layers(sys.argv[4])
        except ValueError:
            sys.exit("kernel_time: --layers LO-HI or LO-end, not " + sys.argv[4])
        main(sys.argv[1], sys.argv[2], layers)
    else:
        sys.exit(__doc__)
