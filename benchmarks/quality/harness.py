"""The planning-quality harness shared by wah.py and alfred.py (issue 30): episodes of next-step
decisions run through the real services, every method scored on the same memory state.

An Episode is an agent's task: its instruction, the memories it starts with, and its decisions in
order. Each Decision has the steps done so far (the query's history), the candidates, the gold
candidate, and the memory changes that taking the gold step makes (applied after the decision):
("set", slot, text, kind) writes a memory the first time its slot is set and updates it later.
"""
import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import List, Tuple

from keep_client import ManagerClient, WorkerClient
from keep_client.local import ROOT, LocalServices

import report

DATA = ROOT.parent / "shared" / "data" / "planning"


@dataclass
class Decision:
    history: List[str]
    candidates: List[str]
    gold: str
    changes: List[Tuple[str, str, str]] = field(default_factory=list)  # (slot, text, kind)


@dataclass
class Episode:
    name: str
    kind: str                 # task type
    instruction: str
    memories: List[Tuple[str, str]]  # (text, kind) written first
    decisions: List[Decision]


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def kl(p, q):
    return sum(a * (math.log(a) - math.log(max(b, 1e-300))) for a, b in zip(p, q) if a > 0)


def parse_method(spec):
    """Parses "keep:decay=0.8+max_hops=0" into ("keep", {"decay": 0.8, "max_hops": 0}): knobs joined by
    "+", since --methods is a comma-separated list."""
    name, _, rest = spec.partition(":")
    knobs = {}
    for kv in filter(None, rest.split("+")):
        k, _, v = kv.partition("=")
        knobs[k] = float(v) if k in ("decay", "cacheblend_ratio") else int(v)
    return name, knobs


def wait_kv(m, agent, deadline_s):
    deadline = time.monotonic() + deadline_s
    while True:
        mems, _ = m.list_memories(agent, limit=1000)
        if all(x.has_kv for x in mems) or time.monotonic() > deadline:
            return sum(x.has_kv for x in mems), len(mems)
        time.sleep(0.05)


def forget(m, agent):
    """The task is over: its agent's memories are deleted, which frees their KV entries (a region
    that only grows fills up, and then no new memory gets its KV)."""
    while True:
        mems, _ = m.list_memories(agent, limit=1000)
        if not mems:
            return
        for x in mems:
            m.delete(agent, x.id)


def order(methods):
    """`prefix` first (its cache then holds the previous decision's prompt, as a serving engine's
    would, not this decision's from another method) and `full` last."""
    if "full" not in methods:
        methods = methods + ["full"]
    rest = [m for m in methods if m not in ("prefix", "full")]
    return (["prefix"] if "prefix" in methods else []) + rest + ["full"]


def choice_scores(r, score):
    """Per-candidate scores: Σ log-prob (`sum`) or its mean per token (`mean`)."""
    if score == "sum":
        return list(r.log_probs)
    return [lp / max(n, 1) for lp, n in zip(r.log_probs, r.tokens)]


def run(m, w, episodes, methods, k, kv_wait, out, tag, score="mean", label=""):
    """Scores every decision of `episodes` with `methods`; a row's method is the spec, with
    " [label]" after it when a label is given (an ablation's rows beside the main run's)."""
    methods = order(methods)
    rows = []
    for ei, ep in enumerate(episodes):
        agent = f"{tag}{ei}"
        for text, kind in ep.memories:
            m.write(agent, text, kind=kind)
        slots, writes_s = {}, 0.0
        for t, d in enumerate(ep.decisions):
            t0 = time.monotonic()
            have, total = wait_kv(m, agent, kv_wait)
            waited = time.monotonic() - t0
            gold_i = d.candidates.index(d.gold)
            results, call_s = {}, {}
            for spec in methods:
                name, knobs = parse_method(spec)
                t0 = time.monotonic()
                results[spec] = w.score(agent, ep.instruction, d.candidates, history=d.history,
                                        k=k, method=name, **knobs)
                call_s[spec] = time.monotonic() - t0
            full_s = choice_scores(results["full"], score)
            full_p, full_best = softmax(full_s), max(range(len(full_s)), key=full_s.__getitem__)
            for spec in methods:
                r = results[spec]
                sc = choice_scores(r, score)
                best = max(range(len(sc)), key=sc.__getitem__)
                row = dict(episode=ep.name, kind=ep.kind, step=t,
                           method=f"{spec} [{label}]" if label else spec, best=best,
                           gold=gold_i, correct=best == gold_i, agree=best == full_best,
                           kl=kl(full_p, softmax(sc)), ratio=r.stats.recompute_ratio,
                           ttft=r.stats.ttft_seconds, hit=r.stats.entries_hit, memories=total,
                           with_kv=have, candidates=len(d.candidates), score=score,
                           kv_wait_s=waited, call_s=call_s[spec], writes_s=writes_s)
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
            if out:
                out.flush()
            t0 = time.monotonic()  # the writes the next decision waits on (its writes_s)
            for slot, text, kind in d.changes:
                if slot not in slots:
                    slots[slot] = (m.write(agent, text, kind=kind).id, text)
                elif slots[slot][1] != text:  # unchanged states are not rewritten
                    m.update(agent, slots[slot][0], text)
                    slots[slot] = (slots[slot][0], text)
            m.advance_step(agent)
            writes_s = time.monotonic() - t0
        forget(m, agent)
        print(f"episode {ei + 1}/{len(episodes)} ({ep.kind}, {len(ep.decisions)} decisions)",
              file=sys.stderr)
    return rows


