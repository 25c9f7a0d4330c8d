#!/usr/bin/env python3
"""Hit rate of the shared KV tier (issue 31, point 6) on a workload of agents sharing example plans.

Starts three redis-server masters in cluster mode and N nodes (keep-manager + CPU keep-worker with
--kv-remote) on loopback, gives each agent a few example plans drawn from a common pool and a few
object states of its own, lets every group turn static, waits until every KV job is done and reads
the workers' keep_worker_kv_shared_total{result} and keep_worker_kv_jobs_total{result="done"}.

    .venv/bin/python benchmarks/cluster/shared_kv.py [--agents 8] [--nodes 2] [--pool 12]
        [--plans 4] [--states 3] [--arrival together|one-by-one] [--build build]

Hit rate = hits / (hits + misses) over the shareable jobs' lookups (static groups, example plans);
"of all jobs" = hits / every KV job done (object states are never looked up).
"""
import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
from keep_client import ManagerClient  # noqa: E402

ROOMS = ["kitchen", "bathroom", "study", "garage", "bedroom", "hall", "garden", "cellar"]
OBJECTS = ["mug", "towel", "laptop", "hammer", "pillow", "umbrella", "watering can", "bottle"]
TASKS = ["fetch a drink", "tidy the desk", "water the plants", "make the bed", "take out the trash",
         "feed the cat", "charge the phone", "fold the laundry", "wash the dishes",
         "open the windows", "sort the mail", "set the table", "sweep the floor", "find the keys",
         "turn off the lights", "pack a bag"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def example_plan(i):
    t = TASKS[i % len(TASKS)]
    r = ROOMS[i % len(ROOMS)]
    o = OBJECTS[(i * 3) % len(OBJECTS)]
    return (f"Example plan: to {t}, walk to the {r}, look for the {o}, pick it up, do what the "
            f"task needs step by step, put the {o} back, report that the task is done.")


def metrics(address):
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("keep_worker_kv_shared_total{") or \
                line.startswith("keep_worker_kv_jobs_total{"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if cond():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def free_redis_port():
    """A port P <= 55535 with P and P + 10000 (the cluster bus) free."""
    while True:
        p = free_port()
        if p > 55535:
            continue
        try:
            s = socket.socket()
            s.bind(("127.0.0.1", p + 10000))
            s.close()
            return p
        except OSError:
            continue


def start_redis(tmp, procs):
    ports = [free_redis_port() for _ in range(3)]
    for i, p in enumerate(ports):
        d = os.path.join(tmp, f"redis{i}")
        os.makedirs(d)
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--dir", d,
             "--cluster-enabled", "yes", "--cluster-config-file", os.path.join(d, "nodes.conf"),
             "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in ports:
        wait_for(lambda p=p: subprocess.run(["redis-cli", "-p", str(p), "PING"],
                                            capture_output=True, text=True).stdout.strip() == "PONG",
                 10, "redis-server")
    subprocess.run(["redis-cli", "--cluster", "create"] + [f"127.0.0.1:{p}" for p in ports] +
                   ["--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True)
    for p in ports:
        wait_for(lambda p=p: "cluster_state:ok" in subprocess.run(
            ["redis-cli", "-p", str(p), "CLUSTER", "INFO"], capture_output=True, text=True).stdout,
            20, "redis cluster")
    return "redis://" + ",".join(f"127.0.0.1:{p}" for p in ports)


def start_node(tmp, i, build, redis_url, procs):
    mport, mmetrics, wport, wmetrics = (free_port() for _ in range(4))
    shm = f"keep-bench-skv-{os.getpid()}-{i}"
    log = open(os.path.join(tmp, f"node{i}.log"), "w")
    procs.append(subprocess.Popen(
        [os.path.join(build, "bin", "keep-manager"), "--data-dir", os.path.join(tmp, f"data{i}"),
         "--endpoint", f"tcp://127.0.0.1:{mport}", "--metrics-listen", f"127.0.0.1:{mmetrics}",
         "--shm-name", shm, "--shm-bytes", "256MiB",
         "--encoder", os.path.join(ROOT, "models", "all-MiniLM-L6-v2"),
         "--model", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
         "--static-after-steps", "2"], stdout=log, stderr=log))
    manager = ManagerClient(f"tcp://127.0.0.1:{mport}", timeout=60.0)
    wait_for(lambda: manager.ping(), 60, "keep-manager")
    procs.append(subprocess.Popen(
        [os.path.join(build, "bin", "keep-worker"), "--endpoint", f"tcp://127.0.0.1:{wport}",
         "--metrics-listen", f"127.0.0.1:{wmetrics}", "--manager", f"tcp://127.0.0.1:{mport}",
         "--shm-name", shm, "--model", os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"),
         "--device", "cpu", "--context", "1024", "--kv-remote", redis_url],
        stdout=log, stderr=log))
    wait_for(lambda: metrics(f"127.0.0.1:{wmetrics}") is not None, 60, "keep-worker")
    return manager, f"127.0.0.1:{wmetrics}", shm


def drained(manager, agents):
    s = manager.stats()
    if s.get("jobs_queued", 1) or s.get("jobs_running", 1) or s.get("jobs_in_flight", 1):
        return False
    for a in agents:
        if not all(m.has_kv for m in manager.list_memories(a, limit=1000)[0]):
            return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--pool", type=int, default=12, help="example plans common to all agents")
    ap.add_argument("--plans", type=int, default=4, help="example plans per agent (from the pool)")
    ap.add_argument("--states", type=int, default=3, help="object states per agent (its own)")
    ap.add_argument("--arrival", choices=["together", "one-by-one"], default="together")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    args = ap.parse_args()
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server is not installed (deploy/install-deps.sh)")

    rng = random.Random(args.seed)
    pool = [example_plan(i) for i in range(args.pool)]
    tmp = tempfile.mkdtemp(prefix="keep-bench-skv-")
    procs = []
    shms = []
    try:
        url = start_redis(tmp, procs)
        nodes = []
        for i in range(args.nodes):
            m, w, shm = start_node(tmp, i, args.build, url, procs)
            nodes.append((m, w))
            shms.append(shm)
        agents = [[] for _ in nodes]
        t0 = time.time()
        for a in range(args.agents):
            n = a % len(nodes)
            m = nodes[n][0]
            name = f"agent{a}"
            agents[n].append(name)
            # The same plans in the same order on every agent that has them (plans are written
            # as a library would hand them out), then the agent's own object states.
            for p in sorted(rng.sample(range(args.pool), args.plans)):
                m.write(name, pool[p], kind="example_plan")
            for s in range(args.states):
                m.write(name, f"Agent {a}'s {OBJECTS[(a + s) % len(OBJECTS)]} is in the "
                              f"{ROOMS[(a * 5 + s) % len(ROOMS)]}, on shelf {a * 10 + s}.")
            m.retrieve(name, "what to do next", 1)  # embeds and groups
            m.advance_step(name, 3)                  # every group turns static
            if args.arrival == "one-by-one":
                wait_for(lambda: drained(m, [name]), 600, "KV jobs")
        for (m, _), names in zip(nodes, agents):
            wait_for(lambda m=m, names=names: drained(m, names), 900, "KV jobs")
        elapsed = time.time() - t0
        total = {}
        per_node = []
        for _, w in nodes:
            mm = metrics(w)
            per_node.append(mm)
            for k, v in mm.items():
                total[k] = total.get(k, 0) + v

        def get(res, family="keep_worker_kv_shared_total"):
            return total.get(f'{family}{{result="{res}"}}', 0)
        hits, misses, errors = get("hit"), get("miss"), get("error")
        done = get("done", "keep_worker_kv_jobs_total")
        out = {
            "agents": args.agents, "nodes": args.nodes, "pool": args.pool, "plans": args.plans,
            "states": args.states, "arrival": args.arrival,
            "hits": hits, "misses": misses, "rejected": get("rejected"), "errors": errors,
            "published": get("published"), "jobs_done": done,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "hits_of_all_jobs": hits / done if done else 0.0,
            "seconds": round(elapsed, 1),
        }
        reasons = set()
        for i in range(args.nodes):
            with open(os.path.join(tmp, f"node{i}.log")) as f:
                reasons.update(line.split(" W kvremote: ", 1)[1].strip()
                               for line in f if " W kvremote: " in line)
        out["error_log"] = sorted(reasons)[:8]
        print(json.dumps(out, indent=1))
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()
        for s in shms:
            try:
                os.unlink(f"/dev/shm/{s}")
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
