#!/usr/bin/env python3
"""Where one bench_keep request's GPU time goes, from a CUPTI trace (benchmarks/prefill/
kernel_trace.cpp's CSV): the last request's window (its TTFT, read from bench_keep's output,
back from the trace's last event), the GPU's busy and idle time in it (any stream), each stream's
busy time (the layers' and the loader's), and the kernels and copies by total time.

  CUDA_INJECTION64_PATH=libkernel_trace.so KEEP_TRACE_OUT=t.csv \\
      bench_keep --shape qwen2.5-14b --segments 40 --reps 1 --warmup 1 --methods keep > b.log
  benchmarks/keep/kernel_time.py t.csv b.log [--layers LO-HI|LO-end] [--gaps US]
(one --segments value and one method per run: the window is the last request's; --layers narrows
it to those layers' windows, as summary.py's timeline bounds them; HI "end": the last layer;
--gaps lists the layers' stream's idle stretches of at least US microseconds instead, each with
the work before and after it and what other streams ran meanwhile).
  benchmarks/keep/kernel_time.py --self-test     (its arithmetic on a synthetic trace)"""
import collections
import re
import signal
import sys


def summarize(csv_path, log_path, top=25, layers=None):
    """Returns (ttft_ms, busy_ms, idle_ms, [(name, ms, count), ...] by time, per-stream busy);
    with layers=(lo, hi) the window is layers lo..hi's (busy and idle within it)."""
    ttft, events, _, start, end = window_bounds(csv_path, log_path, layers)
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


def window_bounds(csv_path, log_path, layers=None):
    """(the TTFT in ms, the events sorted, the request's start ns, the window's start and end ns:
    the request's, or its layers lo..hi's)."""
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
    request_start = start
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
    return ttft, events, request_start, start, end


def gaps(csv_path, log_path, min_us, layers=None):
    """The layers' stream's idle stretches in the window of at least min_us: (ms from the
    request's start, length in us, the event before, the event after, other streams' events
    overlapping it). The layers' stream is the one whose kernels, the loader's aside, run longest."""
    _, events, request_start, start, end = window_bounds(csv_path, log_path, layers)
    kernel_ns = collections.Counter()
    for s, e, name, sid in events:
        if name.startswith("kernel:") and "load_kv_runs" not in name and s < end and e > start:
            kernel_ns[sid] += e - s
    if not kernel_ns:
        raise ValueError("no kernels in the window")
    layers_stream = kernel_ns.most_common(1)[0][0]
    own = [e for e in events if e[3] == layers_stream]
    out = []
    reach = None  # the latest end so far on the layers' stream
    for i, (s, e, name, _) in enumerate(own):
        if reach is not None and s - reach[0] >= min_us * 1000 and s > start and reach[0] < end:
            lo, hi = max(reach[0], start), min(s, end)
            if hi - lo >= min_us * 1000:
                during = sorted({n[:60] for so, eo, n, sid in events
                                 if sid != layers_stream and so < hi and eo > lo})
                out.append(((lo - request_start) / 1e6, (hi - lo) / 1e3, reach[1][:60], name[:60],
                            during))
        if reach is None or e > reach[0]:
            reach = (e, name)
    return out


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
        # --gaps: the 1 ms after layer 0's mlp (before layer 1's norm), with a load beside it.
        with open(csv, "a") as f:
            f.write("kernel,17200000,17400000,9,1,load_kv_runs\n")
        found = gaps(csv, log, 500)
        assert len(found) == 1, found
        at, us, before, after, during = found[0]
        assert abs(at - 8.0) < 1e-9 and abs(us - 1000.0) < 1e-6, found
        assert before == "kernel:mlp0" and after == "kernel:norm", found
        assert during == ["kernel:load_kv_runs"], found
        assert gaps(csv, log, 1001) == [] and gaps(csv, log, 500, layers=(1, 1)) == []
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


def main_gaps(csv_path, log_path, min_us, layers=None):
    try:
        found = gaps(csv_path, log_path, min_us, layers)
    except ValueError as e:
        sys.exit("kernel_time: " + str(e))
    print(f"{len(found)} idle stretches of the layers' stream >= {min_us:g} us "
          f"(ms from the request's start, us, before -> after [other streams meanwhile])")
    for at, us, before, after, during in found:
        print(f"{at:8.3f} {us:8.1f}  {before} -> {after}  [{'; '.join(during)}]")


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
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # under `| head`: end quietly
    args = sys.argv[1:]
    if args == ["--self-test"]:
        self_test()
        sys.exit(0)
    if len(args) < 2 or len(args) % 2 != 0:
        sys.exit(__doc__)
    layers, min_us = None, None
    for flag, value in zip(args[2::2], args[3::2]):
        try:
            if flag == "--layers" and "-" in value:
                layers = parse_layers(value)
            elif flag == "--gaps":
                min_us = float(value)
            else:
                sys.exit(__doc__)
        except ValueError:
            sys.exit(f"kernel_time: {flag} {value}: not LO-HI / LO-end / a number")
    if min_us is not None:
        main_gaps(args[0], args[1], min_us, layers)
    else:
        main(args[0], args[1], layers)
