"""Fault injection for L2 tests: an HTTP proxy in front of S3, and an adapter that fails keys."""

from __future__ import annotations

import enum
import hashlib
import http.client
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpool.agent.l2 import L2Adapter, L2Object, ObjectKey
from kvpool.agent.l2.base import AdapterStats

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection", "te"}
)
_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>injected by the test proxy</Message></Error>"
)


class Fault(enum.Enum):
    ERROR = "answer 500 InternalError"
    SLOW = "wait `delay` seconds, then pass"
    DROP = "close the connection without an answer"
    TRUNCATE = "send the full Content-Length header but half of the body, then close"
    FLIP = "pass with one byte of the body flipped (a consistent, wrong response)"


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    range: str | None
    fault: Fault | None


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that forwards to ``upstream`` and injects faults per request.

    Requests are parsed (keep-alive connections carry many), so a fault hits the
    next matching *request*, whatever connection it arrives on.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.seen: list[SeenRequest] = []
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._times: int | None = None
        self._methods: frozenset[str] | None = None
        self.delay = 0.0
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def inject(
        self,
        fault: Fault,
        times: int | None = None,
        methods: Sequence[str] | None = None,
        delay: float = 0.0,
    ) -> None:
        """Fault the next ``times`` requests (None: all) of ``methods`` (None: any method)."""
        with self._lock:
            self._fault, self._times, self.delay = fault, times, delay
            self._methods = frozenset(methods) if methods else None

    def clear(self) -> None:
        with self._lock:
            self._fault = None

    def faults(self) -> int:
        with self._lock:
            return sum(1 for request in self.seen if request.fault is not None)

    def requests(self) -> int:
        with self._lock:
            return len(self.seen)

    def _admit(self, method: str, path: str, byte_range: str | None) -> Fault | None:
        with self._lock:
            fault = self._fault
            if fault is not None and (self._methods is None or method in self._methods):
                if self._times is not None:
                    self._times -= 1
                    if self._times == 0:
                        self._fault = None
            else:
                fault = None
            self.seen.append(SeenRequest(method, path, byte_range, fault))
            return fault


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that gave up (after a SLOW or TRUNCATE fault) are part of the plan.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30
    server: _Server

    def setup(self) -> None:
        super().setup()
        self._upstream = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=30)

    def finish(self) -> None:
        self._upstream.close()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    def _relay(self) -> None:
        proxy = self.server.proxy
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            raise NotImplementedError("chunked request bodies")
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        fault = proxy._admit(self.command, self.path, self.headers.get("Range"))
        if fault is Fault.DROP:
            self.close_connection = True
            return
        if fault is Fault.ERROR:
            self._answer(500, "Internal Server Error", [], _ERROR_BODY)
            return
        if fault is Fault.SLOW:
            time.sleep(proxy.delay)
        self._upstream.putrequest(
            self.command, self.path, skip_host=True, skip_accept_encoding=True
        )
        for header, value in self.headers.items():
            if header.lower() not in _HOP_BY_HOP:
                self._upstream.putheader(header, value)
        self._upstream.endheaders(body or None)
        response = self._upstream.getresponse()
        data = response.read()
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
        declared = response.getheader("Content-Length")
        # A HEAD answer has no body but declares the length of the one a GET would get.
        length = int(declared) if self.command == "HEAD" and declared else len(data)
        if fault is Fault.TRUNCATE and data:
            self._answer(response.status, response.reason, headers, data[: len(data) // 2], length)
            self.close_connection = True
        elif fault is Fault.FLIP and data:
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0xFF
            self._answer(response.status, response.reason, headers, bytes(flipped), length)
        else:
            self._answer(response.status, response.reason, headers, data, length)

    def _answer(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        data: bytes,
        length: int | None = None,
    ) -> None:
        self.send_response_only(status, reason)
        for header, value in headers:
            if header.lower() != "content-length":
                self.send_header(header, value)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class FaultyAdapter:
    """Wraps an adapter and fails a fixed fraction of keys (chosen by hash), per key.

    A failing key's put returns False without storing, its get None, its exists
    False and its delete False: the other keys of a batch are unaffected.
    """

    name = "faulty"

    def __init__(self, inner: L2Adapter, one_in: int = 4) -> None:
        self.inner = inner
        self.one_in = one_in
        self.stats: AdapterStats = inner.stats

    def fails(self, name: ObjectKey) -> bool:
        return hashlib.sha256(name.tenant.encode() + name.key).digest()[0] % self.one_in == 0

    async def put(self, objects: Sequence[L2Object]) -> list[bool]:
        passed = [obj for obj in objects if not self.fails(obj.name)]
        results = iter(await self.inner.put(passed))
        return [False if self.fails(obj.name) else next(results) for obj in objects]

    async def get(self, keys: Sequence[ObjectKey]) -> list[bytes | memoryview | None]:
        results = iter(await self.inner.get([k for k in keys if not self.fails(k)]))
        return [None if self.fails(k) else next(results) for k in keys]

    async def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        results = iter(await self.inner.exists([k for k in keys if not self.fails(k)]))
        return [False if self.fails(k) else next(results) for k in keys]

    async def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        results = iter(await self.inner.delete([k for k in keys if not self.fails(k)]))
        return [False if self.fails(k) else next(results) for k in keys]

    async def drop_tenant(self, tenant: str) -> int:
        """Passed through: a whole-tenant drop names no key to fail."""
        return await self.inner.drop_tenant(tenant)

    async def close(self) -> None:
        await self.inner.close()
