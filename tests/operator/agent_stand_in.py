"""A stand-in for a pool's agent in the operator's tests: the two routes the operator calls
(``GET /v1/tenants/{id}/usage``, ``POST /v1/tenants/{id}/clear?tiers=all``), answered as
the agent answers them, for the operator's token only: it authenticates a bearer token as
the agents do with the pool's tenants ConfigMap (the SHA-256 digest under ``operator``),
read from the emulated API server at each request.

The real agent learns those digests from the ConfigMap in the agent's half of the change;
the e2e runs the operator against real agents.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USAGE = {"used_bytes": 1000, "nvme_used_bytes": 500, "hits": 3, "misses": 1, "chunks": 2}
CLEARED = {"dropped_chunks": 7, "l2_dropped": 2}


class AgentStandIn:
    """Serves on 127.0.0.1; :attr:`calls` records (method, path) of every authenticated
    call, :attr:`refused` the others."""

    def __init__(self, operator_digest: Callable[[], str | None]) -> None:
        self._operator_digest = operator_digest
        self.calls: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> AgentStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer("GET", USAGE, "/usage")

            def do_POST(self) -> None:
                self._answer("POST", CLEARED, "/clear?tiers=all")

            def _answer(self, method: str, body: dict[str, int], ending: str) -> None:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                known = stand_in._operator_digest()
                call = (method, self.path)
                if known is None or hashlib.sha256(token.encode()).hexdigest() != known:
                    stand_in.refused.append(call)
                    self._send(401, {"detail": "unknown token"})
                elif not self.path.startswith("/v1/tenants/") or not self.path.endswith(ending):
                    self._send(404, {"detail": "no such route"})
                else:
                    stand_in.calls.append(call)
                    self._send(200, body)

            def _send(self, status: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
