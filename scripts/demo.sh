#!/usr/bin/env bash
# The README's demo: installs what is missing, builds, starts keep-manager and runs a scripted
# household-robot agent against it with keepctl. Later issues extend it to the whole planning
# loop with keep-worker. Everything runs on 127.0.0.1 and is cleaned up at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash deploy/install-deps.sh
bash deploy/fetch-models.sh
build=${KEEP_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target keep-manager keepctl -j "$(nproc)"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
data=$(mktemp -d /tmp/keep-demo.XXXXXX)
shm="keep-demo-$$"
endpoint="tcp://127.0.0.1:$port"
log="$data/manager.log"
mgr_pid=""
cleanup() {
  [ -n "$mgr_pid" ] && kill "$mgr_pid" 2>/dev/null && wait "$mgr_pid" 2>/dev/null || true
  rm -rf "$data"
}
trap cleanup EXIT

start_manager() {
  "$build/bin/keep-manager" --endpoint "$endpoint" --metrics-listen "127.0.0.1:$mport" \
    --data-dir "$data/state" --shm-name "$shm" --shm-bytes 64MiB >>"$log" 2>&1 &
  mgr_pid=$!
  for _ in $(seq 1 100); do
    "$build/bin/keepctl" --endpoint "$endpoint" --timeout-ms 200 ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "demo: keep-manager did not come up; its log:" >&2
  cat "$log" >&2
  exit 1
}
k() { "$build/bin/keepctl" --endpoint "$endpoint" "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "keep-manager on $endpoint, metrics on http://127.0.0.1:$mport/metrics"
start_manager
k ping

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

say "ten planning steps pass without changes: groups turn static, joint-KV jobs are queued"
k step robot1 --by 10
k groups robot1
k stats | grep -E "groups_|jobs_queued|transitions"

say "the robot moves the apple: that one record changes, its group turns dynamic at once"
k update robot1 2 "The apple is in the fridge."
k groups robot1

say "retrieve for the instruction 'Put the apple and the milk on the table' (k = 4), in prompt order"
k retrieve robot1 "Put the apple and the milk on the table" --k 4

say "metrics (Prometheus text format)"
curl -s "http://127.0.0.1:$mport/metrics" | grep -E '^keep_manager_(memories|groups|group_transitions_total|requests_total\{type="write"|kv_jobs\{)' || true

say "kill -9 the manager and restart it: every acknowledged memory comes back from the WAL"
kill -9 "$mgr_pid"; wait "$mgr_pid" 2>/dev/null || true
start_manager
k stats | grep -E "^(agents|memories|groups_)"
k list robot1 --all
k groups robot1
grep -E "recovered" "$log" | tail -n 1
say "done"
