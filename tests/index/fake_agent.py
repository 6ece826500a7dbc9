"""A stand-in agent over real ZMQ sockets on 127.0.0.1, for the subscriber's edge cases.

It publishes exactly the events a test scripts (so a test can skip sequence
numbers or change the agent id) and answers ``hello`` and ``snapshot`` from
the keys it says it holds; answers can be withheld or delayed. Its events port takes the
index's token as the agent's does (the agent's own PLAIN authenticator).
"""

from __future__ import annotations

import threading
import time
import uuid

import zmq

from kvpool.agent.edge.zap import PlainAuthenticator
from kvpool.common import protocol as p
from kvpool.common.auth import Role, TokenAuthority
from kvpool.common.kube.discovery import AgentEndpoint
from kvpool.common.protocol import EVENTS_TOPIC, ChunkEvent, encode_event
from tests.support.agent_process import INDEX_TOKEN

TENANT = "0123456789abcdef0123456789abcdef"


class FakeAgent:
    def __init__(self) -> None:
        self._authenticator = PlainAuthenticator(
            TokenAuthority({"indexes": INDEX_TOKEN}), (Role.INDEX,), domain="fake-events"
        )
        self._authenticator.start()
        self._pub: zmq.Socket[bytes] = self._authenticator.context.socket(zmq.XPUB)
        self._authenticator.protect(self._pub)  # XPUB: sees subscriptions
        self._pub.setsockopt(zmq.LINGER, 0)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub.bind("tcp://127.0.0.1:*")
        self._router: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self._lock = threading.Lock()
        self.agent_id = uuid.uuid4().hex
        self.seq = 0
        self.keys: list[bytes] = []
        self.nvme: list[bytes] = []
        """The NVMe tier's keys, listed by snapshots that ask for them (when ``lists_nvme``)."""
        self.lists_nvme = True
        self.answering = True
        self.snapshot_delay = 0.0
        self.snapshots = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def endpoint(self, node: str) -> AgentEndpoint:
        return AgentEndpoint(
            node,
            self._router.getsockopt_string(zmq.LAST_ENDPOINT),
            self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
        )

    def wait_for_subscriber(self, timeout: float = 5.0) -> None:
        assert self._pub.poll(int(timeout * 1000)), "nobody subscribed"
        assert self._pub.recv()[:1] == b"\x01"

    def publish(
        self, kind: str, keys: list[bytes], *, tier: str = "l1", lost: bool = False
    ) -> None:
        """Change the keys and publish the event; ``lost``: the event never reaches anyone."""
        with self._lock:
            self.seq += 1
            held = {"l1": self.keys, "nvme": self.nvme}.get(tier)
            if held is not None:
                if kind == "stored":
                    held += [k for k in keys if k not in held]
                else:
                    held[:] = [k for k in held if k not in keys]
            event = ChunkEvent(self.seq, self.agent_id, kind, tier, TENANT, keys)
        if not lost:
            self._pub.send_multipart([EVENTS_TOPIC, encode_event(event)])

    def restart(self, keep_keys: bool) -> None:
        with self._lock:
            self.agent_id = uuid.uuid4().hex
            self.seq = 0
            if not keep_keys:
                self.keys, self.nvme = [], []

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._pub.close()
        self._authenticator.stop()

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._router.poll(20):
                    self._answer(*self._router.recv_multipart())
        finally:
            self._router.close()

    def _answer(self, identity: bytes, body: bytes) -> None:
        request = p.decode_request(body)
        with self._lock:
            agent_id, seq, keys, nvme = self.agent_id, self.seq, list(self.keys), list(self.nvme)
        reply: p.Reply
        if isinstance(request, p.Hello):
            reply = p.HelloReply(request.req, p.PROTOCOL_VERSION, 7, agent_id, "", 0, 0, 0, 0, 0)
        elif isinstance(request, p.Snapshot):
            if not self.answering:
                return
            self.snapshots += 1
            time.sleep(self.snapshot_delay)  # the state is the one at the request
            listed = {"nvme": {TENANT: nvme}} if "nvme" in request.tiers and self.lists_nvme else {}
            reply = p.SnapshotReply(request.req, agent_id, seq, {TENANT: keys}, listed)
        else:
            reply = p.Error(request.req, p.ErrorCode.UNKNOWN_OP, "not faked")
        self._router.send_multipart([identity, p.encode(reply)])
