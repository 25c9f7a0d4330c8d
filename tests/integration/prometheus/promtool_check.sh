#!/usr/bin/env bash
# CTest metrics_promtool_check: `promtool check metrics` (parse + lint) must accept the rendered
# registry of keep_test_metrics_exporter (every type, labels, hostile label values and help).
# A missing promtool is a FAILURE (deploy/install-deps.sh installs it).
# Usage: promtool_check.sh <keep_test_metrics_exporter>
set -euo pipefail
exporter="${1:?usage: $0 path/to/keep_test_metrics_exporter}"
promtool="${PROMTOOL:-$(command -v promtool || true)}"
if [[ -z "$promtool" || ! -x "$promtool" ]]; then
  echo "FAIL: promtool not found (set PROMTOOL or run deploy/install-deps.sh)" >&2
  exit 1
fi
text="$("$exporter" --render)"
for type in counter gauge histogram; do
  grep -q "^# TYPE [a-z_]* ${type}\$" <<<"$text" || { echo "FAIL: no ${type} in the rendered text" >&2; exit 1; }
done
if ! out="$(printf '%s\n' "$text" | "$promtool" check metrics 2>&1)"; then
  echo "FAIL: promtool check metrics rejected the rendered registry:" >&2
  echo "$out" >&2
  exit 1
fi
if [[ -n "$out" ]]; then  # lint findings are printed even when the exit status is 0
  echo "FAIL: promtool check metrics reported problems:" >&2
  echo "$out" >&2
  exit 1
fi
echo "PASS: promtool check metrics accepted $(grep -vc '^#' <<<"$text") samples"
