#!/usr/bin/env bash
# KEEP's cluster mode on one machine, for a person to try (docs/cluster.md): a three-member etcd,
# a PostgreSQL primary holding the agents' memory logs and its synchronous standby, a Redis
# Cluster of three masters (the shared KV tier) and N nodes (keep-manager --pg, plus a keep-worker
# on the CPU or GPU with --kv-remote), all on 127.0.0.1.
#
#   scripts/cluster.sh up [N]        start (N nodes, default 2) and print their endpoints
#   scripts/cluster.sh status        shards each node serves (its /metrics), PostgreSQL's roles,
#                                    the Redis Cluster's state and each master up or down
#   scripts/cluster.sh kill I        kill -9 node I: its manager and its worker (its shards move
#                                    within the lease)
#   scripts/cluster.sh kill redis I  kill -9 Redis master I (0..2): the workers lose KV hits only
#   scripts/cluster.sh down          stop everything and remove the state
#
# State (pids, logs, data) lives in $KEEP_CLUSTER_DIR (default /tmp/keep-cluster);
# KEEP_CLUSTER_WORKERS=0 starts managers only; KEEP_CLUSTER_PG=0 (or no Debian postgresql) starts
# no PostgreSQL: the managers then route only, and a moved shard arrives without its memories;
# KEEP_CLUSTER_REDIS=0 (or no Debian redis-server, or no workers) starts no Redis: each worker
# computes all its KV itself. KEEP_CLUSTER_LEASE_S is the managers' --etcd-lease-s (default 5).
# The primary listens on 127.0.0.1:25432, the standby on 25433; `up` prints how to promote the
# standby by hand (docs/cluster.md, "PostgreSQL's availability"); the managers find whichever
# server takes writes. The Redis masters listen on 127.0.0.1:26379..26381 (their cluster bus on
# 26479..26481) and require the password `up` writes to $KEEP_CLUSTER_DIR/redis-password.
# keepctl follows `moved`, so any node's endpoint reaches every agent:
#   build/bin/keepctl --endpoint tcp://127.0.0.1:7611 write robot-7 "The mug is on the table."
# or, with no node address, through etcd as the clients route:
#   build/bin/keepctl --etcd http://127.0.0.1:23790 --shards 16 list robot-7
# and any node's worker plans for every agent (it answers `moved` to the owner's worker):
#   build/bin/keepctl --worker-endpoint tcp://127.0.0.1:7621 complete robot-7 "Bring the mug."
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dir=${KEEP_CLUSTER_DIR:-/tmp/keep-cluster}
bin=${KEEP_BIN_DIR:-${KEEP_BUILD_DIR:-build}/bin}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
lease_s=${KEEP_CLUSTER_LEASE_S:-5}
pg_port=25432 pg_standby_port=25433 redis_port=26379
# shellcheck source=scripts/lib/cluster_services.sh
. scripts/lib/cluster_services.sh
redis_password_file=$dir/redis-password
[ -f "$redis_password_file" ] && keep_redis_password_file=$redis_password_file

