#!/usr/bin/env bash
# scripts/cluster.sh as a person uses it: up with two nodes, the shards split 8/8, keepctl reaches
# an agent through either node and through etcd (--etcd, no node address), `kill 1` hands all
# node1's shards to node2 -- with their memories when PostgreSQL is installed -- and down removes
# everything. With PostgreSQL, the primary has a standby streaming synchronously
# (pg_stat_replication's sync_state = 'sync') and every acknowledged write is on the standby.
#
# With models/SmolLM2-135M-Instruct.Q4_1.gguf and keep-worker (else managers only), each node also
# runs a CPU keep-worker, and:
# - node1's worker answers a completion (keepctl complete) for an agent of each node: the other
#   node's agent is answered `moved` to node2's worker, which keepctl follows; every answer has the
#   agent's memories in its prompt (memory_tokens > 0);
# - with Redis (Debian's redis-server; KEEP_CLUSTER_REDIS=0 leaves it out) the workers share KV:
#   `status` says the Redis Cluster is ok with its three masters up, which refuse a client without
#   the password (the workers read it from its file); an example plan written to an
#   agent of node1 is computed and published by node1's worker, and the same plan written to an
#   agent of node2 is read from Redis by node2's worker (its keep_worker_kv_shared_total{result=
#   "hit"} goes up, no error);
# - `kill 1` kills node1's manager and worker (-9; lease 2 s): a completion for one of node1's
#   agents asked through node2's worker is answered again within 15 s of the kill (the time is
#   printed), with at least the memories its prompt held before the kill (with PostgreSQL; without
#   it node2 holds none of them and the answer is not_found);
# - `kill redis 0` (with Redis): status shows that master down, and a completion is still answered.
# Skipped (77) without etcd. 24 to 37 s with workers on a 2-core machine, about 20 s without.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[ -x /usr/bin/etcd ] || { echo "no etcd: skipped"; exit 77; }
KEEP_CLUSTER_DIR=$(mktemp -u /tmp/keep-cluster-test.XXXXXX)
export KEEP_CLUSTER_DIR KEEP_CLUSTER_LEASE_S=2 KEEP_BIN_DIR=${KEEP_BIN_DIR:-build/bin}
workers=0
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -x "$KEEP_BIN_DIR/keep-worker" ] && workers=1
export KEEP_CLUSTER_WORKERS=$workers
failover_bound_s=15  # a completion for a killed node's agent is answered again within this
trap 'scripts/cluster.sh down >/dev/null' EXIT
fail() { echo "FAIL: $*"; exit 1; }
k() { "$KEEP_BIN_DIR/keepctl" --endpoint "$1" "${@:2}"; }
kw() { "$KEEP_BIN_DIR/keepctl" --worker-endpoint "tcp://127.0.0.1:$1" "${@:2}"; }
ms_since() { echo $(((${EPOCHREALTIME/./} - ${1/./}) / 1000)); }  # ms from an $EPOCHREALTIME
shards() { scripts/cluster.sh status | awk -v n="node$1:" '$1 == n {print $3}'; }
metric() {  # metric HOST:PORT SERIES: that series' value in the /metrics there (0 when absent)
  curl -sf "http://$1/metrics" | awk -v s="$2" '$1 == s {v = $2} END {print v + 0}'
}
# complete WORKER_PORT AGENT [keepctl options]: one completion, its JSON answer on stdout.
complete() {
  kw "$1" --json "${@:3}" complete "$2" "Bring me the mug." --max-tokens 4 --method full_reuse
}
memory_tokens() { grep -o '"memory_tokens":[0-9]*' | cut -d: -f2; }
shared_hits() { metric "127.0.0.1:$((9480 + $1))" 'keep_worker_kv_shared_total{result="hit"}'; }
t_start=$SECONDS
up=$(scripts/cluster.sh up 2)
echo "$up"
. scripts/lib/cluster_services.sh
pg=0 redis=0
[ -f "$KEEP_CLUSTER_DIR/pg-primary.pid" ] && pg=1
[ -f "$KEEP_CLUSTER_DIR/redis0.pid" ] && redis=1
if [ "$pg" = 1 ]; then
  grep -q "pg_ctl promote" <<<"$up" || fail "no promotion hint"
  [ "$(keep_pg_psql 25432 "SELECT application_name || ' ' || state || ' ' || sync_state FROM pg_stat_replication")" = "keep_standby streaming sync" ] ||
    fail "no synchronous standby streaming"
  [ "$(keep_pg_psql 25433 "SELECT pg_is_in_recovery()")" = t ] || fail "25433 is no standby"
  grep -q "127.0.0.1:25432: primary, standbys: keep_standby streaming sync" \
    <<<"$(scripts/cluster.sh status)" || fail "status does not show the standby"
