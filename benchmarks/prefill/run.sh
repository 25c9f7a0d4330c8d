#!/usr/bin/env bash
# One call on the GPU machine: KEEP's bench_prefill and the HF transformers baseline for each
# shape, then the ratios. Usage:
#   benchmarks/prefill/run.sh BENCH_PREFILL_BINARY [shapes...]   (default: qwen2.5-7b qwen2.5-14b)
# Env: TOKENS (1024,2048,4096), REPS (10), DECODE (64), OUT (a folder for results.jsonl).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$1"
shift
shapes=("$@")
((${#shapes[@]})) || shapes=(qwen2.5-7b qwen2.5-14b)
tokens="${TOKENS:-1024,2048,4096}"
reps="${REPS:-10}"
decode="${DECODE:-64}"
out="${OUT:-/tmp}/prefill-results.jsonl"
: >"$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv,noheader
for s in "${shapes[@]}"; do
  "$bin" --shape "$s" --tokens "$tokens" --reps "$reps" --decode "$decode" --json "$out" || exit 1
  python3 "$here/hf_prefill.py" --shape "$s" --tokens "$tokens" --reps "$reps" --decode "$decode" \
    --json "$out" || exit 1
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\nshape          tokens  keep_ms    hf_ms  speedup  keep_TFLOP/s")
for r in rows:
    if r["engine"] != "keep" or "tokens" not in r:
        continue
    h = [x for x in rows if x["engine"] == "hf" and x["shape"] == r["shape"] and x.get("tokens") == r["tokens"]]
    if h:
        print(f"{r['shape']:14s} {r['tokens']:6d} {r['ttft_ms']:8.2f} {h[0]['ttft_ms']:8.2f} "
              f"{h[0]['ttft_ms'] / r['ttft_ms']:7.2f}x {r['tflops']:10.1f}")
for r in rows:
    if r["engine"] == "keep" and "decode_ms_per_token" in r:
        h = [x for x in rows if x["engine"] == "hf" and x["shape"] == r["shape"] and "decode_ms_per_token" in x]
        if h:
            print(f"{r['shape']:14s} decode: keep {1000 / r['decode_ms_per_token']:.1f} tok/s, "
                  f"hf {1000 / h[0]['decode_ms_per_token']:.1f} tok/s "
                  f"({h[0]['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x)")
PY
