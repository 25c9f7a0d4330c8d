#!/usr/bin/env bash
# Where a prefill's GPU time goes, from the GPU's own clock: builds the CUPTI injection library
# (kernel_trace.cpp) against this machine's CUDA toolkit, runs bench_prefill under it and prints,
# for the last timed prefill, what each kind of kernel adds to the GPU's timeline (the end of each
# kernel or copy past the latest end before it: the PDL overlap and the idle time between kernels
# both counted where they fall), the GPU's idle time, and the host's share of the TTFT (the TTFT
# less the GPU's span from the first copy to the last). No CUDA events, so no profile overhead.
# On the GPU machine:
#   benchmarks/prefill/trace.sh BENCH_PREFILL_BINARY [bench_prefill args]
#   (default args: --shape qwen2.5-14b --tokens 1024 --reps 3 --warmup 2 --decode 0 --gap-ms 200
#   --graphs on; keep --decode 0, one --tokens value and one --graphs mode (on or off): the summary
#   takes the trace's last embedding as the start of the last timed prefill)
# Env: OUT (folder for trace.csv; /tmp).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$1"
shift
args=("$@")
((${#args[@]})) || args=(--shape qwen2.5-14b --tokens 1024 --reps 3 --warmup 2 --decode 0 --gap-ms 200
  --graphs on)
out="${OUT:-/tmp}"
mkdir -p "$out"
cuda="${CUDA_HOME:-/usr/local/cuda}"
header="$(find "$cuda/" -name cupti_activity.h 2>/dev/null | head -1)"
lib="$(find "$cuda/" -name 'libcupti.so*' 2>/dev/null | sort | head -1)"
if [[ -z "$header" || -z "$lib" ]]; then
  echo "trace.sh: no CUPTI under $cuda (cupti_activity.h, libcupti.so)" >&2
  exit 1
fi
inc="$(dirname "$header")"
libdir="$(dirname "$lib")"
# The newest kernel and memcpy activity records this CUPTI defines.
krec="$(grep -ho 'CUpti_ActivityKernel[0-9]*' "$inc"/*.h | sort -V | uniq | tail -1)"
mrec="$(grep -ho 'CUpti_ActivityMemcpy[0-9]*' "$inc"/*.h | sort -V | uniq | tail -1)"
so="$out/libkernel_trace.so"
g++ -std=c++17 -O2 -shared -fPIC -DKREC="$krec" -DMREC="$mrec" -I"$inc" -I"$cuda/include" \
  "$here/kernel_trace.cpp" -o "$so" -L"$libdir" -lcupti -Wl,-rpath,"$libdir"
log="$out/trace-bench.log"
rm -f "$out/trace.csv"
CUDA_INJECTION64_PATH="$so" KEEP_TRACE_OUT="$out/trace.csv" "$bin" "${args[@]}" | tee "$log"
if [[ ! -s "$out/trace.csv" ]]; then
  echo "trace.sh: $bin wrote no trace to $out/trace.csv (no CUDA work, or CUPTI did not load)" >&2
  exit 1
fi
python3 "$here/trace_summary.py" "$out/trace.csv" "$log"
