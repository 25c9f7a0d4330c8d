#!/usr/bin/env bash
# One call on the GPU machine: KEEP's bench_prefill and the HF transformers baseline for each
# shape, then the ratios (summary.py: on the medians, and on HF's minimum beside them). Usage:
#   benchmarks/prefill/run.sh BENCH_PREFILL_BINARY [shapes...]   (default: qwen2.5-7b qwen2.5-14b)
# Env: TOKENS (1024,2048,4096), REPS (10), DECODE (64), OUT (the folder for prefill-results.jsonl,
#      made if missing; /tmp), GRAPHS (both: KEEP also with CUDA graphs; off; on), PROFILE (1:
#      per-stage GPU times),
#      GAP_MS (0: runs back to back, and both engines report the energy of a prefill from the
#      GPU's energy counter where NVML loads; G: the GPU idles G ms before each timed prefill).
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
python3 "$here/summary.py" "$out"
