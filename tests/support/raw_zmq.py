"""The agent's ZMQ port spoken frame by frame, for what the client library would never send."""

from __future__ import annotations

import socket
import struct

import zmq

from kvpool.common import protocol as p


class RawClient:
    """A DEALER speaking raw frames, for what the client library would never send."""

    def __init__(self, endpoint: str, routing_id: bytes | None = None) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, routing_id)
        self.socket.connect(endpoint)

    def ask(self, *frames: bytes) -> tuple[p.Reply, list[bytes]]:
        self.socket.send_multipart(list(frames))
        assert self.socket.poll(5000), "no reply"
        reply, *data = self.socket.recv_multipart()
        return p.decode_reply(reply), data

    def error(self, *frames: bytes) -> p.Error:
        reply, _ = self.ask(*frames)
        assert isinstance(reply, p.Error), reply
        return reply

    def hello(self, token: str) -> int:
        reply, _ = self.ask(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "raw", token)))
        assert isinstance(reply, p.HelloReply)
        return reply.session

    def close(self) -> None:
        self.socket.close()


class ZmtpPeer:
    """A DEALER spoken by hand over TCP (ZMTP 3.0, NULL mechanism), one frame at a time.

    pyzmq hands libzmq a whole message at once; this peer can send frames flagged MORE
    and never the last one, or millions of empty frames, as a hostile client would.
    """

    GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)

    def __init__(self, endpoint: str, timeout: float = 10.0) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(self.GREETING)
        greeting = self._read(64)
        assert greeting[0] == 0xFF and greeting[10] == 3, greeting
        socket_type = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        self.send_command(b"READY", socket_type)
        flags, size = self._read(2)
        assert flags == 0x04, flags
        assert self._read(size).startswith(b"\x05READY")

    def send_command(self, name: bytes, body: bytes) -> None:
        command = bytes([len(name)]) + name + body
        self.sock.sendall(bytes([0x04, len(command)]) + command)

    @staticmethod
    def frame(payload: bytes, *, more: bool) -> bytes:
        """One frame on the wire: flags, size (1 or 8 bytes), payload."""
        if len(payload) > 255:
            return bytes([0x02 | more]) + struct.pack(">Q", len(payload)) + payload
        return bytes([more, len(payload)]) + payload

    def hello(self, token: str, client: str = "raw") -> p.Reply:
        """Say hello (one frame) and read the reply."""
        self.sock.sendall(
            self.frame(p.encode(p.Hello(1, p.PROTOCOL_VERSION, client, token)), more=False)
        )
        return p.decode_reply(self.receive()[0])

    def receive(self) -> list[bytes]:
        """The frames of the next message from the agent."""
        frames = []
        while True:
            flags, size = self._read(2)
            if flags & 0x02:
                size = struct.unpack(">Q", bytes([size]) + self._read(7))[0]
            frames.append(self._read(size))
            if not flags & 0x01:
                return frames

    def send(self, data: bytes) -> bool:
        """Send raw bytes; False if the agent closed the connection meanwhile."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def dropped(self, timeout: float) -> bool:
        """True once the agent has closed this connection (within ``timeout`` seconds)."""
        return closed_by_peer(self.sock, timeout)

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {size} bytes")
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the other end has closed ``sock`` (within ``timeout`` seconds)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    return True
