#!/usr/bin/env bash
# CTest manager_prometheus_scrape: a real keep-manager with /metrics on a free port; keepctl writes,
# steps and retrieves; then `promtool check metrics` must accept GET /metrics and a real Prometheus
# (tests/integration/prometheus/scrape_test.sh) must find the manager's series with their values.
#
#   manager_prometheus_test.sh <keep-manager> <keepctl>
#
# Both daemons bind port 0; the addresses are read from keep-manager's "serving on" log line.
# Every process and the temp dir are removed on every exit path.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
manager="${1:?usage: $0 <keep-manager> <keepctl>}"
keepctl="${2:?usage: $0 <keep-manager> <keepctl>}"
promtool="${PROMTOOL:-$(command -v promtool || true)}"
[[ -n "$promtool" && -x "$promtool" ]] || { echo "FAIL: promtool not found (deploy/install-deps.sh)" >&2; exit 1; }

workdir="$(mktemp -d "${TMPDIR:-/tmp}/keep-manager-prom.XXXXXX")"
shm="keep-itest-prom-$$"
manager_pid=""
harness_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$harness_pid" ]]; then
    kill -TERM "$harness_pid" 2>/dev/null || true
    wait "$harness_pid" 2>/dev/null || true
  fi
  if [[ -n "$manager_pid" ]] && kill -0 "$manager_pid" 2>/dev/null; then
    kill -TERM "$manager_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$manager_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$manager_pid" 2>/dev/null || true
    wait "$manager_pid" 2>/dev/null || true
  fi
  if [[ $rc -ne 0 && -f "$workdir/manager.log" ]]; then
    echo "--- keep-manager log (tail) ---" >&2
    tail -n 20 "$workdir/manager.log" >&2 || true
  fi
  rm -f "/dev/shm/$shm"
  rm -rf "$workdir"
  exit $rc
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# static-after-steps 3: a group unchanged for 3 steps turns static.
timeout --kill-after=5 120 "$manager" --data-dir "$workdir/data" --endpoint tcp://127.0.0.1:0 \
  --metrics-listen 127.0.0.1:0 --shm-name "$shm" --shm-bytes 16MiB --static-after-steps 3 \
  --max-pending-embeddings 5000 \
  --encoder "$repo/models/all-MiniLM-L6-v2" \
  --model "$repo/models/SmolLM2-135M-Instruct.Q4_1.gguf" >"$workdir/manager.out" \
  2>"$workdir/manager.log" &
manager_pid=$!
serving=""
for _ in $(seq 300); do
  serving="$(grep -m1 'manager: serving on ' "$workdir/manager.log" || true)"
  [[ -n "$serving" ]] && break
  kill -0 "$manager_pid" 2>/dev/null || { echo "FAIL: keep-manager exited at start-up" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$serving" ]] || { echo "FAIL: keep-manager did not start" >&2; exit 1; }
endpoint="$(sed -E 's/.*serving on (tcp:\/\/[0-9.]+:[0-9]+).*/\1/' <<<"$serving")"
metrics="$(sed -E 's/.*metrics on ([0-9.]+:[0-9]+).*/\1/' <<<"$serving")"
echo "keep-manager on $endpoint, metrics on $metrics"

ctl() { "$keepctl" --endpoint "$endpoint" "$@" >/dev/null; }
# 8 memories of agent "robot" (6 kitchen objects, 2 example plans) and 4 of agent "b".
n=0
for obj in "red mug" "blue mug" "white cup" "glass" "coffee cup" "tea cup"; do
  ctl write robot "the $obj is on the kitchen counter"; n=$((n + 1))
done
ctl write robot "plan: find mug, pick up mug, put mug in sink" --kind example_plan; n=$((n + 1))
ctl write robot "plan: open fridge, take apple, close fridge" --kind example_plan; n=$((n + 1))
for i in 1 2 3 4; do ctl write b "box $i is in the garage" --id $((i * 10)); n=$((n + 1)); done
ctl update robot 1 "the red mug is in the sink"
ctl delete b 40
n=$((n - 1))
ctl retrieve robot "where is the mug" --k 4  # embeds and groups robot's memories now
ctl retrieve b "box" --k 4
ctl step robot --by 5                        # robot's groups turn static
ctl step b --by 5
ctl list robot --limit 3
"$keepctl" --endpoint "$endpoint" --json stats

# promtool: the exposition parses and passes the linter.
text="$(curl -sf "http://$metrics/metrics")"
for type in counter gauge histogram; do
  grep -q "^# TYPE keep_manager_[a-z_]* ${type}\$" <<<"$text" || { echo "FAIL: no ${type} in /metrics" >&2; exit 1; }
done
if ! out="$(printf '%s\n' "$text" | "$promtool" check metrics 2>&1)"; then
  echo "FAIL: promtool check metrics rejected /metrics:" >&2
  echo "$out" >&2
  exit 1
fi
if [[ -n "$out" ]]; then
  echo "FAIL: promtool check metrics reported problems:" >&2
  echo "$out" >&2
  exit 1
fi
echo "PASS: promtool check metrics accepted $(grep -vc '^#' <<<"$text") samples of keep-manager"

# 12 writes, 1 update, 1 delete (11 memories), 2 retrieves, 2 steps, 1 list.
"$here/../prometheus/scrape_test.sh" --target "$metrics" --timeout 50 \
  --expect "keep_manager_memories == $n" \
  --expect 'keep_manager_agents == 2' \
  --expect 'keep_manager_groups{state="static"} >= 1' \
  --expect 'keep_manager_requests_total{type="write",code="ok"} == 12' \
  --expect 'keep_manager_requests_total{type="update",code="ok"} == 1' \
  --expect 'keep_manager_requests_total{type="delete",code="ok"} == 1' \
  --expect 'keep_manager_requests_total{type="retrieve",code="ok"} == 2' \
  --expect 'keep_manager_retrieves_deferred_total == 2' \
  --expect 'keep_manager_retrieves_waiting == 0' \
  --expect 'keep_manager_requests_total{type="advance_step",code="ok"} == 2' \
  --expect 'keep_manager_requests_total{type="list_memories",code="ok"} == 1' \
  --expect 'keep_manager_embeddings_pending_limit == 5000' \
  --expect 'keep_manager_group_transitions_total{to="static"} >= 1' \
  --expect 'keep_manager_wal_fsync_seconds_count > 0' \
  --expect 'keep_manager_wal_fsync_seconds_bucket{le="+Inf"} > 0' \
  --expect 'keep_manager_wal_fsync_seconds_bucket{le="+Inf"} - ignoring(le) keep_manager_wal_fsync_seconds_count == 0' \
  --expect 'keep_manager_wal_records_total >= 16' \
  --expect 'keep_manager_arena_bytes{state="free"} > 0' \
  --expect 'keep_manager_arena_bytes{state="used"} >= 0' \
  --expect 'keep_manager_kv_evictions_total == 0' \
  --expect 'keep_manager_request_duration_seconds_count{type="write"} == 12' &
harness_pid=$!
wait "$harness_pid"  # in the background + wait, so that a TERM/INT reaches the trap at once
harness_pid=""

# A clean stop exits 0.
kill -TERM "$manager_pid"
rc=0
wait "$manager_pid" || rc=$?
manager_pid=""
[[ $rc -eq 0 ]] || { echo "FAIL: keep-manager exited $rc after SIGTERM" >&2; exit 1; }
echo "PASS: keep-manager metrics scraped by Prometheus; clean shutdown"
