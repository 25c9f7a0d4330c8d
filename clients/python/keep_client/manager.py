"""ManagerClient: an agent's side of keep-manager (proto/manager.capnp, docs/protocol.md)."""
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import _schema, errors
from ._failover import _RETRY_WAIT, Routes, _lease_lapsed, _retry_here, _transport_failure
from ._channel import Client

def _unconfirmed(e):
    """The node's log of record did not confirm a mutation (it may or may not have landed); the
    node gave the shard up, to be taken again and its log replayed."""
    return isinstance(e, errors.UnavailableError) and "did not confirm" in e.message


def _gave_up(lost, last):
    """What a call that gives up raises: `last`, or, when a try of the mutation lost its answer,
    that loss (it may or may not be applied)."""
    if lost is None or last is lost:
        return last
    return errors.error_for(lost.code, f"{lost.message}; sent again with the same request id "
                            f"until the last answer ({last}): it may or may not be applied")


# The memory kinds, as the wire spells them.
KINDS = {"object_state": "objectState", "task_record": "taskRecord", "example_plan": "examplePlan"}


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() else c for c in str(name))


@dataclass
class Written:
    id: int
    version: int
    step: int


@dataclass
class KvSlice:
    index: int
    generation: int
    token_offset: int
    tokens: int
    joint: bool


@dataclass
class Segment:
    id: int
    text: str
    kind: str
    tokens: int
    version: int
    updated_step: int
    group_id: int
    group_state: str
    group_version: int
    score: float
    kv: Optional[KvSlice] = None


@dataclass
class Memory:
    id: int
    text: str
    kind: str
    tokens: int
    version: int
    updated_step: int
    group_id: int
    embedded: bool
    has_kv: bool


@dataclass
class Group:
    id: int
    state: str
    version: int
    segment_ids: List[int] = field(default_factory=list)
    tokens: int = 0
    last_change_step: int = 0


