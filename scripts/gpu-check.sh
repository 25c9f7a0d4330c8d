#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA kernels and their GPU tests for sm_90a, run them, run
# the engine-level GPU tests, then the kernel tests again under compute-sanitizer (memcheck,
# racecheck), and with --bench time the prefill benchmark against HF transformers. Exits non-zero
# on any failure.
#
#   scripts/gpu-check.sh [--bench] [--skip-sanitizer] [build-dir]     (default build-dir: build-gpu)
#
# Env: TEST_TIMEOUT (seconds a GPU test may run, default 300), GPU_CHECK_TIMINGS=1 (the tests'
# informational timings too), BENCH_SHAPES (the benchmark's model shapes), BENCH_GAP_MS (with
# --bench: also time isolated requests, that many ms of idle GPU before each prefill), OUT (where
# results go), PROFILE=1, TRACE=1 (with --bench: each shape's 1024-token isolated prefill traced
# with CUPTI, benchmarks/prefill/trace.sh, results in $OUT/trace-SHAPE).
# SANITIZER_JOBS (compute-sanitizer passes run at a time, 10: all of them), SANITIZER_TIMEOUT
# (seconds a pass may run, 360: past it the pass fails, and the call's ten minutes still hold).
#
# The whole repository is configured when its Debian dependencies are there (boost, zmq, capnp,
# doctest, ...), and everything is built here. Otherwise -- GPU machines usually lack them and
# cannot install from the network -- the programs come prebuilt from .gpu-bundle/
# (scripts/gpu-bundle.sh, run where the packages are): the engine-level ones, and the kernels' GPU
# tests when it carries them all; else services/worker/kernels is configured on its own (that
# builds the kernels, their references and their GPU tests with nothing but CUDA).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench=0
sanitize=1
build="$root/build-gpu"
for a in "$@"; do
  case "$a" in
    --bench) bench=1 ;;
    --skip-sanitizer) sanitize=0 ;;
    -*) echo "gpu-check: unknown flag $a"; exit 2 ;;
    *) build="$a" ;;
  esac
done
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH="$root/.gpu-bundle/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fail=0
failed=()
step() { echo "=== $* (at ${SECONDS} s)"; }  # the time so far: the call has ten minutes
mark() { fail=1; failed+=("$1"); }

# Each test under a time limit: a kernel that hangs (a deadlocked mbarrier wait) would otherwise
# hold the rest of the call's ten minutes.
run_test() {  # NAME BIN
  local t0=$SECONDS
  # KEEP_GPU_TEST_TIMINGS=0: the tests' informational timings are left out unless
  # GPU_CHECK_TIMINGS=1 (benchmarks/ hold the performance figures).
  # stdbuf -oL: a test killed at the limit still shows how far it got (a pipe's stdout is
  # otherwise block-buffered and lost with the process).
  (cd "$root" && KEEP_GPU_TEST_TIMINGS="${GPU_CHECK_TIMINGS:-0}" timeout "${TEST_TIMEOUT:-300}" \
    stdbuf -oL "$2")
  local rc=$?
  echo "gpu-check: $1 took $((SECONDS - t0)) s"
  ((rc == 124)) && echo "gpu-check: $1 timed out after ${TEST_TIMEOUT:-300} s"
  ((rc == 0)) || mark "$1"
}

stamp() {  # each line of stdin with the seconds since the first: "[  12 s] line"
  local t0=$SECONDS line
  while IFS= read -r line; do printf '[%4d s] %s\n' $((SECONDS - t0)) "$line"; done
}

