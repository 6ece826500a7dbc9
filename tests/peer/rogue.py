"""A peer that proves the pool's credential and then misbehaves, as the agent under test
sees it over a real connection: it claims every chunk, then answers a get with another
tenant's chunk, flipped bytes, half a body before it dies, or nothing at all; sealed, or,
for the ``-plaintext`` behaviours, as a pool that protects integrity only sends."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Literal

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.peer.session import accept_session
from kvpool.agent.peer.transport import PeerChannel, TcpChannel, TcpTransport
from kvpool.agent.peer.wire import Exists, Get, Have, Object, WireError, frame
from kvpool.common.keyring import Keyring

Behaviour = Literal[
    "other-tenant", "flipped", "other-tenant-plaintext", "flipped-plaintext", "cut", "stall"
]


class RoguePeer:
    def __init__(
        self, behaviour: Behaviour, key_dir: Path, pool: str, host: str, chunk: bytes
    ) -> None:
        self.behaviour = behaviour
        self.node = f"rogue-{behaviour}"
        self.pool = pool
        self.chunk = chunk
        """What it seals for any key (the real chunk's bytes, where the test wants them)."""
        self.keyring = Keyring(key_dir, what="peer key")
        sealed = not behaviour.endswith("-plaintext")
        self.codec = ObjectCodec(self.keyring, pool, seal=sealed, buffers=BufferPool())
        self.listener = TcpTransport().listen(host, 0, io_timeout=30.0)
        self.address = self.listener.address
        self.gets = 0
        self.asked = 0
        """Exists requests it answered (whether it was asked which chunks it holds)."""
        self._stopped = threading.Event()
        self._channels: list[PeerChannel] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def entry(self) -> str:
        """Its line in an agent's ``peers.agents``."""
        return f"{self.node}={self.address}"

    def close(self) -> None:
        self._stopped.set()
        self.listener.close()
        for channel in self._channels:
            channel.close()

    def _accept(self) -> None:
        while True:
            try:
                channel = self.listener.accept()
            except OSError:
                return
            self._channels.append(channel)
            threading.Thread(target=self._serve, args=(channel,), daemon=True).start()

    def _serve(self, channel: PeerChannel) -> None:
        with contextlib.closing(channel), contextlib.suppress(OSError, WireError, TimeoutError):
            session = accept_session(channel, self.keyring, self.pool, self.node)
            while True:
                request, _ = channel.receive()
                if isinstance(request, Exists):
                    self.asked += 1
                    channel.send(Have(len(request.keys)))
                elif isinstance(request, Get):
                    self.gets += 1
                    self._answer(channel, session.key_id, ObjectKey(request.tenant, request.key))

    def _answer(self, channel: PeerChannel, key_id: int, name: ObjectKey) -> None:
        sealed_as = (
            ObjectKey("another-tenant", name.key)
            if self.behaviour.startswith("other-tenant")
            else name
        )
        with self.codec.encode(sealed_as, self.chunk, key_id) as (header, body):
            sealed = bytearray(header + bytes(body))
        if self.behaviour.startswith("flipped"):
            sealed[-1] ^= 0x01
        if self.behaviour == "stall":
            self._stopped.wait()
            return
        if self.behaviour == "cut":  # the whole object announced, half of it sent, then gone
            assert isinstance(channel, TcpChannel)
            channel._sock.sendall(frame(Object(), len(sealed)) + sealed[: len(sealed) // 2])
            raise OSError("died mid-transfer")
        channel.send(Object(), [sealed])