class ManagerClient(Client):
    """One blocking connection to keep-manager. Calls raise keep_client.errors.KeepError (its
    subclass for the wire code) on failure; `timeout` (seconds) bounds each call."""

    def __init__(self, endpoint="tcp://127.0.0.1:7601", timeout=20.0, follow_moved=True,
                 directory=None, failover_wait=15.0):
        super().__init__(endpoint, timeout, _schema.manager)
        # Cluster mode (docs/cluster.md): a node answers `moved` for an agent another node
        # serves, naming it; the call is sent there, and the agent's node remembered. A node that
        # stops answering (or answers `unavailable`) is forgotten and the call sent again through
        # the directory or `endpoint` -- a mutation too, with the same request id (every mutation
        # carries one: client_id and this client's count of mutations), so the node that took
        # the agent over answers it as the dead one did if that one applied it, and applies it
        # otherwise: exactly once. Routed anew for up to `failover_wait` seconds (the shard is
        # taken over a lease plus a round after its node died).
        self._follow_moved = follow_moved
        self._failover_wait = failover_wait
        self.client_id = secrets.randbits(64) or 1  # the request ids' client part, never 0
        self._seq = itertools.count(1)
        self.mutations_resent = 0  # mutations sent again after their answer was lost
        # Cluster mode: `directory`, a keep_client.cluster.EtcdDirectory, is asked first for an
        # agent not seen yet (and again after its node stopped answering).
        self._routes = Routes(self._ch.endpoint,
                              directory.owner_endpoint if directory is not None else None)
        self.moved_answers = 0  # `moved` answers received (the directory spares them)

    def _routed(self, agent, kind, fill, mutation=False):
        endpoint = self._routes.first(agent)
        header = {"clientId": self.client_id, "clientSeq": next(self._seq)} if mutation else None
        lost = None  # a try of the mutation without an answer (or unconfirmed): maybe applied
        resent = False
        failover_until = None  # set once the agent's node stopped answering
        # A shard moving while we follow it: a few hops; one between owners (released, not yet
        # taken: "no owner yet") or whose new owner replays its log ("being taken over"): a few
        # short waits (nothing was applied).
        attempt = 0
        while True:
            if lost is not None and not resent:
                resent = True
                self.mutations_resent += 1
            try:
                return self._channel(endpoint).call(kind, fill, header=header)
            except errors.MovedError as e:
                self.moved_answers += 1
                at = errors.moved_target(e.message)
                if not self._again(attempt, failover_until) or at is None or at == endpoint:
                    raise _gave_up(lost, e) from None
                endpoint = self._routes.after_moved(agent, at)
            except (errors.UnavailableError, errors.RequestTimeoutError) as e:
                if _retry_here(e):
                    if not self._again(attempt, failover_until):
                        raise _gave_up(lost, e) from None
                    time.sleep(_RETRY_WAIT)
                    attempt += 1
                    continue
                if _lease_lapsed(e):
                    # Ask again shortly, wherever the directory (or the configured endpoint)
                    # says: the node answering may serve it again once it reaches etcd.
                    if failover_until is None:
                        failover_until = time.monotonic() + self._failover_wait
                    if not self._again(attempt, failover_until):
                        raise _gave_up(lost, e) from None
                    self._routes.forget(agent)
                    time.sleep(_RETRY_WAIT)
                    endpoint = self._routes.lookup(agent)
                    attempt += 1
                    continue
                # The agent's node stopped answering or cannot serve it now: forget it, and send
                # the call (a read, or a mutation with its request id) to the node that takes its
                # shard over.
                if failover_until is None:
                    failover_until = time.monotonic() + self._failover_wait
                self._routes.forget(agent)
                if _transport_failure(e):
                    self._routes.silent.mark(endpoint)
                if mutation and lost is None and (_transport_failure(e) or _unconfirmed(e)):
                    lost = e
                if not self._again(attempt, failover_until):
                    raise _gave_up(lost, e) from None
                nxt = self._routes.lookup(agent)
                if nxt == endpoint and self._routes.has_directory and _transport_failure(e):
                    # etcd names the silent node (here also the configured endpoint) until its
                    # lease runs out: ask etcd again shortly while failover_wait lasts.
                    while (nxt == endpoint and self._routes.silent.contains(endpoint)
                           and time.monotonic() < failover_until):
                        time.sleep(_RETRY_WAIT)
                        nxt = self._routes.lookup(agent)
                    if nxt == endpoint:
                        if time.monotonic() >= failover_until:
                            raise _gave_up(lost, e) from None
                        attempt += 1
                        continue  # silent long enough: it may answer again (restarted)
                if nxt == endpoint:
                    if _unconfirmed(e):  # the node gave the shard up: it is taken again shortly
                        time.sleep(_RETRY_WAIT)
                        attempt += 1
                        continue
                    raise _gave_up(lost, e) from None  # nowhere else to ask
                endpoint = nxt
            attempt += 1

    def _again(self, attempt, failover_until):
        """Whether a call may be sent once more: 16 tries, or until failover_until."""
        return self._follow_moved and (
            attempt < 15 or (failover_until is not None and time.monotonic() < failover_until))

    def ping(self) -> str:
        return self._ch.call("ping", None).get("serverVersion", "")

    def write(self, agent: str, text: str, kind: str = "object_state", id: Optional[int] = None,
              step: Optional[int] = None) -> Written:
        def fill(r):
            r.agent = agent
            r.text = text
            r.kind = _kind(kind)
            if id is not None:
                r.hasId = True
                r.id = id
            if step is not None:
                r.hasStep = True
                r.step = step
        return _written(self._routed(agent, "writeMemory", fill, mutation=True))

    def update(self, agent: str, id: int, text: str, kind: Optional[str] = None,
               step: Optional[int] = None) -> Written:
        def fill(r):
            r.agent = agent
            r.id = id
            r.text = text
            if kind is not None:
                r.hasKind = True
                r.kind = _kind(kind)
            if step is not None:
                r.hasStep = True
                r.step = step
        return _written(self._routed(agent, "updateMemory", fill, mutation=True))

    def delete(self, agent: str, id: int) -> None:
        def fill(r):
            r.agent = agent
            r.id = id
        self._routed(agent, "deleteMemory", fill, mutation=True)

    def advance_step(self, agent: str, by: int = 1) -> int:
        def fill(r):
            r.agent = agent
            r.by = by
        return self._routed(agent, "advanceStep", fill, mutation=True).get("step", 0)

    def retrieve(self, agent: str, query: str, k: int) -> List[Segment]:
        def fill(r):
            r.agent = agent
            r.query = query
            r.k = k
        out = []
        for s in self._routed(agent, "retrieve", fill).get("segments", []):
            kv = None
            if s.get("hasKv"):
                slc = s.get("kv", {})
                e = slc.get("entry", {})
                kv = KvSlice(e.get("index", 0), e.get("generation", 0), slc.get("tokenOffset", 0),
                             slc.get("tokens", 0), slc.get("joint", False))
            out.append(Segment(s.get("id", 0), s.get("text", ""), _snake(s.get("kind", "unknown")),
                               s.get("tokens", 0), s.get("version", 0), s.get("updatedStep", 0),
                               s.get("groupId", 0), _snake(s.get("groupState", "unknown")),
                               s.get("groupVersion", 0), s.get("score", 0.0), kv))
        return out

    def list_memories(self, agent: str, after_id: int = 0,
                      limit: int = 0) -> Tuple[List[Memory], bool]:
        def fill(r):
            r.agent = agent
            r.afterId = after_id
            r.limit = limit
        page = self._routed(agent, "listMemories", fill)
        mems = [Memory(m.get("id", 0), m.get("text", ""), _snake(m.get("kind", "unknown")),
                       m.get("tokens", 0), m.get("version", 0), m.get("updatedStep", 0),
                       m.get("groupId", 0), m.get("embedded", False), m.get("hasKv", False))
                for m in page.get("memories", [])]
        return mems, page.get("more", False)

    def list_groups(self, agent: str) -> List[Group]:
        def fill(r):
            r.agent = agent
        return [Group(g.get("id", 0), _snake(g.get("state", "unknown")), g.get("version", 0),
                      list(g.get("segmentIds", [])), g.get("tokens", 0), g.get("lastChangeStep", 0))
                for g in self._routed(agent, "listGroups", fill).get("groups", [])]

    def stats(self) -> dict:
        s = self._ch.call("stats", None)
        out = {k: v for k, v in s.items() if k != "counters"}
        for c in s.get("counters", []):
            out[c.get("name", "")] = c.get("value", 0)
        return out


def _kind(kind):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind]


def _written(r):
    return Written(r.get("id", 0), r.get("version", 0), r.get("step", 0))
