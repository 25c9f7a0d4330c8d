"""WorkerClient: a planner's side of keep-worker (proto/worker.capnp, docs/protocol.md)."""
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from . import _schema, errors
from ._channel import Client
from ._failover import _RETRY_WAIT, Routes, _lease_lapsed, _retry_here, _transport_failure

# Method names as keep-worker's --method spells them, and their wire enumerants.
METHODS = {"full": "full", "prefix": "prefix", "full_reuse": "fullReuse",
           "cacheblend": "cacheblend", "epic": "epic", "keep": "keep"}
_METHOD_NAMES = {v: k for k, v in METHODS.items()}
# Knobs a request may override (None keeps the worker's default).
KNOBS = {"decay": ("hasDecay", "decay"), "query_rows": ("hasQueryRows", "queryRows"),
         "max_hops": ("hasMaxHops", "maxHops"),
         "cacheblend_ratio": ("hasCacheblendRatio", "cacheblendRatio"),
         "epic_tokens": ("hasEpicTokens", "epicTokens"),
         "anchor_tokens": ("hasAnchorTokens", "anchorTokens")}


@dataclass
class Stats:
    """What a request cost and reused (proto/worker.capnp Stats)."""
    ttft_seconds: float = 0.0
    retrieve_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prompt_tokens: int = 0
    memory_tokens: int = 0
    cached_prefix_tokens: int = 0
    recomputed_per_layer: List[int] = field(default_factory=list)
    recompute_ratio: float = 0.0
    bytes_loaded: int = 0
    entries_hit: int = 0
    entries_missing: int = 0
    entries_stale: int = 0
    entries_device: int = 0
    check_layers: List[int] = field(default_factory=list)
    hops: List[int] = field(default_factory=list)
    segments: List[int] = field(default_factory=list)
    method: str = ""


@dataclass
class Completion:
    text: str
    tokens: List[int]
    stats: Stats


@dataclass
class Scored:
    log_probs: List[float]  # one per candidate, in request order
    tokens: List[int]       # each candidate's token count
    best: int               # index of the highest log-prob
    stats: Stats


# Without a failed node, a shard that moves again while a call follows it: a few hops.
_MAX_HOPS = 4


