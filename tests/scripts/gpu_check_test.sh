#!/usr/bin/env bash
# scripts/gpu-check.sh's own logic without a GPU (its functions sourced, compute-sanitizer and the
# tests stubbed): run_test marks a failing and a hanging test, says the hang timed out, keeps what
# a killed test printed and leaves the tests' timings out unless asked; the sanitizer passes run at
# most SANITIZER_JOBS at a time, each says when it ends, every pass is reported in order, a pass
# with errors and one past SANITIZER_TIMEOUT are marked, the second saying so, and the logs' lines
# carry the seconds into the pass.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
GPU_CHECK_FUNCTIONS_ONLY=1 source "$repo/scripts/gpu-check.sh" || { echo "FAIL: source"; exit 1; }
set +e
root="$tmp"
build="$tmp/build"
mkdir -p "$build" "$tmp/bin" "$tmp/running"
errors=0
expect() {  # WHAT, then a command that must succeed
  local what="$1"
  shift
  if ! "$@"; then
    echo "FAIL: $what"
    errors=1
  fi
}

# --- run_test
printf '#!/bin/sh\nexit 0\n' >"$tmp/ok"
printf '#!/bin/sh\nexit 2\n' >"$tmp/bad"
# awk's print goes through C stdio, block-buffered into a pipe as a test's printf is.
printf '#!/bin/sh\nexec awk '"'"'BEGIN { print "got this far"; while (1) {} }'"'"'\n' >"$tmp/hang"
chmod +x "$tmp/ok" "$tmp/bad" "$tmp/hang"
fail=0 failed=()
out="$(TEST_TIMEOUT=1 run_test t_ok "$tmp/ok"; TEST_TIMEOUT=1 run_test t_bad "$tmp/bad"
  TEST_TIMEOUT=1 run_test t_hang "$tmp/hang"; echo "failed: ${failed[*]}")"
echo "$out"
expect "run_test marks the failing and the hanging test only" grep -qx "failed: t_bad t_hang" <<<"$out"
expect "run_test says the hang timed out" grep -qF "gpu-check: t_hang timed out after 1 s" <<<"$out"
expect "a test killed at the limit still shows its output" grep -qx "got this far" <<<"$out"
expect "run_test prints each test's seconds" grep -qE "gpu-check: t_ok took [0-9]+ s" <<<"$out"
printf '#!/bin/sh\necho "timings=$KEEP_GPU_TEST_TIMINGS"\n' >"$tmp/env"
chmod +x "$tmp/env"
expect "run_test leaves the tests' timings out by default" \
  grep -qx "timings=0" <<<"$(run_test t_env "$tmp/env")"
expect "GPU_CHECK_TIMINGS=1 keeps them" \
  grep -qx "timings=1" <<<"$(GPU_CHECK_TIMINGS=1 run_test t_env "$tmp/env")"

# --- sanitizer_passes: a stub compute-sanitizer that records how many passes run beside it.
cat >"$tmp/bin/compute-sanitizer" <<'STUB'
#!/usr/bin/env bash
bin="${@: -1}"
me="$RUNNING/$$"
: >"$me"
ls "$RUNNING" | wc -l >>"$RUNNING.counts"
tool=""; prev=""
for a in "$@"; do [[ $prev == --tool ]] && tool="$a"; prev="$a"; done
sleep 0.3
rm -f "$me"
case "$(basename "$bin")" in
  t_racy) [[ $tool == racecheck ]] && { echo "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)"; exit 3; } ;;
  t_slow) sleep 5 ;;
esac
echo "========= ERROR SUMMARY: 0 errors (only=$KEEP_GPU_TEST_ONLY quick=$KEEP_GPU_TEST_QUICK)"
STUB
chmod +x "$tmp/bin/compute-sanitizer"
for t in t_a t_racy t_slow test_gemm; do cp "$tmp/ok" "$tmp/$t"; done
find_bin() { echo "$tmp/$1"; }
gpu_tests=(t_a t_racy t_slow test_gemm)
fail=0 failed=()
out="$(PATH="$tmp/bin:$PATH" RUNNING="$tmp/running" SANITIZER_JOBS=3 SANITIZER_TIMEOUT=2 \
  sanitizer_passes; echo "failed: ${failed[*]}")"
echo "$out"
expect "the racy test's racecheck and the slow test's passes are marked" \
  grep -qx "failed: t_racy:racecheck t_slow:memcheck t_slow:racecheck" <<<"$out"
expect "the slow passes are said to have timed out" \
  grep -qF "gpu-check: t_slow under racecheck timed out after 2 s" <<<"$out"
expect "every pass reported, in order" \
  diff <(grep -oE "^--- compute-sanitizer --tool [a-z]+ [a-z_]+" <<<"$out") <(for t in "${gpu_tests[@]}"; do
    for tool in memcheck racecheck; do echo "--- compute-sanitizer --tool $tool $t"; done; done)
expect "each pass says when it ended (8 lines)" \
  test "$(grep -cE "^gpu-check: [a-z_]+ under (memcheck|racecheck) ended at [0-9]+ s, status [0-9]+$" <<<"$out")" = 8
expect "a pass's end line comes before the report" \
  test "$(grep -nF "t_a under memcheck ended" <<<"$out" | cut -d: -f1)" -lt \
  "$(grep -nF -- "--- compute-sanitizer --tool memcheck t_a" <<<"$out" | cut -d: -f1)"
expect "a failed pass's log lines carry the seconds into the pass" \
  grep -qE '^\[ *[0-9]+ s\] ========= RACECHECK SUMMARY: 2 hazards' <<<"$out"
expect "test_gemm's racecheck runs gemm_swiglu only" \
  grep -qF "racecheck test_gemm (KEEP_GPU_TEST_ONLY=gemm_swiglu): ========= ERROR SUMMARY: 0 errors (only=gemm_swiglu quick=1)" <<<"$out"
most="$(sort -n "$tmp/running.counts" | tail -1)"
expect "at most SANITIZER_JOBS passes at once (saw $most)" test "$most" -le 3
expect "passes ran side by side (saw $most)" test "$most" -ge 2

if ((errors)); then
  echo "gpu_check_test.sh: FAILED"
  exit 1
fi
echo "gpu_check_test.sh: passed"
