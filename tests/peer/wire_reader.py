"""What a proven peer reads of a chunk from an agent: the test's wire reader.

:func:`get_as_a_peer` proves the pool's credential to the agent at an address, asks it
for one chunk and returns the header and body as they arrived (no opening, no check):
what a reader of the link sees. Over NIXL the reader must run on a host of its own (UCX
connects back to it), so it is also this module run as a program inside a host:
``python -m tests.peer.wire_reader ADDRESS KEY_DIR TENANT KEY_HEX TRANSPORT [FORMATS]``
prints the header and body in hex, a line each (``FORMATS``: the object formats it says
it opens besides format 2, comma-separated; ``none`` for an agent of an older build).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpool.agent.l2.codec import AEGIS_FORMAT_VERSION, header_size
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
    formats: Sequence[int] = (AEGIS_FORMAT_VERSION,),
) -> tuple[bytes, bytes]:
    """The header and body of ``tenant``'s chunk ``key`` as the agent at ``address`` sends it
    over ``transport`` to a peer that proved the pool's credential and opens ``formats``;
    ``meanwhile`` runs once the answer is here, before the body is read."""
    engine: PeerTransport = TcpTransport() if transport == "tcp" else NixlTransport(NODE)
    assert engine.name == transport, engine.fallback
    channel = engine.connect(address, connect_timeout=2, io_timeout=10)
    try:
        keyring = Keyring(key_dir, what="peer key")
        open_session(channel, keyring, "default", NODE, formats=formats)
        channel.send(Get(tenant, key))
        answer, length = channel.receive()
        assert isinstance(answer, Object), answer
        meanwhile()
        blob = bytearray(length)
        channel.receive_body(memoryview(blob))
        assert channel.transport == transport, channel.transport
    finally:
        channel.close()
    size = header_size(blob)
    return bytes(blob[:size]), bytes(blob[size:])


def main() -> None:
    address, key_dir, tenant, key, transport, *rest = sys.argv[1:]
    said = rest[0].split(",") if rest else [str(AEGIS_FORMAT_VERSION)]
    formats = [int(f) for f in said if f != "none"]
    header, body = get_as_a_peer(
        address, Path(key_dir), tenant, bytes.fromhex(key), transport=transport, formats=formats
    )
    print(header.hex())
    print(body.hex())


if __name__ == "__main__":
    main()
