#!/usr/bin/env bash
# One call on the GPU machine: KEEP's bench_prefill and the HF transformers baseline for each
# shape, then the ratios. Usage:
#   benchmarks/prefill/run.sh BENCH_PREFILL_BINARY [shapes...]   (default: qwen2.5-7b qwen2.5-14b)
# Env: TOKENS (1024,2048,4096), REPS (10), DECODE (64), OUT (the folder for prefill-results.jsonl,
#      made if missing; /tmp), GRAPHS (both: KEEP also with CUDA graphs; off; on), PROFILE (1:
#      per-stage GPU times),
#      GAP_MS (0: runs back to back; G: the GPU idles G ms before each timed prefill, both engines).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$1"
shift
shapes=("$@")
((${#shapes[@]})) || shapes=(qwen2.5-7b qwen2.5-14b)
tokens="${TOKENS:-1024,2048,4096}"
reps="${REPS:-10}"
decode="${DECODE:-64}"
graphs="${GRAPHS:-both}"
profile=()
[[ "${PROFILE:-0}" == 1 ]] && profile=(--profile)
gap="${GAP_MS:-0}"
out="${OUT:-/tmp}/prefill-results.jsonl"
if ! { mkdir -p "$(dirname "$out")" && : >"$out"; }; then
  echo "run.sh: cannot write $out" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv,noheader
for s in "${shapes[@]}"; do
  "$bin" --shape "$s" --tokens "$tokens" --reps "$reps" --decode "$decode" --json "$out" \
    --graphs "$graphs" --gap-ms "$gap" "${profile[@]}" || exit 1
  python3 "$here/hf_prefill.py" --shape "$s" --tokens "$tokens" --reps "$reps" --decode "$decode" \
    --json "$out" --gap-ms "$gap" || exit 1
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def find(engine, shape, key, val=None):
    for x in rows:
        if x["engine"] == engine and x["shape"] == shape and key in x and (val is None or x[key] == val):
            return x
    return None
print("\nshape          tokens  keep_ms    hf_ms  speedup  keep_TFLOP/s  graphs_ms")
for r in rows:
    if r["engine"] != "keep" or "tokens" not in r:
        continue
    h = find("hf", r["shape"], "tokens", r["tokens"])
    ng = find("keep-graphs", r["shape"], "tokens", r["tokens"])
    if h:
        print(f"{r['shape']:14s} {r['tokens']:6d} {r['ttft_ms']:8.2f} {h['ttft_ms']:8.2f} "
              f"{h['ttft_ms'] / r['ttft_ms']:7.2f}x {r['tflops']:10.1f}"
              + (f"  {ng['ttft_ms']:10.2f}" if ng else ""))
for r in rows:
    if r["engine"] == "keep" and "decode_ms_per_token" in r:
        h = find("hf", r["shape"], "decode_ms_per_token")
        ng = find("keep-graphs", r["shape"], "decode_ms_per_token")
        if h:
            print(f"{r['shape']:14s} decode: keep {1000 / r['decode_ms_per_token']:.1f} tok/s, "
                  f"hf {1000 / h['decode_ms_per_token']:.1f} tok/s "
                  f"({h['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x)"
                  + (f", keep with graphs {1000 / ng['decode_ms_per_token']:.1f} tok/s" if ng else ""))
PY
