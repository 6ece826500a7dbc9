"""A peer that proves the pool's credential and then misbehaves, as the agent under test
sees it over a real connection: it claims every chunk, then answers a get with another
tenant's chunk, flipped bytes, half a body before it dies, or nothing at all; sealed, or,
for the ``-plaintext`` behaviours, as a pool that protects integrity only sends; in object
format 3 (AEGIS-128L, which a sealed chunk opens from a NIXL landing), or 2 (AES-GCM, as an
agent of an older build seals, copied out of the landing first) for ``-aes-gcm``. On the
NIXL transport it writes those bodies into the asker's landing, and ``unwritten`` says it
wrote a chunk there that it never wrote (the landing holds what it held before).

It runs in a host of its own (UCX connects to the asker's address, as between two agents):
:class:`RoguePeer` starts this module as a program there (``python -m tests.peer.rogue
WORKDIR BEHAVIOUR TRANSPORT POOL KEY_DIR ADDRESS``: the chunk it seals in ``WORKDIR/chunk``, its
address on stdout, and how often it was asked in ``WORKDIR/counts``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal

from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.buffers import BufferPool
from kvpool.agent.l2.codec import ObjectCodec
from kvpool.agent.peer.session import accept_session
from kvpool.agent.peer.transport import PeerChannel, PeerTransport, TcpChannel, TcpTransport
from kvpool.agent.peer.transport_nixl import NixlChannel, NixlTransport
from kvpool.agent.peer.wire import Exists, Get, Have, Object, WireError, Written, frame
from kvpool.common.keyring import Keyring
from kvpool.tools.bench.local.hosts import Host
from kvpool.tools.bench.local.peers import LINK_ENVIRONMENT

Behaviour = Literal[
    "other-tenant",
    "flipped",
    "other-tenant-plaintext",
    "flipped-plaintext",
    "flipped-aes-gcm",
    "cut",
    "stall",
    "unwritten",
]


class RoguePeer:
    """The rogue, running in ``host`` until :meth:`close`."""

    def __init__(
        self,
        behaviour: Behaviour,
        key_dir: Path,
        host: Host,
        chunk: bytes,
        workdir: Path,
        *,
        transport: str = "tcp",
    ) -> None:
        self.node = f"rogue-{behaviour}"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "chunk").write_bytes(chunk)
        self._counts = workdir / "counts"
        argv = [sys.executable, "-m", __name__, str(workdir), behaviour, transport, "default"]
        self._process = host.popen(
            [*argv, str(key_dir), host.address],
            env={**os.environ, **LINK_ENVIRONMENT},
            stdout=subprocess.PIPE,
        )
        assert self._process.stdout is not None
        self.address = self._process.stdout.readline().strip()
        assert self.address, f"the rogue peer exited {self._process.wait()}"

    @property
    def entry(self) -> str:
        """Its line in an agent's ``peers.agents``."""
        return f"{self.node}={self.address}"

    @property
    def gets(self) -> int:
        """Get requests it answered."""
        return self._read_counts()["gets"]

    @property
    def asked(self) -> int:
        """Exists requests it answered (whether it was asked which chunks it holds)."""
        return self._read_counts()["asked"]

    def close(self) -> None:
        self._process.kill()
        self._process.wait()

    def _read_counts(self) -> dict[str, int]:
        with contextlib.suppress(FileNotFoundError):
            counts: dict[str, int] = json.loads(self._counts.read_text())
            return counts
        return {"gets": 0, "asked": 0}


class _Rogue:
    def __init__(
        self, behaviour: str, transport: PeerTransport, pool: str, key_dir: Path, workdir: Path
    ) -> None:
        self.behaviour = behaviour
        self.node = f"rogue-{behaviour}"
        self.pool = pool
        self.chunk = (workdir / "chunk").read_bytes()
        """What it seals for any key (the real chunk's bytes, where the test wants them)."""
        self.keyring = Keyring(key_dir, what="peer key")
        sealed = not behaviour.endswith("-plaintext")
        aegis = not behaviour.endswith("-aes-gcm")  # as an agent of an older build seals
        self.codec = ObjectCodec(self.keyring, pool, seal=sealed, buffers=BufferPool(), aegis=aegis)
        self.counts = {"gets": 0, "asked": 0}
        self._counts = workdir / "counts"
        self._lock = threading.Lock()
        self._stalled = threading.Event()

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
            self._counts.with_suffix(".new").write_text(json.dumps(self.counts))
            self._counts.with_suffix(".new").replace(self._counts)

    def serve(self, channel: PeerChannel) -> None:
        with contextlib.closing(channel), contextlib.suppress(OSError, WireError, TimeoutError):
            session = accept_session(channel, self.keyring, self.pool, self.node)
            while True:
                request, _ = channel.receive()
                if isinstance(request, Exists):
                    self.count("asked")
                    channel.send(Have(len(request.keys)))
                elif isinstance(request, Get):
                    self.count("gets")
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
            self._stalled.wait()
            return
        if self.behaviour == "cut":  # half of the object sent, then gone
            half = sealed[: len(sealed) // 2]
            if isinstance(channel, NixlChannel):  # written into the landing, never announced
                assert channel._target is not None
                channel._write([half], len(half), channel._target)
            else:  # the whole object announced
                assert isinstance(channel, TcpChannel)
                channel._sock.sendall(frame(Object(), len(sealed)) + half)
            raise OSError("died mid-transfer")
        if self.behaviour == "unwritten":
            assert isinstance(channel, NixlChannel)
            channel._tcp.send(Written(len(sealed)))
            return
        channel.send(Object(), [sealed])


def main() -> None:
    workdir, behaviour, transport_name, pool, key_dir, address = sys.argv[1:]
    node = f"rogue-{behaviour}"
    transport: PeerTransport = TcpTransport() if transport_name == "tcp" else NixlTransport(node)
    assert transport.name == transport_name, transport.fallback
    rogue = _Rogue(behaviour, transport, pool, Path(key_dir), Path(workdir))
    listener = transport.listen(address, 0, io_timeout=30.0)
    print(listener.address, flush=True)
    while True:
        channel = listener.accept()
        threading.Thread(target=rogue.serve, args=(channel,), daemon=True).start()


if __name__ == "__main__":
    main()
