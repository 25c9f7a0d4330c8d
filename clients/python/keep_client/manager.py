"""ManagerClient: an agent's side of keep-manager (proto/manager.capnp, docs/protocol.md)."""
import re
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import _schema, errors
from ._channel import Channel, Client

# The end of a `moved` answer's message: "... is served by NODE at ENDPOINT".
_MOVED_AT = re.compile(r" at (\S+)$")

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
                 directory=None):
        super().__init__(endpoint, timeout, _schema.manager)
        # Cluster mode: a keep_client.cluster.EtcdDirectory, asked first for an agent not seen yet.
        self._directory = directory
        # Cluster mode (docs/cluster.md): a node answers `moved` for an agent another node
        # serves, naming it; the call is sent there, and the agent's node remembered.
        self._follow_moved = follow_moved
        self._owners = {}    # agent -> endpoint
        self._others = {}    # endpoint -> Channel (other nodes)

    def _channel(self, endpoint):
        if endpoint == self._ch.endpoint:
            return self._ch
        ch = self._others.get(endpoint)
        if ch is None:
            ch = self._others[endpoint] = Channel(endpoint, self._ch.timeout, _schema.manager)
        return ch

    def _routed(self, agent, kind, fill):
        if agent not in self._owners and self._directory is not None:
            found = self._directory.owner_endpoint(agent)
            if found:
                self._owners[agent] = found
        endpoint = self._owners.get(agent, self._ch.endpoint)
        # A shard moving while we follow it: a few hops; one between owners (released, not yet
        # taken: "no owner yet") or whose new owner replays its log ("being taken over"): a few
        # short waits (nothing was applied).
        for _ in range(16):
            try:
                return self._channel(endpoint).call(kind, fill)
            except errors.MovedError as e:
                at = _MOVED_AT.search(e.message)
                if not self._follow_moved or at is None or at.group(1) == endpoint:
                    raise
                endpoint = self._owners[agent] = at.group(1)
            except errors.UnavailableError as e:
                if not self._follow_moved or not any(
                        m in e.message for m in ("no owner yet", "being taken over")):
                    raise
                time.sleep(0.25)
        return self._channel(endpoint).call(kind, fill)

    def close(self):
        for ch in self._others.values():
            ch.close()
        self._others.clear()
        super().close()

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
        return _written(self._routed(agent, "writeMemory", fill))

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
        return _written(self._routed(agent, "updateMemory", fill))

    def delete(self, agent: str, id: int) -> None:
        def fill(r):
            r.agent = agent
            r.id = id
        self._routed(agent, "deleteMemory", fill)

    def advance_step(self, agent: str, by: int = 1) -> int:
        def fill(r):
            r.agent = agent
            r.by = by
        return self._routed(agent, "advanceStep", fill).get("step", 0)

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