def summarize(rows):
    """The report's table (report.py), methods in the order they ran."""
    return report.table(report.aggregate(rows))


def arguments(description, default_methods="full,prefix,full_reuse,cacheblend,epic,keep"):
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data-dir", default=str(DATA))
    ap.add_argument("--episodes", type=int, default=0, help="episodes sampled (0: all)")
    ap.add_argument("--max-steps", type=int, default=0, help="decisions per episode (0: all)")
    ap.add_argument("--examples", type=int, default=3, help="example plans of other tasks")
    ap.add_argument("--k", type=int, default=32, help="segments retrieved per decision")
    ap.add_argument("--methods", default=default_methods)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-wait", type=float, default=30.0)
    ap.add_argument("--score", choices=("mean", "sum"), default="mean",
                    help="a candidate's score: mean log-prob per token (default; Σ favours the "
                         "shortest candidates) or Σ log-prob")
    ap.add_argument("--out", help="JSON lines, one per decision and method")
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="run episodes I, I+N, I+2N, ... of the sampled ones (parallel runs, each "
                         "with its own services: run.py)")
    ap.add_argument("--label", default="", help="rows' methods as 'METHOD [LABEL]' (ablations)")
    ap.add_argument("--device", default="cpu", help="for the worker this script starts")
    ap.add_argument("--manager", help="a running keep-manager (with --worker): start none")
    ap.add_argument("--worker")
    ap.add_argument("--check-agree", help="exit 1 unless this method agrees with full everywhere")
    ap.add_argument("--manager-args", default="--static-after-steps 2",
                    help="flags of the keep-manager this script starts (ablations: "
                         "'--static-after-steps 1000000' keeps every group dynamic)")
    ap.add_argument("--shm-bytes", default="512MiB",
                    help="the KV region of the manager this script starts (an episode's memories "
                         "and their static groups' entries must fit)")
    ap.add_argument("--worker-args", default="",
                    help="flags of the keep-worker it starts (ablations: "
                         "'--ablate-position-correction true', '--ablate-produce-prefix true', "
                         "and per method knobs: keep:max_hops=0 for hop 0 only)")
    return ap


def shard(episodes, spec):
    """Episodes I, I+N, ... for spec "I/N" (0 <= I < N)."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        sys.exit(f"--shard {spec!r}: expected I/N")
    if not 0 <= i < n:
        sys.exit(f"--shard {spec!r}: I must be in [0, N)")
    return episodes[i::n]


def main(a, episodes, tag):
    """Runs `episodes` (services started unless --manager/--worker), prints the table, applies
    --check-agree."""
    episodes = shard(episodes, a.shard)
    out = open(a.out, "w") if a.out else None
    svc = None
    try:
        if a.manager and a.worker:
            m_ep, w_ep = a.manager, a.worker
        else:
            svc = LocalServices(worker=True, device=a.device, shm_bytes=a.shm_bytes,
                                extra_manager=a.manager_args.split(),
                                # ALFRED's widest decisions have 65+ admissible actions
                                extra_worker=["--max-candidates", "256"] + a.worker_args.split())
            m_ep, w_ep = svc.manager.endpoint, svc.worker.endpoint
        with ManagerClient(m_ep, timeout=60) as m, WorkerClient(w_ep, timeout=300) as w:
            rows = run(m, w, episodes, a.methods.split(","), a.k, a.kv_wait, out,
                                f"{tag}{a.seed}_", a.score, a.label)
    finally:
        if out:
            out.close()
        if svc:
            svc.close()
    print(summarize(rows))
    if a.check_agree:
        want = f"{a.check_agree} [{a.label}]" if a.label else a.check_agree
        rs = [r for r in rows if r["method"] == want]
        bad = [r for r in rs if not r["agree"]]
        if not rs or bad:
            sys.exit(f"{tag}: {a.check_agree} disagrees with full on {len(bad)} of {len(rs)} "
                     "decisions")
        print(f"{a.check_agree} agrees with full on all {len(rs)} decisions")


def require(path):
    """Exits 77 (CTest's skip code) when the task material is not beside the checkout."""
    if not path.exists():
        print(f"no task material at {path} (../shared/data/planning): skipped", file=sys.stderr)
        sys.exit(77)
