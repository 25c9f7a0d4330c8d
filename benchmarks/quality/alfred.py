#!/usr/bin/env python3
"""Planning quality under KV reuse on ALFRED (ReAcTree's human trajectories), every decision
through the real services (issue 30; harness.py runs and reports them).

  .venv/bin/python benchmarks/quality/alfred.py [--episodes N] [--max-steps S] [--examples E]
      [--methods ...] [--out FILE.jsonl] [--check-agree METHOD]

Episodes are the human-written ReAct trajectories of ALFRED tasks in ReAcTree's material
(reactree_trajectories_human_and_wah_llm.tar.gz, resource/alfred/collect_human/react_wm, read in
place). Each physical action ("go to", "pick up", "put down", "open", "close", "turn on/off",
"slice", "done") is one decision: the query is the task and the actions taken; the gold is the
human's next action; the candidates are the actions admissible at that point in what the agent
has seen (go to any place seen, pick up what the last observation shows, put down what it holds,
open/close/turn on/off/slice where it is), the gold always among them. The observations become
memories as the episode unfolds: where each object was last seen, where the robot is, what it
holds, what is open or on -- written when first seen and updated as they change, so groups turn
dynamic and back static. Example trajectories of other tasks (their actions) are static memories.
"recall location of" actions (ReAcTree's working memory; KEEP's retrieval plays that part) are not
decisions.
"""
import pathlib
import random
import re
import tarfile

import harness

ARCHIVE = "reactree_trajectories_human_and_wah_llm.tar.gz"
PREFIX = "resource/alfred/collect_human/react_wm/"
THING = re.compile(r"([A-Z][A-Za-z]*) \(([0-9, ]+)\)")
PHYSICAL = ("go to ", "pick up ", "put down ", "open ", "close ", "turn on ", "turn off ",
            "slice ")
SWITCHABLE = ("Lamp", "Microwave", "Faucet", "StoveKnob", "Television", "Toaster", "CoffeeMachine")
# Things an agent goes to (ALFRED's receptacles): seen in an observation, they become places.
RECEPTACLES = ("Table", "Counter", "Cabinet", "Drawer", "Shelf", "Fridge", "Microwave", "Sink",
               "Bathtub", "Toilet", "Cart", "Safe", "Dresser", "Bed", "Sofa", "Chair", "Ottoman",
               "GarbageCan", "Stove", "CoffeeMachine", "Desk", "TVStand", "Hamper", "Box")


def things(text):
    """'SideTable (1), Drawer (1, 2)' -> ['SideTable (1)', 'Drawer (1)', 'Drawer (2)']."""
    out = []
    for name, nums in THING.findall(text):
        out += [f"{name} ({n.strip()})" for n in nums.split(",") if n.strip()]
    return out


def load(data_dir):
    path = pathlib.Path(data_dir) / ARCHIVE
    harness.require(path)
    trajs = []
    with tarfile.open(path) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not (member.isfile() and member.name.startswith(PREFIX)):
                continue
            text = tar.extractfile(member).read().decode("utf-8", "replace")
            trajs.append((member.name[len(PREFIX):], text.splitlines()))
    return trajs


def parse(lines):
    """(task, room line, [(action, observation)]) of a ReAct trajectory."""
    task = lines[0].split("Your task is to:", 1)[-1].strip()
    room = lines[1] if len(lines) > 1 else ""
    steps = []
    for i, line in enumerate(lines):
        if line.startswith("Act: "):
            obs = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith(
                ("Act:", "Think:")) else ""
            steps.append((line[5:].strip(), obs))
    return task, room, steps


class Seen:
    """What the agent knows from its observations: places, where it is, what is in view, what it
    holds; and the memory slots each observation sets."""

    def __init__(self, room):
        self.places = things(room.split("you see", 1)[-1]) if "you see" in room else []
        self.at = None
        self.view = []
        self.holding = []

    def candidates(self, gold):
        c = [f"go to {p}" for p in self.places]
        c += [f"pick up {o}" for o in self.view if o not in self.holding and o != self.at]
        c += [f"put down {o}" for o in self.holding]
        if self.at:
            c += [f"open {self.at}", f"close {self.at}"]
        for o in self.view:
            if any(s in o for s in SWITCHABLE):
                c += [f"turn on {o}", f"turn off {o}"]
        if any(h.startswith("Knife") or h.startswith("ButterKnife") for h in self.holding):
            c += [f"slice {o}" for o in self.view if o not in self.holding]
        c.append("done")
        out = []
        for x in c:
            if x not in out:
                out.append(x)
        if gold not in out:
            out.append(gold)
        return out

    def apply(self, action, obs):
        """Updates the state; returns the (slot, text) memories the step sets."""
        changes = []
        if action.startswith("go to "):
            self.at = action[6:]
            changes.append(("robot", f"The robot is at {self.at}."))
        if "You see" in obs:
            self.view = things(obs.split("You see", 1)[1].split("I am holding")[0])
            for o in self.view:
                if o not in self.places and any(r in o for r in RECEPTACLES):
                    self.places.append(o)
            for o in self.view:
                if o not in self.places and o != self.at and o not in self.holding and self.at:
                    changes.append((o, f"{o} is at {self.at}."))
        if action.startswith("pick up "):
            o = action[8:]
            self.holding.append(o)
            changes.append((o, f"The robot holds {o}."))
        elif action.startswith("put down "):
            o = action[9:]
            if o in self.holding:
                self.holding.remove(o)
            changes.append((o, f"{o} is at {self.at}."))
        elif action.startswith(("open ", "close ")):
            verb, o = action.split(" ", 1)
            changes.append((o, f"{o} is {'open' if verb == 'open' else 'closed'}."))
        elif action.startswith(("turn on ", "turn off ")):
            o = action[9:] if action.startswith("turn off ") else action[8:]
            changes.append((o, f"{o} is {'on' if action.startswith('turn on') else 'off'}."))
        elif action.startswith("slice "):
            o = action[6:]
            changes.append((o, f"{o} is sliced."))
        return changes


def episodes(a):
    trajs = [(name, parse(lines)) for name, lines in load(a.data_dir)]
    rng = random.Random(a.seed)
    picked = trajs if a.episodes <= 0 else rng.sample(trajs, min(a.episodes, len(trajs)))
    out = []
    for name, (task, room, steps) in picked:
        others = [t for n, t in trajs if n != name]
        memories = []
        for o_task, _, o_steps in rng.sample(others, min(a.examples, len(others))):
            acts = [s for s, _ in o_steps if s.startswith(PHYSICAL) or s == "done"]
            memories.append((f"Example: {o_task} Actions: {', '.join(acts)}.", "example_plan"))
        seen = Seen(room)
        memories.append((room.strip(), "object_state"))
        history, decisions = [], []
        for action, obs in steps:
            if not (action.startswith(PHYSICAL) or action == "done"):
                continue  # recall: not a physical decision
            cands = seen.candidates(action)
            changes = [] if action == "done" else (
                [(f"record{len(history)}", f"Done: {action}.", "task_record")] +
                [(slot, text, "object_state") for slot, text in seen.apply(action, obs)])
            decisions.append(harness.Decision(list(history), cands, action, changes))
            history.append(action)
            if action == "done":
                break
        if a.max_steps > 0:
            decisions = decisions[:a.max_steps]
        out.append(harness.Episode(name, name.split("-")[0], task, memories, decisions))
    return out


def main():
    a = harness.arguments(__doc__).parse_args()
    harness.main(a, episodes(a), "alfred")


if __name__ == "__main__":
    main()