die() { echo "cluster.sh: $*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
  local n=${1:-2}
  [[ "$n" =~ ^[1-9]$ ]] || die "N must be 1..9"
  [ -x "$keep_etcd_bin" ] || die "no etcd at $keep_etcd_bin (bash deploy/install-deps.sh)"
  [ -x "$bin/keep-manager" ] || die "no $bin/keep-manager (build first)"
  [ -d "$dir" ] && die "$dir exists: scripts/cluster.sh down first"
  mkdir -p "$dir"
  keep_etcd_start "$dir" 23790 23800 || die "etcd did not start"
  local urls=$keep_etcd_urls
  echo "etcd: $urls"
  local pg=()
  if [ "${KEEP_CLUSTER_PG:-1}" = 1 ] && [ -x "$keep_pg_bin/initdb" ]; then
    keep_pg_start_pair "$dir" "$pg_port" "$pg_standby_port" || die "postgresql did not start"
    pg=(--pg "$keep_pg_conninfo")
    echo "postgresql: primary 127.0.0.1:$pg_port (the agents' memory logs), synchronous standby"
    echo "  127.0.0.1:$pg_standby_port (every commit waits for it); the managers reach both:"
    echo "  $keep_pg_conninfo"
    keep_pg_promote_hint "$dir"
  else
    echo "postgresql: not started (KEEP_CLUSTER_PG=0 or no /usr/lib/postgresql): routing only"
  fi
  local workers=0
  if [ "${KEEP_CLUSTER_WORKERS:-1}" = 1 ] && [ -x "$bin/keep-worker" ] && [ -f "$model" ]; then
    workers=1
  fi
  local kv=()
  if [ "$workers" = 0 ]; then
    echo "redis: not started (no keep-worker: KEEP_CLUSTER_WORKERS=0, or no $bin/keep-worker" \
      "or $model)"
  elif [ "${KEEP_CLUSTER_REDIS:-1}" = 1 ] && [ -x "$keep_redis_bin" ] &&
    [ -x "$keep_redis_cli_bin" ]; then
    # A password, as on real machines (docs/cluster.md): in a file only its owner reads, which
    # redis-server and keep-worker read; never on a command line.
    (umask 077 && head -c 18 /dev/urandom | base64 >"$redis_password_file")
    keep_redis_start "$dir" "$redis_port" "$redis_password_file" || die "redis did not start"
    kv=(--kv-remote "$keep_redis_url" --kv-remote-password-file "$redis_password_file")
    echo "redis: a cluster of three masters, $keep_redis_url (the workers' shared KV tier);"
    echo "  its password is in $redis_password_file (REDISCLI_AUTH=\$(cat FILE) redis-cli ...)"
  else
    echo "redis: not started (KEEP_CLUSTER_REDIS=0 or no /usr/bin/redis-server): no shared KV tier"
  fi
  for i in $(seq 1 "$n"); do
    local ep="tcp://127.0.0.1:$((7610 + i))" wep="tcp://127.0.0.1:$((7620 + i))"
    # The manager names its worker in etcd: a worker asked about another node's agent answers
    # moved with that node's worker, which the clients follow.
    local named=()
    [ "$workers" = 1 ] && named=(--advertise-worker "$wep")
    "$bin/keep-manager" --etcd "$urls" --node-id "node$i" --etcd-lease-s "$lease_s" \
      --shards 16 --endpoint "$ep" --metrics-listen "127.0.0.1:$((9470 + i))" "${named[@]}" \
      --data-dir "$dir/node$i" --shm-name "keep-cluster-$i" --shm-bytes 256MiB "${pg[@]}" \
      >"$dir/manager$i.log" 2>&1 &
    echo $! >"$dir/manager$i.pid"
    for _ in $(seq 150); do grep -q "serving on" "$dir/manager$i.log" && break; sleep 0.2; done
    grep -q "serving on" "$dir/manager$i.log" || die "node$i's manager did not start: $dir/manager$i.log"
    if [ "$workers" = 1 ]; then
      "$bin/keep-worker" --manager "$ep" --shm-name "keep-cluster-$i" --model "$model" \
        --endpoint "$wep" --metrics-listen "127.0.0.1:$((9480 + i))" "${kv[@]}" \
        >"$dir/worker$i.log" 2>&1 &
      echo $! >"$dir/worker$i.pid"
      wep=", worker $wep (metrics 127.0.0.1:$((9480 + i)))"
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
  local p
  for p in "$pg_port" "$pg_standby_port"; do
    [ -f "$dir/pg-primary.pid" ] || break
    if "$keep_pg_bin/pg_isready" -q -h 127.0.0.1 -p "$p"; then
      if [ "$(keep_pg_psql "$p" "SELECT pg_is_in_recovery()")" = t ]; then
        echo "postgresql 127.0.0.1:$p: standby"
      else
        echo "postgresql 127.0.0.1:$p: primary, standbys:" \
          "$(keep_pg_psql "$p" "SELECT coalesce(string_agg(application_name || ' ' || state || ' ' || sync_state, ', '), 'none') FROM pg_stat_replication")"
      fi
    else
      echo "postgresql 127.0.0.1:$p: down"
    fi
  done
  [ -f "$dir/redis0.pid" ] || return 0
  local i state=""
  for i in 0 1 2; do  # the cluster's state, as the first master still up sees it
    state=$(keep_redis_cli $((redis_port + i)) CLUSTER INFO 2>/dev/null |
      tr -d '\r' | awk -F: '$1 == "cluster_state" {print $2}' || true)
    [ -n "$state" ] && break
  done
  echo "redis cluster: ${state:-down}"
  for i in 0 1 2; do
    if keep_redis_cli $((redis_port + i)) PING 2>/dev/null | grep -q PONG; then
      echo "redis$i 127.0.0.1:$((redis_port + i)): up"
    else
      echo "redis$i 127.0.0.1:$((redis_port + i)): down"
    fi
  done
}

kill_node() {
  local i=${1:?node number} what="manager"
  alive "$dir/manager$i.pid" || die "node$i's manager is not running"
  kill -9 "$(cat "$dir/manager$i.pid")"
  if alive "$dir/worker$i.pid"; then
    kill -9 "$(cat "$dir/worker$i.pid")"
    what="manager and worker"
  fi
  echo "node$i's $what killed (-9); its shards move within ${lease_s} s"
}

kill_redis() {
  local i=${1:?redis master number}
  [[ "$i" =~ ^[0-2]$ ]] || die "redis master I must be 0..2"
  alive "$dir/redis$i.pid" || die "redis$i is not running"
  kill -9 "$(cat "$dir/redis$i.pid")"
  echo "redis$i (127.0.0.1:$((redis_port + i))) killed (-9); the workers lose KV hits, never"
  echo "  answers: they compute what they would have read"
}

down() {
  [ -d "$dir" ] || return 0
  for p in "$dir"/worker*.pid "$dir"/manager*.pid "$dir"/etcd*.pid "$dir"/pg-*.pid \
    "$dir"/redis*.pid; do
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
  kill) if [ "${2:-}" = redis ]; then kill_redis "${3:-}"; else kill_node "${2:-}"; fi ;;
  down) down ;;
  *) sed -n '2,29p' "$0"; exit 2 ;;
esac