sanitizer_passes() {  # every gpu_tests program under memcheck and racecheck (find_bin)
  local t tool only log rc pass bin
  local -a extra passes
  # The passes run SANITIZER_JOBS at a time (all 10 by default): one after the other they did not
  # fit a call's ten minutes with the engine tests before them; on an H100 all at once, 9 ended
  # within 197 s (test_attention_decode's racecheck was still running at 220 s).
  step "compute-sanitizer, ${SANITIZER_JOBS:-10} passes at a time"
  for t in "${gpu_tests[@]}"; do
    bin="$(find_bin "$t")"
    [[ -n "$bin" ]] || continue
    for tool in memcheck racecheck; do
      # racecheck fails inside cuBLAS's own kernels (a hardware exception it cannot handle in
      # the nvjet TMA/mbarrier kernels): test_gemm runs only our gemm_swiglu's checks under it.
      only=""
      [[ $t == test_gemm && $tool == racecheck ]] && only=gemm_swiglu
      extra=()
      [[ $tool == memcheck ]] && extra=(--leak-check full)
      log="$build/$t.$tool.log"
      rm -f "$log.rc"
      # KEEP_GPU_TEST_QUICK: the tests skip their timing runs and largest cases.
      # Each pass says when it ends, so that a call cut short still shows which ones finished;
      # its log's lines carry the seconds into the pass (the kernel tests line-buffer their
      # stdout: print_device), so that a slow pass shows which of its cases take the time.
      (cd "$root" && KEEP_GPU_TEST_QUICK=1 KEEP_GPU_TEST_ONLY="$only" \
        timeout "${SANITIZER_TIMEOUT:-360}" \
        compute-sanitizer --tool "$tool" "${extra[@]}" \
        --error-exitcode 3 --print-limit 20 "$bin" 2>&1 | stamp >"$log"
      rc=${PIPESTATUS[0]}
      echo "$rc" >"$log.rc"
      echo "gpu-check: $t under $tool ended at ${SECONDS} s, status $rc") &
      passes+=("$t $tool $only")
      while (($(jobs -rp | wc -l) >= ${SANITIZER_JOBS:-10})); do wait -n; done
    done
  done
  wait
  for pass in "${passes[@]}"; do
    read -r t tool only <<<"$pass"
    log="$build/$t.$tool.log"
    echo "--- compute-sanitizer --tool $tool $t${only:+ (KEEP_GPU_TEST_ONLY=$only)}:" \
      "$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$log" | tail -2 |
        sed -E 's/^\[ *[0-9]+ s\] //' | tr '\n' ' ')"
    rc="$(cat "$log.rc" 2>/dev/null)"
    [[ $rc == 124 ]] && echo "gpu-check: $t under $tool timed out after ${SANITIZER_TIMEOUT:-360} s"
    if [[ $rc != 0 ]]; then
      mark "$t:$tool"
      tail -30 "$log"
    fi
  done
  step "compute-sanitizer done"
}

# Sourced with GPU_CHECK_FUNCTIONS_ONLY=1 (benchmarks' and scripts' tests): the functions above only.
if [[ ${GPU_CHECK_FUNCTIONS_ONLY:-0} == 1 ]]; then
  return 0 2>/dev/null || exit 0
fi

step "devices"
nvidia-smi -L || { echo "gpu-check: nvidia-smi failed"; exit 1; }
nvcc --version | tail -1

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
jobs="$(nproc 2>/dev/null || echo 4)"
gpu_tests=(test_kernels test_attention test_attention_decode test_logits test_gemm)

step "configure (whole repository, KEEP_CUDA=ON)"
whole=0
bundled=0
unpacked=0
if cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKEEP_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DKEEP_BENCHMARKS=ON >"$build.configure.log" 2>&1; then
  whole=1
  targets=("${gpu_tests[@]}" test_kernels_ref test_cuda_engine test_cuda_assembler test_device_kv_tier
    device_tier_probe bench_prefill)
  echo "configured the whole repository"
else
  echo "whole-repository configure failed (missing packages?):"
  grep -m3 -E 'Could not|not found|Error' "$build.configure.log" || tail -3 "$build.configure.log"
  # The kernels' GPU tests prebuilt in .gpu-bundle when it carries them all: no build here, which
  # leaves the call's ten minutes to the tests and the sanitizer passes.
  [[ -d "$root/.gpu-bundle/bin" ]] && "$root/scripts/gpu-bundle.sh" --unpack && unpacked=1
  bundled=1
  for t in "${gpu_tests[@]}"; do [[ -x "$root/.gpu-bundle/bin/$t" ]] || bundled=0; done
  targets=()
  if ((bundled)); then
    echo "kernel tests from .gpu-bundle (built by scripts/gpu-bundle.sh)"
    rm -rf "$build"
    mkdir -p "$build"  # the sanitizer passes' logs
  else
    step "configure (services/worker/kernels on its own)"
    rm -rf "$build"
    cmake -S "$root/services/worker/kernels" -B "$build" "${generator[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a ||
      { echo "gpu-check: configure failed"; exit 1; }
    for t in "${gpu_tests[@]}"; do
      [[ -f "$root/tests/gpu/$t.cu" ]] && targets+=("$t")
    done
  fi
fi

