#!/usr/bin/env bash
# CTest metrics_prometheus_scrape: runs keep_test_metrics_exporter on a free port and checks its
# series through a real Prometheus with scrape_test.sh. Usage: example_scrape_test.sh <exporter>
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exporter="${1:?usage: $0 path/to/keep_test_metrics_exporter}"
workdir="$(mktemp -d "${TMPDIR:-/tmp}/keep-exporter.XXXXXX")"
exporter_pid=""
harness_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$harness_pid" ]]; then
    kill -TERM "$harness_pid" 2>/dev/null || true
    wait "$harness_pid" 2>/dev/null || true
  fi
  if [[ -n "$exporter_pid" ]]; then
    kill -TERM "$exporter_pid" 2>/dev/null || true
    wait "$exporter_pid" 2>/dev/null || true
  fi
  rm -rf "$workdir"
  exit $rc
}
trap cleanup EXIT
trap 'exit 1' INT TERM

"$exporter" --host 127.0.0.1 --port 0 --port-file "$workdir/port" --tick-ms 100 --max-seconds 120 &
exporter_pid=$!
for _ in $(seq 100); do [[ -s "$workdir/port" ]] && break; sleep 0.1; done
[[ -s "$workdir/port" ]] || { echo "FAIL: exporter did not report its port" >&2; exit 1; }
target="127.0.0.1:$(cat "$workdir/port")"

# The quantile: 4 x 0.0002 s and 6 x 0.002 s -> rank 5 lies in (0.001, 0.0025], 1 of 6 -> 0.00125.
"$here/scrape_test.sh" --target "$target" --timeout 50 --tol 1e-9 \
  --expect 'keep_example_requests_total{path="/a",code="200"} == 3' \
  --expect 'keep_example_requests_total{path="/b",code="500"} == 1' \
  --expect 'keep_example_ticks_total > 0' \
  --expect 'rate(keep_example_ticks_total[5s]) > 0' \
  --expect 'keep_example_temperature_celsius{room="lab"} == -3.5' \
  --expect 'keep_example_unbounded == +Inf' \
  --expect 'keep_example_collect_hook_runs >= 1' \
  --expect 'keep_example_label_escaping{value="a\"b\\c\nd"} == 1' \
  --expect 'keep_example_label_escaping{value="café"} == 2' \
  --expect 'keep_example_label_escaping{value="bad\ufffdutf8"} == 3' \
  --expect 'keep_example_request_duration_seconds_count{path="/a"} == 10' \
  --expect 'keep_example_request_duration_seconds_sum{path="/a"} ~= 0.0128' \
  --expect 'keep_example_request_duration_seconds_bucket{path="/a",le="0.00025"} == 4' \
  --expect 'keep_example_request_duration_seconds_bucket{path="/a",le="+Inf"} == 10' \
  --expect 'histogram_quantile(0.5, sum by (le) (keep_example_request_duration_seconds_bucket{path="/a"})) ~= 0.00125' \
  --expect 'keep_example_payload_bytes_count == 3' \
  --expect 'keep_example_payload_bytes_bucket{le="256"} == 1' &
harness_pid=$!
wait "$harness_pid"  # in the background + wait, so that a TERM/INT reaches the trap at once