fi
if [ "$redis" = 1 ]; then
  status=$(scripts/cluster.sh status)
  grep -q "^redis cluster: ok$" <<<"$status" || fail "status does not show the Redis Cluster ok"
  [ "$(grep -cE "^redis[0-2] 127\.0\.0\.1:[0-9]+: up$" <<<"$status")" = 3 ] ||
    fail "status does not show three Redis masters up"
  # The masters require the password (the workers read it from its file): none is refused.
  grep -q NOAUTH <<<"$(/usr/bin/redis-cli -h 127.0.0.1 -p 26379 GET anything 2>&1)" ||
    fail "Redis answers without the password"
fi
for _ in $(seq 100); do [ "$(shards 1)" = 8 ] && [ "$(shards 2)" = 8 ] && break; sleep 0.2; done
scripts/cluster.sh status
[ "$(shards 1)" = 8 ] && [ "$(shards 2)" = 8 ] || fail "shards not split 8/8"
# Each agent's node: the one whose agent count (keep_manager_agents) its first write raises.
declare -A owner
writes=0
for i in 0 1 2 3 4 5; do
  before=$(metric 127.0.0.1:9471 keep_manager_agents)
  k tcp://127.0.0.1:7611 write "robot-$i" "The mug is on the table." >/dev/null
  writes=$((writes + 1))
  owner[robot-$i]=2
  if [ "$(metric 127.0.0.1:9471 keep_manager_agents)" -gt "$before" ]; then owner[robot-$i]=1; fi
done
for i in 0 1 2 3 4 5; do
  k tcp://127.0.0.1:7612 list "robot-$i" | grep -q "The mug is on the table." ||
    fail "robot-$i not reached through node2"
  "$KEEP_BIN_DIR/keepctl" --etcd http://127.0.0.1:23790 --shards 16 list "robot-$i" |
    grep -q "The mug is on the table." || fail "robot-$i not reached through etcd"
done
a1="" a2=""  # an agent of node1, one of node2
for i in 5 4 3 2 1 0; do
  if [ "${owner[robot-$i]}" = 1 ]; then a1=robot-$i; else a2=robot-$i; fi
done
[ -n "$a1" ] && [ -n "$a2" ] || fail "robot-0..5 are not spread over both nodes"
echo "node1 serves $a1, node2 serves $a2"

if [ "$workers" = 1 ]; then
  for w in 7621 7622; do
    for _ in $(seq 150); do
      kw "$w" --timeout-ms 1000 worker-ping >/dev/null 2>&1 && break
      sleep 0.2
    done
    kw "$w" worker-ping >/dev/null || fail "no worker at $w"
  done
  for a in "$a1" "$a2"; do  # a2's plan is answered moved by node1's worker, then by node2's
    answer=$(complete 7621 "$a") || fail "no completion for $a through node1's worker"
    [ "$(memory_tokens <<<"$answer")" -gt 0 ] || fail "$a's memories are not in its prompt"
    if [ "$a" = "$a1" ]; then a1_memory_tokens=$(memory_tokens <<<"$answer"); fi
  done
  if [ "$redis" = 1 ]; then
    # An example plan: KV worth sharing. node1's worker computes and publishes it; node2's
    # worker, given the same plan, reads it from Redis.
    plan="To make tea: boil the kettle, put a tea bag in the mug, pour the water."
    published() { metric 127.0.0.1:9481 'keep_worker_kv_shared_total{result="published"}'; }
    hits2=$(shared_hits 2)
    k tcp://127.0.0.1:7611 write "$a1" "$plan" --kind example_plan >/dev/null
    writes=$((writes + 1))
    for _ in $(seq 150); do [ "$(published)" -gt 0 ] && break; sleep 0.2; done
    [ "$(published)" -gt 0 ] || fail "node1's worker published no example plan to Redis"
    k tcp://127.0.0.1:7611 write "$a2" "$plan" --kind example_plan >/dev/null
    writes=$((writes + 1))
    for _ in $(seq 150); do [ "$(shared_hits 2)" -gt "$hits2" ] && break; sleep 0.2; done
    [ "$(shared_hits 2)" -gt "$hits2" ] || fail "node2's worker read nothing from Redis"
    for n in 1 2; do
      [ "$(metric "127.0.0.1:$((9480 + n))" 'keep_worker_kv_shared_total{result="error"}')" = 0 ] ||
        fail "node$n's worker counted Redis errors"
    done
    echo "node2's worker read node1's example plan from Redis: $(shared_hits 2) hit(s)"
  fi
