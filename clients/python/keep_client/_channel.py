"""The DEALER end of a KEEP protocol: one request, one answer at a time (docs/protocol.md).

Frames are [empty][payload], the payload one unpacked Cap'n Proto message. Each request carries
a fresh requestId and the call's timeout (timeoutMs); an answer with another id (a late answer to
an abandoned request) is dropped. After a timeout the socket is replaced, so nothing stale can
arrive on the next call; ZeroMQ reconnects to a restarted server by itself.
"""
import itertools
import time

import zmq

from . import errors


class Channel:
    def __init__(self, endpoint, timeout, schema, max_request_bytes=1 << 20,
                 max_response_bytes=64 << 20, context=None):
        if timeout <= 0:
            raise ValueError("timeout must be > 0 seconds")
        self.endpoint = endpoint
        self.timeout = timeout
        self.schema = schema
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(int(time.time_ns() & 0xFFFFFFFF) << 16 | 1)
        self._socket = None
        self._connect()

    def _connect(self):
        if self._socket is not None:
            self._socket.close(linger=0)
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_response_bytes + 4096)
        s.connect(self.endpoint)
        self._socket = s

    def close(self):
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def call(self, kind, fill, timeout=None, header=None):
        """Sends a Request whose union member `kind` is set by fill(member_builder) and returns
        the Response reader of that kind (raising the KeepError of an error answer). `header`:
        other fields of the Request itself, by name (a mutation's clientId and clientSeq)."""
        if self._socket is None:
            raise errors.error_for("unavailable", "the channel is closed")
        wait = self.timeout if timeout is None else timeout
        request_id = next(self._ids) & 0xFFFFFFFFFFFFFFFF
        msg = self.schema.Request.new_message()
        msg.protocolVersion = self.schema.protocolVersion
        msg.requestId = request_id
        msg.timeoutMs = max(1, min(int(wait * 1000), 0xFFFFFFFF))
        for name, value in (header or {}).items():
            setattr(msg, name, value)
        if _is_void(msg, kind):
            setattr(msg, kind, None)
        else:
            member = msg.init(kind)
            if fill is not None:
                fill(member)
        payload = msg.to_bytes()
        if len(payload) > self.max_request_bytes:
            raise errors.error_for("too_large", f"request of {len(payload)} bytes exceeds the "
                                   f"limit of {self.max_request_bytes}")
        try:
            self._socket.send_multipart([b"", payload])
            deadline = time.monotonic() + wait
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._socket.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self._connect()  # a late answer must not reach the next call
                    raise errors.error_for(
                        "timeout", f"no answer from {self.endpoint} within {int(wait * 1000)} ms")
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 2 or frames[0] != b"":
                    continue
                reply = self._decode(frames[1])
                if reply is None or reply.get("requestId") != request_id:
                    continue  # not this call's answer
                if "error" in reply:
                    e = reply["error"]
                    raise errors.from_wire(e.get("code", "unknown"), e.get("message", ""))
                if kind not in reply:
                    raise errors.error_for("malformed", f"answer without {kind}: {sorted(reply)}")
                return reply[kind]
        except zmq.ZMQError as e:
            self._connect()
            raise errors.error_for("unavailable", f"zmq: {e}") from e

    def _decode(self, payload):
        """The Response as plain Python data (dicts, lists, enum names), or None."""
        try:
            limit = max(1 << 16, 4 * len(payload) // 8)
            with self.schema.Response.from_bytes(payload, traversal_limit_in_words=limit) as r:
                return r.to_dict()
        except Exception:  # noqa: BLE001 -- a frame that does not decode is not this call's
            return None


def _is_void(msg, kind):
    field = msg.schema.fields[kind].proto
    return field.which() == "slot" and str(field.slot.type.which()) == "void"


class Client:
    """What both clients share: one channel, and one to each other node a cluster answer sent
    them to (_channel), all closed by close() or a with-block."""

    def __init__(self, endpoint, timeout, schema):
        self._ch = Channel(endpoint, timeout, schema)
        self._schema = schema
        self._others = {}  # endpoint -> Channel (other nodes)

    def _channel(self, endpoint):
        if endpoint == self._ch.endpoint:
            return self._ch
        ch = self._others.get(endpoint)
        if ch is None:
            ch = self._others[endpoint] = Channel(endpoint, self._ch.timeout, self._schema)
        return ch

    def close(self):
        for ch in self._others.values():
            ch.close()
        self._others.clear()
        self._ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
