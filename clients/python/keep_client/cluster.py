"""Cluster mode's directory for the Python client (docs/cluster.md): which node serves an agent,
read from etcd through its JSON gateway, as keep-manager's placement writes it.

    d = EtcdDirectory(["http://127.0.0.1:23790"], shards=64)
    ManagerClient("tcp://any-node:7601", directory=d)   # asks d first, then follows `moved`
    WorkerClient("tcp://any-node:7602", directory=d)    # the owner's worker, then `moved`
"""
import base64
import json
import urllib.error
import urllib.request

_MASK = 0xFFFFFFFFFFFFFFFF


def shard_of(agent: str, shards: int) -> int:
    """The agent's shard: jump consistent hash of FNV-1a 64 (shared/cluster/placement.cpp)."""
    if shards <= 0:
        return 0
    key = 1469598103934665603
    for c in agent.encode("utf-8"):
        key = ((key ^ c) * 1099511628211) & _MASK
    b, j = -1, 0
    while j < shards:
        b = j
        key = (key * 2862933555777941757 + 1) & _MASK
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def _b64(s):
    return base64.b64encode(s.encode()).decode()


class EtcdDirectory:
    """Owners of shards and nodes' endpoints, read from etcd (`prefix`/shards/N/owner,
    `prefix`/nodes/NODE, and `prefix`/workers/NODE for the node's keep-worker when its manager
    names one: --advertise-worker). `shards` must be the managers' --shards. Lookups hit etcd
    each time; the clients cache the answer per agent and refresh it on a `moved` answer."""

    def __init__(self, endpoints, shards=64, prefix="/keep", timeout=2.0):
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        self.endpoints = list(endpoints)
        self.shards = shards
        self.prefix = prefix
        self.timeout = timeout

    def _get(self, key):
        body = json.dumps({"key": _b64(key)}).encode()
        last = None
        for ep in self.endpoints:  # the members in turn, as the C++ client does
            try:
                req = urllib.request.Request(ep + "/v3/kv/range", data=body, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    kvs = json.loads(r.read()).get("kvs", [])
                return base64.b64decode(kvs[0]["value"]).decode() if kvs else None
            except (urllib.error.URLError, OSError) as e:
                last = e
        raise ConnectionError(f"no etcd member answered: {last}")

    def owner_endpoint(self, agent):
        """The endpoint of the node serving `agent`, or None (no owner right now)."""
        return self._of_owner(agent, "nodes")

    def worker_endpoint(self, agent):
        """The endpoint of the keep-worker of the node serving `agent`, or None (no owner right
        now, or its manager named no worker)."""
        return self._of_owner(agent, "workers")

    def _of_owner(self, agent, registry):
        owner = self._get(f"{self.prefix}/shards/{shard_of(agent, self.shards)}/owner")
        if owner is None:
            return None
        node = owner.rsplit(" ", 1)[0]
        return self._get(f"{self.prefix}/{registry}/{node}")
