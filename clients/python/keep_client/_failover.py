"""What the clients read from a failed call in cluster mode (docs/cluster.md, "Clients"):
whether the node gave no answer, or answered that the agent's shard is moving, and which
endpoints were silent lately. ManagerClient and WorkerClient route by the same rules."""
import time

from . import errors

# Between two tries of a call whose shard is between owners (seconds).
_RETRY_WAIT = 0.25
# An endpoint that gave no answer is not sent an agent's call again for this long (seconds), even
# when a `moved` answer names it: the answering node still sees the silent node's lease until it
# runs out (10 s by default), and each call to a dead node costs a whole timeout.
_SILENT_FOR = 5.0


def _transport_failure(e):
    """No answer at all (timeout, or ZeroMQ failing): the request may have been applied."""
    return isinstance(e, errors.RequestTimeoutError) or (
        isinstance(e, errors.UnavailableError) and e.message.startswith("zmq: "))


def _retry_here(e):
    """Nothing applied, and the same node serves the agent shortly: its shard between owners
    ("no owner yet") or replayed by its new owner ("being taken over"). A keep-worker passes its
    manager's answer on, so planners read the same words."""
    return isinstance(e, errors.UnavailableError) and any(
        m in e.message for m in ("no owner yet", "being taken over"))


def _lease_lapsed(e):
    """The node no longer serves the agent: its lease may have run out (it lost touch with etcd;
    nothing was applied). Another node takes the shard once etcd frees it: routed anew."""
    return isinstance(e, errors.UnavailableError) and "lease may have run out" in e.message


class SilentEndpoints:
    """Endpoints that gave no answer lately (_SILENT_FOR)."""

    def __init__(self):
        self._at = {}  # endpoint -> time.monotonic() it last gave no answer

    def mark(self, endpoint):
        self._at[endpoint] = time.monotonic()

    def contains(self, endpoint):
        at = self._at.get(endpoint)
        return at is not None and time.monotonic() - at < _SILENT_FOR


class Routes:
    """Where a client sends an agent's calls: the node remembered for it (followed `moved`, or
    named by the directory), else the directory's answer, else the configured endpoint -- never a
    node that gave no answer lately. `find(agent)` asks the directory (None: it names none)."""

    def __init__(self, configured, find=None):
        self._configured = configured
        self._find = find
        self._owners = {}  # agent -> endpoint
        self.silent = SilentEndpoints()

    @property
    def owners(self):
        """agent -> the endpoint remembered for it (a copy)."""
        return dict(self._owners)

    @property
    def has_directory(self):
        return self._find is not None

    def first(self, agent):
        """Where `agent`'s call goes first; one remembered on a node that just stopped answering
        (for another agent's call) is routed anew, rather than costing a timeout of its own."""
        endpoint = self._owners.get(agent)
        if endpoint is None or self.silent.contains(endpoint):
            self._owners.pop(agent, None)
            endpoint = self.lookup(agent)
        return endpoint

    def lookup(self, agent):
        """The directory's answer when it names a node that answers, else the configured
        endpoint (which answers moved or "retry")."""
        if self._find is not None:
            try:
                found = self._find(agent)
            except (OSError, ValueError, KeyError):
                found = None  # etcd unreadable: the configured endpoint routes
            if found and not self.silent.contains(found):
                self._owners[agent] = found
                return found
        return self._configured

    def after_moved(self, agent, target):
        """Where the call goes after `moved` named `target`: there (remembered), or, when
        `target` gave no answer lately -- the answering node still sees its lease until it runs
        out -- wherever lookup says after a short wait."""
        if self.silent.contains(target):
            self._owners.pop(agent, None)
            time.sleep(_RETRY_WAIT)
            return self.lookup(agent)
        self._owners[agent] = target
        return target

    def forget(self, agent):
        self._owners.pop(agent, None)
