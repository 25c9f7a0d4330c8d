"""ManagerClient in cluster mode: two real keep-manager processes on a real etcd split the agents'
shards; a client connected to one of them reaches every agent, following `moved` answers to the
node that serves it (docs/cluster.md). With the memories in a real PostgreSQL, a client that is
not recreated reaches its agents again after kill -9 of their node; the writes whose answers died
with it are sent again with their request ids, so every write is acknowledged and there exactly
once; a plan sent to a killed node's worker is sent again by WorkerClient, within the call, to
the node that took the agent over. Skipped without Debian's etcd-server (and postgresql).
"""
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import unittest

from keep_client import ManagerClient, WorkerClient, errors
from keep_client.cluster import EtcdDirectory, shard_of
from keep_client.local import LocalServices, free_port

ETCD = "/usr/bin/etcd"
# initdb and postgres, newest major version first (as tests/integration/pg_server.h looks).
PG_BIN = next((f"/usr/lib/postgresql/{v}/bin" for v in ("17", "16", "15", "14", "13")
               if os.path.exists(f"/usr/lib/postgresql/{v}/bin/initdb")), None)


def start_etcd(tmp):
    """One etcd member on free loopback ports: (process, client URL)."""
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [ETCD, "--name", "m0", "--data-dir", os.path.join(tmp, "m0"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"m0=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, url


def start_manager(flags, deadline_s=30):
    """A keep-manager with `flags`, once etcd has elected itself (it refuses to start before)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return LocalServices(worker=False, extra_manager=flags)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Postgres:
    """A PostgreSQL server in a temp dir on a free loopback port (initdb; as the postgres user
    when we are root, which PostgreSQL refuses); killed by close()."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="keep_pg_")
        as_user = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            as_user = ["/usr/bin/setpriv", "--reuid=postgres", "--regid=postgres",
                       "--init-groups", "--"]
        data = os.path.join(self.dir, "data")
        subprocess.run(as_user + [f"{PG_BIN}/initdb", "-D", data, "--auth=trust", "-U", "postgres",
                                  "--no-sync"], check=True, capture_output=True)
        self.port = free_port()
        self.proc = subprocess.Popen(
            as_user + [f"{PG_BIN}/postgres", "-D", data, "-p", str(self.port), "-k", self.dir,
                       "-c", "listen_addresses=127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.conninfo = (f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres "
                         "connect_timeout=5")
        for _ in range(300):
            ready = subprocess.run([f"{PG_BIN}/pg_isready", "-q", "-h", "127.0.0.1", "-p",
                                    str(self.port)])
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        self.close()
        raise RuntimeError("postgresql did not start")

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class TwoNodes(unittest.TestCase):
    """Two nodes (a, b) on one etcd, started by setUpClass in cls.tmp; stopped here."""

    @classmethod
    def tearDownClass(cls):
        cls.b.close()
        cls.a.close()
        cls.etcd.kill()
        cls.etcd.wait()
        shutil.rmtree(cls.tmp, ignore_errors=True)


@unittest.skipUnless(os.access(ETCD, os.X_OK), "no etcd-server")
class FollowsMoved(TwoNodes):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="keep_cluster_")
        cls.etcd, cls.url = start_etcd(cls.tmp)
        flags = lambda node: ["--etcd", cls.url, "--node-id", node, "--shards", "8",
                              "--etcd-lease-s", "2"]
        cls.a = start_manager(flags("a"))
        cls.b = LocalServices(worker=False, extra_manager=flags("b"))

    def test_every_agent_is_reached_through_one_node(self):
        agents = [f"robot-{i}" for i in range(24)]
        with ManagerClient(self.a.manager.endpoint, timeout=10) as m, \
                ManagerClient(self.a.manager.endpoint, timeout=10, follow_moved=False) as plain:
            deadline = time.monotonic() + 20
            while True:  # until a has handed b its share: some agent answers moved
                try:
                    for agent in agents:
                        plain.list_memories(agent)
                except (errors.NotFoundError, errors.UnavailableError):
                    pass  # unknown agent (ours), or a shard between owners
                except errors.MovedError as e:
                    self.assertIn(f"served by b at {self.b.manager.endpoint}", e.message)
                    self.assertEqual(e.value, 16)
                    break
                if time.monotonic() > deadline:
                    self.fail("b never got a shard")
                time.sleep(0.3)
            for agent in agents:
                w = m.write(agent, f"The mug of {agent} is on the table.")
                self.assertGreater(w.id, 0)
            on_b = [a for a, ep in m._routes.owners.items() if ep == self.b.manager.endpoint]
            self.assertTrue(on_b)
            for agent in agents:  # read back through the same client, wherever it lives
                mems, _ = m.list_memories(agent)
                self.assertEqual([x.text for x in mems], [f"The mug of {agent} is on the table."])
            with ManagerClient(self.b.manager.endpoint, timeout=10) as mb:
                mems, _ = mb.list_memories(on_b[0])  # b holds it itself
                self.assertEqual(len(mems), 1)
            # The etcd directory names the node each agent was found at by following moved:
            # the same hash and the same keys as keep-manager's placement.
            d = EtcdDirectory([self.url], shards=8)
            for agent in agents:
                self.assertEqual(d.owner_endpoint(agent),
                                 m._routes.owners.get(agent, self.a.manager.endpoint), agent)
            # A client that asks the directory first sends no request to the wrong node.
            with ManagerClient(self.a.manager.endpoint, timeout=10, follow_moved=False,
                               directory=d) as direct:
                for agent in agents:
                    mems, _ = direct.list_memories(agent)
                    self.assertEqual(len(mems), 1)
                self.assertEqual(direct.moved_answers, 0)
            self.assertGreater(m.moved_answers, 0)  # the control: m found b's agents by moved


class PgNodes(unittest.TestCase):
    """Two nodes (a, b) with their memories in PostgreSQL, on one etcd, started by setUp in
    self.tmp; stopped here."""

    def tearDown(self):
        self.a.close()
        self.b.close()
        self.etcd.kill()
        self.etcd.wait()
        self.pg.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@unittest.skipUnless(os.access(ETCD, os.X_OK) and PG_BIN, "no etcd-server or postgresql")
class FailsOver(PgNodes):
    """Two managers with their memories in PostgreSQL (lease 2 s); the node serving some agents
    is killed -9 while three clients, made once, write to every agent: one finds nodes by
    `moved`, two in etcd, one of those configured with the node that dies (etcd names it until
    its lease runs out: the client asks again). All reach the killed node's agents again once the
    survivor took their shards over; a write in flight at the kill is sent again with its request
    id, so every write is acknowledged, and is there exactly once."""

    LEASE_S = 2
    BOUND_S = LEASE_S + 8  # the survivor's takeover on a loaded machine

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="keep_failover_")
        self.pg = Postgres()
        self.etcd, url = start_etcd(self.tmp)
        flags = lambda node: ["--etcd", url, "--node-id", node, "--shards", "8",
                              "--etcd-lease-s", str(self.LEASE_S), "--pg", self.pg.conninfo]
        self.b = start_manager(flags("b"))
        self.a = LocalServices(worker=False, extra_manager=flags("a"))
        self.directory = EtcdDirectory([url], shards=8)

    def owners(self):
        """shard -> node name, as etcd says now."""
        out = {}
        for shard in range(8):
            owner = self.directory._get(f"/keep/shards/{shard}/owner")
            if owner:
                out[shard] = owner.rsplit(" ", 1)[0]
        return out

    def test_a_client_not_recreated_reaches_its_agents_after_kill_9(self):
        deadline = time.monotonic() + 20
        while sorted(self.owners().values()) != ["a"] * 4 + ["b"] * 4:  # b hands a its half
            self.assertLess(time.monotonic(), deadline, "the shards were never split")
            time.sleep(0.2)
        a_ep, b_ep = self.a.manager.endpoint, self.b.manager.endpoint
        agents = [f"robot-{i}" for i in range(16)]
        on_a = {ag for ag in agents if self.directory.owner_endpoint(ag) == a_ep}
        self.assertTrue(on_a)
        # Made once for the whole test: two configured with b's endpoint, one with a's.
        clients = [ManagerClient(b_ep, timeout=1.0),
                   ManagerClient(b_ep, timeout=1.0, directory=self.directory),
                   ManagerClient(a_ep, timeout=1.0, directory=self.directory)]
        acked, unknown, refused = set(), set(), set()
        back = [{}, {}, {}]  # per client: agent of a -> seconds from the kill to its first ok write
        killed_at = None
        n = 0
        while True:
            if killed_at is None and n == 3:  # a few rounds through both nodes, then a dies
                self.a.manager.kill9()
                killed_at = time.monotonic()
            if killed_at is not None and (
                    all(len(b) == len(on_a) for b in back)
                    or time.monotonic() - killed_at > self.BOUND_S + 2):
                break
            for agent in agents:
                # The client configured with a first: it meets a dead while etcd still names a.
                for w, m in reversed(list(enumerate(clients))):
                    text = f"{agent} memory {n} of client {w}"
                    try:
                        m.write(agent, text)
                    except (errors.RequestTimeoutError, errors.UnavailableError) as e:
                        unknown.add(f"{text}: {e}")  # the client gave up resending it
                        continue
                    except errors.MovedError:
                        refused.add(text)  # routed away: nothing applied
                        continue
                    acked.add(text)
                    if killed_at is not None and agent in on_a:
                        back[w].setdefault(agent, time.monotonic() - killed_at)
            n += 1
        for w, name in enumerate(("moved only", "etcd directory", "etcd directory, a's endpoint")):
            self.assertEqual(set(back[w]), on_a, f"client {w} ({name}) did not reach them all")
            last = max(back[w].values())
            print(f"\nclient {w} ({name}): the {len(on_a)} agents of the killed node were written "
                  f"again within {last:.2f} s of the kill (lease {self.LEASE_S} s); "
                  f"{clients[w].moved_answers} moved answers, {clients[w].mutations_resent} "
                  f"writes resent after their answer was lost", flush=True)
            self.assertLess(last, self.BOUND_S)
        self.assertGreater(clients[0].moved_answers, 0)

        # Read back through the first client, still the one made before the kill.
        seen = {}
        for agent in agents:
            after = 0
            while True:
                mems, more = clients[0].list_memories(agent, after, 1000)
                for x in mems:
                    seen[x.text] = seen.get(x.text, 0) + 1
                    after = x.id
                if not more:
                    break
        # Every write acknowledged (those in flight at the kill resent), each there once.
        self.assertEqual(unknown, set())
        self.assertEqual(refused, set())
        self.assertGreater(sum(m.mutations_resent for m in clients), 0)
        for t in acked:
            self.assertEqual(seen.get(t, 0), 1, t)
        self.assertEqual(set(seen), acked)
        self.assertGreater(len(acked), 50)
        print(f"{len(acked)} writes acknowledged, all there once", flush=True)
        for m in clients:
            m.close()


@unittest.skipUnless(os.access(ETCD, os.X_OK), "no etcd-server")
class WorkerFollowsMoved(TwoNodes):
    """Two nodes of keep-manager + keep-worker (CPU) on etcd. A worker plans only for its own
    node's agents (their KV is in its node's region) and answers `moved` for another node's,
    naming that node's worker when its manager registered one (--advertise-worker, node a here;
    b names none). WorkerClient follows it, or asks the etcd directory first."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="keep_wcluster_")
        cls.etcd, cls.url = start_etcd(cls.tmp)
        cls.worker_a = f"tcp://127.0.0.1:{free_port()}"
        flags = lambda node: ["--etcd", cls.url, "--node-id", node, "--shards", "4",
                              "--etcd-lease-s", "2"]
        deadline = time.monotonic() + 30
        while True:  # once etcd has elected itself
            try:
                cls.a = LocalServices(worker=True,
                                      extra_manager=flags("a") + ["--advertise-worker",
                                                                  cls.worker_a],
                                      extra_worker=["--endpoint", cls.worker_a])
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        cls.b = LocalServices(worker=True, extra_manager=flags("b"))
        cls.directory = EtcdDirectory([cls.url], shards=4)

    def test_a_plan_goes_to_the_owners_worker(self):
        a_ep, b_ep = self.a.manager.endpoint, self.b.manager.endpoint
        self.assertEqual(self.a.worker.endpoint, self.worker_a)
        deadline = time.monotonic() + 20
        while True:  # until each node serves its half
            owners = [self.directory.owner_endpoint(f"robot-{i}") for i in range(32)]
            x = next((f"robot-{i}" for i, ep in enumerate(owners) if ep == a_ep), None)
            y = next((f"robot-{i}" for i, ep in enumerate(owners) if ep == b_ep), None)
            if x and y:
                break
            self.assertLess(time.monotonic(), deadline, "the shards were never split")
            time.sleep(0.2)
        with ManagerClient(b_ep, timeout=10) as m:
            m.write(x, "The red mug is on the kitchen counter.")
            m.write(y, "The milk is in the fridge.")
        ask = dict(instruction="Where is the mug?", method="full", max_tokens=8)
        with WorkerClient(self.a.worker.endpoint, timeout=60, follow_moved=False) as wa, \
                WorkerClient(self.b.worker.endpoint, timeout=60, follow_moved=False) as plain, \
                WorkerClient(self.b.worker.endpoint, timeout=60) as follow, \
                WorkerClient(self.b.worker.endpoint, timeout=60,
                             directory=self.directory) as direct:
            owner = wa.complete(x, **ask)
            with self.assertRaises(errors.MovedError) as moved:
                plain.complete(x, **ask)
            self.assertEqual(errors.moved_target(moved.exception.message), self.worker_a)
            self.assertIn("served by a at", moved.exception.message)
            for _ in range(2):  # followed, then remembered
                self.assertEqual(follow.complete(x, **ask).tokens, owner.tokens)
            self.assertEqual(follow.moved_answers, 1)
            # b named no worker: a's worker answers moved for y with nothing to follow.
            with WorkerClient(self.a.worker.endpoint, timeout=60) as wa_follow, \
                    self.assertRaises(errors.MovedError) as unknown:
                wa_follow.complete(y, **ask)
            self.assertIsNone(errors.moved_target(unknown.exception.message))
            self.assertIn("whose keep-worker", unknown.exception.message)
            # The directory names x's worker at once; y's owner named none: b's own worker.
            self.assertEqual(self.directory.worker_endpoint(x), self.worker_a)
            self.assertIsNone(self.directory.worker_endpoint(y))
            self.assertEqual(direct.complete(x, **ask).tokens, owner.tokens)
            direct.complete(y, **ask)
            self.assertEqual(direct.moved_answers, 0)


@unittest.skipUnless(os.access(ETCD, os.X_OK) and PG_BIN, "no etcd-server or postgresql")
class WorkerFailsOver(PgNodes):
    """Two nodes of keep-manager + keep-worker (CPU), the memories in PostgreSQL (lease 2 s). A
    planner's WorkerClient, made once, remembers node a's worker for a's robot; a's manager and
    worker are killed -9. The next plan for the robot gets no answer from a's worker within its
    timeout, and the client sends it again, within the same call, through b's worker (which
    answers moved, naming a, until b took the robot's shard over, then plans): the call returns
    a plan over the robot's memories, not an error."""

    LEASE_S = 2
    TIMEOUT_S = 4.0

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="keep_wfailover_")
        self.pg = Postgres()
        self.etcd, url = start_etcd(self.tmp)
        self.worker_ep = {n: f"tcp://127.0.0.1:{free_port()}" for n in ("a", "b")}
        flags = lambda node: ["--etcd", url, "--node-id", node, "--shards", "4",
                              "--etcd-lease-s", str(self.LEASE_S), "--pg", self.pg.conninfo,
                              "--advertise-worker", self.worker_ep[node]]
        deadline = time.monotonic() + 30
        while True:  # once etcd has elected itself
            try:
                self.b = LocalServices(extra_manager=flags("b"),
                                       extra_worker=["--endpoint", self.worker_ep["b"]])
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.a = LocalServices(extra_manager=flags("a"),
                               extra_worker=["--endpoint", self.worker_ep["a"]])
        self.directory = EtcdDirectory([url], shards=4)

    def test_a_plan_in_flight_to_a_dead_worker_is_answered_by_the_survivor(self):
        a_ep = self.a.manager.endpoint
        deadline = time.monotonic() + 20
        x = None
        while x is None:  # until b handed a its half
            x = next((f"robot-{i}" for i in range(32)
                      if self.directory.owner_endpoint(f"robot-{i}") == a_ep), None)
            self.assertLess(time.monotonic(), deadline, "the shards were never split")
            time.sleep(0.2)
        with ManagerClient(self.b.manager.endpoint, timeout=10) as m:
            m.write(x, "The red mug is on the kitchen counter.")
        ask = dict(instruction="Where is the mug?", method="full_reuse", max_tokens=1)
        with WorkerClient(self.worker_ep["b"], timeout=self.TIMEOUT_S) as planner:
            before = planner.complete(x, **ask)
            self.assertEqual(planner.moved_answers, 1)  # a's worker, remembered
            self.a.worker.kill9()
            self.a.manager.kill9()
            killed_at = time.monotonic()
            after = planner.complete(x, **ask)  # sent to a's worker: no answer, then b's
            took = time.monotonic() - killed_at
            print(f"\na plan sent to the killed node's worker was answered by the survivor "
                  f"{took:.2f} s after the kill, in the same call (timeout {self.TIMEOUT_S} s, "
                  f"lease {self.LEASE_S} s)", flush=True)
            self.assertEqual(planner.calls_resent, 1)
            self.assertEqual(after.stats.segments, before.stats.segments)  # the robot's memory
            self.assertLess(took, self.TIMEOUT_S + self.LEASE_S + 6)


class ShardHash(unittest.TestCase):
    def test_spread_and_stability(self):
        counts = [0] * 64
        moved = 0
        for i in range(6400):
            s = shard_of(f"robot-{i}", 64)
            counts[s] += 1
            if shard_of(f"robot-{i}", 65) != s:
                moved += 1
        self.assertTrue(all(60 < c < 140 for c in counts), counts)
        self.assertLess(moved, 6400 // 40)
        self.assertEqual(shard_of("anyone", 1), 0)


if __name__ == "__main__":
    unittest.main()
