"""The agent's ZMQ port spoken frame by frame, for what the client library would never send."""

from __future__ import annotations

import zmq

from kvpool_agent import protocol as p


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
