"""The plain-socket side of the peer bench (:mod:`benchmarks.peer`): the most one plain
Python TCP connection moves between two hosts, the reference for the peer transfer over the
same link.

A sender in host A holds the bytes of every chunk in one buffer (each page its own, as in
a segment) and sends each chunk with one ``sendall`` of a memoryview of it; a receiver in
host B reads each chunk with ``recv_into`` into its place in a buffer it touched before
(as a peer receives into reserved pages). No framing, no request per chunk, no sealing:
the same bytes in the same chunk sizes, at the link's limit.

Both are this module run as a program inside its host (``python -m
benchmarks.peer_socket receive|send ...``, from the checkout's root); :class:`Link`
starts them and times transfers (the NIXL side's too, :mod:`benchmarks.peer_nixl`). A
transfer: the receiver asks the sender for ``count`` chunks of ``size`` bytes and times
from asking to the last byte.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvpool.tools.bench.local.hosts import Host

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root, where ``benchmarks`` and ``tests`` are packages."""
ASK = struct.Struct("!QQ")
"""What the receiver asks the sender for: chunk size, chunk count."""
MiB = 1 << 20
PAGE = 4096


class Link:
    """A receiver inside ``receiver`` and a sender inside ``sender`` (the sides of module
    ``program``, run as a program in each host with ``environment`` added), connected; the
    buffers hold ``total`` bytes (the sender's rounded up to whole MiB), the most one transfer
    moves."""

    def __init__(
        self,
        program: str,
        sender: Host,
        receiver: Host,
        total: int,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self._program = program
        command = [sys.executable, "-m", program]
        env = {**os.environ, **(environment or {})}
        self._receiver = receiver.popen(
            [*command, "receive", receiver.address, str(total)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        port = self._line()
        sending = [*command, "send", receiver.address, port, str(total)]
        self._sender = sender.popen(sending, cwd=ROOT, env=env)

    @property
    def pids(self) -> tuple[int, int]:
        """The sender's and the receiver's."""
        return self._sender.pid, self._receiver.pid

    def transfer(self, size: int, count: int) -> float:
        """Seconds to move ``count`` chunks of ``size`` bytes from the sender to the receiver."""
        assert self._receiver.stdin is not None
        self._receiver.stdin.write(f"{size} {count}\n")
        self._receiver.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        """End both: the receiver at the end of its input, the sender at the connection's."""
        assert self._receiver.stdin is not None
        self._receiver.stdin.close()
        self._receiver.wait(30)
        self._sender.wait(30)

    def _line(self) -> str:
        assert self._receiver.stdout is not None
        line = self._receiver.stdout.readline()
        if not line:
            raise RuntimeError(f"{self._program}'s receiver exited ({self._receiver.poll()})")
        return line.strip()


def plain_link(sender: Host, receiver: Host, total: int) -> Link:
    """The plain socket's sender and receiver."""
    return Link(__name__, sender, receiver, total)


def receive(address: str, total: int) -> None:
    """Listen on ``address`` (the port on stdout), accept the sender, then for each line
    ``SIZE COUNT`` of stdin ask for that and print the seconds it took to arrive."""
    buffer = memoryview(bytearray(total))
    for offset in range(0, total, PAGE):  # touched: the pages exist before any transfer
        buffer[offset] = 1
    with accept_sender(address) as connection:
        for line in sys.stdin:
            size, count = map(int, line.split())
            started = time.perf_counter()
            connection.sendall(ASK.pack(size, count))
            for index in range(count):
                receive_into(connection, buffer[index * size : (index + 1) * size])
            print(time.perf_counter() - started, flush=True)


def accept_sender(address: str) -> socket.socket:
    """Listen on ``address``, say the port on stdout (where :class:`Link` reads it), and
    return the sender's connection (within 30 s: a sender that never comes is an error)."""
    with socket.create_server((address, 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(30)
        connection, _ = server.accept()
    connection.settimeout(None)
    return connection


def send(address: str, port: int, total: int) -> None:
    """Connect to the receiver and send what it asks for, until it closes the connection."""
    buffer = memoryview(os.urandom(MiB) * -(-total // MiB))
    ask = memoryview(bytearray(ASK.size))
    with socket.create_connection((address, port)) as connection:
        while receive_into(connection, ask, eof_ok=True):
            size, count = ASK.unpack(ask)
            for index in range(count):
                connection.sendall(buffer[index * size : (index + 1) * size])


def receive_into(connection: socket.socket, into: memoryview, *, eof_ok: bool = False) -> bool:
    """Fill ``into``; False at the end of the connection before any byte, if ``eof_ok``."""
    got = 0
    while got < len(into):
        received = connection.recv_into(into[got:])
        if not received:
            if got == 0 and eof_ok:
                return False
            raise ConnectionError(f"the connection ended after {got} of {len(into)} bytes")
        got += received
    return True


def main(argv: Sequence[str] | None = None) -> None:
    run_side(__name__, __doc__, receive, send, argv)


def run_side(
    program: str,
    about: str | None,
    receiving: Callable[[str, int], None],
    sending: Callable[[str, int, int], None],
    argv: Sequence[str] | None,
) -> None:
    """A link module run as a program: ``receive ADDRESS TOTAL`` or ``send ADDRESS PORT
    TOTAL`` (:class:`Link` starts them)."""
    parser = argparse.ArgumentParser(prog=f"python -m {program}", description=about)
    sides = parser.add_subparsers(dest="side", required=True)
    receiver = sides.add_parser("receive")
    receiver.add_argument("address")
    receiver.add_argument("total", type=int)
    sender = sides.add_parser("send")
    sender.add_argument("address")
    sender.add_argument("port", type=int)
    sender.add_argument("total", type=int)
    args = parser.parse_args(argv)
    if args.side == "receive":
        receiving(args.address, args.total)
    else:
        sending(args.address, args.port, args.total)


if __name__ == "__main__":
    main()
