"""A stand-in for vLLM's OpenAI server: real HTTP on a loopback port (uvicorn in a thread),
recording what it received and answering as the test says, as JSON or as an SSE stream.

It is not vLLM: it answers whatever it is told (kvpool's decode params, the prompt's token
ids where vLLM puts them), so that the sidecar's side of the exchange is what a test checks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    body: object = field(default_factory=lambda: {"choices": [{"text": "hello"}]})
    events: list[bytes] | None = None
    """An SSE stream of these ``data:`` payloads instead of ``body``."""
    delay_s: float = 0.0
    """Before the answer: a slow server."""
    hold: bool = False
    """After the answer's first part: wait for the client to go."""
    release: threading.Event | None = None
    """Between the first event and the rest: a test's go-ahead."""


class FakeVllm:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.disconnected = threading.Event()
        """A client left a request this server still held."""
        self.reply = Reply()
        listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = uvicorn.Config(
            self._app, interface="asgi3", http="h11", lifespan="off", log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def reset(self, reply: Reply | None = None) -> None:
        self.received.clear()
        self.disconnected.clear()
        self.reply = reply or Reply()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {name.decode(): value.decode() for name, value in scope["headers"]}
        self.received.append(Received(scope["method"], scope["path"], headers, body))
        reply = self.reply
        await asyncio.sleep(reply.delay_s)
        content_type = b"text/event-stream" if reply.events is not None else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(b"content-type", content_type), (b"server", b"fake-vllm")],
            }
        )
        parts = [json.dumps(reply.body).encode()]
        if reply.events is not None:
            parts = [b"data: " + event + b"\n\n" for event in reply.events]
        await send({"type": "http.response.body", "body": parts[0], "more_body": True})
        if reply.hold:
            if (await receive())["type"] == "http.disconnect":
                self.disconnected.set()
            return
        if reply.release is not None:
            await asyncio.to_thread(reply.release.wait, 10)
        for part in parts[1:]:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
