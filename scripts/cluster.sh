#!/usr/bin/env bash
# KEEP's cluster mode on one machine, for a person to try (docs/cluster.md): a three-member etcd,
# a PostgreSQL server holding the agents' memory logs, and N nodes (keep-manager --pg, plus a
# keep-worker on the CPU or GPU), all on 127.0.0.1.
#
#   scripts/cluster.sh up [N]     start (N nodes, default 2) and print their endpoints
#   scripts/cluster.sh status     shards each node serves, from its /metrics
#   scripts/cluster.sh kill I     kill -9 node I's manager (its shards move within the lease)
#   scripts/cluster.sh down       stop everything and remove the state
#
# State (pids, logs, data) lives in $KEEP_CLUSTER_DIR (default /tmp/keep-cluster);
# KEEP_CLUSTER_WORKERS=0 starts managers only; KEEP_CLUSTER_PG=0 (or no Debian postgresql) starts
# no PostgreSQL: the managers then route only, and a moved shard arrives without its memories.
# keepctl follows `moved`, so any node's endpoint reaches every agent:
#   build/bin/keepctl --endpoint tcp://127.0.0.1:7611 write robot-7 "The mug is on the table."
# or, with no node address, through etcd as the clients route:
#   build/bin/keepctl --etcd http://127.0.0.1:23790 --shards 16 list robot-7
# Not yet in cluster mode: the Redis KV tier; see docs/cluster.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dir=${KEEP_CLUSTER_DIR:-/tmp/keep-cluster}
bin=${KEEP_BIN_DIR:-${KEEP_BUILD_DIR:-build}/bin}
etcd_bin=${ETCD:-/usr/bin/etcd}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
lease_s=${KEEP_CLUSTER_LEASE_S:-5}
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
pg_port=25432

