#!/usr/bin/env bash
# The README's demo: installs what is missing, builds, starts keep-manager and keep-worker
# (SmolLM2-135M-Instruct; CUDA when there is a GPU, else the CPU) and runs one household-robot
# agent and its planner through the whole loop: memories written over ZeroMQ, groups turning
# static, the worker computing their KV into the shared region, then one planning step with every
# method side by side (answer, TTFT, recompute ratio, KV bytes loaded, entries reused). Then an
# update, the metrics, and a manager restart under the live worker. Everything runs on 127.0.0.1
# and is cleaned up at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash deploy/install-deps.sh
bash deploy/fetch-models.sh
build=${KEEP_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target keep-manager keep-worker keepctl -j "$(nproc)"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
port=$(free_port); mport=$(free_port); wport=$(free_port); wmport=$(free_port)
data=$(mktemp -d /tmp/keep-demo.XXXXXX)
shm="keep-demo-$$"
endpoint="tcp://127.0.0.1:$port"
wendpoint="tcp://127.0.0.1:$wport"
log="$data/manager.log"
wlog="$data/worker.log"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
mgr_pid=""
wrk_pid=""
cleanup() {
  [ -n "$wrk_pid" ] && kill "$wrk_pid" 2>/dev/null && wait "$wrk_pid" 2>/dev/null || true
  [ -n "$mgr_pid" ] && kill "$mgr_pid" 2>/dev/null && wait "$mgr_pid" 2>/dev/null || true
  rm -rf "$data"
}
trap cleanup EXIT

k() { "$build/bin/keepctl" --endpoint "$endpoint" --worker-endpoint "$wendpoint" "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
wait_for() {  # wait_for WHAT LOG COMMAND...: retries COMMAND for 60 s
  local what=$1 logfile=$2
  shift 2
  for _ in $(seq 1 600); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "demo: $what did not come up; its log:" >&2
  cat "$logfile" >&2
  exit 1
}

start_manager() {
  "$build/bin/keep-manager" --endpoint "$endpoint" --metrics-listen "127.0.0.1:$mport" \
    --data-dir "$data/state" --shm-name "$shm" --shm-bytes 256MiB --model "$model" >>"$log" 2>&1 &
  mgr_pid=$!
  wait_for keep-manager "$log" k --timeout-ms 200 ping
}
start_worker() {
  "$build/bin/keep-worker" --endpoint "$wendpoint" --metrics-listen "127.0.0.1:$wmport" \
    --manager "$endpoint" --shm-name "$shm" --model "$model" >>"$wlog" 2>&1 &
  wrk_pid=$!
  wait_for keep-worker "$wlog" k --timeout-ms 200 worker-ping
}
# Waits until every memory of robot1 has its KV in the region.
wait_kv() {
  for _ in $(seq 1 600); do
    if k list robot1 --all --json | python3 -c '
import json, sys
m = json.load(sys.stdin)["memories"]
sys.exit(0 if m and all(x["has_kv"] for x in m) else 1)'; then
      return 0
    fi
    sleep 0.1
  done
  echo "demo: the worker did not produce the KV; its log:" >&2
  tail -20 "$wlog" >&2
  exit 1
}
instruction="Put the apple and the milk on the table."
history="walk to the kitchen"
# Formats plan_step's JSON answers as a table.
read -r -d '' table <<'PY' || true
import json, sys
print("%-11s %8s %9s %10s %14s  %s" % ("method", "TTFT ms", "recompute", "loaded KiB",
                                       "hit/miss/stale", "answer"))
for line in sys.stdin:
    r = json.loads(line)
    s = r["stats"]
    hms = "%d/%d/%d" % (s["entries_hit"], s["entries_missing"], s["entries_stale"])
    print("%-11s %8.1f %9.2f %10.1f %14s  %s" % (s["method"], s["ttft_s"] * 1e3,
          s["recompute_ratio"], s["bytes_loaded"] / 1024, hms, " ".join(r["text"].split())[:60]))
PY
# One planning step with each method, side by side.
plan_step() {
  for m in full prefix full_reuse cacheblend epic keep; do
    k --json complete robot1 "$instruction" --history "$history" --method "$m" --k 8 \
      --max-tokens 24
  done | python3 -c "$table"
}

say "keep-manager on $endpoint (metrics :$mport), keep-worker on $wendpoint (metrics :$wmport)"
start_manager
start_worker
k ping
k worker-ping

say "the agent writes its memory: example plans, object states, finished tasks (step 0)"
k write robot1 "Example plan: to heat the milk, find the milk, pick it up, open the microwave, put the milk inside, close it and switch it on." --kind example_plan
k write robot1 "The apple is on the kitchen table."
k write robot1 "The banana is on the kitchen counter."
k write robot1 "The bread is in the kitchen cabinet."
k write robot1 "The milk is in the fridge."
k write robot1 "The fridge door is closed."
k write robot1 "The TV in the living room is off."
k write robot1 "The remote control is on the sofa in the living room."
k write robot1 "Task done: put the milk in the fridge." --kind task_record

say "groups right after the writes: all dynamic (embedded in the background, grouped by similarity)"
sleep 1
k groups robot1

say "ten planning steps pass without changes: groups turn static; the worker computes their joint KV"
k step robot1 --by 10
k groups robot1
wait_kv
k stats | grep -E "groups_|jobs_completed|transitions"

say "one planning step, '$instruction', with each method (answer, TTFT, reuse)"
plan_step

say "the planner scores candidate next actions instead (keep)"
k score robot1 "$instruction" --history "$history" --candidates "open the fridge|turn on the TV|pick up the banana"

say "the robot moves the apple: that one record changes, its group turns dynamic, its KV is redone alone"
k update robot1 2 "The apple is in the fridge."
k groups robot1
wait_kv
k complete robot1 "$instruction" --history "$history" --max-tokens 24

say "metrics (Prometheus text format)"
curl -s "http://127.0.0.1:$mport/metrics" | grep -E '^keep_manager_(memories|groups|kv_jobs\{)' || true
curl -s "http://127.0.0.1:$wmport/metrics" | grep -E '^keep_worker_(requests_total|kv_jobs_total|recompute_ratio_(sum|count)|region_attached)' || true

say "kill -9 the manager and restart it: memories come back from the WAL, the worker reconnects"
kill -9 "$mgr_pid"; wait "$mgr_pid" 2>/dev/null || true
start_manager
k stats | grep -E "^(agents|memories|groups_)"
k step robot1 --by 10 >/dev/null
wait_kv
k complete robot1 "$instruction" --history "$history" --max-tokens 24
grep -E "recovered" "$log" | tail -n 1
grep -E "replaced or removed|attached the KV region" "$wlog" | tail -n 2
say "done"
