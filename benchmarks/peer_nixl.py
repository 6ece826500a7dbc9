"""The transfer engine's side of the peer bench (:mod:`benchmarks.peer`): what NIXL moves
between two hosts with none of kvpool's code on the way, the raw rate the engine reaches
over the same link (the limit a peer transport on NIXL is held to).

NIXL (PyPI ``nixl-cu12``, imported as ``nixl_cu12``) with its UCX backend, held to TCP
(``UCX_TLS=tcp``: two network namespaces of one machine could otherwise share memory,
which is not the link), its agents configured as kvpool's agents configure theirs
(:func:`~kvpool.agent.peer.transport_nixl.start_agent`: the same engine, so that the two
differ in kvpool's code alone). A receiver in host B registers one buffer with its NIXL agent
(touched first, as a peer's reserved pages are) and sends the sender, over a TCP control
connection, its agent's metadata and the buffer's descriptor; the sender in host A
registers a buffer of its own (each page its own, random bytes) and loads the receiver's
metadata. A transfer: the receiver asks for ``count`` chunks of ``size`` bytes and times
from asking until the sender says that one NIXL request writing them all (a descriptor per
chunk, into their places in the receiver's buffer) is done; the receiver then checks the
first bytes of every chunk (untimed: a write that did not land is an error, not a rate).

Both are this module run as a program inside its host (``python -m benchmarks.peer_nixl
receive|send ...``, from the checkout's root); :func:`nixl_link` starts them (a
:class:`~benchmarks.peer_socket.Link`) and times transfers.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy

from benchmarks.peer_socket import PAGE, Link, MiB, accept_sender, receive_into, run_side
from kvpool.agent.peer.transport_nixl import start_agent
from kvpool.tools.bench.local.hosts import Host
from kvpool.tools.bench.local.peers import LINK_ENVIRONMENT

ASK = struct.Struct("!QQ")
"""What the receiver asks the sender for: chunk size, chunk count."""
LENGTH = struct.Struct("!Q")
MEMORY = "DRAM"
NAME = "NIXL (UCX over TCP), raw"
"""The side's name in the bench's table."""


def available() -> str | None:
    """None where NIXL imports here; else why not, in one line."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as error:
        return f"NIXL is not installed here (pip install nixl-cu12): {error}"
    return None


def nixl_link(sender: Host, receiver: Host, total: int) -> Link:
    """NIXL's sender and receiver, each with an agent, the sender holding the receiver's
    metadata."""
    return Link(__name__, sender, receiver, total, LINK_ENVIRONMENT)


def _agent(name: str, buffer: numpy.ndarray[Any, Any]) -> Any:
    """A NIXL agent with the UCX backend, configured as the agents configure theirs (its
    progress thread waiting between rounds, not spinning a core), and ``buffer``
    registered."""
    for handler in logging.getLogger("nixl").handlers:  # stdout is the link's protocol
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    agent = start_agent(name)
    agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], MEMORY)
    return agent


def receive(address: str, total: int) -> None:
    """Listen on ``address`` (the port on stdout), accept the sender and give it this
    agent's metadata and buffer, then for each line ``SIZE COUNT`` of stdin ask for that
    and print the seconds it took to be written."""
    buffer = numpy.zeros(total, numpy.uint8)
    buffer[::PAGE] = 1  # touched: the pages exist before any transfer
    agent = _agent("receiver", buffer)
    with accept_sender(address) as connection:
        _send_blob(connection, pickle.dumps((agent.get_agent_metadata(), buffer.ctypes.data)))
        done = memoryview(bytearray(1))
        for line in sys.stdin:
            size, count = map(int, line.split())
            buffer[: size * count : size] = 0
            started = time.perf_counter()
            connection.sendall(ASK.pack(size, count))
            receive_into(connection, done)
            print(time.perf_counter() - started, flush=True)
            if not (buffer[: size * count : size] == 0xA5).all():
                raise RuntimeError(f"a write of {count} chunks of {size} bytes did not land")


def send(address: str, port: int, total: int) -> None:
    """Connect to the receiver, load its metadata, and write what it asks for, until it
    closes the connection."""
    buffer = numpy.frombuffer(os.urandom(MiB) * -(-total // MiB), numpy.uint8).copy()
    agent = _agent("sender", buffer)
    ask = memoryview(bytearray(ASK.size))
    with socket.create_connection((address, port)) as connection:
        metadata, far = pickle.loads(_receive_blob(connection))
        remote = agent.add_remote_agent(metadata)
        while receive_into(connection, ask, eof_ok=True):
            size, count = ASK.unpack(ask)
            buffer[: size * count : size] = 0xA5  # what the receiver checks for
            _write(agent, remote, near=buffer.ctypes.data, far=far, size=size, count=count)
            connection.sendall(b"d")


def _write(agent: Any, remote: str, *, near: int, far: int, size: int, count: int) -> None:
    """One NIXL request writing ``count`` chunks of ``size`` from ``near`` to ``far``."""
    chunks = [(index * size, size, 0) for index in range(count)]
    local = agent.get_xfer_descs([(near + at, length, 0) for at, length, _ in chunks], MEMORY)
    target = agent.get_xfer_descs([(far + at, length, 0) for at, length, _ in chunks], MEMORY)
    handle = agent.initialize_xfer("WRITE", local, target, remote)
    try:
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL's write of {count} chunks of {size} bytes: {state}")
    finally:
        agent.release_xfer_handle(handle)


def _send_blob(connection: socket.socket, blob: bytes) -> None:
    connection.sendall(LENGTH.pack(len(blob)) + blob)


def _receive_blob(connection: socket.socket) -> bytes:
    length = memoryview(bytearray(LENGTH.size))
    receive_into(connection, length)
    blob = memoryview(bytearray(LENGTH.unpack(length)[0]))
    receive_into(connection, blob)
    return bytes(blob)


def main(argv: Sequence[str] | None = None) -> None:
    run_side(__name__, __doc__, receive, send, argv)


if __name__ == "__main__":
    main()
