# shellcheck shell=bash
# Sourced, not run: the services under KEEP's cluster mode on one machine, started the same way
# by scripts/cluster.sh (for a person to try) and benchmarks/cluster/bench_cluster.sh.
#
#   keep_etcd_start DIR CLIENT_PORT PEER_PORT
#       a three-member etcd on loopback: member i listens for clients on CLIENT_PORT + i and for
#       peers on PEER_PORT + i; data DIR/etcdI, logs DIR/etcdI.log, pids DIR/etcdI.pid. Returns
#       once the members have a leader (a put succeeds). Sets keep_etcd_urls (comma-separated).
#   keep_pg_start_pair DIR PRIMARY_PORT STANDBY_PORT
#       a PostgreSQL primary (DIR/pg/primary) and a streaming-replication standby of it
#       (DIR/pg/standby: pg_basebackup -R), the primary waiting for the standby at every commit
#       (synchronous_standby_names = keep_standby, synchronous_commit = on). Logs DIR/pg-primary.log
#       and DIR/pg-standby.log, pids DIR/pg-primary.pid and DIR/pg-standby.pid (the postmasters).
#       Returns once pg_stat_replication says sync. Sets keep_pg_conninfo (libpq's URI form,
#       both servers, the one taking writes chosen) and keep_pg_as (the command prefix running a
#       PostgreSQL program as the postgres user when root: it refuses to run as root).
#   keep_pg_psql PORT SQL...
#       one query's rows, unaligned (psql -Atq as postgres).
#   keep_pg_promote_hint DIR
#       how to promote the standby by hand (docs/cluster.md, "PostgreSQL's availability").
#   keep_redis_start DIR PORT [PASSWORD_FILE]
#       a Redis Cluster of three masters on loopback, configured as tests/integration/
#       redis_cluster.h starts one (cluster mode, no persistence, no replicas,
#       cluster-node-timeout 2000 ms): master i listens on PORT + i, its cluster bus on
#       PORT + i + 100 (not Redis's + 10000: from 26379 that lands in Linux's ephemeral range,
#       32768-60999, where another program's outgoing connection can hold it); data DIR/redisI,
#       logs DIR/redisI.log, pids DIR/redisI.pid. With
#       PASSWORD_FILE (keep-worker's --kv-remote-password-file), every master requires the
#       password on its first line (requirepass, masterauth). Made one cluster by
#       `redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes`; returns once every
#       master says cluster_state:ok. Sets keep_redis_url (keep-worker's --kv-remote:
#       redis://127.0.0.1:PORT,127.0.0.1:PORT+1,127.0.0.1:PORT+2).
#   keep_redis_cli PORT ARGS...
#       one redis-cli command against the master on PORT (with the password of the last
#       keep_redis_start, or of $keep_redis_password_file when set).
#
# Needs Debian's etcd-server (ETCD overrides /usr/bin/etcd), postgresql and redis-server.

keep_etcd_bin=${ETCD:-/usr/bin/etcd}
keep_pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
keep_redis_bin=/usr/bin/redis-server
keep_redis_cli_bin=/usr/bin/redis-cli
keep_pg_as=()
[ "$(id -u)" = 0 ] && keep_pg_as=(setpriv --reuid=postgres --regid=postgres --init-groups --)

keep_etcd_start() {
  local dir=$1 client=$2 peer=$3 cluster="" i
  keep_etcd_urls=""
  for i in 0 1 2; do
    cluster+="${cluster:+,}e$i=http://127.0.0.1:$((peer + i))"
    keep_etcd_urls+="${keep_etcd_urls:+,}http://127.0.0.1:$((client + i))"
  done
  for i in 0 1 2; do
    "$keep_etcd_bin" --name "e$i" --data-dir "$dir/etcd$i" \
      --listen-client-urls "http://127.0.0.1:$((client + i))" \
      --advertise-client-urls "http://127.0.0.1:$((client + i))" \
      --listen-peer-urls "http://127.0.0.1:$((peer + i))" \
      --initial-advertise-peer-urls "http://127.0.0.1:$((peer + i))" \
      --initial-cluster "$cluster" >"$dir/etcd$i.log" 2>&1 &
    echo $! >"$dir/etcd$i.pid"
  done
  for _ in $(seq 100); do  # until the members have a leader
    curl -sf -X POST "http://127.0.0.1:$client/v3/kv/put" -d '{"key":"a2VlcA==","value":"MQ=="}' \
      >/dev/null && return 0
    sleep 0.2
  done
  echo "etcd has no leader: $dir/etcd0.log" >&2
  return 1
}

keep_pg_psql() {
  local port=$1
  shift
  "$keep_pg_bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -Atq -c "$*"
}

keep_pg_wait_ready() {
  for _ in $(seq 100); do "$keep_pg_bin/pg_isready" -q -h 127.0.0.1 -p "$1" && return 0; sleep 0.1; done
  return 1
}