fi

t_kill=$EPOCHREALTIME
scripts/cluster.sh kill 1
if [ "$workers" = 1 ]; then
  # node2's worker answers for a1 once node2 took a1's shard over; until then it answers moved to
  # node1's dead worker, where keepctl waits out its --timeout-ms: 3 s for the first try, more for
  # the next ones (node2's worker embeds a1's replayed memories and computes their KV then).
  answered_ms="" tries=0 bound_ms=$((failover_bound_s * 1000))
  while [ "$(ms_since "$t_kill")" -lt "$bound_ms" ]; do
    tries=$((tries + 1))
    try_ms=$((tries * 3000))
    left_ms=$((bound_ms - $(ms_since "$t_kill")))
    [ "$try_ms" -gt "$left_ms" ] && try_ms=$left_ms
    # Without PostgreSQL node2 takes the shard without a1's memories: it answers not_found.
    if answer=$(complete 7622 "$a1" --timeout-ms "$try_ms" 2>&1) ||
      { [ "$pg" = 0 ] && grep -q "not_found: unknown agent" <<<"$answer"; }; then
      answered_ms=$(ms_since "$t_kill")
      break
    fi
    sleep 0.2
  done
  [ -n "$answered_ms" ] && [ "$answered_ms" -lt "$bound_ms" ] ||
    fail "no completion for $a1 through node2's worker within $failover_bound_s s of the kill"
  echo "a completion for $a1 was answered through node2's worker $answered_ms ms after node1's" \
    "kill (try $tries)"
  if [ "$pg" = 1 ]; then  # at least what its prompt held before (an example plan may have come)
    [ "$(memory_tokens <<<"$answer")" -ge "$a1_memory_tokens" ] ||
      fail "$a1's memories are not in its prompt after the kill"
  fi
fi
for _ in $(seq 100); do [ "$(shards 2)" = 16 ] && break; sleep 0.2; done
[ "$(shards 2)" = 16 ] || fail "node2 did not take node1's shards"
k tcp://127.0.0.1:7612 write robot-0 "The cup is in the sink." >/dev/null
writes=$((writes + 1))
if [ "$pg" = 1 ]; then  # the memories moved with their shards
  for i in 0 1 2 3 4 5; do
    k tcp://127.0.0.1:7612 list "robot-$i" | grep -q "The mug is on the table." ||
      fail "robot-$i's memory lost in the failover"
  done
  # Every acknowledged write is on the standby: synchronous commit waited for it.
  [ "$(keep_pg_psql 25433 "SELECT count(*) FROM keep_log")" = "$writes" ] ||
    fail "the standby does not hold the $writes writes"
fi
if [ "$redis" = 1 ]; then
  scripts/cluster.sh kill redis 0
  grep -q "^redis0 127.0.0.1:26379: down$" <<<"$(scripts/cluster.sh status)" ||
    fail "status does not show redis0 down"
  if [ "$workers" = 1 ]; then  # losing Redis loses hits, never answers
    complete 7622 "$a2" >/dev/null || fail "no completion once a Redis master is gone"
  fi
fi
scripts/cluster.sh down
[ ! -d "$KEEP_CLUSTER_DIR" ] || fail "state left behind"
echo "cluster.sh: passed in $((SECONDS - t_start)) s" \
  "(workers: $workers, postgresql: $pg, redis: $redis)"