if ((${#targets[@]})); then
  step "build ${targets[*]}"
  cmake --build "$build" --target "${targets[@]}" -j "$jobs" ||
    { echo "gpu-check: build failed"; exit 1; }
fi

find_bin() {
  if ((bundled)); then
    echo "$root/.gpu-bundle/bin/$1"
  else
    find "$build" -type f -name "$1" -perm -u+x | head -1
  fi
}

step "kernel tests"
for t in "${gpu_tests[@]}"; do
  bin="$(find_bin "$t")"
  [[ -n "$bin" ]] || continue
  echo "--- $t"
  run_test "$t" "$bin"
done

# The engine-level GPU tests (built here with the whole repository, or prebuilt in .gpu-bundle),
# before the sanitizer passes: they must run within one call's ten minutes even when those do not.
engine_tests=(test_cuda_engine test_cuda_assembler test_device_kv_tier)
bench_bin=""
if ((whole)); then
  bench_bin="$build/bin/bench_prefill"
else
  ((unpacked)) || "$root/scripts/gpu-bundle.sh" --unpack  # its programs travel gzip-compressed
  bench_bin="$root/.gpu-bundle/bin/bench_prefill"
  [[ -x "$bench_bin" ]] && echo "engine programs from .gpu-bundle (built by scripts/gpu-bundle.sh)"
fi
for t in "${engine_tests[@]}"; do
  if ((whole)); then bin="$(find_bin "$t")"; else bin="$root/.gpu-bundle/bin/$t"; fi
  if [[ -x "$bin" ]]; then
    step "$t"
    run_test "$t" "$bin"
  else
    echo "gpu-check: no $t (run scripts/gpu-bundle.sh and carry .gpu-bundle)"
    mark "$t-missing"
  fi
done

# Two keep-workers sharing a device KV tier through the real services (needs the services: a whole
# build, or a bundle made with BUNDLE_SERVICES=1, its .venv, and models/).
svc_bin="$root/.gpu-bundle/bin"
((whole)) && { cmake --build "$build" --target keep-manager keep-worker -j "$jobs" >/dev/null &&
  svc_bin="$build/bin"; }
step "tests/gpu/tier_e2e.py (two keep-workers, one device tier)"
if [[ -x "$svc_bin/keep-worker" && -x "$root/.venv/bin/python" ]]; then
  (cd "$root" && KEEP_BIN_DIR="$svc_bin" .venv/bin/python tests/gpu/tier_e2e.py)
  rc=$?
  ((rc == 0 || rc == 77)) || mark tier_e2e
else
  echo "skipped: no keep-worker in $svc_bin or no .venv (BUNDLE_SERVICES=1 scripts/gpu-bundle.sh)"
fi

((sanitize)) && sanitizer_passes

if ((bench)) && [[ -x "$bench_bin" ]]; then
  step "benchmarks/prefill (KEEP vs HF transformers)"
  read -ra shapes <<<"${BENCH_SHAPES:-}"  # a space-separated list; none: run.sh's default
  OUT="${OUT:-$build}" "$root/benchmarks/prefill/run.sh" "$bench_bin" "${shapes[@]}" ||
    mark bench_prefill
  # BENCH_GAP_MS=G: the prefill comparison again with G ms of idle GPU before each timed run
  # (isolated requests, as a planner sends them; results in $OUT/isolated).
  if [[ -n "${BENCH_GAP_MS:-}" ]]; then
    step "benchmarks/prefill, isolated requests (GAP_MS=$BENCH_GAP_MS)"
    mkdir -p "${OUT:-$build}/isolated"
    OUT="${OUT:-$build}/isolated" GAP_MS="$BENCH_GAP_MS" GRAPHS=both DECODE=0 PROFILE=0 \
      "$root/benchmarks/prefill/run.sh" "$bench_bin" "${shapes[@]}" || mark bench_prefill_isolated
  fi
  if [[ "${TRACE:-0}" == 1 ]]; then
    read -ra traced <<<"${BENCH_SHAPES:-qwen2.5-7b qwen2.5-14b}"  # run.sh's default shapes
    for one in "${traced[@]}"; do
      step "benchmarks/prefill/trace.sh $one (CUPTI)"
      OUT="${OUT:-$build}/trace-$one" "$root/benchmarks/prefill/trace.sh" "$bench_bin" \
        --shape "$one" --tokens 1024 --reps 3 --warmup 2 --decode 0 --gap-ms 200 --graphs on ||
        mark "trace-$one"
    done
  fi
fi

if ((fail)); then
  echo "gpu-check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu-check: all passed"
