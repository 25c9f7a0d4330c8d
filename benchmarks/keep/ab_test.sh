#!/usr/bin/env bash
# ab.sh against a stub bench_keep (the real one needs the GPU machine): the variants alternate
# round by round, each round's median lands in its variant's cell in order, a variant that fails
# or times out is reported by name and makes the exit status 1, and the table still prints.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
stub="$tmp/bench_keep"
cat >"$stub" <<'STUB'
#!/usr/bin/env bash
# Records the call order; TTFT = the variant's base + the call's number / 10.
json="" segments="" base="" sleep_s=0
while (($#)); do
  case "$1" in
    --json) json="$2"; shift ;;
    --segments) segments="$2"; shift ;;
    --base) base="$2"; shift ;;
    --fail) echo "bench_keep: refused: bad option"; exit 3 ;;
    --hang) sleep_s=5 ;;
  esac
  shift
done
sleep "$sleep_s"
n=$(($(wc -l <"$CALLS" 2>/dev/null || echo 0) + 1))
echo "$base" >>"$CALLS"
t="$base.$n"
printf '{"segments":%s,"method":"keep ~0.15","ttft_ms":%s,"recompute_ratio":0.15}\n' "$segments" "$t" >"$json"
printf '{"segments":%s,"method":"full_reuse","ttft_ms":%s,"recompute_ratio":0}\n' "$segments" "$t" >>"$json"
STUB
chmod +x "$stub"
fail=0
check() {  # WHAT CONDITION-RESULT
  if [[ "$2" != 0 ]]; then
    echo "FAIL: $1"
    fail=1
  fi
}

export CALLS="$tmp/calls"
out="$(ROUNDS=2 SEGMENTS=40 OUT="$tmp/a" "$here/ab.sh" "$stub" "--base 10" "--base 20" 2>&1)"
rc=$?
echo "$out"
check "two good variants exit 0" "$rc"
check "alternating calls" "$([[ "$(tr '\n' ' ' <"$CALLS")" == "10 20 10 20 " ]]; echo $?)"
check "keep row with both rounds per variant and the ratio" \
  "$(grep -qE '^ +40  keep ~0.15 +10.1, 10.3 \(0.150\) \| 20.2, 20.4 \(0.150\)$' <<<"$out"; echo $?)"
check "full_reuse row without a ratio" \
  "$(grep -qE '^ +40  full_reuse +10.1, 10.3 \| 20.2, 20.4$' <<<"$out"; echo $?)"

rm -f "$CALLS"
out="$(ROUNDS=1 TIMEOUT=1 OUT="$tmp/b" "$here/ab.sh" "$stub" "--base 10" "--base 30 --fail" \
  "--base 40 --hang" 2>&1)"
rc=$?
echo "$out"
check "a failing variant exits 1" "$([[ $rc == 1 ]]; echo $?)"
check "the refusal is reported by variant" \
  "$(grep -qF "variant '--base 30 --fail' round 1 exited 3 (bench_keep: refused: bad option)" <<<"$out"; echo $?)"
check "the hang is reported as a time-out" \
  "$(grep -qF "variant '--base 40 --hang' round 1 exited 124 (timed out)" <<<"$out"; echo $?)"
check "the good variant still has its cell" \
  "$(grep -qE '^ +40  keep ~0.15 +10.1 \(0.150\) \| - \| -$' <<<"$out"; echo $?)"

if ((fail)); then
  echo "ab_test.sh: FAILED"
  exit 1
fi
echo "ab_test.sh: passed"
