#!/usr/bin/env bash
# scripts/cluster.sh as a person uses it (managers only): up with two nodes, the shards split,
# keepctl reaches an agent through either node and through etcd (--etcd, no node address), a node killed hands all shards to the other --
# with their memories when PostgreSQL is installed -- down removes everything. With PostgreSQL,
# the primary has a standby streaming synchronously (pg_stat_replication's sync_state = 'sync') and
# every acknowledged write is on the standby. Skipped (77) without etcd.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[ -x /usr/bin/etcd ] || { echo "no etcd: skipped"; exit 77; }
export KEEP_CLUSTER_DIR=$(mktemp -u /tmp/keep-cluster-test.XXXXXX) KEEP_CLUSTER_WORKERS=0
export KEEP_CLUSTER_LEASE_S=2 KEEP_BIN_DIR=${KEEP_BIN_DIR:-build/bin}
trap 'scripts/cluster.sh down >/dev/null' EXIT
k() { "$KEEP_BIN_DIR/keepctl" --endpoint "$1" "${@:2}"; }
shards() { scripts/cluster.sh status | awk -v n="node$1:" '$1 == n {print $3}'; }
up=$(scripts/cluster.sh up 2)
echo "$up"
. scripts/lib/cluster_services.sh
if [ -f "$KEEP_CLUSTER_DIR/pg-primary.pid" ]; then
  grep -q "pg_ctl promote" <<<"$up" || { echo "FAIL: no promotion hint"; exit 1; }
  [ "$(keep_pg_psql 25432 "SELECT application_name || ' ' || state || ' ' || sync_state FROM pg_stat_replication")" = "keep_standby streaming sync" ] ||
    { echo "FAIL: no synchronous standby streaming"; exit 1; }
  [ "$(keep_pg_psql 25433 "SELECT pg_is_in_recovery()")" = t ] || { echo "FAIL: 25433 is no standby"; exit 1; }
  grep -q "127.0.0.1:25432: primary, standbys: keep_standby streaming sync" \
    <<<"$(scripts/cluster.sh status)" ||
    { echo "FAIL: status does not show the standby"; exit 1; }
fi
for _ in $(seq 100); do [ "$(shards 1)" = 8 ] && [ "$(shards 2)" = 8 ] && break; sleep 0.2; done
scripts/cluster.sh status
[ "$(shards 1)" = 8 ] && [ "$(shards 2)" = 8 ] || { echo "FAIL: shards not split 8/8"; exit 1; }
for i in 0 1 2 3 4 5; do k tcp://127.0.0.1:7611 write "robot-$i" "The mug is on the table." >/dev/null; done
for i in 0 1 2 3 4 5; do
  k tcp://127.0.0.1:7612 list "robot-$i" | grep -q "The mug is on the table." ||
    { echo "FAIL: robot-$i not reached through node2"; exit 1; }
  "$KEEP_BIN_DIR/keepctl" --etcd http://127.0.0.1:23790 --shards 16 list "robot-$i" |
    grep -q "The mug is on the table." || { echo "FAIL: robot-$i not reached through etcd"; exit 1; }
done
scripts/cluster.sh kill 1
for _ in $(seq 100); do [ "$(shards 2)" = 16 ] && break; sleep 0.2; done
[ "$(shards 2)" = 16 ] || { echo "FAIL: node2 did not take node1's shards"; exit 1; }
k tcp://127.0.0.1:7612 write robot-0 "The cup is in the sink." >/dev/null
if [ -f "$KEEP_CLUSTER_DIR/pg-primary.pid" ]; then  # the memories moved with their shards
  for i in 0 1 2 3 4 5; do
    k tcp://127.0.0.1:7612 list "robot-$i" | grep -q "The mug is on the table." ||
      { echo "FAIL: robot-$i's memory lost in the failover"; exit 1; }
  done
  # Every acknowledged write (7) is on the standby: synchronous commit waited for it.
  [ "$(keep_pg_psql 25433 "SELECT count(*) FROM keep_log")" = 7 ] ||
    { echo "FAIL: the standby does not hold the 7 writes"; exit 1; }
fi
scripts/cluster.sh down
[ ! -d "$KEEP_CLUSTER_DIR" ] || { echo "FAIL: state left behind"; exit 1; }
echo "cluster.sh: passed"
