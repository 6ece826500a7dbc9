"""A stand-in for a pool's agents' HTTP API, for the operator's tests: it answers the calls
the operator makes (usage, clear, a shared space's pins and warming) and records each with
its bearer token and JSON body."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpool.common.api_models import Cleared, Pin, Usage, Warmed


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: Any
    token: str


class AgentStub:
    """One agent at ``host:port``; :attr:`calls` in the order they came."""

    def __init__(self, host: str, port: int) -> None:
        self.calls: list[Call] = []
        self.failing = False
        """Answer every call 503 (an agent that is down)."""
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub._answer(self)

            do_PUT = do_POST = do_DELETE = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> AgentStub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def made(self, method: str, path: str) -> list[Call]:
        return [call for call in list(self.calls) if (call.method, call.path) == (method, path)]

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length)) if length else None
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.calls.append(Call(request.command, request.path, body, token))
        status, answer = self._reply(request.command, request.path, body)
        data = json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _reply(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if self.failing:
            return 503, {"detail": "down"}
        tenant = path.split("/")[3]
        if path.endswith("/usage"):
            usage = Usage(
                tenant=tenant,
                used_bytes=4096,
                nvme_used_bytes=8192,
                chunks=1,
                quota_bytes=None,
                hits=3,
                misses=1,
                stored_chunks=1,
                evicted_chunks=0,
            )
            return 200, usage.model_dump()
        if path.endswith("/clear?tiers=all"):
            return 200, Cleared(dropped_chunks=2, l2_dropped_objects=1).model_dump()
        if method == "DELETE":
            return 404, {"detail": "no such pin"}
        keys = len(body["keys"])
        if method == "PUT":
            name = path.rpartition("/")[2]
            pin = Pin(name=name, keys=keys, resident_keys=0, pinned_keys=0, pinned_bytes=0)
            return 200, pin.model_dump()
        return 200, Warmed(keys=keys, resident=0, loaded=0, missing=keys, done=True).model_dump()
