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
etcd_bin=${ETCD:-/usr/bin/etcd}
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
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
[ -x "$etcd_bin" ] || { echo "no etcd at $etcd_bin" >&2; exit 77; }
[ -x "$pg_bin/initdb" ] || { echo "no postgresql" >&2; exit 77; }
[ -x "$bin/bench_manager_writes" ] || { echo "build bench_manager_writes first" >&2; exit 1; }

dir=$(mktemp -d /tmp/keep-bench-cluster.XXXXXX)
chmod 755 "$dir"  # the postgres user reaches its directories below
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

# Ports: a free block above 30000 (etcd clients, etcd peers, primary, standby).
base=$((30000 + RANDOM % 20000))
urls="" cluster=""
for i in 0 1 2; do
  urls+="${urls:+,}http://127.0.0.1:$((base + i))"
  cluster+="${cluster:+,}e$i=http://127.0.0.1:$((base + 10 + i))"
done
for i in 0 1 2; do
  "$etcd_bin" --name "e$i" --data-dir "$dir/etcd$i" \
    --listen-client-urls "http://127.0.0.1:$((base + i))" \
    --advertise-client-urls "http://127.0.0.1:$((base + i))" \
    --listen-peer-urls "http://127.0.0.1:$((base + 10 + i))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((base + 10 + i))" \
    --initial-cluster "$cluster" >"$dir/etcd$i.log" 2>&1 &
  pids+=($!)
done

# PostgreSQL as the postgres user when root (it refuses root); setpriv execs, so $! is the server.
as=()
mkdir -p "$dir/pg1" "$dir/pg2"
if [ "$(id -u)" = 0 ]; then
  chown postgres: "$dir/pg1" "$dir/pg2"
  as=(setpriv --reuid=postgres --regid=postgres --init-groups --)
fi
p1=$((base + 20)) p2=$((base + 21))
"${as[@]}" "$pg_bin/initdb" -D "$dir/pg1/data" --auth=trust -U postgres >"$dir/pg1.log" 2>&1 ||
  { cat "$dir/pg1.log" >&2; exit 1; }
"${as[@]}" "$pg_bin/postgres" -D "$dir/pg1/data" -p "$p1" -k "$dir/pg1" \
  -c listen_addresses=127.0.0.1 -c synchronous_standby_names=keep_standby \
  -c synchronous_commit=on >>"$dir/pg1.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$p1" && break; sleep 0.1; done
"${as[@]}" "$pg_bin/pg_basebackup" -D "$dir/pg2/data" -h 127.0.0.1 -p "$p1" -U postgres -R \
  -X stream -c fast >"$dir/pg2.log" 2>&1
"${as[@]}" "$pg_bin/postgres" -D "$dir/pg2/data" -p "$p2" -k "$dir/pg2" \
  -c listen_addresses=127.0.0.1 -c cluster_name=keep_standby >>"$dir/pg2.log" 2>&1 &
pids+=($!)
psql=("$pg_bin/psql" -h 127.0.0.1 -p "$p1" -U postgres -d postgres -Atq)
for _ in $(seq 100); do
  [ "$("${psql[@]}" -c "SELECT sync_state FROM pg_stat_replication" 2>/dev/null)" = sync ] && break
  sleep 0.1
done
[ "$("${psql[@]}" -c "SELECT sync_state FROM pg_stat_replication")" = sync ] ||
  { echo "no synchronous standby: $dir/pg2.log" >&2; exit 1; }
# libpq's URI form (bench_manager_writes splits --manager-args on spaces): both servers, the one
# taking writes chosen.
pg="postgresql://postgres@127.0.0.1:$p1,127.0.0.1:$p2/postgres?target_session_attrs=read-write&connect_timeout=5"

echo "# bench_cluster: $(nproc) cores, etcd 3 members, PostgreSQL $("${psql[@]}" -c 'SHOW server_version'), sync standby $("${psql[@]}" -c 'SELECT application_name || '"'"' '"'"' || sync_state FROM pg_stat_replication'), fsync $("${psql[@]}" -c 'SHOW fsync'), shards $shards"
IFS=, read -r -a ns <<<"$agents"
IFS=, read -r -a ms <<<"$modes"
run=0
for mode in "${ms[@]}"; do
  for n in "${ns[@]}"; do
    echo "== $mode, $n agents: single node (local WAL, fsync on)"
    "$bin/bench_manager_writes" --modes "$mode" --agents "$n" --seconds "$seconds" |
      grep -v '^#' | grep -v 'manager threads'
    # A fresh log, and a fresh node name (the previous one left, revoking its lease).
    "${psql[@]}" -c "SET client_min_messages = warning; DROP TABLE IF EXISTS keep_log, keep_fence" >/dev/null
    run=$((run + 1))
    echo "== $mode, $n agents: cluster (--etcd, --pg with a synchronous standby)"
    "$bin/bench_manager_writes" --modes "$mode" --agents "$n" --seconds "$seconds" \
      --manager-args="--etcd $urls --node-id bench$run --shards $shards --pg $pg" |
      grep -v '^#' | grep -v 'manager threads'
  done
done
