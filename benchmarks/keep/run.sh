#!/usr/bin/env bash
# The TTFT benchmark (issue 29, point 5) in one call on the GPU machine: for each shape bench_keep
# (every method) and the HF transformers full prefill of the same prompt lengths; one KEEP request
# traced with CUPTI for the per-layer timeline; then summary.py's tables (and plots with
# matplotlib). Usage:
#   benchmarks/keep/run.sh BENCH_KEEP [shapes...]   (default: qwen2.5-7b qwen2.5-14b qwen2.5-32b)
# Env: SEGMENTS (10,20,40,80), REPS (7), WARMUP (2), DECAYS (0.96: the paper's), RATIOS (0.15:
#      keep at the d whose requests reach that recompute ratio, per shape and segment count),
#      OUT (/tmp/keep-bench), TRACE_SHAPE (qwen2.5-14b; empty: no trace), TRACE_ARGS (--segments 40
#      --methods keep --keep-ratios 0.15: the last request is traced), HF (1; 0 skips HF),
#      LAYER_RANGES (the trace's kernels by layer range, trace/kernel_time_layers.txt; default
#      "0-0 1-10 11-24 25-end").
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$1"
shift
shapes=("$@")
((${#shapes[@]})) || shapes=(qwen2.5-7b qwen2.5-14b qwen2.5-32b)
segments="${SEGMENTS:-10,20,40,80}"
reps="${REPS:-7}"
warmup="${WARMUP:-2}"
decays="${DECAYS:-0.96}"
ratios="${RATIOS:-0.15}"
out="${OUT:-/tmp/keep-bench}"
trace_shape="${TRACE_SHAPE-qwen2.5-14b}"
trace_args="${TRACE_ARGS:---segments 40 --methods keep --keep-ratios 0.15}"
mkdir -p "$out" || exit 1
results="$out/keep-results.jsonl"
hf="$out/keep-hf.jsonl"
: >"$results"
: >"$hf"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for s in "${shapes[@]}"; do
  "$bin" --shape "$s" --segments "$segments" --reps "$reps" --warmup "$warmup" \
    --decays "$decays" --keep-ratios "$ratios" --json "$results" | grep -v "gemm autotune" || exit 1
  if [[ "${HF:-1}" == 1 ]]; then
    tokens="$(python3 -c "import json,sys; print(','.join(sorted({str(json.loads(l)['prompt_tokens']) for l in open(sys.argv[1]) if json.loads(l)['shape'] == sys.argv[2]}, key=int)))" "$results" "$s")"
    python3 "$here/../prefill/hf_prefill.py" --shape "$s" --tokens "$tokens" --reps "$reps" \
      --warmup "$warmup" --decode 0 --json "$hf" || echo "run.sh: HF baseline failed for $s"
  fi
done
trace=()
if [[ -n "$trace_shape" ]]; then
  # trace.sh's own summary is bench_prefill's: only its trace.csv and log are used here.
  # shellcheck disable=SC2086  # TRACE_ARGS is a list of flags
  OUT="$out/trace" "$here/../prefill/trace.sh" "$bin" --shape "$trace_shape" --reps 1 \
    --warmup 2 $trace_args >/dev/null 2>&1
  if [[ -s "$out/trace/trace.csv" ]]; then
    trace=(--trace "$out/trace/trace.csv" --trace-log "$out/trace/trace-bench.log")
    python3 "$here/kernel_time.py" "$out/trace/trace.csv" "$out/trace/trace-bench.log" \
      >"$out/trace/kernel_time.txt" && head -n 14 "$out/trace/kernel_time.txt"
    # By layer range (LAYER_RANGES; the default is 14B's at ~15 %: layer 0 recomputes every
    # segment, 1-10 most of the recompute, 11-24 its tail, 25-end the query's rows alone).
    for range in ${LAYER_RANGES:-0-0 1-10 11-24 25-end}; do
      python3 "$here/kernel_time.py" "$out/trace/trace.csv" "$out/trace/trace-bench.log" \
        --layers "$range" | head -n 10
    done >"$out/trace/kernel_time_layers.txt" && cat "$out/trace/kernel_time_layers.txt"
    # Where the layers' stream waits: its idle stretches of 50 us or more, with their neighbours.
    python3 "$here/kernel_time.py" "$out/trace/trace.csv" "$out/trace/trace-bench.log" \
      --gaps 50 >"$out/trace/gaps.txt" && head -n 40 "$out/trace/gaps.txt"
  else
    echo "run.sh: the trace failed (no CUPTI?)"
  fi
fi
python3 "$here/summary.py" "$results" "$hf" "${trace[@]}" --out "$out"
