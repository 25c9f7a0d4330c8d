#!/usr/bin/env python3
"""Two keep-workers sharing one device KV tier on one GPU (issue 29 point 3), through the real
services: a keep-manager, worker A owning the tier (--device-tier NAME --device-tier-bytes B),
worker B attached to it by CUDA IPC (--device-tier NAME). A planner's request to A reads the
entries from the region and A admits them into the tier; the same request to B then reads every
entry from GPU memory (entries_device) and scores exactly as A did from the region. After a memory
is updated and its new entry produced, B scores as A does from the region again: a rewritten entry
is never read stale from the tier.

  KEEP_BIN_DIR=.gpu-bundle/bin .venv/bin/python tests/gpu/tier_e2e.py     (scripts/gpu-check.sh)

Needs a CUDA build of keep-worker and models/ (SmolLM2 GGUF, all-MiniLM-L6-v2). Exit 0: passed;
1: a check failed; 77: no GPU build or model here.
"""
import os
import sys
import time

from keep_client import ManagerClient, WorkerClient
from keep_client.local import Daemon, LocalServices, bin_path

MEMORIES = ["The apple is in the fridge.", "The robot is at the kitchen counter.",
            "The mug is on the table.", "The fridge is closed.", "The lamp is switched off.",
            "Step 1 done: find a mug.", "The sink is empty.", "The book is on the sofa."]
CANDIDATES = ["open the fridge", "pick up the mug", "switch on the lamp", "find a book"]
INSTRUCTION = "Put the apple on the table."


def wait_kv(m, agent, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mems, _ = m.list_memories(agent, limit=100)
        if mems and all(x.has_kv for x in mems):
            return
        time.sleep(0.05)
    raise SystemExit("tier_e2e: the worker did not produce every entry in time")


def check(cond, what):
    if not cond:
        print(f"tier_e2e: FAILED: {what}")
        sys.exit(1)
    print(f"tier_e2e: ok: {what}")


def main():
    if not os.path.exists(os.path.join(os.environ.get("KEEP_BIN_DIR", "build/bin"),
                                       "keep-worker")):
        print("tier_e2e: no keep-worker (KEEP_BIN_DIR): skipped")
        sys.exit(77)
    tier = f"keep_tier_e2e_{os.getpid()}"
    owner = ["--device-tier", tier, "--device-tier-bytes", "512MiB",
             "--device-tier-slot-bytes", "8MiB"]
    try:
        svc = LocalServices(worker=True, device="cuda", extra_worker=owner)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"tier_e2e: services did not start ({e}): skipped")
        sys.exit(77)
    b = None
    try:
        b = Daemon([bin_path("keep-worker"), "--endpoint", "tcp://127.0.0.1:0",
                    "--metrics-listen", "off", "--manager", svc.manager.endpoint, "--shm-name",
                    svc.shm, "--model", svc.model, "--device", "cuda", "--context", "2048",
                    "--job-poll-ms", "20", "--device-tier", tier], "worker", svc.tmp).wait_ready(120)
        with ManagerClient(svc.manager.endpoint) as m, \
                WorkerClient(svc.worker.endpoint, timeout=120) as wa, \
                WorkerClient(b.endpoint, timeout=120) as wb:
            agent = "tier"
            ids = [m.write(agent, t).id for t in MEMORIES]
            wait_kv(m, agent)

            def score(w):
                return w.score(agent, INSTRUCTION, CANDIDATES, k=len(MEMORIES), method="full_reuse")

            a1 = score(wa)  # from the region; A admits what it read, after the request
            check(a1.stats.entries_hit == len(MEMORIES) and a1.stats.entries_device == 0,
                  f"A read {a1.stats.entries_hit} entries from the region")
            time.sleep(0.5)  # admission runs between A's requests
            b1 = score(wb)
            check(b1.stats.entries_device == len(MEMORIES),
                  f"B read {b1.stats.entries_device} of {len(MEMORIES)} entries from A's tier")
            check(b1.log_probs == a1.log_probs, "B's scores from the tier equal A's from the region")

            m.update(agent, ids[0], "The apple is on the kitchen counter.")
            wait_kv(m, agent)
            b2 = score(wb)  # the tier's copy of ids[0] is stale: B must not use it
            a2 = score(wa)
            check(b2.log_probs == a2.log_probs and b2.log_probs != b1.log_probs,
                  "after an update B scores the new entry, as A does "
                  f"(B: {b2.stats.entries_device} from the tier, {b2.stats.entries_hit} hits)")
            check(b2.stats.entries_device <= len(MEMORIES) - 1,
                  "the rewritten entry was not read from the tier")
    finally:
        if b is not None:
            b.kill9()
        svc.close()
    print("tier_e2e: passed")


if __name__ == "__main__":
    main()
