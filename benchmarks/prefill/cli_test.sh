#!/usr/bin/env bash
# CTest bench_prefill_cli: bench_prefill and hf_prefill.py refuse a --json path they cannot open
# with exit status 1, nothing on stdout and one line on stderr naming the path, before any weights
# are made (so no GPU and no torch are needed), and they create nothing; bench_prefill refuses a bad
# option, and pairings.sh a bad pairing count, the same way with exit status 2.
#
#   cli_test.sh <bench_prefill>
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bench="${1:?usage: $0 <bench_prefill>}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/keep-bench-cli.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
bad="$tmp/missing/results.jsonl"
failures=0

# expect_refusal NAME PREFIX COMMAND...: runs COMMAND, checks the refusal described above.
expect_refusal() {
  local name="$1" prefix="$2"
  shift 2
  local rc=0
  "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
  local problems=()
  [[ "$rc" -eq 1 ]] || problems+=("exit status $rc, not 1")
  [[ ! -s "$tmp/out" ]] || problems+=("stdout not empty: $(head -c 200 "$tmp/out")")
  [[ "$(wc -l <"$tmp/err")" -eq 1 ]] || problems+=("$(wc -l <"$tmp/err") stderr lines, not 1")
  grep -q "^$prefix: cannot open --json $bad" "$tmp/err" || problems+=("no '$prefix: cannot open --json' line")
  [[ ! -e "$tmp/missing" ]] || problems+=("created $tmp/missing")
  if ((${#problems[@]})); then
    echo "FAIL $name: ${problems[*]}; stderr: $(cat "$tmp/err")" >&2
    failures=$((failures + 1))
  else
    echo "ok   $name: $(cat "$tmp/err")"
  fi
}

expect_refusal bench_prefill bench_prefill \
  "$bench" --shape qwen2.5-7b --tokens 16 --decode 0 --json "$bad"
expect_refusal hf_prefill hf_prefill \
  python3 "$here/hf_prefill.py" --shape qwen2.5-7b --tokens 16 --decode 0 --json "$bad"
# bench_prefill's own options: a bad one is refused before anything else, with exit status 2,
# nothing on stdout and one line on stderr that names the option and what it takes; --help prints
# the options on stdout and exits 0.
# expect_usage_error NAME LINE-START COMMAND...: COMMAND exits 2 with nothing on stdout and one
# line on stderr that starts with LINE-START.
expect_usage_error() {
  local name="$1" start="$2"
  shift 2
  local rc=0
  "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
  if [[ "$rc" -eq 2 && ! -s "$tmp/out" && "$(wc -l <"$tmp/err")" -eq 1 && "$(cat "$tmp/err")" == "$start"* ]]; then
    echo "ok   $name: $(cat "$tmp/err")"
  else
    echo "FAIL $name: exit status $rc; stdout: $(head -c 200 "$tmp/out"); stderr: $(cat "$tmp/err")" >&2
    failures=$((failures + 1))
  fi
}
expect_bad_option() {  # EXPECTED-START (after "bench_prefill: ") ARGS...
  local want="$1"
  shift
  expect_usage_error "bench_prefill $*" "bench_prefill: $want" "$bench" "$@"
}
expect_bad_option "unknown argument '--frobnicate'" --shape qwen2.5-7b --frobnicate
expect_bad_option "--reps 'abc': not an integer in [1, 1000000]" --reps abc
expect_bad_option "--reps '0': not an integer" --reps 0
expect_bad_option "--warmup '-1': not an integer" --warmup -1
expect_bad_option "--tokens '16,x': not N[,N...]" --tokens 16,x
expect_bad_option "--tokens '40000': not N[,N...]" --tokens 40000
expect_bad_option "--tokens '16,': not N[,N...]" --tokens 16,
expect_bad_option "--graphs 'maybe': not one of both|on|off|ab" --graphs maybe
expect_bad_option "--pdl ab and --graphs ab: one A/B at a time" --shape qwen2.5-7b --pdl ab --graphs ab
expect_bad_option "--attention 'fast': not one of auto|mma|wgmma|wgmma1k|wide" --attention fast
expect_bad_option "--shape 'nope': not one of" --shape nope
expect_bad_option "--reps needs a value" --shape qwen2.5-7b --reps
expect_bad_option "--json '': not a file name" --json ""
rc=0
"$bench" --help >"$tmp/out" 2>"$tmp/err" || rc=$?
if [[ "$rc" -eq 0 && ! -s "$tmp/err" ]] && grep -q "^usage: bench_prefill" "$tmp/out" &&
  grep -q "shapes:.*qwen2.5-14b" "$tmp/out"; then
  echo "ok   bench_prefill --help"
else
  echo "FAIL bench_prefill --help: exit status $rc; stderr: $(cat "$tmp/err")" >&2
  failures=$((failures + 1))
fi
# pairings.sh: a pairing count that is not a positive integer is refused with exit status 2 and
# one line, before anything runs.
expect_usage_error pairings.sh "pairings.sh: N must be a positive integer" \
  "$here/pairings.sh" "$bench" qwen2.5-7b 0
exit $((failures > 0))
