#!/usr/bin/env bash
# N pairings of KEEP and HF transformers on one GPU machine: run.sh N times in a row, each into
# its own folder, then summary.py --pairings over them (each pairing's speed-up, and their median,
# minimum and maximum). HF's median moves by 5-10 % between runs on some machines, so a target is
# read off several pairings, not one (benchmarks/RESULTS.md runs 20-21). Usage:
#   benchmarks/prefill/pairings.sh BENCH_PREFILL_BINARY SHAPE [N]        (N: 5)
# Env: as run.sh, with isolated requests of 1024 tokens by default here (TOKENS 1024, REPS 15,
# DECODE 0, GRAPHS both: KEEP launch by launch and with graphs replayed, GAP_MS 200); OUT (the
# pairings' folders go under it; /tmp).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: pairings.sh BENCH_PREFILL_BINARY SHAPE [N]" >&2
  exit 2
fi
bin="$1"
shape="$2"
n="${3:-5}"
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
  echo "pairings.sh: N must be a positive integer, not '$n'" >&2
  exit 2
fi
base="${OUT:-/tmp}/pairings-$shape"
files=()
for i in $(seq 1 "$n"); do
  echo "== pairing $i of $n ($(date +%T))"
  TOKENS="${TOKENS:-1024}" REPS="${REPS:-15}" DECODE="${DECODE:-0}" GRAPHS="${GRAPHS:-both}" \
    GAP_MS="${GAP_MS:-200}" OUT="$base/$i" "$here/run.sh" "$bin" "$shape" || exit 1
  files+=("$base/$i/prefill-results.jsonl")
done
python3 "$here/summary.py" --pairings "${files[@]}"