keep_pg_start_pair() {
  local dir=$1 p1=$2 p2=$3
  mkdir -p "$dir/pg"
  # The postgres user reaches its directories below DIR.
  chmod 755 "$dir"
  [ "$(id -u)" = 0 ] && chown postgres: "$dir/pg"
  "${keep_pg_as[@]}" "$keep_pg_bin/initdb" -D "$dir/pg/primary" --auth=trust -U postgres \
    --no-sync >"$dir/pg-primary.log" 2>&1 ||
    { echo "initdb failed: $dir/pg-primary.log" >&2; return 1; }
  # setpriv execs, so $! is the postmaster.
  "${keep_pg_as[@]}" "$keep_pg_bin/postgres" -D "$dir/pg/primary" -p "$p1" -k "$dir/pg" \
    -c listen_addresses=127.0.0.1 -c synchronous_standby_names=keep_standby \
    -c synchronous_commit=on >>"$dir/pg-primary.log" 2>&1 &
  echo $! >"$dir/pg-primary.pid"
  keep_pg_wait_ready "$p1" || { echo "postgresql did not start: $dir/pg-primary.log" >&2; return 1; }
  "${keep_pg_as[@]}" "$keep_pg_bin/pg_basebackup" -D "$dir/pg/standby" -h 127.0.0.1 -p "$p1" \
    -U postgres -R -X stream -c fast >"$dir/pg-standby.log" 2>&1 ||
    { echo "pg_basebackup failed: $dir/pg-standby.log" >&2; return 1; }
  "${keep_pg_as[@]}" "$keep_pg_bin/postgres" -D "$dir/pg/standby" -p "$p2" -k "$dir/pg" \
    -c listen_addresses=127.0.0.1 -c cluster_name=keep_standby >>"$dir/pg-standby.log" 2>&1 &
  echo $! >"$dir/pg-standby.pid"
  for _ in $(seq 100); do
    [ "$(keep_pg_psql "$p1" "SELECT sync_state FROM pg_stat_replication" 2>/dev/null)" = sync ] &&
      break
    sleep 0.1
  done
  [ "$(keep_pg_psql "$p1" "SELECT sync_state FROM pg_stat_replication")" = sync ] ||
    { echo "no synchronous standby: $dir/pg-standby.log" >&2; return 1; }
  keep_pg_conninfo="postgresql://postgres@127.0.0.1:$p1,127.0.0.1:$p2/postgres?target_session_attrs=read-write&connect_timeout=5"
}

keep_pg_promote_hint() {
  local as=""
  [ "$(id -u)" = 0 ] && as="setpriv --reuid=postgres --regid=postgres --init-groups -- "
  echo "  promote the standby once the primary is gone for good (docs/cluster.md, \"PostgreSQL's"
  echo "  availability\"): kill -9 \$(cat $1/pg-primary.pid); ${as}$keep_pg_bin/pg_ctl promote -w -D $1/pg/standby"
}

keep_redis_cli() {
  local port=$1 auth=()
  shift
  # REDISCLI_AUTH: redis-cli's password without it showing in the process list.
  [ -n "${keep_redis_password_file:-}" ] &&
    auth=(env "REDISCLI_AUTH=$(head -n 1 "$keep_redis_password_file")")
  "${auth[@]}" "$keep_redis_cli_bin" -h 127.0.0.1 -p "$port" "$@"
}

keep_redis_start() {
  local dir=$1 port=$2 i p masters=() auth=()
  keep_redis_password_file=${3:-}
  keep_redis_url=""
  if [ -n "$keep_redis_password_file" ]; then
    # A config file on stdin ("-"), so that the password is not in the process list either.
    local pw
    pw=$(head -n 1 "$keep_redis_password_file")
    auth=(-)
  fi
  for i in 0 1 2; do
    p=$((port + i))
    mkdir -p "$dir/redis$i"
    if [ ${#auth[@]} -gt 0 ]; then
      printf 'requirepass "%s"\nmasterauth "%s"\n' "$pw" "$pw"
    fi | "$keep_redis_bin" "${auth[@]}" --port "$p" --bind 127.0.0.1 --dir "$dir/redis$i" \
      --cluster-port $((p + 100)) --cluster-enabled yes --cluster-config-file "$dir/redis$i/nodes.conf" \
      --cluster-node-timeout 2000 --save "" --appendonly no --daemonize no \
      >"$dir/redis$i.log" 2>&1 &
    echo $! >"$dir/redis$i.pid"
    masters+=("127.0.0.1:$p")
    keep_redis_url+="${keep_redis_url:+,}127.0.0.1:$p"
  done
  keep_redis_url="redis://$keep_redis_url"
  for i in 0 1 2; do
    for _ in $(seq 100); do
      keep_redis_cli $((port + i)) PING 2>/dev/null | grep -q PONG && break
      sleep 0.1
    done
  done
  keep_redis_cli "$port" --cluster create "${masters[@]}" --cluster-replicas 0 --cluster-yes \
    >"$dir/redis-create.log" 2>&1 ||
    { echo "redis-cli --cluster create failed: $dir/redis-create.log" >&2; return 1; }
  for i in 0 1 2; do
    for _ in $(seq 100); do
      keep_redis_cli $((port + i)) CLUSTER INFO | grep -q "^cluster_state:ok" && break
      sleep 0.1
    done
    keep_redis_cli $((port + i)) CLUSTER INFO | grep -q "^cluster_state:ok" ||
      { echo "redis cluster not ok on 127.0.0.1:$((port + i)): $dir/redis$i.log" >&2; return 1; }
  done
}
