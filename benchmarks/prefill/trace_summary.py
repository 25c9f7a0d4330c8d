#!/usr/bin/env python3
"""Summarises kernel_trace.cpp's CSV for the last prefill bench_prefill timed (trace.sh).

The last prefill runs from the host-to-device copies before the trace's last embedding kernel to
the trace's end (bench_prefill with --decode 0, as trace.sh runs it). For every kind of kernel it
prints what the kind adds to the GPU's timeline -- each record's end past the latest end before
it -- so the figures sum to the prefill's GPU span; a product is named with the kernel before it
("... after attention" is o_proj, "... after gate/up + SwiGLU" down); "own" is the records' mean duration, which
counts the time a dependent launch waits for the kernel before it. Idle is the span not covered
by any record. With the bench log, the host's share is the median TTFT less the GPU span.
"""
import collections
import csv
import re
import statistics
import sys

KINDS = [  # (substring of the kernel name, label); the first match wins
    # gemm_wgmma_kernel<Epilogue, width>: kStore (QKV), kAccumulate (o_proj, down), kSwiglu.
    ("gemm_wgmma_kernelILNS1_8EpilogueE0", "product, bf16 out (ours)"),
    ("gemm_wgmma_kernelILNS1_8EpilogueE1", "product, fp32 += (ours)"),
    ("gemm_wgmma_kernelILNS1_8EpilogueE2", "gate/up + SwiGLU (ours)"),
    ("gemm_wgmma", "product (ours)"),
    ("_badd_", "product, fp32 += (cuBLAS)"),
    ("nvjet", "product, bf16 out (cuBLAS)"),
    ("gemm", "product (cuBLAS)"),
    ("add_rmsnorm", "add_rmsnorm"),
    ("qkv_finish", "qkv_finish"),
    ("attention_prefill", "attention (prefill)"),
    ("attention_decode", "attention (decode)"),
    ("gemv", "gemv (last row, lm_head)"),
    ("embedding", "embedding"),
    ("gather_rows", "gather_rows"),
    ("rmsnorm", "rmsnorm (final)"),
    ("swiglu_rows", "swiglu_rows (last row)"),
]


def kind(r):
    if r["what"] == "memcpy":
        return {"kind1": "copy to the GPU", "kind2": "copy to the host"}.get(r["name"], "copy")
    for key, label in KINDS:
        if key in r["name"]:
            return label
    m = re.search(r"\d+([A-Za-z_]\w*?_kernel)", r["name"])  # a mangled name's ..._kernel
    return (m.group(1) if m else r["name"])[:40]


def last_prefill(rows):
    """The records of the last prefill: from the copies before its embedding kernel on."""
    rows = sorted(rows, key=lambda r: int(r["start_ns"]))
    embeds = [i for i, r in enumerate(rows) if r["what"] == "kernel" and "embedding" in r["name"]]
    if not embeds:
        return []
    first = embeds[-1]
    while first > 0 and rows[first - 1]["what"] == "memcpy" and rows[first - 1]["name"] == "kind1":
        first -= 1  # the token ids' upload belongs to the prefill
    return rows[first:]


def summarize(seg):
    """(span ns, idle ns, {kind: ns added}, {kind: [durations]}) of time-ordered records; what the
    kinds add sums to the span, each idle gap counted for the record after it."""
    t0 = int(seg[0]["start_ns"])
    adds = collections.defaultdict(int)
    own = collections.defaultdict(list)
    idle = 0
    last = t0
    before = "start"  # the kernel before: names a product's place in the layer (o_proj, down)
    for r in seg:
        s, e = int(r["start_ns"]), int(r["end_ns"])
        k = kind(r)
        if r["what"] == "kernel":
            if k.startswith("product"):
                k, before = f"{k} after {before.split(' (')[0]}", k
            else:
                before = k
        own[k].append(e - s)
        if s > last:
            idle += s - last
        adds[k] += max(0, e - last)
        last = max(last, e)
    return last - t0, idle, adds, own


def self_test():
    """Overlapping, nested and separated records with known answers."""
    def rec(what, s, e, name):
        return {"what": what, "start_ns": str(s), "end_ns": str(e), "name": name}
    rows = [
        rec("kernel", 0, 10, "embedding_kernel"),  # an earlier prefill, ignored
        rec("memcpy", 100, 101, "kind1"),
        rec("kernel", 105, 110, "embedding_kernel"),
        rec("kernel", 108, 150, "nvjet_sm90_x_badd_y"),    # overlaps the embedding by 2
        rec("kernel", 120, 130, "add_rmsnorm_kernel"),     # inside the product: adds 0
        rec("kernel", 160, 170, "qkv_finish_kernel"),      # after 10 idle
        rec("memcpy", 165, 175, "kind2"),                  # adds 5
    ]
    seg = last_prefill(rows)
    assert len(seg) == 6 and seg[0]["name"] == "kind1", seg
    span, idle, adds, own = summarize(seg)
    assert span == 75 and idle == 4 + 10, (span, idle)
    assert sum(adds.values()) == span, (adds, span)  # an idle gap counts for the record after it
    assert adds["product, fp32 += (cuBLAS) after embedding"] == 40, adds
    assert adds["add_rmsnorm"] == 0, adds
    assert adds["embedding"] == 4 + 5 and adds["qkv_finish"] == 10 + 10, adds
    assert adds["copy to the host"] == 5 and own["embedding"] == [5], (adds, own)
    print("trace_summary.py: self-test passed")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        self_test()
        return
    if len(sys.argv) < 2:
        sys.exit("usage: trace_summary.py TRACE_CSV [BENCH_LOG] | --self-test")
    with open(sys.argv[1]) as f:
        seg = last_prefill(csv.DictReader(f))
    if not seg:
        sys.exit("trace_summary.py: no embedding kernel in the trace")
    span, idle, adds, own = summarize(seg)
    print(f"\nlast prefill on the GPU: {span / 1e3:.1f} us from its first copy to its last record, "
          f"{len(seg)} records, idle {idle / 1e3:.1f} us")
    print(f"{'kind':50s} {'adds us':>9s} {'share':>6s} {'count':>6s} {'adds/each':>10s} {'own/each':>9s}")
    for k, v in sorted(adds.items(), key=lambda x: -x[1]):
        n = len(own[k])
        print(f"{k:50s} {v / 1e3:9.1f} {100 * v / span:5.1f}% {n:6d} {v / 1e3 / n:10.1f} "
              f"{statistics.mean(own[k]) / 1e3:9.1f}")
    if len(sys.argv) > 2:
        ttft_ns = None  # the log's last KEEP line: the mode the last prefill ran in
        for line in open(sys.argv[2]):
            f = line.split()
            if len(f) >= 4 and f[1] in ("keep", "keep-graphs") and f[2].isdigit():
                ttft_ns = float(f[3]) * 1e6
        if ttft_ns is not None:
            print(f"median TTFT {ttft_ns / 1e6:.2f} ms, the last prefill's GPU span "
                  f"{span / 1e6:.2f} ms: ~{(ttft_ns - span) / 1e3:.0f} us of host time before "
                  f"its first copy and after its last")


if __name__ == "__main__":
    main()
