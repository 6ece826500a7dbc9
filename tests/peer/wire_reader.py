"""What a proven peer reads of a chunk from an agent: the test's wire reader.

:func:`get_as_a_peer` proves the pool's credential to the agent at an address, asks it
for one chunk and returns the header and body as they arrived (no opening, no check):
what a reader of the link sees. Over NIXL the reader must run on a host of its own (UCX
connects back to it), so it is also this module run as a program inside a host:
``python -m tests.peer.wire_reader ADDRESS KEY_DIR TENANT KEY_HEX TRANSPORT`` prints the
header and body in hex, a line each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from kvpool.agent.l2.codec import HEADER
from kvpool.agent.peer.session import open_session
from kvpool.agent.peer.transport import PeerTransport, TcpTransport
from kvpool.agent.peer.transport_nixl import NixlTransport
from kvpool.agent.peer.wire import Get, Object
from kvpool.common.keyring import Keyring

NODE = "wire-reader"


def get_as_a_peer(
    address: str,
    key_dir: Path,
    tenant: str,
    key: bytes,
    *,
    transport: str = "tcp",
    meanwhile: Callable[[], None] = lambda: None,
) -> tuple[bytes, bytes]:
    """The header and body of ``tenant``'s chunk ``key`` as the agent at ``address`` sends it
    over ``transport`` to a peer that proved the pool's credential; ``meanwhile`` runs once
    the answer is here, before the body is read."""
    engine: PeerTransport = TcpTransport() if transport == "tcp" else NixlTransport(NODE)
    assert engine.name == transport, engine.fallback
    channel = engine.connect(address, connect_timeout=2, io_timeout=10)
    try:
        open_session(channel, Keyring(key_dir, what="peer key"), "default", NODE)
        channel.send(Get(tenant, key))
        answer, length = channel.receive()
        assert isinstance(answer, Object), answer
        meanwhile()
        blob = bytearray(length)
        channel.receive_body(memoryview(blob))
        assert channel.transport == transport, channel.transport
    finally:
        channel.close()
    return bytes(blob[: HEADER.size]), bytes(blob[HEADER.size :])


def main() -> None:
    address, key_dir, tenant, key, transport = sys.argv[1:]
    header, body = get_as_a_peer(
        address, Path(key_dir), tenant, bytes.fromhex(key), transport=transport
    )
    print(header.hex())
    print(body.hex())


if __name__ == "__main__":
    main()