die() { echo "cluster.sh: $*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
  local n=${1:-2}
  [[ "$n" =~ ^[1-9]$ ]] || die "N must be 1..9"
  [ -x "$etcd_bin" ] || die "no etcd at $etcd_bin (bash deploy/install-deps.sh)"
  [ -x "$bin/keep-manager" ] || die "no $bin/keep-manager (build first)"
  [ -d "$dir" ] && die "$dir exists: scripts/cluster.sh down first"
  mkdir -p "$dir"
  local cluster="" urls=""
  for i in 0 1 2; do
    cluster+="${cluster:+,}e$i=http://127.0.0.1:$((23800 + i))"
    urls+="${urls:+,}http://127.0.0.1:$((23790 + i))"
  done
  for i in 0 1 2; do
    "$etcd_bin" --name "e$i" --data-dir "$dir/etcd$i" \
      --listen-client-urls "http://127.0.0.1:$((23790 + i))" \
      --advertise-client-urls "http://127.0.0.1:$((23790 + i))" \
      --listen-peer-urls "http://127.0.0.1:$((23800 + i))" \
      --initial-advertise-peer-urls "http://127.0.0.1:$((23800 + i))" \
      --initial-cluster "$cluster" >"$dir/etcd$i.log" 2>&1 &
    echo $! >"$dir/etcd$i.pid"
  done
  for _ in $(seq 100); do  # until the members have a leader
    curl -sf -X POST "http://127.0.0.1:23790/v3/kv/put" -d '{"key":"a2VlcA==","value":"MQ=="}' \
      >/dev/null && break
    sleep 0.2
  done
  echo "etcd: $urls"
  local pg=()
  if [ "${KEEP_CLUSTER_PG:-1}" = 1 ] && [ -x "$pg_bin/initdb" ]; then
    # PostgreSQL refuses to run as root: then as the postgres user (setpriv execs, so the pid
    # recorded is the postmaster's).
    local as=()
    mkdir -p "$dir/pg"
    if [ "$(id -u)" = 0 ]; then
      chown postgres: "$dir/pg"
      as=(setpriv --reuid=postgres --regid=postgres --init-groups --)
    fi
    "${as[@]}" "$pg_bin/initdb" -D "$dir/pg/data" --auth=trust -U postgres --no-sync \
      >"$dir/pg.log" 2>&1 || die "initdb failed: $dir/pg.log"
    "${as[@]}" "$pg_bin/postgres" -D "$dir/pg/data" -p "$pg_port" -k "$dir/pg" \
      -c listen_addresses=127.0.0.1 >>"$dir/pg.log" 2>&1 &
    echo $! >"$dir/pg.pid"
    for _ in $(seq 100); do "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port" && break; sleep 0.1; done
    "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port" || die "postgresql did not start: $dir/pg.log"
    pg=(--pg "host=127.0.0.1 port=$pg_port user=postgres dbname=postgres connect_timeout=5")
    echo "postgresql: 127.0.0.1:$pg_port (the agents' memory logs)"
  else
    echo "postgresql: not started (KEEP_CLUSTER_PG=0 or no /usr/lib/postgresql): routing only"
  fi
  for i in $(seq 1 "$n"); do
    local ep="tcp://127.0.0.1:$((7610 + i))" wep="tcp://127.0.0.1:$((7620 + i))"
    "$bin/keep-manager" --etcd "$urls" --node-id "node$i" --etcd-lease-s "$lease_s" \
      --shards 16 --endpoint "$ep" --metrics-listen "127.0.0.1:$((9470 + i))" \
      --data-dir "$dir/node$i" --shm-name "keep-cluster-$i" --shm-bytes 256MiB "${pg[@]}" \
      >"$dir/manager$i.log" 2>&1 &
    echo $! >"$dir/manager$i.pid"
    for _ in $(seq 150); do grep -q "serving on" "$dir/manager$i.log" && break; sleep 0.2; done
    grep -q "serving on" "$dir/manager$i.log" || die "node$i's manager did not start: $dir/manager$i.log"
    if [ "${KEEP_CLUSTER_WORKERS:-1}" = 1 ] && [ -x "$bin/keep-worker" ] && [ -f "$model" ]; then
      "$bin/keep-worker" --manager "$ep" --shm-name "keep-cluster-$i" --model "$model" \
        --endpoint "$wep" --metrics-listen "127.0.0.1:$((9480 + i))" >"$dir/worker$i.log" 2>&1 &
      echo $! >"$dir/worker$i.pid"
      wep=", worker $wep"
    else
      wep=""
    fi
    echo "node$i: manager $ep (metrics 127.0.0.1:$((9470 + i)))$wep"
  done
}

status() {
  [ -d "$dir" ] || die "not up"
  for m in "$dir"/manager*.pid; do
    local i=${m##*manager}; i=${i%.pid}
    if alive "$m"; then
      local owned
      owned=$(curl -sf "http://127.0.0.1:$((9470 + i))/metrics" |
        awk '/^keep_manager_cluster_shards_owned /{print $2}')
      echo "node$i: up, ${owned:-?} shards"
    else
      echo "node$i: down"
    fi
  done
}

kill_node() {
  local i=${1:?node number}
  alive "$dir/manager$i.pid" || die "node$i's manager is not running"
  kill -9 "$(cat "$dir/manager$i.pid")"
  echo "node$i's manager killed; its shards move within ${lease_s} s"
}

down() {
  [ -d "$dir" ] || return 0
  for p in "$dir"/worker*.pid "$dir"/manager*.pid "$dir"/etcd*.pid "$dir"/pg.pid; do
    [ -f "$p" ] && kill "$(cat "$p")" 2>/dev/null || true
  done
  sleep 1
  for p in "$dir"/*.pid; do
    [ -f "$p" ] && kill -9 "$(cat "$p")" 2>/dev/null || true
  done
  for s in /dev/shm/keep-cluster-*; do [ -e "$s" ] && rm -f "$s"; done
  rm -rf "$dir"
  echo "cluster down"
}

case "${1:-}" in
  up) up "${2:-2}" ;;
  status) status ;;
  kill) kill_node "${2:-}" ;;
  down) down ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
