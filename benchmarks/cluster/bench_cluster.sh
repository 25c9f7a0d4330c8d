#!/usr/bin/env bash
# Acknowledged writes/s and write latency of keep-manager in cluster mode (issue 31) against
# single-node mode, in the same run on the same machine (benchmarks/RESULTS.md, "Cluster mode").
#
#   benchmarks/cluster/bench_cluster.sh [--agents 1,4,16,64] [--modes blocking,pipelined]
#       [--seconds 5] [--shards 64]
#
# Single node: keep-manager alone, a write acknowledged after its batch's WAL fdatasync (fsync
# on). Cluster: the same binary with --etcd (a three-member etcd on loopback) and --pg (a
# PostgreSQL primary with a synchronous standby on loopback, fsync on, synchronous_commit=on: a
# write is acknowledged once its batch's transaction is flushed on both servers), one node
# owning every shard. The load is build/bin/bench_manager_writes (N agents, one thread and one
# connection each); each (N, mode) is run single-node first, then cluster, each on a fresh
# manager and, for the cluster, an emptied keep_log. Needs Debian's etcd-server and postgresql.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bin=${KEEP_BIN_DIR:-${KEEP_BUILD_DIR:-build}/bin}
# shellcheck source=scripts/lib/cluster_services.sh
. scripts/lib/cluster_services.sh
agents=1,4,16,64
modes=blocking,pipelined
seconds=5
shards=64
while [ $# -gt 0 ]; do
  case "$1" in
    --agents) agents=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
  esac
done
[ -x "$keep_etcd_bin" ] || { echo "no etcd at $keep_etcd_bin" >&2; exit 77; }
[ -x "$keep_pg_bin/initdb" ] || { echo "no postgresql" >&2; exit 77; }
[ -x "$bin/bench_manager_writes" ] || { echo "build bench_manager_writes first" >&2; exit 1; }

dir=$(mktemp -d /tmp/keep-bench-cluster.XXXXXX)
cleanup() {
  for p in "$dir"/*.pid; do [ -f "$p" ] && kill -9 "$(cat "$p")" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

# Ports: a free block above 30000 (etcd clients, etcd peers, primary, standby).
base=$((30000 + RANDOM % 20000))
keep_etcd_start "$dir" "$base" $((base + 10))
urls=$keep_etcd_urls
p1=$((base + 20))
keep_pg_start_pair "$dir" "$p1" $((base + 21))
# libpq's URI form (bench_manager_writes splits --manager-args on spaces): both servers, the one
# taking writes chosen.
pg=$keep_pg_conninfo
psql() { keep_pg_psql "$p1" "$@"; }

echo "# bench_cluster: $(nproc) cores, etcd 3 members, PostgreSQL $(psql 'SHOW server_version'), sync standby $(psql 'SELECT application_name || '"'"' '"'"' || sync_state FROM pg_stat_replication'), fsync $(psql 'SHOW fsync'), shards $shards"
IFS=, read -r -a ns <<<"$agents"
IFS=, read -r -a ms <<<"$modes"
run=0
for mode in "${ms[@]}"; do
  for n in "${ns[@]}"; do
    echo "== $mode, $n agents: single node (local WAL, fsync on)"
    "$bin/bench_manager_writes" --modes "$mode" --agents "$n" --seconds "$seconds" |
      grep -v '^#' | grep -v 'manager threads'
    # A fresh log, and a fresh node name (the previous one left, revoking its lease).
    psql "SET client_min_messages = warning; DROP TABLE IF EXISTS keep_log, keep_fence, keep_checkpoint" >/dev/null
    run=$((run + 1))
    echo "== $mode, $n agents: cluster (--etcd, --pg with a synchronous standby)"
    "$bin/bench_manager_writes" --modes "$mode" --agents "$n" --seconds "$seconds" \
      --manager-args="--etcd $urls --node-id bench$run --shards $shards --pg $pg" |
      grep -v '^#' | grep -v 'manager threads'
  done
done
