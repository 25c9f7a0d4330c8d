"""ManagerClient in cluster mode: two real keep-manager processes on a real etcd split the agents'
shards; a client connected to one of them reaches every agent, following `moved` answers to the
node that serves it (docs/cluster.md). Skipped without Debian's etcd-server.
"""
import os
import shutil
import subprocess
import tempfile
import time
import unittest

from keep_client import ManagerClient, errors
from keep_client.cluster import EtcdDirectory, shard_of
from keep_client.local import LocalServices, free_port

ETCD = "/usr/bin/etcd"


@unittest.skipUnless(os.access(ETCD, os.X_OK), "no etcd-server")
class FollowsMoved(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="keep_cluster_")
        client, peer = free_port(), free_port()
        cls.url = f"http://127.0.0.1:{client}"
        cls.etcd = subprocess.Popen(
            [ETCD, "--name", "m0", "--data-dir", os.path.join(cls.tmp, "m0"),
             "--listen-client-urls", cls.url, "--advertise-client-urls", cls.url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"m0=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        flags = lambda node: ["--etcd", cls.url, "--node-id", node, "--shards", "8",
                              "--etcd-lease-s", "2"]
        deadline = time.monotonic() + 30
        while True:  # etcd takes a moment to elect itself
            try:
                cls.a = LocalServices(worker=False, extra_manager=flags("a"))
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        cls.b = LocalServices(worker=False, extra_manager=flags("b"))

    @classmethod
    def tearDownClass(cls):
        cls.b.close()
        cls.a.close()
        cls.etcd.kill()
        cls.etcd.wait()
        shutil.rmtree(cls.tmp, ignore_errors=True)

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
            on_b = [a for a, ep in m._owners.items() if ep == self.b.manager.endpoint]
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
                                 m._owners.get(agent, self.a.manager.endpoint), agent)
            # A client that asks the directory first sends no request to the wrong node.
            with ManagerClient(self.a.manager.endpoint, timeout=10, follow_moved=False,
                               directory=d) as direct:
                for agent in agents:
                    mems, _ = direct.list_memories(agent)
                    self.assertEqual(len(mems), 1)


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
