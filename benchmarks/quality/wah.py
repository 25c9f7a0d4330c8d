#!/usr/bin/env python3
"""Planning quality under KV reuse on WAH-NL (LoTA-Bench's 250 household tasks), every decision
through the real services (issue 30): an agent (keep_client) writes its memory at keep-manager,
keep-worker produces the KV, and each next-step decision is scored by the worker with every
method on the same memory state.

  .venv/bin/python benchmarks/quality/wah.py [--episodes N] [--max-steps S] [--examples E]
      [--methods full,prefix,full_reuse,cacheblend,epic,keep,keep:decay=0.9] [--out FILE.jsonl]
      [--device cpu|auto] [--manager EP --worker EP] [--check-agree METHOD]

Per task (its instruction and LoTA-Bench's human plan), per step t: memory = E example plans of
other tasks (static), the steps done as task records, and object states derived from the plan so
far (where the robot is, what it holds, what is open, on, or inside what: updated as the episode
unfolds, so groups turn dynamic and back static); query = instruction + the steps done;
candidates = LoTA-Bench-style skills over the task's objects (a verb is admissible for an object
when some WAH plan applies it to that object) and "done"; gold = the plan's step t ("done" after
the last). harness.py runs the decisions and reports (accuracy ± standard error, agreement with
full, KL, recompute ratio, TTFT); the choice is the candidate with the highest mean log-prob
per token (--score sum: Σ log-prob).
The WAH material is CC BY-NC-SA: it is read from ../shared/data/planning at run time, never
copied into the repository.
"""
import collections
import json
import pathlib
import random
import re

import harness

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
    harness.require(path)
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
    return [skill(v, o) for o in objs for v in VERBS if v in affords[o]] + ["done"]


def example_text(task):
    steps = ", ".join(f"{i + 1}. {s}" for i, s in enumerate(task["task_plan"] + ["done"]))
    return f"Example: {task['nl_instructions'][0]} Plan: {steps}."


def state_changes(step, world):
    """The object-state memories `step` changes: (slot, text) pairs; `world` keeps the place."""
    p = parse_step(step)
    if not p:
        return []
    verb, obj = p
    if verb == "find":
        world["at"] = obj
        return [("robot", f"The robot is at the {obj}.")]
    if verb == "pick up":
        return [(obj, f"The robot holds the {obj}.")]
    if verb == "put down":
        return [(obj, f"The {obj} is in or on the {world.get('at', 'floor')}.")]
    if verb in ("open", "close"):
        return [(obj, f"The {obj} is {'open' if verb == 'open' else 'closed'}.")]
    return [(obj, f"The {obj} is switched on.")]


def episodes(a):
    tasks, affords = load_tasks(a.data_dir)
    rng = random.Random(a.seed)
    picked = tasks if a.episodes <= 0 else rng.sample(tasks, a.episodes)
    out = []
    for task in picked:
        others = [t for t in tasks if t["task_id"] != task["task_id"]]
        memories = [(example_text(t), "example_plan") for t in rng.sample(others, a.examples)]
        plan = task["task_plan"] + ["done"]
        cands = candidates(task, affords)
        world, decisions = {}, []
        for t, gold in enumerate(plan):
            changes = [] if gold == "done" else (
                [(f"record{t}", f"Step {t + 1} done: {gold}.", "task_record")] +
                [(slot, text, "object_state") for slot, text in state_changes(gold, world)])
            decisions.append(harness.Decision(plan[:t], cands, gold, changes))
        if a.max_steps > 0:
            decisions = decisions[:a.max_steps]
        out.append(harness.Episode(str(task["task_id"]), task["task_name"],
                                   task["nl_instructions"][0], memories, decisions))
    return out


def main():
    a = harness.arguments(__doc__).parse_args()
    harness.main(a, episodes(a), "wah")


if __name__ == "__main__":
    main()
