#!/usr/bin/env python3
"""A household agent's loop over KEEP: keep the memory at keep-manager, ask keep-worker which
skill to run next, act, record what changed. (No simulator here: acting is printed.)

    .venv/bin/python clients/python/examples/agent_loop.py \\
        [--manager tcp://127.0.0.1:7601] [--worker tcp://127.0.0.1:7602] [--method keep]
"""
import argparse

from keep_client import KeepError, ManagerClient, WorkerClient

SKILLS = ["walk to the kitchen", "open the fridge", "grab the milk", "close the fridge",
          "walk to the table", "put the milk on the table", "done"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manager", default="tcp://127.0.0.1:7601")
    ap.add_argument("--worker", default="tcp://127.0.0.1:7602")
    ap.add_argument("--agent", default="robot1")
    ap.add_argument("--method", default="keep")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    with ManagerClient(a.manager) as memory, WorkerClient(a.worker) as planner:
        # What the robot knows: object states, and an example plan of another task.
        milk = memory.write(a.agent, "The milk is in the fridge.", kind="object_state").id
        memory.write(a.agent, "The fridge is in the kitchen.", kind="object_state")
        memory.write(a.agent, "Example plan for 'bring an apple': walk to the kitchen, grab the "
                     "apple, walk to the table, put the apple on the table.", kind="example_plan")
        instruction = "Bring the milk to the table."
        history = []
        for _ in range(a.steps):
            try:
                choice = planner.score(a.agent, instruction, SKILLS, history=history,
                                       method=a.method)
            except KeepError as e:  # typed: e.code is the wire code ("timeout", ...)
                print(f"planner failed ({e.code}): {e.message}")
                return 1
            skill = SKILLS[choice.best]
            print(f"step {len(history) + 1}: {skill}  (TTFT {choice.stats.ttft_seconds * 1e3:.1f} ms,"
                  f" recompute {choice.stats.recompute_ratio:.2f},"
                  f" {choice.stats.entries_hit} segments' KV reused)")
            if skill == "done":
                break
            history.append(skill)
            # What acting changed: a task record, and the milk's new place once grabbed.
            memory.write(a.agent, f"Task done: {skill}.", kind="task_record")
            if skill == "grab the milk":
                memory.update(a.agent, milk, "The robot holds the milk.")
            memory.advance_step(a.agent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
