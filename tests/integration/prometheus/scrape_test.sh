#!/usr/bin/env bash
# Proves an exporter works with a REAL Prometheus server (2.42, Debian package `prometheus`).
#
#   scrape_test.sh --target HOST:PORT [--timeout SECONDS] [--tol ABS] [--path /metrics]
#                  --expect 'PROMQL OP VALUE' [--expect ...]
#
# Starts prometheus on 127.0.0.1:<free port> with a generated config that scrapes the target every
# 1 s (job "keep"), waits until up{job="keep"} == 1, then polls /api/v1/query until every
# expectation holds (see prom_query.py: OP is == != >= <= > < ~= or 'PROMQL exists'), all within
# --timeout seconds (default 45). Prometheus and its temp dir are removed on every exit path.
# Exit 0: all expectations passed; 1: a failure (prometheus log tail printed); 2: usage.
#
# Reuse for the services, e.g.:
#   scrape_test.sh --target 127.0.0.1:9464 --expect 'keep_manager_memories >= 0' \
#     --expect 'keep_manager_wal_fsync_seconds_count > 0'
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="" timeout_s=45 tol=0 metrics_path=/metrics
expects=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --tol) tol="$2"; shift 2 ;;
    --path) metrics_path="$2"; shift 2 ;;
    --expect) expects+=("$2"); shift 2 ;;
    *) echo "usage: $0 --target HOST:PORT [--timeout S] [--tol ABS] [--path P] --expect 'Q OP V'..." >&2
       exit 2 ;;
  esac
done
[[ -n "$target" && ${#expects[@]} -gt 0 ]] || { echo "scrape_test: --target and --expect are required" >&2; exit 2; }

prometheus_bin="${PROMETHEUS:-$(command -v prometheus || true)}"
if [[ -z "$prometheus_bin" || ! -x "$prometheus_bin" ]]; then
  echo "FAIL: prometheus not found (set PROMETHEUS or run deploy/install-deps.sh)" >&2
  exit 1
fi

start_time=$(date +%s)
deadline=$((start_time + timeout_s))
workdir="$(mktemp -d "${TMPDIR:-/tmp}/keep-prom.XXXXXX")"
prom_pid=""
query_pid=""
status=1

cleanup() {
  local rc=$?
  [[ -n "$query_pid" ]] && kill -TERM "$query_pid" 2>/dev/null || true
  if [[ -n "$prom_pid" ]] && kill -0 "$prom_pid" 2>/dev/null; then
    kill -TERM "$prom_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$prom_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$prom_pid" 2>/dev/null || true
    wait "$prom_pid" 2>/dev/null || true
  fi
  if [[ $status -ne 0 && -f "$workdir/prometheus.log" ]]; then
    echo "--- prometheus log (tail) ---" >&2
    tail -n 30 "$workdir/prometheus.log" >&2 || true
  fi
  rm -rf "$workdir"
  exit $rc
}
trap cleanup EXIT
trap 'exit 1' INT TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

cat > "$workdir/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: keep
    metrics_path: ${metrics_path}
    static_configs:
      - targets: ['${target}']
YAML

# Start prometheus; retry on another port if the free port was taken in between.
prom_url=""
for attempt in 1 2 3; do
  port="$(free_port)"
  rm -rf "$workdir/data"
  # Under `timeout` so that prometheus cannot outlive the test even if this script is SIGKILLed.
  timeout --kill-after=5 $((timeout_s + 30)) "$prometheus_bin" --config.file="$workdir/prometheus.yml" \
    --storage.tsdb.path="$workdir/data" \
    --web.listen-address="127.0.0.1:${port}" \
    --log.level=warn >"$workdir/prometheus.log" 2>&1 &
  prom_pid=$!
  while kill -0 "$prom_pid" 2>/dev/null && [[ $(date +%s) -lt $deadline ]]; do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:${port}/-/ready', timeout=1)" 2>/dev/null; then
      prom_url="http://127.0.0.1:${port}"
      break
    fi
    sleep 0.2
  done
  [[ -n "$prom_url" ]] && break
  wait "$prom_pid" 2>/dev/null || true
  prom_pid=""
  echo "scrape_test: prometheus did not become ready on port ${port} (attempt ${attempt})" >&2
done
[[ -n "$prom_url" ]] || { echo "FAIL: prometheus did not start" >&2; exit 1; }
echo "scrape_test: prometheus $("$prometheus_bin" --version 2>&1 | head -n1 | awk '{print $3}') on ${prom_url}, scraping ${target}${metrics_path}"

# In the background + wait, so that a TERM/INT reaches the trap at once.
python3 "$here/prom_query.py" --prometheus "$prom_url" --deadline "$deadline" --tol "$tol" \
  "up{job=\"keep\"} == 1" "${expects[@]}" &
query_pid=$!
if wait "$query_pid"; then
  query_pid=""
  status=0
  echo "PASS: ${#expects[@]} expectation(s) on ${target} in $(( $(date +%s) - start_time )) s"
else
  query_pid=""
  echo "FAIL: expectations not met within ${timeout_s} s (target ${target})" >&2
  exit 1
fi
