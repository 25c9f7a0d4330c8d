#!/usr/bin/env python3
"""Planning quality under KV reuse on WAH-NL (LoTA-Bench's 250 household tasks), every decision
through the real services (issue 30): an agent (keep_client) writes its memory at keep-manager,
keep-worker produces the KV, and each next-step decision is scored by the worker with every
method on the same memory state.

  .venv/bin/python benchmarks/quality/wah.py [--tasks N] [--max-steps S] [--examples E]
      [--methods full,prefix,full_reuse,cacheblend,epic,keep,keep:decay=0.9] [--out FILE.jsonl]
      [--device cpu|auto] [--manager EP --worker EP] [--check-agree METHOD]

Per task (its instruction and LoTA-Bench's human plan), per step t: memory = E example plans of
other tasks (static), the steps done as task records, and object states derived from the plan so
far (where the robot is, what it holds, what is open, on, or inside what: updated as the episode
unfolds, so groups turn dynamic and back static); query = instruction + the steps done;
candidates = LoTA-Bench-style skills over the task's objects (a verb is admissible for an object
when some WAH plan applies it to that object) and "done"; gold = the plan's step t ("done" after
the last). Before each decision the harness waits (up to --kv-wait s) until every memory has KV.
The choice is the candidate with the highest Σ log-prob (the worker's `best`).

Reports per method: next-step accuracy against the human plan (± standard error), agreement with
`full`'s choice, mean KL(full || method) over the candidates' softmax, mean recompute ratio, and
TTFT. --check-agree M exits 1 unless M agrees with `full` on every decision (CI: keep at d = 1).
The WAH material is CC BY-NC-SA: it is read from ../shared/data/planning at run time, never
copied into the repository.
"""
import argparse
import collections
import json
import math
import pathlib
import random
import re
import statistics
import sys
import time

from keep_client import ManagerClient, WorkerClient
from keep_client.local import ROOT, LocalServices

DATA = ROOT.parent / "shared" / "data" / "planning"
VERBS = ("find", "pick up", "put down", "open", "close", "switch on")
STEP = re.compile(r"^(find an?|pick up the|put down the|open the|close the|switch on the) (.+)$")


def parse_step(step):
    m = STEP.match(step.strip())
    if not m:
        return None
    verb = m.group(1)
    verb = "find" if verb.startswith("find") else verb[:-4]  # "pick up the" -> "pick up"
    return verb, m.group(2)


def skill(verb, obj):
    if verb == "find":
        return f"find {'an' if obj[0] in 'aeiou' else 'a'} {obj}"
    return f"{verb} the {obj}"


def load_tasks(data_dir):
    path = pathlib.Path(data_dir) / "lotabench_wah_examples_for_prompt_default.json"
    tasks = json.loads(path.read_text())
    affords = collections.defaultdict(set)  # object -> verbs some plan applies to it
    for t in tasks:
        for s in t["task_plan"]:
            p = parse_step(s)
            if p:
                affords[p[1]].add(p[0])
    return tasks, affords


def candidates(task, affords):
    objs = []
    for s in task["task_plan"]:
        p = parse_step(s)
        if p and p[1] not in objs:
            objs.append(p[1])
    out = [skill(v, o) for o in objs for v in VERBS if v in affords[o]]
    return out + ["done"]


def example_text(task):
    steps = ", ".join(f"{i + 1}. {s}" for i, s in enumerate(task["task_plan"] + ["done"]))
    return f"Example: {task['nl_instructions'][0]} Plan: {steps}."


class World:
    """Object states implied by the plan steps done so far: text per memory slot."""

    def __init__(self):
        self.at = None
        self.holding = []
        self.states = {}  # slot -> text

    def apply(self, step):
        p = parse_step(step)
        if not p:
            return
        verb, obj = p
        if verb == "find":
            self.at = obj
            self.states["robot"] = f"The robot is at the {obj}."
        elif verb == "pick up":
            self.holding.append(obj)
            self.states[obj] = f"The robot holds the {obj}."
        elif verb == "put down":
            if obj in self.holding:
                self.holding.remove(obj)
            where = self.at or "floor"
            self.states[obj] = f"The {obj} is in or on the {where}."
        elif verb in ("open", "close"):
            self.states[obj] = f"The {obj} is {'open' if verb == 'open' else 'closed'}."
        elif verb == "switch on":
            self.states[obj] = f"The {obj} is switched on."


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def kl(p, q):
    return sum(a * (math.log(a) - math.log(max(b, 1e-300))) for a, b in zip(p, q) if a > 0)


def parse_method(spec):
    name, _, rest = spec.partition(":")
    knobs = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        knobs[k] = float(v) if k in ("decay", "cacheblend_ratio") else int(v)
    return name, knobs


def wait_kv(m, agent, deadline_s):
    deadline = time.monotonic() + deadline_s
    while True:
        mems, more = m.list_memories(agent, limit=1000)
        if all(x.has_kv for x in mems) or time.monotonic() > deadline:
            return sum(x.has_kv for x in mems), len(mems)
        time.sleep(0.05)


