"""keep_client against real keep-manager and keep-worker processes (SmolLM2 on the CPU).

    KEEP_BIN_DIR=build/bin .venv/bin/python -m unittest discover -s clients/python/tests -v
"""
import time
import unittest

import keep_client
from keep_client import ManagerClient, WorkerClient, errors

from keep_client.local import LocalServices as Services

MEMORIES = [
    ("The milk is in the fridge.", "object_state"),
    ("The fridge is in the kitchen, next to the sink.", "object_state"),
    ("The red mug is on the kitchen counter.", "object_state"),
    ("Task done: walked to the kitchen.", "task_record"),
    ("Example plan for 'make tea': walk to kitchen, grab kettle, fill kettle, boil water.",
     "example_plan"),
]


class ManagerAndWorker(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.svc = Services(worker=True, extra_manager=["--static-after-steps", "2"])
        cls.m = ManagerClient(cls.svc.manager.endpoint, timeout=20)
        cls.w = WorkerClient(cls.svc.worker.endpoint, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.m.close()
        cls.w.close()
        cls.svc.close()

    def test_memory_lifecycle(self):
        agent = "py_lifecycle"
        self.assertTrue(self.m.ping().startswith("keep-manager"))
        ids = [self.m.write(agent, t, kind=k).id for t, k in MEMORIES]
        self.assertEqual(len(set(ids)), len(ids))
        w = self.m.update(agent, ids[0], "The milk is on the table.")
        self.assertEqual(w.id, ids[0])
        self.assertGreater(w.version, 1)
        self.assertEqual(self.m.advance_step(agent, 3), 3)
        segs = self.m.retrieve(agent, "Where is the milk?", 3)
        # The example plan always comes first, then the 3 others nearest the query.
        self.assertEqual(len(segs), 4)
        self.assertEqual(segs[0].kind, "example_plan")
        self.assertIn("milk", " ".join(s.text for s in segs))
        self.assertTrue(all(s.kind in ("object_state", "task_record", "example_plan")
                            for s in segs))
        self.m.delete(agent, ids[-1])
        mems, more = self.m.list_memories(agent)
        self.assertFalse(more)
        self.assertEqual(sorted(x.id for x in mems), sorted(ids[:-1]))
        self.assertEqual(mems[0].text if mems[0].id == ids[0] else "", "The milk is on the table.")
        self.assertTrue(self.m.list_groups(agent))
        self.assertGreaterEqual(self.m.stats()["memories"], len(ids) - 1)

    def test_wire_errors_are_typed(self):
        with self.assertRaises(errors.NotFoundError) as c:
            self.m.delete("py_errors", 424242)
        self.assertEqual(c.exception.code, "not_found")
        self.assertEqual(c.exception.value, 6)
        self.assertIsInstance(c.exception, keep_client.KeepError)
        with self.assertRaises(errors.InvalidArgumentError):
            self.m.write("bad agent name!", "text")
        with self.assertRaises(errors.InvalidArgumentError):
            self.w.complete("py_errors", "go", method="keep", decay=2.0)
        with self.assertRaises(ValueError):  # refused before sending
            self.m.write("py_errors", "text", kind="gossip")
        with self.assertRaises(ValueError):
            self.w.complete("py_errors", "go", method="fastest")

    def test_plans_with_every_method(self):
        agent = "py_plans"
        for t, k in MEMORIES:
            self.m.write(agent, t, kind=k)
        self.m.retrieve(agent, "milk", 1)  # embeds and groups them
        self.m.advance_step(agent, 3)      # groups turn static: their KV is computed
        info = self.w.ping()
        self.assertTrue(info["server_version"].startswith("keep-worker"))
        # Wait for the worker to have produced KV for every memory.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            mems, _ = self.m.list_memories(agent)
            if mems and all(x.has_kv for x in mems):
                break
            time.sleep(0.2)
        done = self.w.complete(agent, "Bring me a glass of milk.", history=["walk to kitchen"],
                               k=5, method="full", max_tokens=6)
        self.assertTrue(done.tokens)
        self.assertEqual(done.stats.method, "full")
        self.assertEqual(len(done.stats.segments), len(MEMORIES))
        reuse = self.w.complete(agent, "Bring me a glass of milk.", k=5, method="full_reuse",
                                max_tokens=4)
        self.assertEqual(reuse.stats.entries_hit, len(MEMORIES))
        self.assertEqual(reuse.stats.recompute_ratio, 0.0)
        scored = self.w.score(agent, "Bring me a glass of milk.",
                              ["open the fridge", "turn on the laptop"], k=5, method="keep",
                              decay=1.0)
        self.assertEqual(len(scored.log_probs), 2)
        self.assertIn(scored.best, (0, 1))
        self.assertEqual(scored.log_probs[scored.best], max(scored.log_probs))
        self.assertEqual(scored.stats.method, "keep")


class Reconnect(unittest.TestCase):
    def test_timeout_then_the_same_client_reaches_a_restarted_manager(self):
        svc = Services(worker=False)
        try:
            m = ManagerClient(svc.manager.endpoint, timeout=2)
            m.write("py_restart", "The cup is on the shelf.")
            svc.manager.kill9()
            t0 = time.monotonic()
            with self.assertRaises(errors.RequestTimeoutError):
                m.ping()
            self.assertLess(time.monotonic() - t0, 5)
            svc.manager = svc.start_manager()  # same port, same data directory
            mems, _ = m.list_memories("py_restart")  # the acknowledged write survived
            self.assertEqual([x.text for x in mems], ["The cup is on the shelf."])
            m.close()
        finally:
            svc.close()


class RequestIds(unittest.TestCase):
    """Every mutation carries the client's request id; one sent again with the same id (as the
    client resends one whose answer was lost) is answered as the first time and not applied
    again, also by a manager restarted after kill -9 (from its WAL)."""

    def test_a_resent_mutation_is_answered_once_applied_once(self):
        svc = Services(worker=False)
        try:
            m = ManagerClient(svc.manager.endpoint, timeout=5)
            self.assertNotEqual(m.client_id, 0)
            agent = "py_resend"
            header = {"clientId": m.client_id, "clientSeq": 1_000_000}

            def fill(r):
                r.agent = agent
                r.text = "The kettle is on the stove."
                r.kind = "objectState"

            first = m._ch.call("writeMemory", fill, header=header)
            again = m._ch.call("writeMemory", fill, header=header)
            self.assertEqual(again["id"], first["id"])
            step = m._ch.call("advanceStep", lambda r: (setattr(r, "agent", agent),
                                                         setattr(r, "by", 2)),
                              header=dict(header, clientSeq=1_000_001))
            self.assertEqual(step["step"], 2)
            m.write(agent, "The cup is on the shelf.")  # an id of the client's own
            self.assertEqual(m.stats()["mutations_deduplicated"], 1)
            svc.manager.kill9()
            svc.manager = svc.start_manager()  # same data directory: the WAL keeps the ids
            again = m._ch.call("writeMemory", fill, header=header)
            self.assertEqual(again["id"], first["id"])
            step = m._ch.call("advanceStep", lambda r: (setattr(r, "agent", agent),
                                                         setattr(r, "by", 2)),
                              header=dict(header, clientSeq=1_000_001))
            self.assertEqual(step["step"], 2)  # not 4
            mems, _ = m.list_memories(agent)
            self.assertEqual([x.text for x in mems],
                             ["The kettle is on the stove.", "The cup is on the shelf."])
            self.assertEqual(m.stats()["mutations_deduplicated"], 2)
            m.close()
        finally:
            svc.close()


if __name__ == "__main__":
    unittest.main()
