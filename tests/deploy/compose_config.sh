#!/usr/bin/env bash
# docker-compose.yml must be a valid Compose file: `docker compose config` where the Compose
# plugin exists, else the standalone docker-compose (Debian package, installed by
# deploy/install-deps.sh). Neither needs a Docker engine for `config`.
set -euo pipefail
cd "$(dirname "$0")/../.."
if docker compose version >/dev/null 2>&1; then
  docker compose -f docker-compose.yml config -q
elif command -v docker-compose >/dev/null; then
  docker-compose -f docker-compose.yml config -q
else
  echo "compose_config: neither 'docker compose' nor docker-compose is installed" >&2
  exit 1
fi
for f in deploy/Dockerfile.manager deploy/Dockerfile.worker deploy/prometheus.yml deploy/manager.conf \
    deploy/worker.conf; do
  [ -f "$f" ] || { echo "compose_config: $f is missing" >&2; exit 1; }
done
promtool check config deploy/prometheus.yml >/dev/null
echo "compose_config: docker-compose.yml and deploy/prometheus.yml are valid"