def run(a, m, w, tasks, affords, out):
    rng = random.Random(a.seed)
    methods = a.methods.split(",")
    if "full" not in methods:
        methods = ["full"] + methods
    picked = tasks if a.tasks <= 0 else rng.sample(tasks, a.tasks)
    rows = []
    for ti, task in enumerate(picked):
        agent = f"wah{task['task_id']}_{a.seed}"
        others = [t for t in tasks if t["task_id"] != task["task_id"]]
        for ex in rng.sample(others, a.examples):
            m.write(agent, example_text(ex), kind="example_plan")
        instruction = task["nl_instructions"][0]
        cands = candidates(task, affords)
        plan = task["task_plan"] + ["done"]
        world = World()
        state_ids = {}
        steps = plan if a.max_steps <= 0 else plan[:a.max_steps]
        for t, gold in enumerate(steps):
            have, total = wait_kv(m, agent, a.kv_wait)
            gold_i = cands.index(gold) if gold in cands else -1
            full_p = None
            full_best = None
            for spec in methods:
                name, knobs = parse_method(spec)
                r = w.score(agent, instruction, cands, history=plan[:t], k=a.k, method=name,
                            **knobs)
                p = softmax(r.log_probs)
                if spec == "full":
                    full_p, full_best = p, r.best
                row = dict(task=task["task_id"], task_name=task["task_name"], step=t,
                           method=spec, best=r.best, gold=gold_i, correct=r.best == gold_i,
                           agree=r.best == full_best, kl=kl(full_p, p),
                           ratio=r.stats.recompute_ratio, ttft=r.stats.ttft_seconds,
                           hit=r.stats.entries_hit, memories=total, with_kv=have,
                           candidates=len(cands))
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
            # The step is done: a task record, the object states it changed, a step passes.
            if gold == "done":
                break
            m.write(agent, f"Step {t + 1} done: {gold}.", kind="task_record")
            before = dict(world.states)
            world.apply(gold)
            for slot, text in world.states.items():
                if before.get(slot) == text:
                    continue
                if slot in state_ids:
                    m.update(agent, state_ids[slot], text)
                else:
                    state_ids[slot] = m.write(agent, text, kind="object_state").id
            m.advance_step(agent)
        print(f"task {ti + 1}/{len(picked)} ({task['task_name']}, {len(steps)} decisions)",
              file=sys.stderr)
    return methods, rows


def summarize(methods, rows):
    lines = ["| method | decisions | accuracy | agreement with full | KL(full ‖ method) | "
             "recompute ratio | TTFT ms (median) |", "|---|---|---|---|---|---|---|"]
    for spec in methods:
        rs = [r for r in rows if r["method"] == spec]
        if not rs:
            continue
        n = len(rs)
        acc = sum(r["correct"] for r in rs) / n
        se = math.sqrt(acc * (1 - acc) / n)
        agree = sum(r["agree"] for r in rs) / n
        lines.append(f"| {spec} | {n} | {100 * acc:.1f} ± {100 * se:.1f} % | {100 * agree:.1f} % | "
                     f"{statistics.mean(r['kl'] for r in rs):.4f} | "
                     f"{statistics.mean(r['ratio'] for r in rs):.3f} | "
                     f"{1000 * statistics.median(r['ttft'] for r in rs):.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data-dir", default=str(DATA))
    ap.add_argument("--tasks", type=int, default=0, help="tasks sampled (0: all 250)")
    ap.add_argument("--max-steps", type=int, default=0, help="decisions per task at most (0: all)")
    ap.add_argument("--examples", type=int, default=3, help="example plans of other tasks")
    ap.add_argument("--k", type=int, default=32, help="segments retrieved per decision")
    ap.add_argument("--methods", default="full,prefix,full_reuse,cacheblend,epic,keep")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-wait", type=float, default=30.0)
    ap.add_argument("--out", help="JSON lines, one per decision and method")
    ap.add_argument("--device", default="cpu", help="for the worker this script starts")
    ap.add_argument("--manager", help="a running keep-manager (with --worker): start none")
    ap.add_argument("--worker")
    ap.add_argument("--check-agree", help="exit 1 unless this method agrees with full everywhere")
    a = ap.parse_args()
    if not (pathlib.Path(a.data_dir) / "lotabench_wah_examples_for_prompt_default.json").exists():
        print(f"wah: no task material in {a.data_dir} (../shared/data/planning): skipped",
              file=sys.stderr)
        sys.exit(77)  # CTest's skip code
    try:
        tasks, affords = load_tasks(a.data_dir)
    except (OSError, ValueError) as e:
        sys.exit(f"wah: cannot read the task material: {e}")
    out = open(a.out, "w") if a.out else None
    svc = None
    try:
        if a.manager and a.worker:
            m_ep, w_ep = a.manager, a.worker
        else:
            svc = LocalServices(worker=True, device=a.device,
                                extra_manager=["--static-after-steps", "2"])
            m_ep, w_ep = svc.manager.endpoint, svc.worker.endpoint
        with ManagerClient(m_ep, timeout=60) as m, WorkerClient(w_ep, timeout=300) as w:
            methods, rows = run(a, m, w, tasks, affords, out)
    finally:
        if out:
            out.close()
        if svc:
            svc.close()
    print(summarize(methods, rows))
    if a.check_agree:
        rs = [r for r in rows if r["method"] == a.check_agree]
        bad = [r for r in rs if not r["agree"]]
        if not rs or bad:
            sys.exit(f"wah: {a.check_agree} disagrees with full on {len(bad)} of {len(rs)} "
                     "decisions")
        print(f"{a.check_agree} agrees with full on all {len(rs)} decisions")


if __name__ == "__main__":
    main()