class WorkerClient(Client):
    """One blocking connection to keep-worker. Calls raise keep_client.errors.KeepError (its
    subclass for the wire code); `timeout` (seconds) bounds each call and is sent with it, so a
    request still queued when it runs out is dropped by the worker.

    Cluster mode (docs/cluster.md): a worker plans only for its own node's agents (it reads their
    KV in its node's region) and answers `moved` for another node's, naming that node's worker;
    the call is sent there (a plan changes no memory, so sending it again is always safe) and the
    agent's worker remembered. With a `directory` (keep_client.cluster.EtcdDirectory) the owner's
    worker is read from etcd before an agent's first call. A worker that gives no answer within
    `timeout` is forgotten (and not asked again for a few seconds, even where a `moved` answer
    names it) and the call sent again through the directory or `endpoint` to the node that takes
    the agent over; one answered "no owner yet" or "being taken over" is sent again shortly. That
    goes on for up to `failover_wait` seconds after the first such answer, so a call takes at most
    timeout + failover_wait. follow_moved=False: every answer is raised as it is."""

    def __init__(self, endpoint="tcp://127.0.0.1:7602", timeout=60.0, follow_moved=True,
                 directory=None, failover_wait=15.0):
        super().__init__(endpoint, timeout, _schema.worker)
        self._follow_moved = follow_moved
        self._failover_wait = failover_wait
        self._routes = Routes(self._ch.endpoint,
                              directory.worker_endpoint if directory is not None else None)
        self.moved_answers = 0  # `moved` answers received (the directory spares them)
        self.calls_resent = 0  # calls sent again after no answer or "no owner yet"

    def _routed(self, agent, fill):
        endpoint = self._routes.first(agent)
        failover_until = None  # set once the agent's worker failed or its shard was moving
        resent = False
        attempt = 0
        while True:
            try:
                return self._channel(endpoint).call("complete", fill)
            except errors.MovedError as e:
                self.moved_answers += 1
                at = errors.moved_target(e.message)
                if not self._again(attempt, failover_until) or at is None or at == endpoint:
                    raise
                endpoint = self._routes.after_moved(agent, at)
            except (errors.UnavailableError, errors.RequestTimeoutError) as e:
                self._routes.forget(agent)  # routed anew (next time, if not now)
                no_answer = _transport_failure(e)
                if not (no_answer or _retry_here(e) or _lease_lapsed(e)):
                    raise  # e.g. the worker's queue is full
                if failover_until is None:
                    failover_until = time.monotonic() + self._failover_wait
                if no_answer:
                    self._routes.silent.mark(endpoint)
                if not self._again(attempt, failover_until):
                    raise
                if no_answer:
                    # The directory names the dead node until its lease runs out.
                    nxt = self._routes.lookup(agent)
                    while (nxt == endpoint and self._routes.has_directory
                           and time.monotonic() < failover_until):
                        time.sleep(_RETRY_WAIT)
                        nxt = self._routes.lookup(agent)
                    if nxt == endpoint:
                        raise  # nowhere else to ask
                    endpoint = nxt
                else:
                    time.sleep(_RETRY_WAIT)
                    if _lease_lapsed(e):
                        endpoint = self._routes.lookup(agent)
                if not resent:
                    resent = True
                    self.calls_resent += 1
            attempt += 1

    def _again(self, attempt, failover_until):
        """Whether a call may be sent once more: a few hops, or until failover_until."""
        return self._follow_moved and (
            attempt < _MAX_HOPS or (failover_until is not None
                                    and time.monotonic() < failover_until))

    def ping(self) -> Dict[str, str]:
        p = self._ch.call("ping", None)
        return {"server_version": p.get("serverVersion", ""), "model": p.get("model", "")}

    def complete(self, agent: str, instruction: str, history: Sequence[str] = (), k: int = 0,
                 method: Optional[str] = None, max_tokens: int = 0, temperature: float = 0.0,
                 **knobs) -> Completion:
        r = self._routed(agent, self._fill(agent, instruction, history, k, method, max_tokens,
                                           temperature, (), knobs))
        return Completion(r.get("text", ""), list(r.get("tokens", [])), _stats(r.get("stats", {})))

    def score(self, agent: str, instruction: str, candidates: Sequence[str],
              history: Sequence[str] = (), k: int = 0, method: Optional[str] = None,
              **knobs) -> Scored:
        if not candidates:
            raise ValueError("score needs at least one candidate")
        r = self._routed(agent, self._fill(agent, instruction, history, k, method, 0, 0.0,
                                           candidates, knobs))
        scores = r.get("scores", [])
        return Scored([s.get("logProb", 0.0) for s in scores], [s.get("tokens", 0) for s in scores],
                      r.get("best", 0), _stats(r.get("stats", {})))

    @staticmethod
    def _fill(agent, instruction, history, k, method, max_tokens, temperature, candidates, knobs):
        if method is not None and method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
        for name in knobs:
            if name not in KNOBS:
                raise ValueError(f"unknown knob {name!r}; knobs: {sorted(KNOBS)}")

        def fill(c):
            c.agent = agent
            c.instruction = instruction
            h = c.init("history", len(history))
            for i, s in enumerate(history):
                h[i] = s
            c.k = k
            c.method = METHODS[method] if method is not None else "unknown"
            c.maxTokens = max_tokens
            c.temperature = temperature
            cs = c.init("candidates", len(candidates))
            for i, s in enumerate(candidates):
                cs[i] = s
            kb = c.init("knobs")
            for name, value in knobs.items():
                if value is None:
                    continue
                has, field_name = KNOBS[name]
                setattr(kb, has, True)
                setattr(kb, field_name, value)
        return fill


def _stats(s):
    return Stats(s.get("ttftSeconds", 0.0), s.get("retrieveSeconds", 0.0),
                 s.get("prefillSeconds", 0.0), s.get("promptTokens", 0), s.get("memoryTokens", 0),
                 s.get("cachedPrefixTokens", 0), list(s.get("recomputedPerLayer", [])),
                 s.get("recomputeRatio", 0.0), s.get("bytesLoaded", 0), s.get("entriesHit", 0),
                 s.get("entriesMissing", 0), s.get("entriesStale", 0), s.get("entriesDevice", 0),
                 list(s.get("checkLayers", [])), list(s.get("hops", [])),
                 list(s.get("segments", [])), _METHOD_NAMES.get(s.get("method", ""), ""))
