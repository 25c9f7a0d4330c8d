#!/usr/bin/env bash
# An A/B of bench_keep options in one GPU call, the way benchmarks/RESULTS.md's experiments are
# run: the variants alternate (A, B, ..., A, B, ...) for ROUNDS rounds, each a separate
# bench_keep process over the same request, so that clock and thermal drift fall on every
# variant alike; then one line per (variant, segments, method) with every round's TTFT median.
#
#   benchmarks/keep/ab.sh BENCH_KEEP "VARIANT A ARGS" "VARIANT B ARGS" [...]
#   e.g. benchmarks/keep/ab.sh .gpu-bundle/bin/bench_keep "--pool fused" "--pool tensor"
#
# Env: ROUNDS (2), SHAPE (qwen2.5-14b), SEGMENTS (40), METHODS (full_reuse,keep), RATIOS (0.15:
#      keep ~0.15), DECAYS (0.96), REPS (7), WARMUP (2), TIMEOUT (seconds per process, 120),
#      OUT (a directory for the JSON lines; default a temporary one).
set -uo pipefail
(($# >= 3)) || {
  sed -n '7,8p' "$0" | sed 's/^# *//'
  exit 2
}
bin="$1"
shift
variants=("$@")
rounds="${ROUNDS:-2}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out" || exit 1
results="$out/ab.jsonl"
: >"$results"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
rc=0
for ((r = 1; r <= rounds; ++r)); do
  for i in "${!variants[@]}"; do
    read -ra extra <<<"${variants[$i]}"
    one="$out/round$r.v$i.jsonl"
    timeout "${TIMEOUT:-120}" "$bin" --shape "${SHAPE:-qwen2.5-14b}" \
      --segments "${SEGMENTS:-40}" --methods "${METHODS:-full_reuse,keep}" \
      --keep-ratios "${RATIOS:-0.15}" --decays "${DECAYS:-0.96}" --reps "${REPS:-7}" \
      --warmup "${WARMUP:-2}" --json "$one" "${extra[@]}" >"$out/round$r.v$i.log" 2>&1
    status=$?
    if ((status != 0)); then
      echo "ab.sh: variant '${variants[$i]}' round $r exited $status" \
        "($( ((status == 124)) && echo "timed out" || tail -1 "$out/round$r.v$i.log"))"
      rc=1
      continue
    fi
    # Tag each line with its variant and round.
    python3 -c '
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    d["variant"], d["round"] = sys.argv[2], int(sys.argv[3])
    print(json.dumps(d))' "$one" "${variants[$i]}" "$r" >>"$results"
  done
done
python3 - "$results" "${variants[@]}" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
variants = sys.argv[2:]
keys = sorted({(d["segments"], d["method"]) for d in rows})
print(f"{'segments':>8}  {'method':<14} " + " | ".join(f"{v}" for v in variants))
for seg, method in keys:
    cells = []
    for v in variants:
        got = [d for d in rows if d["variant"] == v and d["segments"] == seg and d["method"] == method]
        got.sort(key=lambda d: d["round"])
        ratio = f" ({got[0]['recompute_ratio']:.3f})" if got and 0 < got[0]["recompute_ratio"] < 1 else ""
        cells.append(", ".join(f"{d['ttft_ms']:.1f}" for d in got) + ratio or "-")
    print(f"{seg:>8}  {method:<14} " + " | ".join(cells))
EOF
echo "ab.sh: JSON lines in $results"
exit $rc
